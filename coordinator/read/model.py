"""The read model: immutable snapshots of an experiment, its trials and its environments.

Snapshots are read from the experiment's store, so a live coordinator (whose store is
written before anything is acknowledged) and the store of a finished or crashed experiment
give the same ones. The CLI reads only through here; so will a dashboard.

Nothing read from a store raises: a value an older version (or a hostile agent) stored that
this one cannot read is shown as ``None``, with a note in the snapshot's ``unreadable``.
Only a store that cannot be opened or queried at all raises :class:`StoreError`.
"""

from __future__ import annotations

import functools
import json
import math
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from ..engine.model import RankInfo, TrialInfo
from ..engine.rows import GpuSampleRow
from ..engine.states import EnvStatus, TrialStatus
from ..store.reads import StoreError, StoreReader, holds_experiment
from .failures import failure_summary
from .results import reported

# One picture of a trial, live or stored: the core's (see engine/model.py).
TrialSnapshot = TrialInfo


@dataclass(frozen=True)
class HistoryEntry:
    at: float | None
    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class GpuUsage:
    """What the stored GPU samples say about one trial."""

    samples: int
    mean_utilization_percent: float | None = None
    max_utilization_percent: float | None = None
    peak_memory_used_bytes: int | None = None
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrialDetail:
    """A trial with what is read on demand: its metrics, GPU usage and status history."""

    trial: TrialSnapshot
    intermediate: tuple[float, ...]
    # The same results as the trial reported each: a number, or a dict of keys (NNI's).
    intermediate_results: tuple[Any, ...]
    gpu_usage: GpuUsage
    history: tuple[HistoryEntry, ...]
    stdout: str
    stderr: str
    # Its checkpoints kept, oldest first.
    checkpoints: tuple[CheckpointInfo, ...] = ()
    # A FAILED trial's reason with the last meaningful line of its stderr ("" otherwise).
    failure_summary: str = ""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint a trial saved, as the CLI, the dashboard and the embedding API show it."""

    trial_id: str
    step: int
    metric_index: int  # results the trial had reported when it saved
    size_bytes: int
    digest: str
    location: str  # "" in the experiment's checkpoint directory; else an object storage URL
    saved_at: float
    env_id: str


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU of an environment, with its latest stored sample (None before the first)."""

    index: int | None
    uuid: str
    name: str
    memory_total_bytes: int | None
    mig: bool
    simulated: bool
    utilization_percent: float | None
    memory_used_bytes: int | None
    sampled_at: float | None
    held_by: tuple[str, ...]


@dataclass(frozen=True)
class EnvSnapshot:
    id: str
    platform: str
    platform_id: str
    status: EnvStatus | None
    reason: str
    hostname: str
    connected: bool  # its agent's stream is open (as the coordinator last stored it)
    instance_id: str  # the agent process that registered last ('' before any did)
    gpus: tuple[GpuSnapshot, ...]
    gpu_unavailable_reason: str
    trials: tuple[str, ...]  # every trial placed on it last
    running_trials: tuple[str, ...]  # those still waiting to start or running
    stopping_trials: tuple[str, ...]  # those canceled whose processes are being stopped
    stopping: bool  # the environment itself is draining
    created_at: float | None
    ended_at: float | None
    unreadable: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExperimentSnapshot:
    id: str
    name: str | None
    status: str
    reason: str
    directory: str
    coordinator_address: str
    started_at: float | None
    ended_at: float | None
    optimize_mode: str
    trials: Mapping[str, int]  # trial count per status
    trial_count: int
    metrics: int
    environments: int
    best: TrialSnapshot | None
    unreadable: tuple[str, ...] = ()


# ---- best trial ----------------------------------------------------------------------------


class _Scored(Protocol):
    @property
    def final_metric(self) -> float | None: ...


S = TypeVar("S", bound=_Scored)


def optimize_mode(class_args: Mapping[str, Any] | None) -> str:
    """The tuner's optimize mode: "maximize" (the default) or "minimize"."""
    mode = (class_args or {}).get("optimize_mode", "maximize")
    return "minimize" if mode == "minimize" else "maximize"


def ranked(trials: Iterable[S], mode: str) -> list[S]:
    """Trials with a final metric, best first."""
    scored = [t for t in trials if t.final_metric is not None]
    return sorted(scored, key=lambda t: t.final_metric, reverse=mode == "maximize")  # type: ignore[arg-type,return-value]


