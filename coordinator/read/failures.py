"""Why a trial failed, in one line: its stored reason ("exit code 1") with the last
meaningful line of its stderr tail ("RuntimeError: diverged"), which is what a person needs.
The CLI (`run`'s summary, `trials`, `trial`) and the dashboard's JSON (``failure_summary``)
all show this one."""

from __future__ import annotations

from typing import Any

from ..engine.states import TrialStatus

__all__ = ["failure_summary", "last_meaningful_line"]

# How much of the line is kept: a whole exception message can be a page long.
MAX_LINE = 300
_TRACEBACK = "Traceback (most recent call last):"


def _meaningful(line: str) -> bool:
    text = line.strip()
    if not text or text.startswith("[trialkeeper]"):
        return False  # blank, or the agent's own note in the trial's log
    return bool(text.strip("^~ "))  # Python's carets under a frame's code mark nothing new


def last_meaningful_line(stderr_tail: str) -> str:
    """The line of a stderr tail that says what went wrong: the final exception line of a
    traceback (its frames skipped), else the last line that is not blank nor one of
    trialkeeper's notes; "" when there is none."""
    lines = [line.rstrip() for line in stderr_tail.splitlines() if _meaningful(line)]
    if not lines:
        return ""
    chosen = lines[-1]
    if any(line.strip() == _TRACEBACK for line in lines) and chosen[:1].isspace():
        # The tail ends inside a traceback's frames: the exception line, unindented, is the
        # last such line after the traceback's head, when the tail holds one.
        head = max(i for i, line in enumerate(lines) if line.strip() == _TRACEBACK)
        flush = [line for line in lines[head + 1:] if not line[:1].isspace()]
        chosen = flush[-1] if flush else chosen
    chosen = chosen.strip()
    return chosen if len(chosen) <= MAX_LINE else chosen[: MAX_LINE - 3] + "..."


def failure_summary(trial: Any) -> str:
    """A FAILED trial's reason with the last meaningful line of its stderr tail ("exit code 1:
    RuntimeError: diverged"); "" for a trial that did not fail. ``trial`` is a
    :class:`~trialkeeper.coordinator.read.model.TrialSnapshot` (or anything with ``status``,
    ``reason`` and ``stderr_tail``)."""
    if getattr(trial, "status", None) is not TrialStatus.FAILED:
        return ""
    reason = (str(getattr(trial, "reason", "") or "").strip().splitlines() or ["failed"])[0]
    line = last_meaningful_line(str(getattr(trial, "stderr_tail", "") or ""))
    if not line or line in reason:
        return reason
    return f"{reason}: {line}"
