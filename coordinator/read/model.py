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
import math
import sqlite3
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from ..engine.rows import GpuSampleRow
from ..engine.states import EnvStatus, TrialStatus
from ..store.reads import StoreError, StoreReader, holds_experiment
from .failures import failure_summary
from .results import reported
from .rows import _Fields, _sane, loads_or_none, trial_snapshot
from .snapshots import (
    CheckpointInfo,
    EnvSnapshot,
    ExperimentSnapshot,
    GpuSnapshot,
    GpuUsage,
    HistoryEntry,
    TrialDetail,
    TrialSnapshot,
    best_trial,
    optimize_mode,
    ranked,
)

# What the read side's users import from here (its snapshots and rows live beside it).
__all__ = [
    "CheckpointInfo", "EnvSnapshot", "ExperimentSnapshot", "GpuSnapshot", "GpuUsage", "HistoryEntry", "ReadModel",
    "StoreError", "TrialDetail", "TrialSnapshot", "best_trial", "list_experiments", "loads_or_none",
    "optimize_mode", "ranked", "to_json", "trial_snapshot",
]

# The limits `trialkeeper update` changes (core.LIMITS), as the config names them.
_UPDATED_KEYS = {
    "trial_concurrency": "trialConcurrency", "max_trial_number": "maxTrialNumber",
    "max_experiment_duration": "maxExperimentDuration",
}


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

    def read(self, what: str, query: Callable[[], _T]) -> _T:
        """``query()``, a read of the store: what the read side's modules ask of the store
        beyond the snapshots. A store that cannot be read raises :class:`StoreError` naming
        ``what`` was being read (the trials, the metrics, ...)."""
        try:
            return query()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot read the {what} of the experiment store {self.store.path}: {e}") from e

    def changes(self) -> Hashable:
        """What moves whenever a trial row or a result is written (a trial submitted, a status,
        a result), and not otherwise: the store's change counter, one lookup. A store no version
        that keeps it has opened for writing (none writes it then but an older version) gives
        SQLite's count of the commits this connection has seen: any commit moves it."""
        counted = self.read("store", self.store.changes)
        if counted is not None:
            return counted
        return self.store, self.read("store", self.store.data_version)

    # -- trials

    def trials(self) -> tuple[TrialSnapshot, ...]:
        return tuple(trial_snapshot(r) for r in self.read("trials", self.store.trials))

    def trial(self, trial_id: str) -> TrialSnapshot | None:
        row = self.read("trials", lambda: self.store.trial(trial_id))
        return None if row is None else trial_snapshot(row)

    def trial_detail(self, trial_id: str) -> TrialDetail | None:
        trial = self.trial(trial_id)
        if trial is None:
            return None
        metrics = self.read("metrics", lambda: self.store.metrics(trial_id))
        samples = [s for s in self.read("GPU samples", lambda: self.store.gpu_samples(trial_id=trial_id)) if _sane(s)]
        usage = GpuUsage(samples=len(samples))
        if samples:
            usage = GpuUsage(
                samples=len(samples),
                mean_utilization_percent=sum(s.utilization for s in samples) / len(samples),
                max_utilization_percent=max(s.utilization for s in samples),
                peak_memory_used_bytes=max(s.memory_used_bytes for s in samples),
                gpus=tuple(sorted({s.uuid for s in samples})),
            )
        events = self.read("events", lambda: self.store.events(trial_id))
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
        rows = self.read("checkpoints", lambda: self.store.checkpoints(trial_id))
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
        for status, n in self.read("trials", self.store.trial_counts).items():
            key = status if status in known else "UNREADABLE"
            counts[key] = counts.get(key, 0) + n
        return dict(sorted(counts.items()))

    def best(self, mode: str) -> TrialSnapshot | None:
        row = self.read("trials", lambda: self.store.best_trial(descending=mode == "maximize"))
        return None if row is None else trial_snapshot(row)

    # -- environments

    def environments(
        self, latest: int | None = None, *, offset: int = 0, limit: int | None = None
    ) -> tuple[EnvSnapshot, ...]:
        """The environments in the order they were made (``limit`` of them from ``offset``:
        a page, whose trials and GPU samples alone are read). ``latest``: each one's ``trials``
        are only its latest ``latest`` (:meth:`trials_per_environment` counts them all), read
        in the store: a hundred thousand trials need not be read for a page of environments."""
        rows = self.read("environments", lambda: self.store.envs(offset, limit))
        ids = None if limit is None else [r["id"] for r in rows]
        # Only the trials still waiting or running are read whole (their GPUs, whether they
        # stop): with a hundred thousand ended trials, an environment needs just their ids.
        active = self.active_by_environment()
        places = self.store.trial_places if latest is None else lambda: self.store.latest_trial_places(latest, ids)
        if latest == 0:  # none of their trials: nothing to read for them
            places = list
        by_env: dict[str | None, list[str]] = {}
        for tid, env_id, *_ in self.read("trials", places):
            if isinstance(tid, str) and (env_id is None or isinstance(env_id, str)):
                by_env.setdefault(env_id, []).append(tid)
        samples = self.read("GPU samples", lambda: self.store.latest_gpu_samples(ids))
        return tuple(self._env(r, by_env, active, samples) for r in rows)

    def environment_count(self) -> int:
        return self.read("environments", self.store.env_count)

    def trials_per_environment(self, env_ids: Sequence[str] | None = None) -> dict[str | None, int]:
        """How many trials were placed on each environment (on those of ``env_ids`` when given)."""
        return self.read("trials", lambda: self.store.trials_per_environment(env_ids))

    def active_by_environment(self) -> dict[str | None, list[TrialSnapshot]]:
        """The trials waiting or running, by the environment they are placed on."""
        active: dict[str | None, list[TrialSnapshot]] = {}
        for t in map(trial_snapshot, self.read("trials", self.store.active_trials)):
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
        row = self.read("experiment", self.store.experiment)
        if row is None:
            return None
        config = _Fields(row).json("config_json", lambda v: isinstance(v, dict), "a JSON object")
        if config is not None:  # with the limits `trialkeeper update` changed while it ran
            updated = loads_or_none(self.read("meta", lambda: self.store.meta("updated_limits")))
            for name, key in _UPDATED_KEYS.items():
                if isinstance(updated, dict) and name in updated:
                    config[key] = updated[name]
        return config

    def bound_address(self) -> str:
        """The address the experiment's coordinator listened on last ("" if never)."""
        return self.read("meta", lambda: self.store.meta("bound_address")) or ""

    def experiment(self) -> ExperimentSnapshot | None:
        row = self.read("experiment", self.store.experiment)
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
            metrics=self.read("metrics", self.store.metric_count),
            environments=self.environment_count(),
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
