"""A running experiment's work on checkpoint files, off the event loop's way: a checkpoint an
agent says is whole made whole here (uploaded pieces, or written through shared storage), an
uploaded checkpoint's digest taken a little after it was recorded, a checkpoint sent down an
agent's stream in paced pieces, and the removals and digests still under way let finish at
the end. The shell hands it the engine's checkpoint instructions; what it learns goes back
to the engine as events."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ..engine import checkpoints as ck
from ..engine import events as ev
from .checkpointfiles import CheckpointFiles, CheckpointFilesError

__all__ = ["CHECKPOINT_WINDOW", "CheckpointWork"]

log = logging.getLogger(__name__)

# Pieces of a checkpoint going down waiting in a stream's queue (1 MiB each), how long one waits.
CHECKPOINT_WINDOW = 8
CHECKPOINT_SEND_TIMEOUT_S = 120.0
# How long the end of an experiment waits for checkpoints being removed.
REMOVAL_WAIT_S = 60.0
# An uploaded checkpoint's digest is taken this long after it was recorded.
DIGEST_DELAY_S = 2.0


class PacedLink(Protocol):
    """An agent's stream, as far as sending a checkpoint down it goes."""

    def send(self, message: ev.ToAgent) -> None: ...

    async def send_paced(self, message: ev.ToAgent, *, max_queued: int, timeout: float) -> bool: ...


class CheckpointWork:
    """``spawn`` runs a coroutine in the background (the shell's, which ends the experiment
    when one raises); ``tell`` hands the engine an event, unless the shell is closed."""

    def __init__(self, files: CheckpointFiles, spawn: Callable[[Any, str], asyncio.Task[Any]],
                 tell: Callable[[ev.Event], Any]) -> None:
        self.files = files
        self._spawn = spawn
        self._tell = tell
        self._removals: set[asyncio.Task[Any]] = set()  # checkpoints being removed
        self._digests: set[asyncio.Task[Any]] = set()  # uploaded checkpoints' digests being taken
        self._ending = asyncio.Event()

    def finished(self, event: ev.AgentReported, saved: ck.CheckpointSavedReported) -> ev.AgentReported:
        """A checkpoint an agent says is whole: its files made whole here first (uploaded,
        or written through shared storage), what is wrong with them told to the engine."""
        if saved.location:
            return event  # in object storage: the agent wrote it there
        problem = self.files.finish(saved.trial_id, saved.step, saved.files)
        return dataclasses.replace(event, report=dataclasses.replace(saved, problem=problem)) if problem else event

    def recorded(self, c: ck.Checkpoint) -> None:
        """A checkpoint was stored: one uploaded here gets its digest taken."""
        if not c.digest and not c.location:
            self._take_digest(c)

    def digest_missing(self, checkpoints: Iterable[ck.Checkpoint]) -> None:
        """After a crash: of ``checkpoints``, those uploaded whose digest was not taken yet."""
        for c in {c for c in checkpoints if not c.digest and not c.location}:
            self._take_digest(c)

    def _take_digest(self, c: ck.Checkpoint) -> None:
        task = self._spawn(self._digest(c), "a checkpoint's digest")
        self._digests.add(task)
        task.add_done_callback(self._digests.discard)

    async def _digest(self, c: ck.Checkpoint) -> None:
        """An uploaded checkpoint's digest, read here from its files off the trial's save's way."""
        # After the saves coming behind it, not in their way; at once when the experiment ends.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ending.wait(), DIGEST_DELAY_S)
        try:
            digest = await asyncio.to_thread(self.files.digest, c)
        except OSError as e:  # removed meanwhile, say: it stays without one
            return log.info("no digest for checkpoint %d of trial %s: %s", c.step, c.trial_id, e)
        self._tell(ck.CheckpointDigested(c.trial_id, c.step, digest))

    def send(self, i: ck.SendCheckpoint, links: Mapping[int, PacedLink]) -> None:
        """Send a checkpoint down the stream ``i.link`` of ``links`` (the open ones)."""
        self._spawn(self._send(i, links), f"send checkpoint {i.checkpoint.step} of {i.trial_id}")

    async def _send(self, i: ck.SendCheckpoint, links: Mapping[int, PacedLink]) -> None:
        link = links.get(i.link)
        if link is None:
            return  # the agent asks again once it is back
        try:
            async for piece in self.files.pieces(i.trial_id, i.checkpoint, i.path, i.offset):
                if not await link.send_paced(piece, max_queued=CHECKPOINT_WINDOW, timeout=CHECKPOINT_SEND_TIMEOUT_S):
                    return  # the stream broke or stalled: the agent asks again from where it got to
        except CheckpointFilesError as e:
            link.send(ck.CheckpointRefused(i.trial_id, i.checkpoint.step, str(e)))

    def remove(self, c: ck.Checkpoint) -> None:
        task = self._spawn(self.files.remove(c), f"remove {c.trial_id}'s")
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def digests_taken(self) -> None:
        """The end: the digests still to take are taken now (and told), within REMOVAL_WAIT_S."""
        self._ending.set()
        if self._digests:
            await asyncio.wait(list(self._digests), timeout=REMOVAL_WAIT_S)

    async def removals_done(self) -> None:
        """The end: the store says they are gone, let them go (within REMOVAL_WAIT_S)."""
        if self._removals:
            await asyncio.wait(list(self._removals), timeout=REMOVAL_WAIT_S)
