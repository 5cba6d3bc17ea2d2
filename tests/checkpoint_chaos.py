"""The experiment of examples/checkpoints, run by ``trialkeeper run`` while its environments
are taken away, and what must hold once it has ended.

Each trial trains scikit-learn's SGDClassifier epoch by epoch and saves a checkpoint after
every epoch; ``EPOCH_SECONDS`` makes an epoch last long enough to pull the plug on it and
``EPOCH_LOG`` names a file where each computed epoch is written as "<trial id> <epoch>".
:func:`take_environments` takes environments away one by one (a platform's own way: kill -9,
scancel, a pod deleted), each once a trial on it has saved a checkpoint it had not saved at
the previous loss, so that the losses are spread over the run by its progress, not by time.
:func:`check_finished` then says whether every trial SUCCEEDED with one complete curve (each
epoch's result once, with the value an undisturbed run reports) and whether the epochs
computed in all stay within 1.3 times those of an undisturbed run.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.read.model import EnvSnapshot, ExperimentSnapshot, ReadModel, TrialSnapshot
from trialkeeper.coordinator.store.store import Store, StoreError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "checkpoints"
EPOCH_SECONDS = 0.5
# At most this many times the epochs of an undisturbed run may be computed in all.
BUDGET = 1.3
ALPHAS = (1e-4, 1e-3)
ETA0S = (0.02, 0.05)
POLL_S = 0.05
LIVE = (EnvStatus.READY, EnvStatus.BUSY)
# Epochs a running trial still has to go when the experiment is stopped.
STOP_MARGIN = 3


@dataclass
class Workload:
    """The experiment's files: its code (the example's train.py), its epoch log and its
    directory, all under ``root``."""

    root: Path
    trials: int
    epochs: int

    @property
    def code(self) -> Path:
        return self.root / "code"

    @property
    def epoch_log(self) -> Path:
        return self.root / "epochs.log"

    @property
    def exp(self) -> Path:
        return self.root / "exp"

    def config(self, training_service: dict[str, Any], **overrides: Any) -> dict[str, Any]:
        """The experiment as plain data: ``trials`` trials of ``epochs`` epochs, two at a time,
        a loss after a new checkpoint not counting against the one retry each may have."""
        data: dict[str, Any] = {
            "experimentName": "checkpoint-chaos",
            "searchSpace": {
                "epochs": {"_type": "choice", "_value": [self.epochs]},
                "alpha": {"_type": "choice", "_value": list(ALPHAS)},
                "eta0": {"_type": "choice", "_value": list(ETA0S)},
            },
            "trialCommand": "python3 train.py",
            "trialCodeDirectory": str(self.code),
            "experimentWorkingDirectory": str(self.root / "experiments"),
            "trialConcurrency": 2,
            "maxTrialNumber": self.trials,
            "maxTrialRetries": 1,
            "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize", "seed": 5}},
            "trialEnv": {"EPOCH_SECONDS": str(EPOCH_SECONDS), "EPOCH_LOG": str(self.epoch_log)},
            # Loose timers: a loaded machine must not make a slow agent look lost.
            "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 10, "trialLostTimeout": 30},
            "trainingService": training_service,
        }
        data.update(overrides)
        return data

    def write_config(self, training_service: dict[str, Any], **overrides: Any) -> Path:
        path = self.root / "config.yml"
        path.write_text(json.dumps(self.config(training_service, **overrides)))  # JSON is YAML
        return path

    def computed(self) -> list[tuple[str, int]]:
        """Every epoch computed so far, in the order they were, as (trial id, epoch)."""
        if not self.epoch_log.exists():
            return []
        out = []
        for line in self.epoch_log.read_text().splitlines():
            trial_id, epoch = line.split()
            out.append((trial_id, int(epoch)))
        return out


def workload(root: Path, *, trials: int, epochs: int) -> Workload:
    """A workload under ``root`` with the example's training script as its code."""
    w = Workload(root, trials, epochs)
    w.code.mkdir(parents=True, exist_ok=True)
    shutil.copy2(EXAMPLE / "train.py", w.code / "train.py")
    return w


# ---- the coordinator as a command ---------------------------------------------------------