def best_trial(trials: Iterable[S], mode: str) -> S | None:
    scored = [t for t in trials if t.final_metric is not None]
    if not scored:
        return None
    pick = max if mode == "maximize" else min
    return pick(scored, key=lambda t: t.final_metric)  # type: ignore[arg-type,return-value]


# ---- reading rows without raising ----------------------------------------------------------

_SHOWN = 60  # characters of a bad value quoted in its note


class _Fields:
    """Typed reads of one stored row; what cannot be read becomes a default and a note."""

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.row = row
        self.notes: list[str] = []

    def bad(self, column: str, why: str) -> None:
        value = repr(self.row.get(column))
        shown = value if len(value) <= _SHOWN else value[:_SHOWN] + "..."
        self.notes.append(f"{column}: unreadable ({why}): {shown}")

    def text(self, column: str) -> str:
        value = self.row.get(column)
        if value is None or isinstance(value, str):
            return value or ""
        self.bad(column, "not text")
        return ""

    def optional_text(self, column: str) -> str | None:
        return self.text(column) or None

    def number(self, column: str) -> float | None:
        value = self.row.get(column)
        if value is None:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        self.bad(column, "not a number")
        return None

    def integer(self, column: str) -> int | None:
        value = self.row.get(column)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        self.bad(column, "not an integer")
        return None

    def flag(self, column: str) -> bool:
        return bool(self.integer(column))

    def json(self, column: str, check: Callable[[Any], bool], expected: str, default: Any = None) -> Any:
        raw = self.row.get(column)
        if raw is None:
            return default
        try:
            value = json.loads(raw) if isinstance(raw, (str, bytes)) else _NOT_JSON
        except (ValueError, RecursionError):
            value = _NOT_JSON
        if value is _NOT_JSON:
            self.bad(column, "not JSON")
            return default
        if not check(value):
            self.bad(column, f"not {expected}")
            return default
        return value

    def status(self, column: str, kind: type[_E]) -> _E | None:
        value = self.row.get(column)
        try:
            return kind(value)
        except ValueError:
            self.bad(column, f"not a {kind.__name__.removesuffix('Status').lower()} status this version knows")
            return None


_E = TypeVar("_E", bound=Enum)
_NOT_JSON = object()


def _sane(sample: GpuSampleRow) -> bool:
    """A GPU sample whose figures are numbers (a row that is not is left out)."""
    return all(
        isinstance(v, (int, float)) and not isinstance(v, bool)
        for v in (sample.at, sample.utilization, sample.memory_used_bytes, sample.memory_total_bytes)
    )


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(i, str) for i in v)


def loads_or_none(raw: str | None) -> Any:
    """A stored JSON text's value; None when there is none or it cannot be read."""
    return _Fields({"v": raw}).json("v", lambda _: True, "JSON")


# The limits `trialkeeper update` changes (core.LIMITS), as the config names them.
_UPDATED_KEYS = {
    "trial_concurrency": "trialConcurrency", "max_trial_number": "maxTrialNumber",
    "max_experiment_duration": "maxExperimentDuration",
}


def trial_snapshot(row: Mapping[str, Any]) -> TrialSnapshot:
    """A trial from its stored row (a mapping of column to value)."""
    f = _Fields(row)
    status = f.status("status", TrialStatus)
    reason = f.text("reason")
    active = status in (TrialStatus.WAITING, TrialStatus.RUNNING)
    stopping = f.flag("stopping")
    if reason.startswith("stopping: ") and not stopping:
        # How a store made before the stopping column said it.
        reason, stopping = reason.removeprefix("stopping: "), True
    return TrialSnapshot(
        id=f.text("id"),
        sequence_id=f.integer("seq"),
        status=status,
        parameters=f.json("parameters_json", lambda v: isinstance(v, dict), "a JSON object"),
        environment_id=f.optional_text("environment_id"),
        gpu_indices=tuple(f.json("gpu_indices_json", _is_int_list, "a list of GPU indices", [])),
        final_metric=f.number("final_metric"),
        final_metric_value=f.json("final_metric_json", lambda _: True, "JSON"),
        exit_code=f.integer("exit_code"),
        signal=f.integer("signal"),
        reason=reason,
        stderr_tail=f.text("stderr_tail"),
        submitted_at=f.number("submitted_at"),
        started_at=f.number("started_at"),
        ended_at=f.number("ended_at"),
        attempts=f.integer("attempts") or 0,
        waiting_reason=f.text("waiting_reason") if status is TrialStatus.WAITING else "",
        stopping=stopping and active,
        unreadable=tuple(f.notes),
        checkpoint_step=f.integer("checkpoint_step") if "checkpoint_step" in row else None,
        nodes=max(1, f.integer("nodes") or 1) if "nodes" in row else 1,
        ranks=_ranks(f.json("ranks_json", lambda v: isinstance(v, list), "a list of ranks", []) if "ranks_json" in row
                     else []),
    )


