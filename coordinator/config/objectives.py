"""Several objectives: the result keys a search optimizes, each with its direction; the result
keys that must stay within bounds (constraints); and how a method that ranks by one number
(population-based training; a tuner or an assessor with ``use_objectives``) ranks trials: by one chosen key, or by a
declared weighted sum. Plain functions over results as trials report them (a number, or a dict
of keys such as ``{"default": 0.93, "latency": 12.0}``; a number is the key ``default``).

The config's ``objectives`` section::

    objectives:
      optimize: {accuracy: maximize, latency: minimize}
      constraints: {memory_gb: {max: 8}, accuracy: {min: 0.5}}
      rank: accuracy                 # or {weights: {accuracy: 1.0, latency: -0.01}}

``parse`` reads it (its problems named by field), ``Objectives.score`` ranks one result (bigger
is better, None for a result that misses a key or breaks a constraint), ``pareto_front`` keeps
the results no other dominates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "DIRECTIONS",
    "Constraint",
    "Objective",
    "Objectives",
    "ObjectivesError",
    "dominates",
    "from_config",
    "number",
    "pareto_front",
    "parse",
    "single",
]

DIRECTIONS = ("maximize", "minimize")
_T = TypeVar("_T")


class ObjectivesError(ValueError):
    """An ``objectives`` section that cannot be used; ``issues`` are (field, problem) pairs."""

    def __init__(self, issues: list[tuple[str, str]]) -> None:
        self.issues = issues
        super().__init__("; ".join(f"{where}: {what}" for where, what in issues))


@dataclass(frozen=True)
class Objective:
    key: str
    direction: str  # "maximize" or "minimize"


@dataclass(frozen=True)
class Constraint:
    """A result key that must stay within [low, high] (either bound may be open)."""

    key: str
    low: float | None = None
    high: float | None = None

    def violation(self, value: float) -> float:
        """How far ``value`` lies outside the bounds; 0 within them."""
        if self.low is not None and value < self.low:
            return self.low - value
        if self.high is not None and value > self.high:
            return value - self.high
        return 0.0


def number(result: Any, key: str) -> float | None:
    """The finite number ``key`` holds in a reported result (a bare number is ``default``)."""
    if isinstance(result, Mapping):
        result = result.get(key)
    elif key != "default":
        return None
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        return None
    value = float(result)
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Objectives:
    """What a search optimizes, and how one number ranks its trials."""

    optimize: tuple[Objective, ...]
    constraints: tuple[Constraint, ...] = ()
    rank_key: str | None = None  # rank by this objective (the first when neither is given)
    weights: tuple[tuple[str, float], ...] = ()  # or by this weighted sum, maximized

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.optimize)

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(o.direction for o in self.optimize)

    @property
    def several(self) -> bool:
        return len(self.optimize) > 1

    def values(self, result: Any) -> tuple[float, ...] | None:
        """The objectives' values in a result, in order; None when one is missing."""
        found = tuple(number(result, k) for k in self.keys)
        return None if any(v is None for v in found) else found  # type: ignore[return-value]

    def violation(self, result: Any) -> float:
        """How far the result breaks its constraints, summed: 0 when it keeps them all,
        infinite when a constrained key is missing."""
        total = 0.0
        for c in self.constraints:
            value = number(result, c.key)
            if value is None:
                return math.inf
            total += c.violation(value)
        return total

    def constraint_values(self, result: Any) -> list[float]:
        """One number per bound, at most 0 when the result keeps it (Optuna's form of
        constraints); 1 for a bound whose key the result misses."""
        found = []
        for c in self.constraints:
            value = number(result, c.key)
            if c.low is not None:
                found.append(1.0 if value is None else c.low - value)
            if c.high is not None:
                found.append(1.0 if value is None else value - c.high)
        return found

    def feasible(self, result: Any) -> bool:
        return self.violation(result) == 0.0

    @property
    def rank_direction(self) -> str:
        """Whether ``rank_value`` is better bigger or smaller."""
        if self.weights:
            return "maximize"
        key = self.rank_key or self.optimize[0].key
        return next(o.direction for o in self.optimize if o.key == key)

    def rank_value(self, result: Any) -> float | None:
        """The one number a single-objective method ranks by, in ``rank_direction``: the
        chosen key's value, or the weighted sum; None when a key it needs is missing."""
        if self.weights:
            parts = [number(result, k) for k, _ in self.weights]
            if any(p is None for p in parts):
                return None
            return sum(w * p for (_, w), p in zip(self.weights, parts, strict=True))  # type: ignore[operator]
        return number(result, self.rank_key or self.optimize[0].key)

    def score(self, result: Any) -> float | None:
        """The result's rank, bigger is better: None when it misses a key the ranking needs
        or breaks a constraint (such a result ranks below every other)."""
        value = self.rank_value(result)
        if value is None or not self.feasible(result):
            return None
        return value if self.rank_direction == "maximize" else -value


