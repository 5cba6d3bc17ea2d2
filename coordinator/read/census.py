"""What a scrape of ``/metrics`` reads, bounded by what is alive: environments counted per
status with only the ones not ended read whole, and the ended trials' durations counted
under each bound in the store. Functions of a :class:`ReadModel`, as in ``pages``."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..engine.states import EnvStatus, TrialStatus
from .model import EnvSnapshot, ReadModel, _Fields

__all__ = ["Durations", "EnvCensus", "environment_census", "trial_durations"]


@dataclass(frozen=True)
class EnvCensus:
    """Environments counted per status (ended ones included), and those not ended in full."""

    counts: Mapping[str, int]  # per status; UNREADABLE for a status this version cannot read
    alive: tuple[EnvSnapshot, ...]  # neither STOPPED nor FAILED; their trials: waiting or running only


@dataclass(frozen=True)
class Durations:
    """How long the ended trials ran (from start to end), counted under each bound."""

    bounds: tuple[float, ...]
    under: tuple[int, ...]  # trials that ran at most bounds[i] seconds
    count: int
    total_s: float


def environment_census(model: ReadModel) -> EnvCensus:
    """Counts per status of every environment, and the ones not ended read whole: ten
    thousand environments ended cost a count, not a snapshot each."""
    counts: dict[str, int] = {}
    alive_rows = []
    for row in model._read("environments", model.store.envs):
        status = _Fields(row).status("status", EnvStatus)
        key = status.value if status is not None else "UNREADABLE"
        counts[key] = counts.get(key, 0) + 1
        if status is not None and not status.terminal:
            alive_rows.append(row)
    if not alive_rows:
        return EnvCensus(MappingProxyType(counts), ())
    active = model.active_by_environment()
    by_env = {env_id: [t.id for t in trials] for env_id, trials in active.items()}
    samples = model._read("GPU samples", model.store.latest_gpu_samples)
    return EnvCensus(MappingProxyType(counts), tuple(model._env(r, by_env, active, samples) for r in alive_rows))


def trial_durations(model: ReadModel, bounds: Sequence[float]) -> Durations:
    """How long the ended trials ran, counted in the store under each of ``bounds`` (seconds,
    ascending): one pass over the trials, whatever their number."""
    ended = ", ".join(f"'{s.value}'" for s in TrialStatus if s.terminal)
    numeric = "BETWEEN -1e999 AND 1e999"  # a number: neither NULL nor text
    under = "".join(", total(d <= ?)" for _ in bounds)
    sql = (
        f"SELECT count(*), total(d){under} FROM (SELECT ended_at - started_at AS d FROM trials "
        f"WHERE status IN ({ended}) AND started_at {numeric} AND ended_at {numeric})"
    )

    def query() -> tuple[Any, ...]:
        # A connection of its own, read-only: the store's reader has no aggregate of this kind.
        db = sqlite3.connect(f"file:{model.store.path}?mode=ro", uri=True, timeout=10.0)
        try:
            return tuple(db.execute(sql, [float(b) for b in bounds]).fetchone())
        finally:
            db.close()

    row = model._read("trials", query)
    return Durations(tuple(bounds), tuple(int(n) for n in row[2:]), int(row[0]), float(row[1]))
