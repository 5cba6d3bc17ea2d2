"""What a scrape of ``/metrics`` reads, bounded by what is alive: environments counted per
status with only the ones not ended read whole, and the ended trials' durations counted
under each bound in the store. Functions of a :class:`ReadModel`, as in ``pages``."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..engine.states import EnvStatus, TrialStatus
from .kept import Kept
from .model import ReadModel
from .pages import TRIAL_SORTS, UNTIMED
from .rows import _Fields
from .snapshots import EnvSnapshot

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
    for row in model.read("environments", model.store.envs):
        status = _Fields(row).status("status", EnvStatus)
        key = status.value if status is not None else "UNREADABLE"
        counts[key] = counts.get(key, 0) + 1
        if status is not None and not status.terminal:
            alive_rows.append(row)
    if not alive_rows:
        return EnvCensus(MappingProxyType(counts), ())
    active = model.active_by_environment()
    by_env = {env_id: [t.id for t in trials] for env_id, trials in active.items()}
    samples = model.read("GPU samples", model.store.latest_gpu_samples)
    return EnvCensus(MappingProxyType(counts), tuple(model._env(r, by_env, active, samples) for r in alive_rows))


def trial_durations(model: ReadModel, bounds: Sequence[float]) -> Durations:
    """How long the ended trials ran, counted in the store under each of ``bounds`` (seconds,
    ascending): one pass over the trials, whatever their number, kept until the trials change
    (a trial that ends moves the store's change counter)."""
    return _durations.get(model, ("durations", tuple(bounds)), lambda: _count_durations(model, bounds))


_durations: Kept[Durations] = Kept()


def _count_durations(model: ReadModel, bounds: Sequence[float]) -> Durations:
    ended = ", ".join(f"'{s.value}'" for s in TrialStatus if s.terminal)
    numeric = "BETWEEN -1e999 AND 1e999"  # a number: neither NULL nor text
    duration = TRIAL_SORTS["duration"] if "ran_s" in model.store.trial_columns else UNTIMED  # every attempt's
    bucket = "CASE " + " ".join(f"WHEN d <= ? THEN {i}" for i in range(len(bounds))) + f" ELSE {len(bounds)} END"
    # Each trial counted in the first bucket it fits, the buckets added up below. A plain scan
    # (NOT INDEXED): most trials of a long experiment have ended, and looking each one up from
    # the status index costs more than reading the table through.
    sql = (
        f"SELECT {bucket} AS b, count(*), total(d) FROM (SELECT {duration} AS d FROM trials NOT INDEXED "
        f"WHERE status IN ({ended}) AND started_at {numeric} AND ended_at {numeric}) GROUP BY b"
    )

    def query() -> list[tuple[Any, ...]]:
        # A connection of its own, read-only: the store's reader has no aggregate of this kind.
        db = sqlite3.connect(f"file:{model.store.path}?mode=ro", uri=True, timeout=10.0)
        try:
            return db.execute(sql, [float(b) for b in bounds]).fetchall()
        finally:
            db.close()

    per_bucket = [0] * (len(bounds) + 1)
    total_s = 0.0
    for b, n, seconds in model.read("trials", query):
        per_bucket[int(b)] += int(n)
        total_s += float(seconds)
    under = list(itertools.accumulate(per_bucket[: len(bounds)]))
    return Durations(tuple(bounds), tuple(under), sum(per_bucket), total_s)
