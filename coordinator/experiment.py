"""A standalone experiment: a built-in or plugged-in tuner driving a Coordinator.

The loop is the pass of ``search.loop`` on the real clock and a real coordinator; it carries
out what the search decides (``search.search``): it submits the trials the tuner proposes
(from another trial's checkpoint when the tuner says so), stops, pauses and continues trials
as the tuner and the assessor ask, and tells the search every result and status change. A
trial the search paused and never continued before it ran out of work ends EARLY_STOPPED;
one paused by someone else keeps the experiment from ending DONE: it ends STOPPED, and
``resume`` continues its paused trials first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import experimentlog
from .config.experiment import ExperimentConfig
from .config.objectives import from_config as objectives_from_config
from .core import Coordinator
from .engine import results
from .engine.events import CheckpointSaved
from .engine.model import MetricEvent, StatusEvent, TrialInfo
from .engine.states import TrialStatus
from .read.model import EnvSnapshot, best_trial, optimize_mode
from .read.model import ranked as _ranked
from .search.algorithms import create_assessor, create_tuner
from .search.loop import End, GiveUp, Loop
from .search.search import (
    ContinueTrial,
    Instruction,
    Mirror,
    PauseTrial,
    Search,
    StopTrial,
    SubmitTrial,
)
from .search.space import is_batch_tuner
from .search.steering import Limits, Steering, submit_customized
from .search.tuners import PastTrial, Tuner, TunerError, normalized
from .store.reads import StoreReader

log = logging.getLogger(__name__)

LOG_FILENAME = experimentlog.LOG_FILENAME
# Where NNI's tuners keep checkpoints by default, in the experiment directory: beside
# trialkeeper's own checkpoints (checkpoints/), whose upkeep removes what it did not record.
NNI_CHECKPOINTS = "nni-checkpoints"


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
    trials: list[TrialInfo] = field(default_factory=list)  # those not ended; at the end, all of them
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
    return optimize_mode((config.advisor or config.tuner).class_args)


async def run_experiment(
    config: ExperimentConfig,
    *,
    experiment_dir: Path | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 0.5,
    stop: asyncio.Event | None = None,
    on_start: Callable[[Coordinator], None] | None = None,
    steering: Steering | None = None,
    experiment_id: str | None = None,
) -> ExperimentResult:
    """Run the experiment to its end: tuner exhausted, maxTrialNumber reached, or
    maxExperimentDuration passed. ``stop`` ends it early (trials are canceled).
    ``steering``: how the control socket changes limits and submits trials while it runs."""
    coordinator = Coordinator(config, experiment_dir=experiment_dir, experiment_id=experiment_id)
    return await _drive(
        coordinator, on_progress=on_progress, progress_interval_s=progress_interval_s, stop=stop, on_start=on_start,
        steering=steering,
    )


async def resume_experiment(
    experiment_dir: Path,
    *,
    config: ExperimentConfig | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 0.5,
    stop: asyncio.Event | None = None,
    on_start: Callable[[Coordinator], None] | None = None,
    steering: Steering | None = None,
) -> ExperimentResult:
    """Carry on an experiment whose coordinator died or was stopped: its trials,
    environments and agents are taken over, and the tuner goes on from where it was. A
    stopped experiment's paused trials are continued first."""
    was = _stored_status(experiment_dir)
    coordinator = Coordinator.resume(experiment_dir, config=config)
    return await _drive(
        coordinator, on_progress=on_progress, progress_interval_s=progress_interval_s, stop=stop, on_start=on_start,
        continue_paused=was == "STOPPED", steering=steering,
    )


def _stored_status(experiment_dir: Path) -> str:
    """The status the store holds for the experiment ('' when it cannot say)."""
    try:
        store = StoreReader.in_dir(Path(experiment_dir).resolve())
    except Exception:  # noqa: BLE001 - Coordinator.resume says what is wrong with the directory
        return ""
    try:
        exp = store.experiment()
    finally:
        store.close()
    return str(exp.get("status") or "") if exp else ""


async def _drive(
    coordinator: Coordinator,
    *,
    on_progress: Callable[[Progress], None] | None,
    progress_interval_s: float,
    stop: asyncio.Event | None,
    on_start: Callable[[Coordinator], None] | None = None,
    continue_paused: bool = False,
    steering: Steering | None = None,
) -> ExperimentResult:
    # Everything this experiment's tasks log is its own (several may share a process).
    scope = experimentlog.enter(coordinator.experiment_id)
    try:
        return await _drive_in_scope(coordinator, on_progress=on_progress, progress_interval_s=progress_interval_s,
                                     stop=stop, on_start=on_start, continue_paused=continue_paused,
                                     steering=steering or Steering())
    finally:
        experimentlog.leave(scope)


