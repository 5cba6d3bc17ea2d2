"""A standalone experiment: a built-in or plugged-in tuner driving a Coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config import ExperimentConfig
from .core import Coordinator
from .model import StatusEvent, TrialInfo
from .readmodel import EnvSnapshot, best_trial, optimize_mode
from .readmodel import ranked as _ranked
from .states import TrialStatus
from .tuners import NoMoreTrials, Tuner, create_tuner

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What a live view shows."""

    experiment_id: str
    experiment_dir: Path
    counts: Counter[str]
    best: TrialInfo | None
    submitted: int
    max_trials: int | None
    elapsed_s: float
    eta_s: float | None
    trials: list[TrialInfo] = field(default_factory=list)
    environments: list[tuple[str, str, str]] = field(default_factory=list)  # id, status, detail


@dataclass
class ExperimentResult:
    experiment_id: str
    experiment_dir: Path
    trials: list[TrialInfo]
    best: TrialInfo | None
    ok: bool
    reason: str


ranked = _ranked  # where the CLI's run command imports it from


def optimize_mode_of(config: ExperimentConfig) -> str:
    return optimize_mode(config.tuner.class_args)


async def run_experiment(
    config: ExperimentConfig,
    *,
    experiment_dir: Path | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 0.5,
    stop: asyncio.Event | None = None,
    on_start: Callable[[Coordinator], None] | None = None,
) -> ExperimentResult:
    """Run the experiment to its end: tuner exhausted, maxTrialNumber reached, or
    maxExperimentDuration passed. ``stop`` ends it early (trials are canceled)."""
    coordinator = Coordinator(config, experiment_dir=experiment_dir)
    return await _drive(coordinator, on_progress=on_progress, progress_interval_s=progress_interval_s, stop=stop, on_start=on_start)


async def resume_experiment(
    experiment_dir: Path,
    *,
    config: ExperimentConfig | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 0.5,
    stop: asyncio.Event | None = None,
    on_start: Callable[[Coordinator], None] | None = None,
) -> ExperimentResult:
    """Carry on an experiment whose coordinator died: its trials, environments and agents
    are taken over, and the tuner goes on from where it was."""
    coordinator = Coordinator.resume(experiment_dir, config=config)
    return await _drive(coordinator, on_progress=on_progress, progress_interval_s=progress_interval_s, stop=stop, on_start=on_start)


async def _drive(
    coordinator: Coordinator,
    *,
    on_progress: Callable[[Progress], None] | None,
    progress_interval_s: float,
    stop: asyncio.Event | None,
    on_start: Callable[[Coordinator], None] | None = None,
) -> ExperimentResult:
    config = coordinator.config
    tuner_cfg = config.tuner
    class_args = dict(tuner_cfg.class_args)
    tuner: Tuner = create_tuner(
        tuner_cfg.name,
        tuner_cfg.class_name,
        class_args,
        config.search_space or {},
        str(tuner_cfg.code_directory) if tuner_cfg.code_directory else None,
    )
    mode = optimize_mode_of(config)
    stop = stop or asyncio.Event()
    changed = asyncio.Event()
    params_of: dict[str, tuple[int, dict]] = {}

    def on_status(ev: StatusEvent) -> None:
        t = ev.trial
        if t.status.terminal and t.id in params_of:
            pid, params = params_of.pop(t.id)
            try:
                if t.final_metric is not None:
                    tuner.receive_trial_result(pid, params, t.final_metric)
                tuner.trial_end(pid, t.status is TrialStatus.SUCCEEDED)
            except Exception:
                log.exception("the tuner raised on a trial result; going on")
        changed.set()

    coordinator.on_status(on_status)
    started = time.monotonic()
    exhausted = False
    reason = ""
    ok = True
    await coordinator.start()
    try:
        if on_start is not None:  # e.g. the dashboard, once there is a store to read
            on_start(coordinator)
        submitted = _catch_up(tuner, coordinator.trials(), params_of)
        last_progress = 0.0
        while True:
            trials = coordinator.trials()
            active = sum(1 for t in trials if not t.status.terminal)
            limit_reached = config.max_trial_number is not None and submitted >= config.max_trial_number
            elapsed = time.monotonic() - started
            if stop.is_set():
                ok, reason = False, "stopped by the user"
                break
            if config.max_experiment_duration is not None and elapsed >= config.max_experiment_duration:
                reason = f"maxExperimentDuration ({config.max_experiment_duration:g} s) reached"
                break
            if coordinator.environment_error:
                ok, reason = False, coordinator.environment_error
                break
            if coordinator.failure:
                ok, reason = False, coordinator.failure
                break
            while not exhausted and not limit_reached and active < config.trial_concurrency:
                try:
                    params = tuner.generate_parameters(submitted)
                except NoMoreTrials:
                    exhausted = True
                    break
                handle = await coordinator.submit(params)
                params_of[handle.id] = (submitted, params)
                submitted += 1
                active += 1
                limit_reached = config.max_trial_number is not None and submitted >= config.max_trial_number
            if active == 0 and (exhausted or limit_reached):
                break
            now = time.monotonic()
            if on_progress and now - last_progress >= progress_interval_s:
                last_progress = now
                on_progress(_progress(coordinator, trials, submitted, config, mode, elapsed))
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), progress_interval_s)
            except asyncio.TimeoutError:
                pass
    finally:
        trials = coordinator.trials()
        unfinished = [t for t in trials if not t.status.terminal]
        if unfinished and not reason:
            reason = f"{len(unfinished)} trials had not finished"
        status = "DONE" if ok else ("FAILED" if coordinator.failure else "STOPPED")
        await coordinator.stop(status=status, reason=reason)
    trials = coordinator.trials()
    if on_progress:
        on_progress(_progress(coordinator, trials, len(trials), config, mode, time.monotonic() - started))
    return ExperimentResult(
        experiment_id=coordinator.experiment_id,
        experiment_dir=coordinator.experiment_dir,
        trials=trials,
        best=best_trial(trials, mode),
        ok=ok and all(t.status.terminal for t in trials),
        reason=reason,
    )


