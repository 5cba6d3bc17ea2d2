"""The session's side of checkpoints: what goes up the stream (numbered chunks read from the
files when sent, CheckpointSaved, FetchCheckpoint) and what comes back for them (the Ack that
records a save, CheckpointRefused)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from trialkeeper.protos.v1 import coordinator_pb2 as pb

from .checkpoint_files import CHUNK_BYTES, FileEntry
from .checkpoints import CheckpointRef, SavedCheckpoint

log = logging.getLogger(__name__)


class CheckpointWire:
    """Numbered checkpoint messages go through ``enqueue`` (the session's journal, replayed
    after a reconnect until acked); a chunk's bytes are named in ``ranges`` (seq -> file,
    length) and read when it is sent, as a LogChunk's are. FetchCheckpoint is not numbered: it
    goes out once on the current stream, and the keeper asks again on the next one."""

    def __init__(
        self,
        enqueue: Callable[[pb.AgentMessage], None],
        ranges: dict[int, tuple[Path, int]],
        wake: Callable[[], None],
    ) -> None:
        self._enqueue = enqueue
        self._ranges = ranges
        self._wake = wake
        self._waiting: dict[int, tuple[str, int, asyncio.Future[str | None]]] = {}
        self._once: list[pb.AgentMessage] = []

    def upload(self, trial_id: str, step: int, directory: Path, files: Sequence[FileEntry]) -> None:
        """Each file in manifest order, CHUNK_BYTES at a time (an empty file as one empty chunk)."""
        for i, f in enumerate(files):
            offset = 0
            while True:
                length = min(CHUNK_BYTES, f.size - offset)
                last = i == len(files) - 1 and offset + length >= f.size
                chunk = pb.CheckpointChunk(trial_id=trial_id, step=step, path=f.path, offset=offset, last=last)
                msg = pb.AgentMessage(checkpoint_chunk=chunk)
                self._enqueue(msg)
                self._ranges[msg.seq] = (directory / f.path, length)
                offset += length
                if offset >= f.size:
                    break

    def saved(self, s: SavedCheckpoint) -> asyncio.Future[str | None]:
        saved = pb.CheckpointSaved(
            trial_id=s.trial_id, step=s.step, metric_index=s.metric_index, size_bytes=s.manifest.size_bytes,
            digest=s.manifest.digest, location=s.location, saved_at=s.saved_at,
            files=[pb.CheckpointFile(path=f.path, size=f.size, mode=f.mode) for f in s.manifest.files],
        )
        msg = pb.AgentMessage(checkpoint_saved=saved)
        self._enqueue(msg)
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._waiting[msg.seq] = (s.trial_id, s.step, answer)
        return answer

    def fetch(self, trial_id: str, step: int, path: str, offset: int) -> None:
        self._once.append(
            pb.AgentMessage(fetch_checkpoint=pb.FetchCheckpoint(trial_id=trial_id, step=step, path=path, offset=offset))
        )
        self._wake()

    def take_once(self) -> list[pb.AgentMessage]:
        """The unnumbered messages to write now."""
        out, self._once = self._once, []
        return out

    def new_stream(self) -> None:
        self._once.clear()  # asked again for the new stream by whoever still needs them

    def acked(self, seq: int) -> None:
        """Saves up to ``seq`` are recorded (those refused were answered before)."""
        for done in [s for s in self._waiting if s <= seq]:
            _, _, answer = self._waiting.pop(done)
            if not answer.done():
                answer.set_result(None)

    def refused(self, trial_id: str, step: int, reason: str) -> None:
        for seq, (tid, st, answer) in list(self._waiting.items()):
            if tid == trial_id and st == step and not answer.done():
                answer.set_result(reason or "refused by the coordinator")
                del self._waiting[seq]

    def close(self) -> None:
        for _, _, answer in self._waiting.values():
            answer.cancel()
        self._waiting.clear()


def checkpoint_ref(ref: pb.CheckpointRef) -> CheckpointRef:
    """A StartTrial's checkpoint as the keeper takes it."""
    return CheckpointRef(
        trial_id=ref.trial_id, step=ref.step, metric_index=ref.metric_index, location=ref.location,
        digest=ref.digest, size_bytes=ref.size_bytes,
        files=tuple(FileEntry(f.path, f.size, f.mode) for f in ref.files),
    )


def with_file_data(msg: pb.AgentMessage, ranges: dict[int, tuple[Path, int]]) -> pb.AgentMessage:
    """``msg`` as sent: a LogChunk or CheckpointChunk gets its bytes from its file, in a copy
    that is dropped once written, so the journal never holds them."""
    where = ranges.get(msg.seq)
    if where is None:
        return msg
    path, length = where
    kind = "log" if msg.HasField("log") else "checkpoint_chunk"
    body = getattr(msg, kind)
    try:
        with open(path, "rb") as f:
            f.seek(body.offset)
            data = f.read(length)
    except OSError as e:
        # A refused checkpoint's files may be gone already; its chunks are dropped anyway.
        if kind == "log" or body.offset == 0:
            log.warning("trial %s: cannot read %s to send it: %s", body.trial_id, path, e)
        data = b""
    out = pb.AgentMessage()
    out.CopyFrom(msg)
    getattr(out, kind).data = data
    return out