async def _drive_in_scope(
    coordinator: Coordinator,
    *,
    on_progress: Callable[[Progress], None] | None,
    progress_interval_s: float,
    stop: asyncio.Event | None,
    on_start: Callable[[Coordinator], None] | None,
    continue_paused: bool,
    steering: Steering,
) -> ExperimentResult:
    config = coordinator.config
    limits = Limits.of(config)
    search = make_search(config, coordinator.experiment_id, coordinator.experiment_dir)
    mode = optimize_mode_of(config)
    stop = stop or asyncio.Event()
    changed = asyncio.Event()
    loop = Loop(search, limits)

    def on_metric(ev: MetricEvent) -> None:
        loop.metric(ev, ev.kind == "intermediate" and coordinator.trial(ev.trial_id).checkpoint_step is not None)
        if loop.changed:
            changed.set()

    def on_checkpoint(ev: CheckpointSaved) -> None:
        loop.checkpointed(ev.trial_id)
        changed.set()  # a pass answers the save (saves_heard), with what the search decided sent first

    tally = _Tally(mode)

    def on_status(ev: StatusEvent) -> None:
        loop.status(ev)
        tally.status(ev)
        changed.set()

    if search.hears_intermediate or limits.max_trial_resource:  # otherwise no metric is published
        coordinator.on_metric(on_metric)
    # An assessor judges a trial at its rung as soon as the trial can pause; it, or a tuner that
    # hears results (PBT), may pause one on the results before a save: the pause lands at that save.
    if search.hears_intermediate:
        coordinator.on_checkpoint(on_checkpoint)
        coordinator.hold_saves()
    coordinator.on_status(on_status)
    started = time.monotonic()
    reason = ""
    ok = True
    pause = False  # the experiment ends STOPPED with its trials paused, to be resumed
    await coordinator.start()
    log_file = experimentlog.open_log(coordinator.experiment_id, coordinator.experiment_dir)
    steering.attach(coordinator, limits, changed.set)
    try:
        if on_start is not None:  # e.g. the dashboard, once there is a store to read
            on_start(coordinator)
        # Nothing is awaited between start() and here, so no result arrives unheard.
        loop.submitted, loop.trained = _resume(search, coordinator, count=limits.max_trial_resource is not None)
        trials = coordinator.trials()
        tally.reset(trials)  # from here on, kept by the status changes
        for t in trials:  # saves made before a resume (those made from now on are heard)
            if t.checkpoint_step is not None and t.status is TrialStatus.RUNNING:
                loop.checkpointed(t.id)
        if continue_paused:
            await _continue_paused(coordinator, search)
        last_progress = 0.0
        while True:
            # Cleared before the state is read, not after: a change that comes while this
            # pass awaits (a submit, an early stop) wakes the next pass at once.
            changed.clear()
            loop.begin()
            while (order := loop.next_order()) is not None:
                await _carry_out(coordinator, order)
            # Nothing awaited since the last order: every save heard so far had its orders sent ahead of its ack.
            coordinator.saves_heard()
            loop.submitted = await submit_customized(coordinator, search, steering, limits, loop.submitted, loop.to_do)
            # A pass reads the trials not ended only: its cost stays with the trials at work, not
            # with all the experiment ran (ended trials hold no slot, are settled, and stop nothing).
            trials = coordinator.live_trials()
            # A trial being stopped gives up its slot now: the next one is queued at once
            # and placed as soon as the slot is free. A paused one holds none.
            active = sum(1 for t in trials if _holds_a_slot(t))
            elapsed = time.monotonic() - started
            if stop.is_set():
                ok, reason, pause = False, "stopped by the user", True
                break
            spent = loop.spent(elapsed, _paused(trials))
            if spent is not None and any(t.stopping for t in trials):
                # A pause or a stop in flight lands first, so that a trial it pauses is given up
                # with the others rather than left paused after the end.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), progress_interval_s)
                continue
            if spent is not None:  # the search ends: what it holds paused will not be continued
                reason = spent.reason
                await _give_up(coordinator, spent.give_up)
                break
            if coordinator.environment_error:
                ok, reason = False, coordinator.environment_error
                break
            if coordinator.failure:
                ok, reason = False, coordinator.failure
                break
            while (proposal := loop.propose(active)) is not None:
                source = _checkpoint_source(coordinator, proposal)
                try:
                    if source is None:
                        handle = await coordinator.submit(proposal.parameters)
                    else:
                        handle = await coordinator.submit(proposal.parameters, checkpoint_from=source)
                except (TypeError, ValueError) as e:  # not JSON, or no environment could run it
                    loop.refused(proposal, e)
                    break
                loop.submitted_as(handle.id, proposal, source)
                active += 1
            steering.submitted = loop.submitted
            trials = coordinator.live_trials()
            # Ends when nothing more will happen by itself: no trial runs, waits, or is ending.
            settled = loop.settle(all(_settled(t) for t in trials), _paused(trials))
            if isinstance(settled, GiveUp):
                await _give_up(coordinator, settled)
                continue  # their ends reach the search, which may propose more
            if isinstance(settled, End):
                if settled.kind == "failed":
                    where = f" (its traceback is in {LOG_FILENAME})" if loop.search.traceback_logged else ""
                    ok, reason = False, f"{settled.reason}{where}"
                elif settled.kind == "paused":
                    ok, pause, paused = False, True, settled.paused
                    reason = (
                        f"{len(paused)} trials are paused ({', '.join(paused[:5])}"
                        f"{', ...' if len(paused) > 5 else ''}) and nothing else runs: resume the experiment to "
                        "continue them"
                    )
                break
            if loop.changed:  # the search asked more: carried out at once
                changed.set()
            now = time.monotonic()
            if on_progress and now - last_progress >= progress_interval_s:
                last_progress = now
                on_progress(_progress(coordinator, tally.counts(), tally.best, trials, loop.submitted, limits, elapsed))
            try:
                await asyncio.wait_for(changed.wait(), progress_interval_s)
            except asyncio.TimeoutError:
                pass
    finally:
        steering.detach("the experiment is ending")
        trials = coordinator.trials()
        unfinished = [t for t in trials if not t.status.terminal]
        if unfinished and not reason:
            reason = f"{len(unfinished)} trials had not finished"
        status = "DONE" if ok else ("FAILED" if coordinator.failure or search.failure else "STOPPED")
        try:
            if pause and status == "STOPPED":
                # Trials that checkpoint pause, to be continued by a resume; the others are canceled.
                await coordinator.stop(status=status, reason=reason, pause_trials=True)
            else:
                await coordinator.stop(status=status, reason=reason)
        finally:
            experimentlog.close_log(coordinator.experiment_id, log_file)
    trials = coordinator.trials()
    if on_progress:
        counts = Counter(t.status.value for t in trials)
        on_progress(_progress(coordinator, counts, best_trial(trials, mode), trials, len(trials), limits,
                              time.monotonic() - started))
    return ExperimentResult(
        experiment_id=coordinator.experiment_id,
        experiment_dir=coordinator.experiment_dir,
        trials=trials,
        best=best_trial(trials, mode),
        ok=ok and all(t.status.terminal for t in trials),
        reason=reason,
    )


