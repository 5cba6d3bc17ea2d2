"""Stored rows read without raising: a value an older version (or a hostile agent) stored
that this one cannot read becomes a default, with a note for the snapshot's ``unreadable``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, TypeVar

from ..engine.model import RankInfo
from ..engine.rows import GpuSampleRow
from ..engine.states import TrialStatus
from .snapshots import TrialSnapshot

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
        ran_s=_ran_s(f, row),
        # A store from before the column: the environment it is placed on, if any.
        last_environment_id=f.optional_text("last_environment_id") or f.optional_text("environment_id"),
    )


def _ran_s(f: _Fields, row: Mapping[str, Any]) -> float:
    """Seconds a trial ran in its attempts ended so far; of an ended trial a store from before
    ran_s, read as it is, kept only its last attempt's start and end."""
    if "ran_s" in row:
        return f.number("ran_s") or 0.0
    started, ended = f.number("started_at"), f.number("ended_at")
    return max(0.0, ended - started) if started is not None and ended is not None else 0.0


def _ranks(raw: list[Any]) -> tuple[RankInfo, ...]:
    """A multi-node trial's ranks as stored ([rank, environment, GPUs, state] each); one
    that cannot be read is left out."""
    found = []
    for r in raw:
        if isinstance(r, list) and len(r) == 4 and isinstance(r[0], int) and _is_int_list(r[2]):
            found.append(RankInfo(r[0], str(r[1]), tuple(r[2]), str(r[3])))
    return tuple(found)
