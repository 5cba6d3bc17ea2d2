"""What a tuner or an assessor may ask of the trials it watches, besides proposing new ones:
pause a trial (it saves a checkpoint and frees its slot), continue a paused one (with new
parameters, and from another trial's checkpoint, for a population-based search), or stop one.

Both interfaces inherit :class:`Requesting`: an algorithm calls ``request_pause`` and the
others from any of its methods, and the search takes the requests after each call and
turns them into instructions for the experiment loop. A tuner names trials by parameter id,
an assessor by trial id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Request", "RequestKind", "Requesting"]


class RequestKind(enum.Enum):
    PAUSE = "pause"
    CONTINUE = "continue"
    STOP = "stop"


@dataclass(frozen=True)
class Request:
    kind: RequestKind
    target: int | str  # a tuner's parameter id, an assessor's trial id
    reason: str = ""
    parameters: dict[str, Any] | None = None  # CONTINUE only: the trial's new parameters
    checkpoint_from: int | str | None = None  # CONTINUE only: the trial whose checkpoint it continues from


class Requesting:
    """The requests an algorithm makes of running and paused trials."""

    def _requests(self) -> list[Request]:
        # Kept in the instance's dict, not set in __init__: subclasses that do not call
        # super().__init__ (NNI users porting their classes) can still make requests.
        pending: list[Request] | None = self.__dict__.get("_pending_requests")
        if pending is None:
            pending = self.__dict__["_pending_requests"] = []
        return pending

    def request_pause(self, trial: int | str, reason: str = "") -> None:
        """Pause ``trial``: it saves a checkpoint and ends its process, freeing its slot,
        until continued. A trial that never saves one within the pause grace period is
        canceled."""
        self._requests().append(Request(RequestKind.PAUSE, trial, reason))

    def request_continue(
        self, trial: int | str, parameters: dict[str, Any] | None = None, checkpoint_from: int | str | None = None
    ) -> None:
        """Continue the paused ``trial`` from its last checkpoint, with ``parameters`` in
        place of its own when given; from the newest checkpoint of trial ``checkpoint_from``
        instead when given (a population-based search's exploit; named as ``trial`` is). Asked
        of a trial still being paused, it is continued once paused."""
        self._requests().append(Request(RequestKind.CONTINUE, trial, parameters=parameters,
                                        checkpoint_from=checkpoint_from))

    def request_stop(self, trial: int | str, reason: str = "") -> None:
        """End ``trial`` now as EARLY_STOPPED, running or paused."""
        self._requests().append(Request(RequestKind.STOP, trial, reason))

    def take_requests(self) -> list[Request]:
        """The requests made since the last call, oldest first."""
        pending = self._requests()
        taken = list(pending)
        pending.clear()
        return taken