def _holds_a_slot(t: TrialInfo) -> bool:
    return not _settled(t) and not t.stopping


def _settled(t: TrialInfo) -> bool:
    """Ended, or paused: nothing happens to it by itself."""
    return t.status is None or t.status.terminal or t.status is TrialStatus.PAUSED


def _checkpoint_source(coordinator: Coordinator, proposal: SubmitTrial) -> str | None:
    """The trial whose checkpoint the proposed trial starts from: the one the tuner named,
    when it saved a checkpoint; else None (a fresh start)."""
    source = proposal.checkpoint_from
    if source is None:
        return None
    try:
        step = coordinator.trial(source).checkpoint_step
    except KeyError:
        step = None
    if step is None:
        log.info("trial %d would start from trial %s's checkpoint, but it saved none: it starts afresh",
                 proposal.parameter_id, source)
        return None
    return source


async def _carry_out(coordinator: Coordinator, order: Instruction) -> None:
    """Stop, pause or continue a trial as the search asked, if its status still allows."""
    try:
        status = coordinator.trial(order.trial_id).status
        if isinstance(order, StopTrial):
            if status is not None and not status.terminal:
                await coordinator.early_stop(order.trial_id, order.reason)
        elif isinstance(order, PauseTrial):
            if status in (TrialStatus.WAITING, TrialStatus.RUNNING):
                await coordinator.pause(order.trial_id, reason=order.reason)
        elif isinstance(order, ContinueTrial) and status is TrialStatus.PAUSED:
            source = order.checkpoint_from
            if source is not None and coordinator.trial(source).checkpoint_step is None:
                log.info("trial %s would continue from trial %s's checkpoint, but it saved none: it continues "
                         "from its own", order.trial_id, source)
                source = None
            await coordinator.resume_trial(order.trial_id, parameters=order.parameters, checkpoint_from=source or "")
    except (KeyError, ValueError) as e:  # it changed status meanwhile, or the parameters are refused
        log.warning("trial %s: cannot %s it as the search asked: %s", order.trial_id,
                    type(order).__name__.removesuffix("Trial").lower(), e)