def _ranks(raw: list[Any]) -> tuple[RankInfo, ...]:
    """A multi-node trial's ranks as stored ([rank, environment, GPUs, state] each); one
    that cannot be read is left out."""
    found = []
    for r in raw:
        if isinstance(r, list) and len(r) == 4 and isinstance(r[0], int) and _is_int_list(r[2]):
            found.append(RankInfo(r[0], str(r[1]), tuple(r[2]), str(r[3])))
    return tuple(found)


# ---- the read model ------------------------------------------------------------------------


class ReadModel:
    """Snapshots of the experiment a store holds. Open one with :meth:`open` (read-only, for
    any process), or give it the live coordinator's own store."""

    def __init__(self, store: StoreReader, experiment_dir: Path | None = None) -> None:
        self.store = store
        self.experiment_dir = experiment_dir if experiment_dir is not None else store.path.parent

    @classmethod
    def open(cls, experiment_dir: Path) -> ReadModel:
        return cls(StoreReader.in_dir(experiment_dir), experiment_dir)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> ReadModel:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, what: str, query: Callable[[], _T]) -> _T:
        try:
            return query()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot read the {what} of the experiment store {self.store.path}: {e}") from e

    # -- trials

    def trials(self) -> tuple[TrialSnapshot, ...]:
        return tuple(trial_snapshot(r) for r in self._read("trials", self.store.trials))

    def trial(self, trial_id: str) -> TrialSnapshot | None:
        row = self._read("trials", lambda: self.store.trial(trial_id))
        return None if row is None else trial_snapshot(row)

    def trial_detail(self, trial_id: str) -> TrialDetail | None:
        trial = self.trial(trial_id)
        if trial is None:
            return None
        metrics = self._read("metrics", lambda: self.store.metrics(trial_id))
        samples = [s for s in self._read("GPU samples", lambda: self.store.gpu_samples(trial_id=trial_id)) if _sane(s)]
        usage = GpuUsage(samples=len(samples))
        if samples:
            usage = GpuUsage(
                samples=len(samples),
                mean_utilization_percent=sum(s.utilization for s in samples) / len(samples),
                max_utilization_percent=max(s.utilization for s in samples),
                peak_memory_used_bytes=max(s.memory_used_bytes for s in samples),
                gpus=tuple(sorted({s.uuid for s in samples})),
            )
        events = self._read("events", lambda: self.store.events(trial_id))
        history = []
        for ev in events:
            f = _Fields(ev)
            history.append(HistoryEntry(f.number("at"), f.text("old"), f.text("new"), f.text("reason")))
        trial_dir = self.experiment_dir / "trials" / trial_id
        return TrialDetail(
            trial=trial,
            intermediate=tuple(
                m.value for m in metrics if m.kind == "intermediate" and isinstance(m.value, (int, float))
            ),
            intermediate_results=tuple(reported(m.value, m.value_json) for m in metrics if m.kind == "intermediate"),
            gpu_usage=usage,
            history=tuple(history),
            stdout=str(trial_dir / "stdout.log"),
            stderr=str(trial_dir / "stderr.log"),
            checkpoints=tuple(self.checkpoints(trial_id)),
            failure_summary=failure_summary(trial),
        )

    def checkpoints(self, trial_id: str | None = None) -> list[CheckpointInfo]:
        """The checkpoints kept (of one trial, or of all), oldest first."""
        rows = self._read("checkpoints", lambda: self.store.checkpoints(trial_id))
        found = []
        for r in rows:
            f = _Fields(r)
            found.append(CheckpointInfo(
                f.text("trial_id"), f.integer("step") or 0, f.integer("metric_index") or 0,
                f.integer("size_bytes") or 0, f.text("digest"), f.text("location"), f.number("saved_at") or 0.0,
                f.text("env_id"),
            ))
        return found

    def trial_counts(self) -> dict[str, int]:
        """Trials per status (a status this version does not know counts as UNREADABLE)."""
        known = {s.value for s in TrialStatus}
        counts: dict[str, int] = {}
        for status, n in self._read("trials", self.store.trial_counts).items():
            key = status if status in known else "UNREADABLE"
            counts[key] = counts.get(key, 0) + n
        return dict(sorted(counts.items()))

    def best(self, mode: str) -> TrialSnapshot | None:
        row = self._read("trials", lambda: self.store.best_trial(descending=mode == "maximize"))
        return None if row is None else trial_snapshot(row)

    # -- environments

    def environments(self, latest: int | None = None) -> tuple[EnvSnapshot, ...]:
        """Every environment. ``latest``: each one's ``trials`` are only its latest ``latest``
        (:meth:`trials_per_environment` counts them all), read in the store: a hundred
        thousand trials need not be read for a page of environments."""
        # Only the trials still waiting or running are read whole (their GPUs, whether they
        # stop): with a hundred thousand ended trials, an environment needs just their ids.
        active = self.active_by_environment()
        places = self.store.trial_places if latest is None else lambda: self.store.latest_trial_places(latest)
        by_env: dict[str | None, list[str]] = {}
        for tid, env_id, *_ in self._read("trials", places):
            if isinstance(tid, str) and (env_id is None or isinstance(env_id, str)):
                by_env.setdefault(env_id, []).append(tid)
        samples = self._read("GPU samples", self.store.latest_gpu_samples)
        return tuple(self._env(r, by_env, active, samples) for r in self._read("environments", self.store.envs))

    def trials_per_environment(self) -> dict[str | None, int]:
        return self._read("trials", self.store.trials_per_environment)

    def active_by_environment(self) -> dict[str | None, list[TrialSnapshot]]:
        """The trials waiting or running, by the environment they are placed on."""
        active: dict[str | None, list[TrialSnapshot]] = {}
        for t in map(trial_snapshot, self._read("trials", self.store.active_trials)):
            active.setdefault(t.environment_id, []).append(t)
        return active

    def _env(
        self,
        row: Mapping[str, Any],
        by_env: Mapping[str | None, Sequence[str]],
        active: Mapping[str | None, Sequence[TrialSnapshot]],
        samples: Mapping[str, Mapping[str, GpuSampleRow]],
    ) -> EnvSnapshot:
        """An environment's snapshot: ``by_env`` the ids of the trials placed on each, ``active``
        the waiting and running ones."""
        f = _Fields(row)
        env_id = f.text("id")
        info = f.json("info_json", lambda v: isinstance(v, dict), "a JSON object", {})
        placed = by_env.get(env_id, ())
        running = [t for t in active.get(env_id, ()) if t.active]
        holding: dict[int, list[str]] = {}
        for t in running:
            for i in t.gpu_indices:
                holding.setdefault(i, []).append(t.id)
        latest = samples.get(env_id, {})
        gpus = []
        listed = info.get("gpus")
        if not isinstance(listed, list) or not all(isinstance(g, dict) for g in listed):
            if listed is not None:
                f.bad("info_json", "its gpus are not a list of objects")
            listed = []
        for g in listed:
            gf = _Fields(g)
            uuid, index = gf.text("uuid"), gf.integer("index")
            sample = latest.get(uuid)
            sample = sample if sample is not None and _sane(sample) else None
            gpus.append(GpuSnapshot(
                index=index, uuid=uuid, name=gf.text("name"), memory_total_bytes=gf.integer("memory_total_bytes"),
                mig=bool(g.get("mig")), simulated=bool(g.get("simulated")),
                utilization_percent=sample.utilization if sample else None,
                memory_used_bytes=sample.memory_used_bytes if sample else None,
                sampled_at=sample.at if sample else None,
                held_by=tuple(holding.get(index, [])) if index is not None else (),
            ))
            f.notes.extend(f"info_json gpus {note}" for note in gf.notes)
        status = f.status("status", EnvStatus)
        unavailable = info.get("gpu_unavailable_reason")
        return EnvSnapshot(
            id=env_id, platform=f.text("platform"), platform_id=f.text("platform_id"), status=status,
            reason=f.text("reason"), hostname=f.text("hostname"), connected=f.flag("connected"),
            instance_id=f.text("agent_instance_id"),
            gpus=tuple(gpus), gpu_unavailable_reason=unavailable if isinstance(unavailable, str) else "",
            trials=tuple(placed), running_trials=tuple(t.id for t in running),
            stopping_trials=tuple(t.id for t in running if t.stopping),
            stopping=status is EnvStatus.DRAINING,
            created_at=f.number("created_at"), ended_at=f.number("ended_at"), unreadable=tuple(f.notes),
        )

    # -- the experiment

    def stored_config(self) -> dict[str, Any] | None:
        """The config the experiment was started with (secrets redacted), with the limits
        ``trialkeeper update`` changed since; None when there is no experiment or its stored
        text cannot be read (the snapshot's ``unreadable`` says)."""
        row = self._read("experiment", self.store.experiment)
        if row is None:
            return None
        config = _Fields(row).json("config_json", lambda v: isinstance(v, dict), "a JSON object")
        if config is not None:  # with the limits `trialkeeper update` changed while it ran
            updated = loads_or_none(self._read("meta", lambda: self.store.meta("updated_limits")))
            for name, key in _UPDATED_KEYS.items():
                if isinstance(updated, dict) and name in updated:
                    config[key] = updated[name]
        return config

    def bound_address(self) -> str:
        """The address the experiment's coordinator listened on last ("" if never)."""
        return self._read("meta", lambda: self.store.meta("bound_address")) or ""

    def experiment(self) -> ExperimentSnapshot | None:
        row = self._read("experiment", self.store.experiment)
        if row is None:
            return None
        f = _Fields(row)
        config = f.json("config_json", lambda v: isinstance(v, dict), "a JSON object", {})
        tuner = config.get("tuner")
        class_args = tuner.get("classArgs") if isinstance(tuner, dict) else None
        mode = optimize_mode(class_args if isinstance(class_args, dict) else None)
        # Counted and ranked in the store: a hundred thousand trials need not be read for it.
        counts = self.trial_counts()
        return ExperimentSnapshot(
            id=f.text("id"), name=f.optional_text("name"), status=f.text("status"), reason=f.text("reason"),
            directory=str(self.experiment_dir), coordinator_address=f.text("coordinator_address"),
            started_at=f.number("created_at"), ended_at=f.number("ended_at"), optimize_mode=mode,
            trials=MappingProxyType(counts), trial_count=sum(counts.values()),
            metrics=self._read("metrics", self.store.metric_count),
            environments=len(self._read("environments", self.store.envs)),
            best=self.best(mode), unreadable=tuple(f.notes),
        )


