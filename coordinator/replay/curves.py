"""The learning curves an experiment recorded, as a replay draws them: each trial's
parameters, its intermediate results with the seconds each took, its final result and how
it ended; and the recorded trial a configuration is drawn from.

A configuration the experiment ran is drawn from its own trial (from one that ran to its end
when there are several). One it never ran is drawn from the nearest recorded configuration
that ran to its end (``unseen="nearest"``), or not at all (``unseen="skip"``). Nearest means
the smallest distance over the parameters: a number's difference as a fraction of the range
the experiment tried (of their logarithms where they span more than a factor of 20, as a
learning rate does), and 1 for each other value that differs.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.rows import MetricRow
from ..store.reads import StoreReader

__all__ = ["UNSEEN", "Curves", "Recorded", "ReplayError", "read_experiment"]

UNSEEN = ("nearest", "skip")  # what becomes of a configuration the experiment never ran
_LOG_SPAN = 20.0  # numbers spanning more than this factor are compared by their logarithms
_GAP = 3.0  # a pause between two results longer than this many typical steps is waiting, not training


class ReplayError(ValueError):
    """A replay that cannot run: no experiment, no curves, a bad option."""


@dataclass(frozen=True)
class Recorded:
    """One recorded trial: its curve, and the seconds each of its results took to train."""

    trial_id: str
    seq: int
    parameters: dict[str, Any]
    status: str  # as it ended (SUCCEEDED, EARLY_STOPPED, ...) or as it was left
    values: tuple[float, ...]  # intermediate results, index 0 on
    seconds: tuple[float, ...]  # training seconds before each result (since the one before)
    final: float | None
    final_seconds: float  # from the last intermediate result (or the start) to the final one
    reason: str = ""
    checkpoints: bool = True  # it saved checkpoints: replayed, it saves one after each result

    @property
    def complete(self) -> bool:
        """It ran to its end: its curve is whole and its final result known."""
        return self.status == "SUCCEEDED"


class _Group:
    """The recorded configurations that share every value that is not a number, sorted along
    the numeric axis that spreads them most."""

    def __init__(self, others: tuple[str, ...], points: list[tuple[tuple[float | None, ...], int]]) -> None:
        self.others = others
        width = len(points[0][0]) if points else 0
        spread = [len({p[k] for p, _ in points}) for k in range(width)]
        self.axis = max(range(width), key=lambda k: spread[k]) if width else -1
        self.points = sorted(points, key=lambda p: _along(p[0], self.axis))
        self.keys = [_along(p, self.axis) for p, _ in self.points]

    def nearest(self, point: tuple[float | None, ...], best_d: float) -> tuple[float, int]:
        """The nearest of the group if nearer than ``best_d``: (distance, pool index), index
        -1 when none is."""
        best_i = -1
        axis = _along(point, self.axis)
        at = bisect.bisect_left(self.keys, axis)
        lo, hi, n = at - 1, at, len(self.keys)
        # Outward from the closest along the axis, the nearer side first: once that side is
        # farther along the axis alone than the best distance so far, nothing left is nearer.
        while lo >= 0 or hi < n:
            below = axis - self.keys[lo] if lo >= 0 else math.inf
            above = self.keys[hi] - axis if hi < n else math.inf
            if below <= above:
                gap, (p, i) = below, self.points[lo]
                lo -= 1
            else:
                gap, (p, i) = above, self.points[hi]
                hi += 1
            if gap * gap >= best_d:
                break
            d = 0.0
            for a, b in zip(point, p):
                d += 1.0 if a is None or b is None else (a - b) * (a - b)
            if d < best_d:
                best_d, best_i = d, i
        return best_d, best_i


def _along(point: tuple[float | None, ...], axis: int) -> float:
    v = point[axis] if axis >= 0 else None
    return 0.0 if v is None else v


@dataclass
class Curves:
    """Every recorded trial, and the lookup of the one a configuration is drawn from."""

    trials: list[Recorded]
    maximize: bool = True
    _exact: dict[str, list[Recorded]] = field(default_factory=dict, init=False, repr=False)
    _numeric: dict[str, tuple[float, float, bool]] = field(default_factory=dict, init=False, repr=False)
    _others: list[str] = field(default_factory=list, init=False, repr=False)
    _groups: list[_Group] = field(default_factory=list, init=False, repr=False)
    _pool: list[Recorded] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.trials:
            raise ReplayError("the experiment recorded no trial to replay")
        for r in self.trials:
            self._exact.setdefault(_key(r.parameters), []).append(r)
        flat = [_flatten(r.parameters) for r in self.trials]
        names = {n for f in flat for n in f}
        for name in sorted(names):
            values = [f[name] for f in flat if name in f]
            if values and all(_is_number(v) for v in values):
                lo, hi = min(values), max(values)
                log = lo > 0 and hi / lo > _LOG_SPAN
                if log:
                    lo, hi = math.log(lo), math.log(hi)
                self._numeric[name] = (lo, (hi - lo) or 1.0, log)
            else:
                self._others.append(name)
        # Drawn from: trials that ran to their end, when there are any.
        self._pool = [r for r in self.trials if r.complete] or list(self.trials)
        grouped: dict[tuple[str, ...], list[tuple[tuple[float | None, ...], int]]] = {}
        for i, r in enumerate(self._pool):
            numbers, others = self._point(r.parameters)
            grouped.setdefault(others, []).append((numbers, i))
        self._groups = [_Group(others, points) for others, points in grouped.items()]

    def best(self) -> float | None:
        """The best result any recorded trial reported: the optimum a replay is measured by."""
        seen = [v for r in self.trials for v in (*r.values, *(() if r.final is None else (r.final,)))]
        if not seen:
            return None
        return max(seen) if self.maximize else min(seen)

    def draw(self, parameters: Mapping[str, Any], unseen: str) -> tuple[Recorded | None, bool]:
        """The recorded trial a configuration is drawn from, and whether it ran exactly
        these parameters; (None, False) for one never run when ``unseen`` is ``skip``."""
        same = self._exact.get(_key(parameters))
        if same:
            return next((r for r in same if r.complete), same[0]), True
        if unseen == "skip":
            return None, False
        return self._nearest(parameters), False

    def _point(self, parameters: Mapping[str, Any]) -> tuple[tuple[float | None, ...], tuple[str, ...]]:
        """The numbers, scaled to the range tried (None: absent or not a number), and the
        other values as JSON ("": absent)."""
        flat = _flatten(parameters)
        numbers: list[float | None] = []
        for name, (lo, span, log) in self._numeric.items():
            v = flat.get(name)
            if not _is_number(v):
                numbers.append(None)
                continue
            x = (math.log(v) if v > 0 else lo) if log else float(v)
            numbers.append((x - lo) / span)
        others = tuple(json.dumps(flat[n], sort_keys=True) if n in flat else "" for n in self._others)
        return tuple(numbers), others

    def _nearest(self, parameters: Mapping[str, Any]) -> Recorded:
        numbers, others = self._point(parameters)

        def mismatch(g: _Group) -> int:
            return sum(a != b for a, b in zip(others, g.others))

        # The groups that differ least in their other values first: a group that differs in
        # k of them is k away before any number is compared.
        best_d, best_i = math.inf, 0
        for k, g in sorted(((mismatch(g), g) for g in self._groups), key=lambda kg: kg[0]):
            if k >= best_d:
                break
            d, i = g.nearest(numbers, best_d - k)
            if i >= 0:
                best_d, best_i = d + k, i
        return self._pool[best_i]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _flatten(parameters: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters (a choice of sub-spaces) as one level of dotted names."""
    out: dict[str, Any] = {}
    for k, v in parameters.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _key(parameters: Mapping[str, Any]) -> str:
    return json.dumps(parameters, sort_keys=True, default=str)


