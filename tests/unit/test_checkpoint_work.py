"""A running experiment's work on checkpoint files (store/checkpointwork.py), against real
files in a real experiment checkpoint directory: an upload made whole or found wanting, a
digest taken once recorded, a checkpoint sent down a stream in pieces or refused, a removal
waited for at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from conftest import run_async
from trialkeeper.agent import checkpoint_files as cf
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.store.checkpointfiles import CheckpointFiles
from trialkeeper.coordinator.store.checkpointwork import CheckpointWork

FILES = {"a.bin": b"a" * 3000, "sub/b.txt": b"hello"}
ENTRIES = tuple(ck.CheckpointFile(p, len(d)) for p, d in sorted(FILES.items()))


def _saved(step: int, *, location: str = "") -> tuple[ev.AgentReported, ck.CheckpointSavedReported]:
    saved = ck.CheckpointSavedReported("t1", step, 2, sum(len(d) for d in FILES.values()), "", ENTRIES, location, 1.0)
    return ev.AgentReported("e1", 1, 7, saved), saved


def _checkpoint(step: int) -> ck.Checkpoint:
    return ck.Checkpoint("t1", step, 2, sum(len(d) for d in FILES.values()), "", ENTRIES, "", 1.0)


def _upload(files: CheckpointFiles, step: int, contents: dict[str, bytes]) -> None:
    for path, data in contents.items():
        files.write_chunk("t1", step, path, 0, data)


class _Link:
    def __init__(self, room: int = 1000) -> None:
        self.room = room
        self.paced: list[Any] = []
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)

    async def send_paced(self, message: Any, *, max_queued: int, timeout: float) -> bool:
        if len(self.paced) >= self.room:
            return False  # the stream stalled
        self.paced.append(message)
        return True


def _work(tmp_path: Path) -> tuple[CheckpointWork, list[Any], set[asyncio.Task[Any]]]:
    files = CheckpointFiles(tmp_path / "checkpoints", "exp")
    files.mark()
    told: list[Any] = []
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Any, what: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        return task

    return CheckpointWork(files, spawn, told.append), told, tasks


def test_an_upload_said_whole_becomes_the_steps_directory_and_one_short_is_told_as_a_problem(tmp_path: Path) -> None:
    async def body() -> None:
        work, _, _ = _work(tmp_path)
        _upload(work.files, 3, FILES)
        event, _ = _saved(3)
        assert work.finished(event, event.report) is event  # type: ignore[arg-type]
        assert (work.files.dir_of("t1", 3) / "sub" / "b.txt").read_bytes() == b"hello"

        _upload(work.files, 4, {"a.bin": FILES["a.bin"], "sub/b.txt": b"hel"})  # its last piece lost
        event, saved = _saved(4)
        told = work.finished(event, saved)
        assert told is not event and told.report.problem == (  # type: ignore[union-attr]
            "the coordinator did not get all of it: sub/b.txt has 3 bytes, not 5")
        assert not work.files.dir_of("t1", 4).exists()  # not made a checkpoint

        event, saved = _saved(5, location="s3://bucket/exp/t1/5")
        assert work.finished(event, saved) is event  # in object storage: nothing to look at here

    run_async(body)


def test_a_recorded_upload_gets_its_digest_taken_and_told_at_the_latest_at_the_end(tmp_path: Path) -> None:
    async def body() -> None:
        work, told, _ = _work(tmp_path)
        _upload(work.files, 3, FILES)
        event, saved = _saved(3)
        work.finished(event, saved)
        work.recorded(_checkpoint(3))
        work.recorded(ck.Checkpoint("t1", 9, 0, 0, "sha256:known", (), "", 1.0))  # has one: not taken again
        await work.digests_taken()  # the end: taken now, not after the delay
        expected = cf.digest_of(work.files.dir_of("t1", 3), [cf.FileEntry(f.path, f.size) for f in ENTRIES])
        assert told == [ck.CheckpointDigested("t1", 3, expected)]

    run_async(body)


def test_a_checkpoint_whose_files_went_gets_no_digest_and_nothing_is_told(tmp_path: Path) -> None:
    async def body() -> None:
        work, told, _ = _work(tmp_path)
        work.digest_missing([_checkpoint(8), _checkpoint(8)])  # after a crash; named twice, taken once
        await work.digests_taken()
        assert told == []

    run_async(body)


def test_a_checkpoint_goes_down_in_pieces_from_where_the_agent_got_to_or_is_refused(tmp_path: Path) -> None:
    async def body() -> None:
        work, _, tasks = _work(tmp_path)
        _upload(work.files, 3, FILES)
        work.finished(*_saved(3))
        link = _Link()
        work.send(ck.SendCheckpoint(1, "t2", _checkpoint(3), "sub/b.txt", 2), {1: link})
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert [(p.path, p.offset, p.data, p.last) for p in link.paced] == [("sub/b.txt", 2, b"llo", True)]
        assert all(p.trial_id == "t2" for p in link.paced)

        stalled = _Link(room=0)
        work.send(ck.SendCheckpoint(1, "t2", _checkpoint(3), "", 0), {1: stalled})
        work.send(ck.SendCheckpoint(2, "t2", _checkpoint(3), "", 0), {1: stalled})  # its stream is gone
        gone = _Link()
        work.send(ck.SendCheckpoint(1, "t2", _checkpoint(6), "", 0), {1: gone})  # never saved here
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert stalled.paced == [] and stalled.sent == []  # the agent asks again from where it got to
        assert len(gone.sent) == 1 and isinstance(gone.sent[0], ck.CheckpointRefused)
        assert gone.sent[0].step == 6 and "a.bin" in gone.sent[0].reason

    run_async(body)


def test_removals_under_way_are_waited_for_at_the_end(tmp_path: Path) -> None:
    async def body() -> None:
        work, _, _ = _work(tmp_path)
        _upload(work.files, 3, FILES)
        work.finished(*_saved(3))
        work.remove(_checkpoint(3))
        await work.removals_done()
        assert not work.files.dir_of("t1", 3).exists()

    run_async(body)