async def _continue_paused(coordinator: Coordinator, search: Search) -> None:
    """After a stop, the trials it paused go on first, from their checkpoints; those the
    search keeps paused (waiting at a rung) stay as they are."""
    for t in coordinator.trials():
        if t.status is TrialStatus.PAUSED and not search.holds(t.id):
            log.info("trial %s: continued from its checkpoint after the resume", t.id)
            await coordinator.resume_trial(t.id)


def make_search(config: ExperimentConfig, experiment_id: str, experiment_dir: Path | None = None) -> Search:
    """The config's tuner and assessor; TunerError or SearchSpaceError when they cannot be made.
    ``experiment_dir`` holds the directory NNI's PBT names its checkpoint paths under."""
    if experiment_dir is None:
        return _make_search(config, experiment_id)
    with _nni_checkpoints(config, experiment_dir):
        return _make_search(config, experiment_id)


def _nni_checkpoints(config: ExperimentConfig, experiment_dir: Path) -> contextlib.AbstractContextManager[None]:
    """NNI_CHECKPOINT_DIRECTORY while the tuner is built, as NNI's manager sets it: NNI's PBT
    names its trials' checkpoint paths under it (unless classArgs.all_checkpoint_dir does); the
    checkpoints themselves are the trials' own, kept where every checkpoint is."""
    from .search.nnialgos import checkpoint_directory, is_pbt

    directory = experiment_dir / NNI_CHECKPOINTS
    t = config.tuner
    if config.advisor is None and is_pbt(t.name, t.class_name) and not t.class_args.get("all_checkpoint_dir"):
        directory.mkdir(parents=True, exist_ok=True)
    return checkpoint_directory(directory)


def _make_search(config: ExperimentConfig, experiment_id: str) -> Search:
    t, a = config.tuner, config.assessor
    objectives = None if config.objectives is None else objectives_from_config(config.objectives)
    if config.advisor is not None:
        if config.advisor.class_name is not None or config.advisor.name is None:
            raise TunerError("advisor: only NNI's Hyperband and BOHB are supported, by name")
        advisor = create_tuner(config.advisor.name, None, dict(config.advisor.class_args), config.search_space or {})
        return Search(advisor, None, _mirror(config, experiment_id), objectives)
    class_args = dict(t.class_args)
    own_study = t.name is not None and normalized(t.name) == "optuna"
    if own_study and config.optuna_storage is not None:
        # An Optuna tuner keeps its study there itself: the mirror is the tuner's own study.
        class_args.setdefault("storage", config.optuna_storage)
        class_args.setdefault("study_name", config.optuna_study_name or _study_name(experiment_id))
    tuner: Tuner = create_tuner(
        t.name, t.class_name, class_args, config.search_space or {},
        str(t.code_directory) if t.code_directory else None, experiment_id=experiment_id, objectives=objectives,
    )
    assessor = None
    if a is not None:
        assessor = create_assessor(
            a.name, a.class_name, dict(a.class_args), str(a.code_directory) if a.code_directory else None, tuner=tuner
        )
        if objectives is not None and callable(getattr(assessor, "use_objectives", None)):
            assessor.use_objectives(objectives)  # type: ignore[attr-defined]  # it ranks by objectives.rank
    return Search(tuner, assessor, None if own_study else _mirror(config, experiment_id), objectives)


def _study_name(experiment_id: str) -> str:
    return f"trialkeeper-{experiment_id}"