_T = TypeVar("_T")


def list_experiments(directory: Path) -> list[ExperimentSnapshot]:
    """The experiments in the subdirectories of ``directory``, oldest first. A store that
    cannot be read at all is listed with its directory name as id and the error."""
    found = []
    try:
        children = sorted(p for p in directory.iterdir() if holds_experiment(p))
    except OSError:
        return []
    for child in children:
        try:
            with ReadModel.open(child) as model:
                snapshot = model.experiment()
        except StoreError as e:
            snapshot = None
            why = str(e)
        else:
            why = "the store holds no experiment"
        found.append(snapshot or _unreadable_experiment(child, why))
    return sorted(found, key=lambda e: (e.started_at is None, e.started_at or 0.0, e.id))


def _unreadable_experiment(directory: Path, why: str) -> ExperimentSnapshot:
    return ExperimentSnapshot(
        id=directory.name, name=None, status="", reason="", directory=str(directory), coordinator_address="",
        started_at=None, ended_at=None, optimize_mode="maximize", trials=MappingProxyType({}), trial_count=0,
        metrics=0, environments=0, best=None, unreadable=(why,),
    )


def to_json(value: Any) -> Any:
    """A snapshot (or anything made of them) as plain JSON data."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:  # most of what a snapshot holds
        return value
    if kind is float:
        return value if math.isfinite(value) else str(value)  # JSON has no NaN or infinity
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {name: to_json(getattr(value, name)) for name in _field_names(kind)}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))