def _catch_up(tuner: Tuner, trials: list[TrialInfo], params_of: dict[str, tuple[int, dict]]) -> int:
    """After a resume: bring the tuner to where it was (it proposes again what it had
    proposed, which a seeded tuner does identically, and hears every result), and track
    the trials still running. Returns how many trials had been submitted."""
    for t in trials:
        with contextlib.suppress(NoMoreTrials):
            tuner.generate_parameters(t.sequence_id)
        if t.status.terminal:
            if t.final_metric is not None:
                tuner.receive_trial_result(t.sequence_id, t.parameters, t.final_metric)
            tuner.trial_end(t.sequence_id, t.status is TrialStatus.SUCCEEDED)
        else:
            params_of[t.id] = (t.sequence_id, t.parameters)
    return len(trials)


def _env_detail(e: EnvSnapshot) -> str:
    where = e.hostname or e.platform_id or e.reason
    gpus = []
    for g in sorted(e.gpus, key=lambda g: -1 if g.index is None else g.index):
        util, used, total = g.utilization_percent or 0.0, g.memory_used_bytes or 0, g.memory_total_bytes or 0
        text = f"GPU{g.index} {util:.0f}% {used / 2**30:.1f}/{total / 2**30:.1f} GiB"
        if g.held_by:
            stopping = "; stopping" if set(g.held_by) & set(e.stopping_trials) else ""
            text += " [" + " ".join(sorted(g.held_by)) + stopping + "]"
        gpus.append(text)
    return "; ".join([where, *gpus]) if gpus else where


def _progress(
    c: Coordinator, trials: list[TrialInfo], submitted: int, config: ExperimentConfig, mode: str, elapsed: float
) -> Progress:
    counts = Counter(t.status.value for t in trials)
    done = sum(1 for t in trials if t.status.terminal)
    eta = None
    if config.max_trial_number and done:
        eta = elapsed / done * (config.max_trial_number - done)
    envs = [(e.id, e.status.value if e.status else "UNREADABLE", _env_detail(e)) for e in c.environments()]
    return Progress(
        experiment_id=c.experiment_id,
        experiment_dir=c.experiment_dir,
        counts=counts,
        best=best_trial(trials, mode),
        submitted=submitted,
        max_trials=config.max_trial_number,
        elapsed_s=elapsed,
        eta_s=eta,
        trials=trials,
        environments=envs,
    )