def _mirror(config: ExperimentConfig, experiment_id: str) -> Mirror | None:
    """The Optuna study ``optunaStorage`` names, kept as a copy of the experiment."""
    if config.optuna_storage is None:
        return None
    from .search.optunasearch import create_optuna_mirror

    t = config.tuner
    return create_optuna_mirror(
        config.optuna_storage, config.optuna_study_name or _study_name(experiment_id), config.search_space or {},
        optimize_mode_of(config), batch=config.advisor is None and is_batch_tuner(t.name, t.class_name),
    )


async def _give_up(coordinator: Coordinator, give_up: GiveUp | None) -> None:
    """End EARLY_STOPPED the paused trials the search holds and will not continue. Their
    ends reach the search, which may propose more."""
    for trial_id in give_up.trial_ids if give_up is not None else ():
        await coordinator.early_stop(trial_id, give_up.reason)


def _paused(trials: list[TrialInfo]) -> list[str]:
    return [t.id for t in trials if t.status is TrialStatus.PAUSED]


def _resume(search: Search, coordinator: Coordinator, *, count: bool = False) -> tuple[int, int]:
    """After a resume: tell the search every stored trial and result before it proposes or
    judges anything, and track the trials still running. Returns how many trials had been
    submitted (0 for a new experiment) and, with ``count``, the intermediate results stored."""
    trials = coordinator.trials()
    if not trials:
        return 0, 0
    assert coordinator.store is not None
    intermediate: dict[str, list[float]] = {}
    # Every stored metric is read only for a search that uses intermediate results, or to count them.
    indexes: dict[str, list[int]] = {}
    reported: dict[str, list[Any]] = {}
    for row in coordinator.store.metrics() if search.hears_intermediate or count else ():
        if row.kind == "intermediate":
            intermediate.setdefault(row.trial_id, []).append(row.value)
            indexes.setdefault(row.trial_id, []).append(row.index)
            if search.hears_reported:
                reported.setdefault(row.trial_id, []).append(results.loads(row.value_json))
    search.resume([
        PastTrial(
            t.id, t.sequence_id, t.parameters, tuple(intermediate.get(t.id, ())), t.final_metric,
            t.status if t.status.terminal else None, paused=t.status is TrialStatus.PAUSED,
            intermediate_indexes=tuple(indexes.get(t.id, ())), reported=t.final_metric_value,
            intermediate_reported=tuple(reported.get(t.id, ())),
        )
        for t in trials
    ])
    return len(trials), sum(len(v) for v in intermediate.values())


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


class _Tally:
    """What the progress line counts, kept from the trials' status changes as they come: a
    snapshot of every trial for each line would cost more the longer the experiment runs."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._counts: Counter[str] = Counter()
        self.best: TrialInfo | None = None

    def reset(self, trials: list[TrialInfo]) -> None:
        self._counts = Counter(t.status.value for t in trials)
        self.best = best_trial(trials, self.mode)

    def status(self, ev: StatusEvent) -> None:
        t = ev.trial
        if ev.old is not t.status:  # else a new trial (published WAITING from WAITING)
            self._counts[ev.old.value] -= 1
        self._counts[t.status.value] += 1
        if t.final_metric is None:
            return
        if self.best is None or self.best.id == t.id:
            self.best = t
        else:  # in submission order: best_trial picks the first submitted among equals
            self.best = best_trial(sorted((self.best, t), key=lambda i: i.sequence_id or 0), self.mode)

    def counts(self) -> Counter[str]:
        return +self._counts  # the statuses some trial has


def _progress(
    c: Coordinator, counts: Counter[str], best: TrialInfo | None, trials: list[TrialInfo], submitted: int,
    config: Limits, elapsed: float,
) -> Progress:
    done = sum(n for s, n in counts.items() if TrialStatus(s).terminal)
    eta = None
    if config.max_trial_number and done:
        eta = elapsed / done * (config.max_trial_number - done)
    # Their GPUs and the trials holding them; not the trials each ran (read for every line, that grows).
    envs = [(e.id, e.status.value if e.status else "UNREADABLE", _env_detail(e)) for e in c.environments(latest=0)]
    return Progress(
        experiment_id=c.experiment_id,
        experiment_dir=c.experiment_dir,
        counts=counts,
        best=best,
        submitted=submitted,
        max_trials=config.max_trial_number,
        elapsed_s=elapsed,
        eta_s=eta,
        trials=trials,
        environments=envs,
    )
