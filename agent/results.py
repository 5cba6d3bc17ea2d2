"""A trial's results, however they came (the SDK's datagrams on the metric socket, NNI's lines
on its stdout): read, checked and made into the number and JSON the coordinator stores.

Nothing here keeps state: the runner numbers the accepted results in the trial's order and
writes the refusals into the trial's log.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from trialkeeper.protos.limits import MAX_VALUE_JSON_CHARS

from . import trial as sdk

__all__ = ["Accepted", "Datagram", "check", "decode", "plain_run"]

# Made once: json.loads/json.dumps with arguments build a decoder or encoder per call, and
# these run for every metric a trial reports.
_decode = json.JSONDecoder().decode
_encode = json.JSONEncoder(separators=(",", ":")).encode
_PLAIN = frozenset((float,))


@dataclass(frozen=True)
class Datagram:
    """One message of a trial: a result {"trial", "kind", "value"}, several of one kind that it
    reported in a tight loop {"trial", "kind", "values": [...]}, or a save_checkpoint
    {"trial", "kind": "checkpoint", "step", "reply"}."""

    trial_id: object
    kind: object
    value: object = None
    values: object = None
    message: Any = None


def decode(data: bytes) -> Datagram | None:
    """The datagram's message, or None when it cannot be read."""
    try:
        msg = _decode(data.decode())
        trial_id = msg["trial"]
        kind = msg["kind"]
        values = msg.get("values")
        value = msg["value"] if values is None and kind != "checkpoint" else None  # a save has no value
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return Datagram(trial_id, kind, value, values, msg)


def plain_run(values: list[Any]) -> bool:
    """Whether a run of intermediate results are finite floats, handed on as they are (what a
    trial reporting in a tight loop sends)."""
    return bool(values) and _PLAIN.issuperset(map(type, values)) and _all_finite(values)


@dataclass(frozen=True)
class Accepted:
    number: float
    raw: str | None  # the value's JSON, None when it is a float (its repr)


def check(kind: object, value: object, final_reported: bool) -> Accepted | str:
    """The accepted result, or why it is refused."""
    problem = sdk.check_metric(value)
    if problem is None and kind not in ("intermediate", "final"):
        problem = f"unknown result kind {kind!r}"
    if problem is None and kind == "final" and final_reported:
        problem = "the final result was already reported"
    if problem is not None:
        return problem
    # A number's JSON is its repr (bool, NaN and infinities were refused above).
    raw = repr(value) if type(value) is float or type(value) is int else _encode(value)
    if len(raw) > MAX_VALUE_JSON_CHARS:  # escaped non-ASCII keys can outgrow the datagram
        return f"larger than {MAX_VALUE_JSON_CHARS} characters as JSON"
    number = float(value["default"] if isinstance(value, dict) else value)  # type: ignore[arg-type,index]
    return Accepted(number, None if type(value) is float else raw)


def _all_finite(numbers: list[float]) -> bool:
    """Whether every float is finite, found in C (a sum of finite floats is finite unless
    it overflows; then they go one by one)."""
    try:
        return math.isfinite(math.fsum(numbers))
    except OverflowError:
        return False
