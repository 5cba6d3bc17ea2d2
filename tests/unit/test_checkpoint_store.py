"""What the store and the experiment's checkpoint directory keep of checkpoints, on real files
and a real SQLite store in a temporary directory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.rows import MetricRun
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.store.checkpointfiles import MARKER, CheckpointFiles, CheckpointFilesError
from trialkeeper.coordinator.store.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.in_dir(tmp_path)
    s.keep(ev.TrialAdded("t1", 0, TrialStatus.WAITING, {}, "c", 0, 1.0))
    yield s
    s.close()


def _run(trial_id: str, first: int, values: list[float]) -> MetricRun:
    return MetricRun(trial_id, "intermediate", first, values, None, [float(i) for i in range(len(values))])


def test_results_after_a_checkpoint_move_to_history_and_the_continued_run_takes_their_indexes(store: Store) -> None:
    store.add_runs([_run("t1", 0, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])])
    with store.transaction():
        store.keep(ck.MetricsSuperseded("t1", 4, 99.0))
    assert [m.index for m in store.metrics("t1")] == [0, 1, 2, 3]
    assert [(h["idx"], h["value"]) for h in store.metric_history("t1")] == [(4, 4.0), (5, 5.0)]
    assert store.next_metric_index("t1") == 4
    store.add_runs([_run("t1", 4, [40.0, 50.0, 60.0])])
    assert [m.value for m in store.metrics("t1")] == [0.0, 1.0, 2.0, 3.0, 40.0, 50.0, 60.0]
    assert store.metric_count() == 7


def test_a_recorded_checkpoint_is_read_back_and_marks_its_trial(store: Store) -> None:
    c = ck.Checkpoint("t1", 3, 2, 10, "sha256:ab", (ck.CheckpointFile("model.pt", 10, 0o600),), "", 5.0, "env-1")
    with store.transaction():
        store.keep(ck.CheckpointRecorded(c))
    read = ReadModel(store)
    assert [(i.step, i.size_bytes, i.metric_index, i.env_id) for i in read.checkpoints("t1")] == [(3, 10, 2, "env-1")]
    trial = read.trial("t1")
    assert trial is not None and trial.checkpoint_step == 3
    assert ck.from_row(store.checkpoints("t1")[0]) == c
    with store.transaction():
        store.keep(ck.CheckpointRemoved("t1", 3, 6.0))
    assert read.checkpoints("t1") == [] and len(store.checkpoints("t1", kept=False)) == 1


def test_an_upload_becomes_whole_by_one_rename_and_a_short_one_is_refused(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path / "checkpoints", "exp")
    files.mark()
    assert (tmp_path / "checkpoints" / MARKER).read_text().strip() == "exp"
    manifest = (ck.CheckpointFile("a/b.bin", 6), ck.CheckpointFile("c.txt", 2))
    files.write_chunk("t1", 1, "a/b.bin", 0, b"abc")
    assert files.finish("t1", 1, manifest) == "the coordinator did not get all of it: a/b.bin has 3 bytes, not 6"
    files.write_chunk("t1", 1, "a/b.bin", 3, b"def")
    files.write_chunk("t1", 1, "a/b.bin", 3, b"def")  # a replay changes nothing
    files.write_chunk("t1", 1, "a/b.bin", 10, b"zz")  # past the end: dropped, no hole
    files.write_chunk("t1", 1, "c.txt", 0, b"ok")
    files.write_chunk("t1", 1, "../escape", 0, b"no")
    assert files.finish("t1", 1, manifest) == ""
    final = files.dir_of("t1", 1)
    assert (final / "a" / "b.bin").read_bytes() == b"abcdef" and (final / "c.txt").read_bytes() == b"ok"
    assert not (tmp_path / "checkpoints" / "t1" / ".incoming-1").exists()
    assert not (tmp_path / "checkpoints" / "escape").exists()
    assert files.finish("t1", 1, manifest) == ""  # a replayed save finds it whole
    assert "did not get any of it" in files.finish("t1", 2, manifest)


def test_a_checkpoint_goes_down_in_pieces_from_where_a_download_stopped(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path, "exp")
    d = files.dir_of("t1", 4)
    d.mkdir(parents=True)
    big = bytes(range(256)) * (ck.CHUNK_BYTES // 256 + 10)
    (d / "big.bin").write_bytes(big)
    (d / "small").write_bytes(b"s")
    c = ck.Checkpoint("t1", 4, 0, len(big) + 1, "", (ck.CheckpointFile("big.bin", len(big)), ck.CheckpointFile(
        "small", 1)), "", 0.0)

    async def collect(path: str, offset: int) -> list[ck.CheckpointData]:
        return [p async for p in files.pieces("t9", c, path, offset)]

    pieces = asyncio.run(collect("", 0))
    assert b"".join(p.data for p in pieces if p.path == "big.bin") == big
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(p.trial_id == "t9" and p.step == 4 for p in pieces)
    resumed = asyncio.run(collect("big.bin", ck.CHUNK_BYTES))
    assert resumed[0].offset == ck.CHUNK_BYTES and b"".join(p.data for p in resumed[:-1]) == big[ck.CHUNK_BYTES:]
    (d / "small").unlink()
    with pytest.raises(CheckpointFilesError):
        asyncio.run(collect("small", 0))
    empty = ck.Checkpoint("t1", 5, 0, 0, "", (), "", 0.0)
    assert [(p.path, p.last) for p in asyncio.run(_gather(files, empty))] == [("", True)]
    asyncio.run(files.remove(c))
    assert not d.exists()


async def _gather(files: CheckpointFiles, c: ck.Checkpoint) -> list[ck.CheckpointData]:
    return [p async for p in files.pieces("t1", c, "", 0)]


def test_prune_removes_what_no_kept_checkpoint_holds(tmp_path: Path) -> None:
    from trialkeeper.coordinator.store.checkpointfiles import prune

    root = tmp_path / "checkpoints"
    for rel in ("t1/3/model.pt", "t1/2/model.pt", "t1/.incoming-4/model.pt", "t2/live-1-ab/x", "t3/1/y"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"12345")
    (root / MARKER).write_text("exp\n")
    assert prune(root, {("t1", 3)}) == (4, 20)
    assert (root / "t1" / "3" / "model.pt").exists() and (root / MARKER).exists()
    assert sorted(p.name for p in root.iterdir()) == [MARKER, "t1"]
    assert [p.name for p in (root / "t1").iterdir()] == ["3"]


def test_an_upload_of_a_step_again_replaces_what_an_interrupted_one_left(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path, "exp")
    files.write_chunk("t1", 2, "model.pt", 0, b"old-and-longer")
    files.write_chunk("t1", 2, "stale.bin", 0, b"x")
    files.write_chunk("t1", 2, "model.pt", 0, b"new")
    assert files.finish("t1", 2, (ck.CheckpointFile("model.pt", 3),)) == ""
    final = files.dir_of("t1", 2)
    assert (final / "model.pt").read_bytes() == b"new" and not (final / "stale.bin").exists()
