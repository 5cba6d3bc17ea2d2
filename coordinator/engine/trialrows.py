"""Trials as the store kept them, read back into the book's state after a crash.

A row an older or broken version wrote badly is taken as far as it can be read; it never
stops a resume. Plain functions: the book (``book.py``) calls ``restore``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

from . import checkpoints as ck
from . import events as ev
from .model import TrialState, enum_or, loads_or
from .states import TrialStatus


def restore(
    rows: Iterable[Mapping[str, Any]], checkpoint_rows: Iterable[Mapping[str, Any]], gpu_memory: int, wall: float,
    out: list[ev.Instruction],
) -> dict[str, TrialState]:
    """The trials of the stored rows, by id, with their checkpoints; the facts of those that
    cannot run again go to ``out``."""
    rows = list(rows)
    trials = {}
    for r in rows:
        t, failed = trial_of(r, gpu_memory, wall)
        if failed is not None:
            out.append(failed)
        trials[t.id] = t
    attach_checkpoints(trials, rows, checkpoint_rows)
    return trials


def trial_of(r: Mapping[str, Any], gpu_memory: int, wall: float) -> tuple[TrialState, ev.TrialStatusChanged | None]:
    """The trial of a stored row; and, when what it needs to run again cannot be read (its
    status, its parameters), the fact that it failed: it is not run again, and the store
    says why."""
    status = enum_or(TrialStatus, r["status"], None)
    parameters = loads_or(r["parameters_json"], None)
    unreadable = [what for what, bad in (
        ("status", status is None), ("parameters", not isinstance(parameters, dict))
    ) if bad]
    gpu_number = int(r["gpu_number"] or 0)
    attempts = int(r["attempts"] or 0)
    retries = r.get("retries")
    t = TrialState(
        id=r["id"], seq=r["seq"], status=status or TrialStatus.FAILED,
        parameters=parameters if isinstance(parameters, dict) else {}, command=r["command"],
        gpu_number=gpu_number, submitted_at=r["submitted_at"],
        gpu_memory=gpu_memory if gpu_number else 0, env_id=r["environment_id"],
        last_env_id=r.get("last_environment_id") or r["environment_id"],
        gpu_indices=tuple(loads_or(r["gpu_indices_json"], [])),
        gpu_uuids=tuple(loads_or(r["gpu_uuids_json"], [])),
        exit_code=r["exit_code"], signal=r["signal"], reason=r["reason"], stderr_tail=r["stderr_tail"],
        final_metric=r["final_metric"], final_metric_json=r["final_metric_json"],
        attempts=attempts, started_at=r["started_at"],
        # An older version kept the end of an attempt a trial was retried or paused after as its own.
        ended_at=None if status and not status.terminal else r["ended_at"],
        platforms=_platforms(r.get("platforms_json")), nodes=max(1, int(r.get("nodes") or 1)),
        max_duration=float(r.get("max_duration") or 0.0),
        # A store from before retries were counted apart: every run after the first was one.
        retries=int(retries) if retries is not None else max(0, attempts - 1),
        progressed=bool(r.get("progressed") or 0), ran_s=float(r.get("ran_s") or 0.0),
    )
    if not unreadable or (status is not None and status.terminal):
        return t, None
    t.status, t.env_id = TrialStatus.FAILED, None
    t.reason = f"its stored {' and '.join(unreadable)} cannot be read; not resumed"
    t.ended_at = t.ended_at or wall
    log.warning("trial %s: %s", t.id, t.reason)
    return t, ev.TrialStatusChanged(t.id, str(r["status"]), t.status, t.reason, t.reason, t.ended_at)


def attach_checkpoints(
    trials: Mapping[str, TrialState], trial_rows: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]]
) -> None:
    """Give each trial its kept checkpoints (oldest first), and a forked one the checkpoint
    it was forked from."""
    every: dict[tuple[str, int], ck.Checkpoint] = {}
    for r in rows:
        c = ck.from_row(r)
        every[c.trial_id, c.step] = c
        t = trials.get(c.trial_id)
        if t is not None and not r.get("removed_at"):
            t.checkpoints.append(c)
    for t in trials.values():
        t.checkpoints.sort(key=lambda c: (c.saved_at, c.step))
    for r in trial_rows:
        fork = loads_or(r.get("forked_from_json"), None)
        t = trials.get(r["id"])
        if t is not None and not t.checkpoints and isinstance(fork, list) and len(fork) == 2:
            t.forked_from = every.get((str(fork[0]), int(fork[1])))


def _platforms(raw: Any) -> tuple[str, ...]:
    found = loads_or(raw, [])
    return tuple(p for p in found if isinstance(p, str)) if isinstance(found, list) else ()
