"""NNI's search-space format: validate it, sample from it, enumerate it as a grid.

A search space is a JSON object of parameter name -> ``{"_type": T, "_value": [...]}``:

=============  =====================  ==================================================
``_type``      ``_value``             a sample
=============  =====================  ==================================================
choice         [item, ...]            one item; a dict item with ``_name`` is a nested
                                      space and yields ``{"_name": ..., <its params>}``
randint        [lower, upper]         an int in [lower, upper)
uniform        [low, high]            uniform in [low, high]
quniform       [low, high, q]         clip(round(uniform(low, high) / q) * q, low, high)
loguniform     [low, high]            exp(uniform(log low, log high)), low > 0
qloguniform    [low, high, q]         loguniform, quantized and clipped like quniform
normal         [mu, sigma]            normal(mu, sigma)
qnormal        [mu, sigma, q]         round(normal(mu, sigma) / q) * q
lognormal      [mu, sigma]            exp(normal(mu, sigma))
qlognormal     [mu, sigma, q]         round(lognormal(mu, sigma) / q) * q
=============  =====================  ==================================================

Quantized values are ints when q and the bounds are ints.
"""

from __future__ import annotations

import copy
import difflib
import math
import random
from collections.abc import Iterator
from typing import Any

__all__ = [
    "TYPES",
    "SearchSpaceError",
    "grid",
    "grid_size",
    "is_batch_tuner",
    "is_discrete",
    "sample",
    "validate_search_space",
]

# What each numeric _type takes, phrased for error messages.
_RULES: dict[str, str] = {
    "randint": "2 integers [lower, upper) with lower < upper",
    "uniform": "2 numbers [low, high] with low < high",
    "quniform": "3 numbers [low, high, q] with low < high and q > 0",
    "loguniform": "2 numbers [low, high] with 0 < low < high",
    "qloguniform": "3 numbers [low, high, q] with 0 < low < high and q > 0",
    "normal": "2 numbers [mu, sigma] with sigma > 0",
    "qnormal": "3 numbers [mu, sigma, q] with sigma > 0 and q > 0",
    "lognormal": "2 numbers [mu, sigma] with sigma > 0",
    "qlognormal": "3 numbers [mu, sigma, q] with sigma > 0 and q > 0",
}
TYPES: tuple[str, ...] = ("choice", *_RULES)
_BOUNDED = ("uniform", "quniform", "loguniform", "qloguniform")
_UNBOUNDED = ("normal", "qnormal", "lognormal", "qlognormal")
_SPEC = '{"_type": ..., "_value": [...]}'
_GRID_HINT = "grid search needs discrete values (use quniform or choice)"


class SearchSpaceError(ValueError):
    """A search space that is invalid, or unfit for what was asked of it.

    ``issues`` holds every problem found, as (path, message) pairs; a path looks like
    ``lr._value`` or ``optimizer._value[1].momentum._type``.
    """

    def __init__(self, issues: list[tuple[str, str]]) -> None:
        self.issues = issues
        lines = "\n".join(f"  {path}: {message}" for path, message in issues)
        super().__init__(f"search space has {len(issues)} problem(s):\n{lines}")


def is_batch_tuner(name: object, class_name: object = None) -> bool:
    """Whether a tuner is NNI's Batch tuner, which reads a search space of its own format:
    one ``choice`` whose options are whole parameter sets, handed out in order."""
    key = "".join(c for c in str(name).lower() if c.isalnum()) if name is not None else ""
    return key in ("batch", "batchtuner") or (isinstance(class_name, str) and class_name.endswith("BatchTuner"))


def validate_search_space(space: object, *, batch: bool = False) -> None:
    """Raise SearchSpaceError listing every problem in ``space``; return if there is none.
    ``batch``: the space is for NNI's Batch tuner (see is_batch_tuner)."""
    issues: list[tuple[str, str]] = []
    if not isinstance(space, dict):
        got = type(space).__name__
        issues.append(("<root>", f"a search space is a JSON object of name -> {_SPEC}, got {got}"))
    elif batch:
        _check_batch(space, issues)
    else:
        _check_space(space, "", issues)
    if issues:
        raise SearchSpaceError(issues)


def _check_batch(space: dict[Any, Any], issues: list[tuple[str, str]]) -> None:
    shape = (
        "NNI's Batch tuner takes one parameter, "
        '{"combine_params": {"_type": "choice", "_value": [{name: value, ...}, ...]}}'
    )
    if len(space) != 1:
        issues.append(("<root>", f"{shape}; got {len(space)} parameters"))
        return
    (name, spec), = space.items()
    if (
        not isinstance(spec, dict)
        or spec.get("_type") != "choice"
        or not isinstance(spec.get("_value"), list)
        or not spec["_value"]
    ):
        issues.append((str(name), f"{shape}: a choice with a non-empty list of parameter sets"))
        return
    for i, item in enumerate(spec["_value"]):
        if not (isinstance(item, dict) and item and all(isinstance(k, str) for k in item)):
            issues.append(
                (f"{name}._value[{i}]", f"{shape}: each option is a non-empty mapping of parameter name -> value")
            )


