"""Why a workload's pod waits, and when waiting becomes failing: a pod that cannot pull its
image waits forever (a wrong image name, a missing pull secret), so its environment fails
once that has lasted ``imagePullTimeout``. Pure: the service keeps when it began."""

from __future__ import annotations

from typing import Any

from .._record import State
from .objects import POD, Kind, pod_state, pull_failure


def waiting_state(kind: Kind, pods: list[dict[str, Any]], detail: str, failing_since: float | None,
                  now: float, timeout: float) -> tuple[State, float | None]:
    """The state of a starting environment with ``pods``, and since when (monotonic) its pod
    has failed to pull its image (None: it does not). An operator's workload that is only
    "created" says why its pod waits (no node fits it)."""
    why = next((w for w in map(pull_failure, reversed(pods)) if w), "")
    if not why:
        if kind is not POD:
            waiting = [d for s, d in (pod_state(p.get("status") or {}) for p in pods) if s == "starting" and d]
            detail = waiting[-1] if waiting else detail
        return State("waiting", detail), None
    since = now if failing_since is None else failing_since
    waited = now - since
    if waited >= timeout:
        return State("failed", f"the image could not be pulled for {waited:.0f} s: {why}"), since
    return State("waiting", why), since