def single(mode: str = "maximize", key: str = "default") -> Objectives:
    """One objective: what a search without an ``objectives`` section optimizes."""
    return Objectives((Objective(key, mode),))


def from_config(raw: Any, mode: str = "maximize") -> Objectives:
    """What an experiment optimizes: its config's ``objectives`` section when given (checked
    when the config was read), else ``mode`` on the ``default`` result."""
    return single(mode) if raw is None else parse(raw)


def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    """Whether ``a`` is at least as good as ``b`` in every objective and better in one."""
    better = False
    for x, y, d in zip(a, b, directions, strict=True):
        if d == "minimize":
            x, y = -x, -y
        if x < y:
            return False
        better = better or x > y
    return better


def pareto_front(items: Iterable[_T], objectives: Objectives, result_of: Callable[[_T], Any]) -> list[_T]:
    """The items whose result (``result_of(item)``) keeps the constraints and is dominated by
    no other such result, in their order; items missing an objective are left out."""
    scored = []
    for item in items:
        result = result_of(item)
        values = objectives.values(result)
        if values is not None and objectives.feasible(result):
            scored.append((item, values))
    directions = objectives.directions
    return [item for item, v in scored if not any(dominates(w, v, directions) for _, w in scored)]


# ---- reading the config's section --------------------------------------------------------------


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse(raw: Any, where: str = "objectives") -> Objectives:
    """The config's ``objectives`` section; ObjectivesError names each bad field and what
    would be valid."""
    issues: list[tuple[str, str]] = []
    if not isinstance(raw, Mapping):
        raise ObjectivesError([(where, f"expected a mapping with optimize (and constraints, rank), got {raw!r}")])
    unknown = sorted(set(raw) - {"optimize", "constraints", "rank"})
    issues += [(f"{where}.{k}", "unknown field: expected optimize, constraints or rank") for k in unknown]
    optimize = raw.get("optimize")
    objectives: list[Objective] = []
    if not isinstance(optimize, Mapping) or not optimize:
        why = ("expected a mapping of result key to maximize or minimize, like {accuracy: maximize, latency: "
               f"minimize}}, got {optimize!r}")
        issues.append((f"{where}.optimize", why))
    else:
        for key, direction in optimize.items():
            if direction not in DIRECTIONS:
                issues.append((f"{where}.optimize.{key}", f"expected maximize or minimize, got {direction!r}"))
            else:
                objectives.append(Objective(str(key), direction))
    constraints = _constraints(raw.get("constraints", {}), f"{where}.constraints", issues)
    rank_key, weights = _rank(raw.get("rank"), f"{where}.rank", [o.key for o in objectives], issues)
    if issues:
        raise ObjectivesError(issues)
    return Objectives(tuple(objectives), constraints, rank_key, weights)


def _constraints(raw: Any, where: str, issues: list[tuple[str, str]]) -> tuple[Constraint, ...]:
    if not isinstance(raw, Mapping):
        issues.append((where, f"expected a mapping of result key to {{min: ..., max: ...}}, got {raw!r}"))
        return ()
    found = []
    for key, bounds in raw.items():
        at = f"{where}.{key}"
        if not isinstance(bounds, Mapping) or not bounds or set(bounds) - {"min", "max"}:
            issues.append((at, f"expected {{min: number}}, {{max: number}} or both, got {bounds!r}"))
            continue
        low, high = bounds.get("min"), bounds.get("max")
        bad = [n for n, v in (("min", low), ("max", high)) if v is not None and not _finite(v)]
        if bad:
            issues += [(f"{at}.{n}", f"expected a finite number, got {bounds[n]!r}") for n in bad]
        elif low is not None and high is not None and low > high:
            issues.append((at, f"min ({low}) is above max ({high})"))
        else:
            low, high = (None if v is None else float(v) for v in (low, high))
            found.append(Constraint(str(key), low, high))
    return tuple(found)


def _rank(raw: Any, where: str, keys: list[str], issues: list[tuple[str, str]]) -> tuple[str | None, tuple]:
    if raw is None:
        return None, ()
    if isinstance(raw, str):
        if keys and raw not in keys:
            why = f"expected one of the objectives ({', '.join(keys)}) or {{weights: ...}}, got {raw!r}"
            issues.append((where, why))
        return raw, ()
    weights = raw.get("weights") if isinstance(raw, Mapping) and set(raw) == {"weights"} else None
    if not isinstance(weights, Mapping) or not weights:
        why = ("expected an objective's key, or {weights: {key: number, ...}} (a weighted sum, maximized; give a "
               f"minimized key a negative weight), got {raw!r}")
        issues.append((where, why))
        return None, ()
    bad = [(f"{where}.weights.{k}", f"expected a finite number, got {w!r}") for k, w in weights.items()
           if not _finite(w)]
    issues += bad
    return None, () if bad else tuple((str(k), float(w)) for k, w in weights.items())