# ---- reading a store -----------------------------------------------------------------------


def recorded_trials(
    trial_rows: Iterable[Mapping[str, Any]], metrics: Iterable[MetricRow], checkpointed: set[str] | None = None,
) -> list[Recorded]:
    """The stored trials and metrics as curves with their step times (``checkpointed``: the
    trials that saved a checkpoint; None: all of them)."""
    by_trial: dict[str, list[MetricRow]] = {}
    for m in metrics:
        by_trial.setdefault(m.trial_id, []).append(m)
    out: list[Recorded] = []
    for row in trial_rows:
        try:
            parameters = json.loads(row["parameters_json"])
        except (TypeError, ValueError):
            continue  # unreadable: nothing to draw from it
        if not isinstance(parameters, dict):
            continue
        rows = sorted((m for m in by_trial.get(row["id"], ()) if m.kind == "intermediate"), key=lambda m: m.index)
        values = tuple(m.value for m in rows)
        started = row.get("started_at") or (rows[0].reported_at if rows else 0.0)
        ended = row.get("ended_at") or (rows[-1].reported_at if rows else started)
        seconds = _step_seconds(started, [m.reported_at for m in rows])
        last = rows[-1].reported_at if rows else started
        final = row.get("final_metric")
        typical = statistics.median(seconds) if seconds else max(0.0, ended - started)
        final_seconds = max(0.0, ended - last)
        if rows and final_seconds > _GAP * typical:
            final_seconds = typical
        out.append(Recorded(
            str(row["id"]), int(row["seq"]), parameters, str(row["status"]), values, seconds,
            None if final is None else float(final), final_seconds, str(row.get("reason") or ""),
            checkpointed is None or row["id"] in checkpointed,
        ))
    return out


def _step_seconds(started: float, reported: Sequence[float]) -> tuple[float, ...]:
    """The training seconds before each result: the time since the one before, where a pause
    (the trial waited, paused, for its continue) counts as a typical step."""
    if not reported:
        return ()
    gaps = [reported[0] - started, *(b - a for a, b in itertools.pairwise(reported))]
    typical = statistics.median(gaps[1:]) if len(gaps) > 1 else gaps[0]
    typical = max(typical, 0.0)
    return tuple(typical if g < 0 or g > _GAP * max(typical, 1e-3) else g for g in gaps)


def read_experiment(experiment_dir: Path) -> tuple[dict[str, Any], list[Recorded]]:
    """The stored config (secrets redacted) and the recorded trials of an experiment."""
    from ..read.model import ReadModel

    store = StoreReader.in_dir(experiment_dir)
    try:
        config = ReadModel(store).stored_config()
        if config is None:
            raise ReplayError(f"{experiment_dir}: the experiment's stored config is unreadable")
        checkpointed = {str(c["trial_id"]) for c in store.checkpoints(kept=False)}
        return config, recorded_trials(store.trials(), store.metrics(), checkpointed)
    finally:
        store.close()