def cli(*args: str) -> subprocess.Popen[bytes]:
    """``trialkeeper ARGS`` in a process of its own, its output collected."""
    return subprocess.Popen(
        [sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen[bytes], timeout: float, what: str) -> str:
    """Wait for a command to end with status 0; its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"{what} did not end within {timeout:g} s:\n{out.decode(errors='replace')}") from None
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{what} ended with status {proc.returncode}:\n{text}"
    return text


def end(*procs: subprocess.Popen[bytes] | None) -> None:
    """Kill what is still running of these commands (after a failed test)."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


# ---- reading the store while it is written --------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """The trials and environments as the store held them at one moment."""

    trials: tuple[TrialSnapshot, ...]
    envs: tuple[EnvSnapshot, ...]
    experiment: ExperimentSnapshot | None

    @property
    def progress(self) -> int:
        """Epochs saved in all: the sum of each trial's latest checkpoint step."""
        return sum(t.checkpoint_step or 0 for t in self.trials)

    def env(self, env_id: str | None) -> EnvSnapshot | None:
        return next((e for e in self.envs if e.id == env_id), None)


def seen(exp: Path) -> Seen | None:
    """What the store holds now; None while it does not exist yet or cannot be read."""
    if not (exp / Store.FILENAME).exists():
        return None
    try:
        with ReadModel.open(exp) as model:
            return Seen(model.trials(), model.environments(), model.experiment())
    except (StoreError, OSError):
        return None  # being created


def wait_for(
    proc: subprocess.Popen[bytes] | None, predicate: Callable[[], Any], timeout: float, message: str
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds or
    as soon as ``proc`` (the coordinator) has ended, with its output."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"{message}: the coordinator ended (status {proc.returncode}) first:\n{out}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (within {timeout:g} s)")
        time.sleep(POLL_S)


# ---- taking environments away ------------------------------------------------------------------


@dataclass(frozen=True)
class Loss:
    """One environment taken away: under which trial, at which saved step, and how many
    epochs had been computed in all just before."""

    env_id: str
    trial_id: str
    step: int
    computed_before: int


@dataclass
class Losses:
    taken: list[Loss] = field(default_factory=list)

    def last_step(self, trial_id: str) -> int:
        return max((loss.step for loss in self.taken if loss.trial_id == trial_id), default=0)

    def of(self, trial_id: str) -> int:
        return sum(loss.trial_id == trial_id for loss in self.taken)

    def env_ids(self) -> set[str]:
        return {loss.env_id for loss in self.taken}


def _victim(now: Seen, losses: Losses, epochs: int) -> tuple[TrialSnapshot, EnvSnapshot] | None:
    """A running trial with epochs still to go, on a live environment not taken before, which
    has saved a checkpoint since its environment was last taken away; the one with the fewest
    losses so far, so that they fall on different trials."""
    found = []
    for t in now.trials:
        env = now.env(t.environment_id)
        step = t.checkpoint_step or 0
        if (t.status is TrialStatus.RUNNING and env is not None and env.status in LIVE and env.connected
                and env.id not in losses.env_ids() and losses.last_step(t.id) < step < epochs):
            found.append((t, env))
    found.sort(key=lambda te: losses.of(te[0].id))
    return found[0] if found else None


def take_environments(
    w: Workload,
    proc: subprocess.Popen[bytes],
    count: int,
    take: Callable[[EnvSnapshot, Seen], None],
    *,
    timeout: float,
) -> Losses:
    """Take ``count`` environments away with ``take(env, seen)``, the k-th once the trials
    have saved about k/count of three quarters of all their epochs and a running trial has a
    checkpoint it did not have at its previous loss; after each, wait until the coordinator
    has seen the environment go (it is no longer live)."""
    losses = Losses()
    total = w.trials * w.epochs
    for k in range(1, count + 1):
        threshold = round(k * 0.75 * total / count)

        def ready(threshold: int = threshold) -> tuple[Seen, TrialSnapshot, EnvSnapshot] | None:
            now = seen(w.exp)
            if now is None or now.progress < threshold:
                return None
            chosen = _victim(now, losses, w.epochs)
            return (now, *chosen) if chosen else None

        now, trial, env = wait_for(
            proc, ready, timeout,
            f"loss {k} of {count}: no running trial saved {threshold} epochs in all with a new checkpoint",
        )
        losses.taken.append(Loss(env.id, trial.id, trial.checkpoint_step or 0, len(w.computed())))
        take(env, now)

        def gone(env_id: str = env.id) -> bool:
            again = seen(w.exp)
            e = again.env(env_id) if again else None
            return e is not None and (e.status not in LIVE or not e.connected)

        wait_for(proc, gone, timeout, f"the coordinator did not notice that {env.id} was taken away")
    return losses


# ---- stopping to be resumed ---------------------------------------------------------------


def stop_experiment(w: Workload, run: subprocess.Popen[bytes], *, after: int, timeout: float) -> list[Loss]:
    """Once the trials have saved ``after`` epochs in all and each running trial has a
    checkpoint and at least STOP_MARGIN epochs to go, `trialkeeper stop` and assert what
    must hold: the run ends saying it was stopped, the experiment is STOPPED, the trials that
    ran PAUSED at their next save (none failed or canceled), every environment stopped. The
    paused trials, as losses whose steps :func:`check_finished` makes sure are not computed
    again.

    (A stop cancels a trial that has saved no checkpoint yet: the margin keeps a trial from
    ending, and the next from starting, while the stop command starts.)"""

    def checkpointed() -> Seen | None:
        now = seen(w.exp)
        if now is None or now.progress < after:
            return None
        running = [t.checkpoint_step or 0 for t in now.trials if t.status is TrialStatus.RUNNING]
        return now if running and all(1 <= step <= w.epochs - STOP_MARGIN for step in running) else None

    wait_for(run, checkpointed, timeout, f"the trials never saved {after} epochs in all")
    stop = cli("stop", str(w.exp), "--timeout", str(timeout))
    said = finish(stop, timeout + 30, "trialkeeper stop")
    assert "STOPPED" in said and "resume" in said, said
    out, _ = run.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert run.returncode == 1 and "stopped by the user" in text, text  # it did not complete: it was stopped

    now = seen(w.exp)
    assert now is not None and now.experiment is not None and now.experiment.status == "STOPPED", now
    statuses = {t.id: t.status for t in now.trials}
    paused = [t for t in now.trials if t.status is TrialStatus.PAUSED]
    assert paused, statuses
    assert set(statuses.values()) <= {TrialStatus.PAUSED, TrialStatus.SUCCEEDED, TrialStatus.WAITING}, statuses
    assert all(t.checkpoint_step for t in paused), [(t.id, t.checkpoint_step) for t in paused]
    assert all(e.status is not None and e.status.terminal for e in now.envs), [(e.id, e.status) for e in now.envs]
    assert not any(e.status is EnvStatus.FAILED for e in now.envs), [(e.id, e.reason) for e in now.envs]
    # Nothing runs now: whatever is computed from here on is the resumed experiment's.
    computed_before = len(w.computed())
    return [Loss("", t.id, t.checkpoint_step or 0, computed_before) for t in paused]


# ---- what must hold at the end ---------------------------------------------------------------------


def expected_curve(params: dict[str, Any], epochs: int) -> list[float]:
    """The validation accuracy after each epoch of an undisturbed run of train.py."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import SGDClassifier
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x / 16.0, y, test_size=0.25, random_state=0)
    model = SGDClassifier(alpha=float(params["alpha"]), learning_rate="constant", eta0=float(params["eta0"]),
                          random_state=0)
    out = []
    for _ in range(epochs):
        model.partial_fit(x_train, y_train, classes=list(range(10)))
        out.append(float(model.score(x_val, y_val)))
    return out


def check_finished(w: Workload, losses: Losses | None = None) -> dict[str, Any]:
    """Assert what must hold once the experiment has ended: the experiment DONE, every trial
    SUCCEEDED, each curve complete with every epoch's result once (the values an undisturbed
    run reports), every epoch of every trial computed, at most BUDGET times an undisturbed
    run's epochs computed in all, and no trial continued from before the checkpoint it had
    when its environment was taken away. Returns a summary for the test's report."""
    store = Store.in_dir(w.exp, readonly=True)
    try:
        experiment = store.experiment()
        assert experiment is not None and experiment["status"] == "DONE", experiment
        trials = store.trials()
        assert len(trials) == w.trials, [(t["id"], t["status"]) for t in trials]
        assert [t["status"] for t in trials] == ["SUCCEEDED"] * w.trials, [
            (t["id"], t["status"], t["reason"]) for t in trials
        ]
        curves = {}
        for t in trials:
            params = json.loads(str(t["parameters_json"]))
            rows = store.metrics(str(t["id"]))
            intermediate = [(m.index, m.value) for m in rows if m.kind == "intermediate"]
            finals = [m.value for m in rows if m.kind == "final"]
            assert [i for i, _ in intermediate] == list(range(w.epochs)), (t["id"], intermediate)
            expected = expected_curve(params, w.epochs)
            got = [v for _, v in intermediate]
            assert all(abs(a - b) < 1e-9 for a, b in zip(got, expected)), (t["id"], got, expected)
            assert len(finals) == 1 and abs(finals[0] - expected[-1]) < 1e-9, (t["id"], finals, expected[-1])
            curves[str(t["id"])] = got
        attempts = {str(t["id"]): int(t["attempts"]) for t in trials}
    finally:
        store.close()

    computed = w.computed()
    each = {(tid, e) for tid in curves for e in range(1, w.epochs + 1)}
    assert set(computed) == each, sorted(each ^ set(computed))
    undisturbed = w.trials * w.epochs
    assert len(computed) <= BUDGET * undisturbed, (
        f"{len(computed)} epochs computed, more than {BUDGET} x the {undisturbed} of an undisturbed run: "
        f"{_repeats(computed)}"
    )
    for loss in (losses.taken if losses else []):
        again = [e for tid, e in computed[loss.computed_before:] if tid == loss.trial_id and e <= loss.step]
        assert not again, (
            f"trial {loss.trial_id} computed epochs {again} again after {loss.env_id} was taken away, "
            f"though its checkpoint at step {loss.step} was recorded"
        )
    return {"computed": len(computed), "undisturbed": undisturbed, "attempts": attempts}


def _repeats(computed: list[tuple[str, int]]) -> dict[str, list[int]]:
    seen_once: set[tuple[str, int]] = set()
    out: dict[str, list[int]] = {}
    for tid, e in computed:
        if (tid, e) in seen_once:
            out.setdefault(tid, []).append(e)
        seen_once.add((tid, e))
    return out
