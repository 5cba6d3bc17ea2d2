"""The rules every reported result passes: finite numbers only, from trials placed where
they were reported. Plain functions the book (``book.py``) calls per batch."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any

from .rows import MetricRun


def checked(runs: Sequence[MetricRun], owned: set[str]) -> Sequence[MetricRun]:
    """The runs of trials in ``owned``, less any result that is not a finite number. The
    edge sends only finite numbers, which the first check finds in C: the runs are taken
    apart only when something must go."""
    if all(r.trial_id in owned for r in runs) and all_finite(chain.from_iterable(r.values for r in runs)):
        return runs
    return [
        r._replace(first_index=row.index, values=(row.value,), value_jsons=(row.value_json,),
                   reported_at=(row.reported_at,))
        for r in runs if r.trial_id in owned
        for row in r.rows() if math.isfinite(row.value)
    ]


def all_finite(numbers: Iterable[float]) -> bool:
    """Whether every number is finite, found in C: a sum of finite numbers is finite
    unless it overflows, and then the numbers are looked at one by one."""
    try:
        return math.isfinite(math.fsum(numbers))
    except OverflowError:
        return False


def loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw
