"""A trial's results as it reported them: a number, or a dict of keys NNI trials report
(``{"default": 0.93, "loss": 0.21}``). The read model keeps each result's ``default`` number
for ranking and curves, and each result as reported (``TrialDetail.intermediate_results``);
the CLI and the dashboard show every key with these."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["reported", "result_keys"]


def reported(value: float, value_json: str) -> Any:
    """One stored result as reported: its JSON read back, or the number when that is all."""
    if not value_json or value_json == repr(value):
        return value
    try:
        return json.loads(value_json)
    except ValueError:
        return value  # a JSON this version cannot read: the number still stands


def result_keys(results: Iterable[Any]) -> list[str]:
    """The keys of the dict results among ``results``, ``default`` first, then as first seen."""
    keys: dict[str, None] = {}
    for r in results:
        if isinstance(r, dict):
            keys.update((str(k), None) for k in r)
    return sorted(keys, key=lambda k: k != "default")
