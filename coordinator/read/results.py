"""A trial's results as it reported them: a number, or a dict of keys NNI trials report
(``{"default": 0.93, "loss": 0.21}``). The read model keeps each result's ``default`` number
for ranking and curves; the CLI and the dashboard show every key from here."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from ..store.reads import StoreError
from .model import ReadModel

__all__ = ["reported", "result_keys", "trial_results"]


def reported(value: float, value_json: str) -> Any:
    """One stored result as reported: its JSON read back, or the number when that is all."""
    if not value_json or value_json == repr(value):
        return value
    try:
        return json.loads(value_json)
    except ValueError:
        return value  # a JSON this version cannot read: the number still stands


def trial_results(model: ReadModel, trial_id: str) -> tuple[Any, ...]:
    """The trial's intermediate results, in order, each as reported."""
    try:
        rows = model.store.metrics(trial_id)
    except sqlite3.DatabaseError as e:
        where = model.store.path
        raise StoreError(f"cannot read the metrics of the experiment store {where}: {e}") from e
    return tuple(reported(r.value, r.value_json) for r in rows if r.kind == "intermediate")


def result_keys(results: Iterable[Any]) -> list[str]:
    """The keys of the dict results among ``results``, ``default`` first, then as first seen."""
    keys: dict[str, None] = {}
    for r in results:
        if isinstance(r, dict):
            keys.update((str(k), None) for k in r)
    return sorted(keys, key=lambda k: k != "default")
