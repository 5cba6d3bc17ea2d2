"""How a chart should draw each parameter, from the experiment's search space: a ``choice`` on
a category axis (its options in their order), the log-distributed types (``loguniform``,
``qloguniform``, ``lognormal``, ``qlognormal``) on a log axis, the others on a linear one.
A parameter the search space does not name (a trial submitted with parameters of its own, a
space changed since) is drawn as its values say: on categories when any is not a number."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LOG_TYPES = ("loguniform", "qloguniform", "lognormal", "qlognormal")
INTEGER_TYPES = ("randint",)


@dataclass(frozen=True)
class Axis:
    """One parameter's axis: ``kind`` is ``category``, ``log`` or ``value``; ``source`` the
    search space's ``_type`` (``observed`` when read from the values)."""

    name: str
    kind: str
    source: str
    categories: tuple[str, ...] = ()
    options: tuple[Any, ...] = ()  # the values the categories name, in the same order
    low: float | None = None
    high: float | None = None
    integer: bool = False


def label(value: Any) -> str:
    """A parameter value as a category axis names it: a string as it is, a nested choice by its
    ``_name``, anything else as JSON (``1``, ``0.5``, ``true``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("_name"), str):
        return value["_name"]
    return json.dumps(value, sort_keys=True)


def search_space(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The stored config's search space (an empty one when it has none it can read)."""
    space = (config or {}).get("searchSpace")
    return space if isinstance(space, dict) else {}


def axes(space: Mapping[str, Any], names: Iterable[str], values: Mapping[str, list[Any]]) -> list[Axis]:
    """An axis for each parameter of ``names``; ``values``: values of it seen in trials."""
    return [_axis(name, space.get(name), values.get(name, [])) for name in names]


def _axis(name: str, spec: Any, seen: list[Any]) -> Axis:
    kind = spec.get("_type") if isinstance(spec, dict) else None
    given = spec.get("_value") if isinstance(spec, dict) else None
    given = given if isinstance(given, list) else []
    if kind == "choice" and given:
        named = {label(v): v for v in given}
        for v in seen:  # values the space no longer offers, after its own
            named.setdefault(label(v), v)
        return Axis(name, "category", "choice", tuple(named), tuple(named.values()))
    numbers = [float(v) for v in seen if _number(v)]
    if kind in LOG_TYPES and all(v > 0 for v in numbers):
        low, high = _bounds(kind, given, numbers)
        return Axis(name, "log", kind, low=low, high=high)
    if isinstance(kind, str) and kind != "choice" and len(numbers) == len(seen):
        low, high = _bounds(kind, given, numbers)
        return Axis(name, "value", kind, low=low, high=high, integer=kind in INTEGER_TYPES)
    if seen and len(numbers) == len(seen):
        integer = all(float(v).is_integer() for v in numbers)
        return Axis(name, "value", "observed", low=min(numbers), high=max(numbers), integer=integer)
    named = {label(v): v for v in seen}
    order = sorted(named)
    return Axis(name, "category", "observed", tuple(order), tuple(named[k] for k in order))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bounds(kind: str, given: list[Any], numbers: list[float]) -> tuple[float | None, float | None]:
    """The space's own bounds for a bounded type, else (or beyond them) what trials took."""
    low = min(numbers) if numbers else None
    high = max(numbers) if numbers else None
    if kind in ("uniform", "quniform", "loguniform", "qloguniform", "randint") and len(given) >= 2:
        a, b = given[0], given[1]
        if _number(a) and _number(b):
            low = float(a) if low is None else min(low, float(a))
            high = float(b) if high is None else max(high, float(b))
    return low, high