def _check_space(space: dict[Any, Any], prefix: str, issues: list[tuple[str, str]]) -> None:
    for name, spec in space.items():
        if not isinstance(name, str):
            issues.append((f"{prefix}{name!r}", "a parameter name must be a string"))
            continue
        _check_param(spec, f"{prefix}{name}", issues)


def _check_param(spec: object, path: str, issues: list[tuple[str, str]]) -> None:
    if not isinstance(spec, dict):
        issues.append((path, f"a parameter is {_SPEC}, got {type(spec).__name__}"))
        return
    for key in spec:
        if key not in ("_type", "_value"):
            issues.append((f"{path}.{key}", "unexpected key; a parameter has only _type and _value"))
    kind, value = spec.get("_type"), spec.get("_value")
    known = isinstance(kind, str) and kind in TYPES
    if "_type" not in spec:
        issues.append((f"{path}._type", f"missing; valid: {', '.join(TYPES)}"))
    elif not known:
        close = difflib.get_close_matches(str(kind), TYPES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        issues.append((f"{path}._type", f"unknown _type {kind!r}{hint} valid: {', '.join(TYPES)}"))
    vpath = f"{path}._value"
    if "_value" not in spec:
        issues.append((vpath, "missing; it is a list whose meaning depends on _type"))
    elif not isinstance(value, list):
        issues.append((vpath, f"must be a list, got {type(value).__name__}"))
    elif known and kind == "choice":
        _check_choice(value, vpath, issues)
    elif known:
        _check_numbers(str(kind), value, vpath, issues)


def _check_choice(items: list[Any], vpath: str, issues: list[tuple[str, str]]) -> None:
    if not items:
        issues.append((vpath, "choice needs a non-empty list of options"))
    names: set[object] = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        ipath = f"{vpath}[{i}]"
        if "_name" not in item:
            issues.append((ipath, (
                "a dict option is a nested space and needs a '_name' key (a choice of whole parameter sets "
                "is the format of NNI's Batch tuner: give tuner: {name: Batch} to use it)")))
            continue
        name = item["_name"]
        if not isinstance(name, (str, int, float)):
            issues.append((f"{ipath}._name", f"must be a string or number, got {type(name).__name__}"))
        elif name in names:
            issues.append((f"{ipath}._name", f"duplicate _name {name!r} in this choice"))
        else:
            names.add(name)
        _check_space(_subspace(item), f"{ipath}.", issues)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_numbers(kind: str, value: list[Any], vpath: str, issues: list[tuple[str, str]]) -> None:
    arity = 3 if kind.startswith("q") else 2
    ok = _is_int if kind == "randint" else _is_number
    if len(value) != arity or not all(ok(x) for x in value):
        issues.append((vpath, f"{kind} needs {_RULES[kind]}, got {value!r}"))
        return
    if kind in _UNBOUNDED:
        if value[1] <= 0:
            issues.append((vpath, f"{kind} needs sigma > 0, got sigma={value[1]!r}"))
    else:
        low, high = value[0], value[1]
        if low >= high:
            lo_name, hi_name = ("lower", "upper") if kind == "randint" else ("low", "high")
            issues.append((vpath, f"{kind} needs {lo_name} < {hi_name}, got [{low!r}, {high!r}]"))
        if "log" in kind and low <= 0:
            issues.append((vpath, f"{kind} needs low > 0 (it samples on a log scale), got low={low!r}"))
    if arity == 3 and value[2] <= 0:
        issues.append((vpath, f"{kind} needs q > 0, got q={value[2]!r}"))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _subspace(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != "_name"}


def _quantize(k: int, q: float, low: float | None, high: float | None) -> int | float:
    """The k-th multiple of q, clipped to [low, high] when bounded."""
    as_int = _is_int(q) and all(b is None or _is_int(b) for b in (low, high))
    if as_int:
        x: int | float = k * int(q)
    else:
        # 15 significant digits drop float noise (3 * 0.1 -> 0.3) that users would see in
        # their parameters; tidy before clipping so a clipped value is exactly low or high.
        x = float(f"{k * q:.15g}")
    if low is not None and high is not None:
        x = min(max(x, low), high)
    return x if as_int else float(x)


def sample(space: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """One random point of ``space``, which must be valid (see validate_search_space)."""
    return {name: _sample_param(spec, rng) for name, spec in space.items()}


def _sample_param(spec: dict[str, Any], rng: random.Random) -> Any:
    kind, v = spec["_type"], spec["_value"]
    if kind == "choice":
        item = v[rng.randrange(len(v))]
        if isinstance(item, dict):
            return {"_name": item["_name"], **sample(_subspace(item), rng)}
        return copy.deepcopy(item)
    if kind == "randint":
        return rng.randrange(v[0], v[1])
    if kind in ("uniform", "quniform"):
        x = rng.uniform(v[0], v[1])
    elif kind in ("loguniform", "qloguniform"):
        x = math.exp(rng.uniform(math.log(v[0]), math.log(v[1])))
    else:
        x = rng.normalvariate(v[0], v[1])
        if "log" in kind:
            x = math.exp(x)
    if kind in _BOUNDED:
        low, high = v[0], v[1]
        # rng.uniform and exp(log(...)) may overshoot the bounds by an ulp.
        x = min(max(x, low), high)
        if kind.startswith("q"):
            return _quantize(round(x / v[2]), v[2], low, high)
        return float(x)
    if kind.startswith("q"):
        return _quantize(round(x / v[2]), v[2], None, None)
    return x


def _grid_issues(space: dict[str, Any], prefix: str) -> list[tuple[str, str]]:
    issues: list[tuple[str, str]] = []
    for name, spec in space.items():
        kind, path = spec["_type"], f"{prefix}{name}"
        if kind in ("uniform", "loguniform", "normal", "lognormal"):
            issues.append((path, f"{kind} is continuous; {_GRID_HINT}"))
        elif kind in ("qnormal", "qlognormal"):
            issues.append((path, f"{kind} is unbounded; {_GRID_HINT}"))
        elif kind == "choice":
            for i, item in enumerate(spec["_value"]):
                if isinstance(item, dict):
                    issues += _grid_issues(_subspace(item), f"{path}._value[{i}].")
    return issues


def is_discrete(space: dict[str, Any]) -> bool:
    """Whether the (valid) ``space`` has finitely many points, so grid() can enumerate it."""
    return not _grid_issues(space, "")


def _check_grid(space: object) -> dict[str, Any]:
    validate_search_space(space)
    assert isinstance(space, dict)
    issues = _grid_issues(space, "")
    if issues:
        raise SearchSpaceError(issues)
    return space


def grid(space: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every point of ``space``, the first parameter varying slowest.

    Raises SearchSpaceError at once (not on first ``next``) when ``space`` is invalid or
    has a continuous or unbounded parameter. Quantized values are those sample() can give.
    """
    return _product(list(_check_grid(space).items()))


def grid_size(space: dict[str, Any]) -> int:
    """How many points grid(space) yields, computed without enumerating them."""
    return _size(_check_grid(space))


def _product(params: list[tuple[str, dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    # Hand-rolled rather than itertools.product, which would materialise every axis
    # (a randint over a million ints) before yielding anything.
    if not params:
        yield {}
        return
    (name, spec), rest = params[0], params[1:]
    for value in _values(spec):
        for tail in _product(rest):
            yield {name: value, **tail}


def _quantized_ks(v: list[Any]) -> range:
    return range(round(v[0] / v[2]), round(v[1] / v[2]) + 1)


def _values(spec: dict[str, Any]) -> Iterator[Any]:
    kind, v = spec["_type"], spec["_value"]
    if kind == "choice":
        for item in v:
            if isinstance(item, dict):
                for sub in _product(list(_subspace(item).items())):
                    yield {"_name": item["_name"], **sub}
            else:
                yield copy.deepcopy(item)
    elif kind == "randint":
        yield from range(v[0], v[1])
    else:
        previous: object = None
        for k in _quantized_ks(v):
            x = _quantize(k, v[2], v[0], v[1])
            # Clipping can map the first or last two multiples of q onto the same bound.
            if x != previous:
                yield x
            previous = x


def _size(space: dict[str, Any]) -> int:
    total = 1
    for spec in space.values():
        kind, v = spec["_type"], spec["_value"]
        if kind == "choice":
            n = sum(_size(_subspace(item)) if isinstance(item, dict) else 1 for item in v)
        elif kind == "randint":
            n = v[1] - v[0]
        else:
            ks = _quantized_ks(v)
            n = len(ks)
            ends = [(ks[0], ks[1]), (ks[-2], ks[-1])] if n >= 3 else [(ks[0], ks[-1])]
            n -= sum(_quantize(a, v[2], v[0], v[1]) == _quantize(b, v[2], v[0], v[1])
                     for a, b in ends if a != b)
        total *= n
    return total
