"""The agent's checkpoints: the files (manifest, digest, unsafe paths, downloads), the keeper
(snapshot by rename, size refusal, the local cache, continuing from shared storage or a
download, pausing), and the trial SDK asking a real runner through its socket."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import async_wait_until, run_async
from trialkeeper.agent import checkpoint_files as cf
from trialkeeper.agent import trial
from trialkeeper.agent.checkpoint_files import CheckpointFilesError, FileEntry
from trialkeeper.agent.checkpoints import (
    CACHE_DIR,
    CheckpointKeeper,
    CheckpointLink,
    CheckpointRef,
    CheckpointUnavailable,
    SavedCheckpoint,
)

# ---- files -------------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def _expected_digest(files: dict[str, bytes]) -> str:
    """The documented digest, computed here on its own."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + str(len(files[rel])).encode() + b"\0" + files[rel])
    return "sha256:" + h.hexdigest()


FILES = {"model.pt": b"weights" * 1000, "opt/state.bin": b"\x00\x01" * 70_000, "a/empty": b"", "z.json": b"{}"}


def test_the_manifest_lists_files_sorted_and_the_digest_is_the_documented_one(tmp_path: Path) -> None:
    root = _tree(tmp_path / "c", FILES)
    (root / "only-a-dir").mkdir()
    os.chmod(root / "model.pt", 0o600)
    m = cf.make_manifest(root)
    assert [f.path for f in m.files] == sorted(FILES)
    assert {f.path: f.size for f in m.files} == {k: len(v) for k, v in FILES.items()}
    assert next(f for f in m.files if f.path == "model.pt").mode == 0o600
    assert m.size_bytes == sum(map(len, FILES.values()))
    assert m.digest == _expected_digest(FILES)
    assert cf.digest_of(root, m.files) == m.digest


def test_a_checkpoint_over_the_size_limit_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    root = _tree(tmp_path / "c", {"big": b"x" * 1000})
    with pytest.raises(CheckpointFilesError, match=r"1000 bytes, more than the experiment's maxCheckpointSize \(999"):
        cf.make_manifest(root, max_bytes=999)
    assert cf.make_manifest(root, max_bytes=1000).size_bytes == 1000


@pytest.mark.parametrize("target", ["inside", "/etc/passwd", "../outside"])
def test_symbolic_links_are_refused_wherever_they_point(tmp_path: Path, target: str) -> None:
    root = _tree(tmp_path / "c", {"inside": b"1", "sub/x": b"2"})
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(target, root / "sub" / "link")
    with pytest.raises(CheckpointFilesError, match=r"sub/link is a symbolic link"):
        cf.scan(root)


def test_a_pipe_and_a_directory_replaced_by_a_link_are_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path / "c", {"a": b"1"})
    os.mkfifo(root / "fifo")
    with pytest.raises(CheckpointFilesError, match="fifo is not a regular file"):
        cf.scan(root)
    os.symlink(tmp_path / "c", tmp_path / "link")
    with pytest.raises(CheckpointFilesError, match="not a directory"):
        cf.scan(tmp_path / "link")


@pytest.mark.parametrize(
    "path,words",
    [("", "empty"), ("/abs", "not relative"), ("a/../b", "plain relative"), ("./a", "plain relative"),
     ("a//b", "plain relative"), ("a\\b", "not relative")],
)
def test_unsafe_manifest_paths_are_named(path: str, words: str) -> None:
    assert words in cf.path_problem(path)
    assert words in cf.manifest_problem([FileEntry(path, 0)], 0)


def test_a_manifest_naming_a_file_twice_or_not_adding_up_is_refused() -> None:
    assert "twice" in cf.manifest_problem([FileEntry("a", 1), FileEntry("a", 1)], 2)
    assert "add up" in cf.manifest_problem([FileEntry("a", 1)], 2)
    assert cf.manifest_problem([FileEntry("a", 1), FileEntry("b/c", 1)], 2) == ""


def _chunks(files: dict[str, bytes], size: int) -> list[tuple[str, int, bytes, bool]]:
    """The chunks the coordinator sends for ``files``, ``size`` bytes at a time."""
    out: list[tuple[str, int, bytes, bool]] = []
    names = sorted(files)
    for n, rel in enumerate(names):
        data, at = files[rel], 0
        while True:
            piece = data[at: at + size]
            end = at + len(piece) >= len(data)
            out.append((rel, at, piece, end and n == len(names) - 1))
            at += len(piece)
            if end:
                break
    return out


def _entries(files: dict[str, bytes]) -> list[FileEntry]:
    return [FileEntry(k, len(files[k]), 0o640) for k in sorted(files)]


def test_a_download_resumes_where_it_stopped_skips_repeats_and_checks_the_digest(tmp_path: Path) -> None:
    target = tmp_path / "live"
    target.mkdir()
    dl = cf.Download(target, _entries(FILES), _expected_digest(FILES))
    chunks = _chunks(FILES, 4096)
    half = len(chunks) // 2
    for c in chunks[:half]:
        assert not dl.feed(*c)
    path, offset = dl.position()  # a reconnect: ask again from here; the coordinator resends one chunk
    resent = [c for c in chunks if c[0] == path and c[1] <= offset]
    for c in [resent[-1], *chunks[half:]]:
        done = dl.feed(*c)
    assert done
    for rel, data in FILES.items():
        assert (target / rel).read_bytes() == data
        assert (target / rel).stat().st_mode & 0o777 == 0o640
    dl.close()


def test_a_download_with_a_gap_or_a_wrong_digest_fails_with_the_reason(tmp_path: Path) -> None:
    chunks = _chunks(FILES, 4096)
    (tmp_path / "a").mkdir()
    gap = cf.Download(tmp_path / "a", _entries(FILES), _expected_digest(FILES))
    first = next(i for i, c in enumerate(chunks) if c[0] == "model.pt")
    for c in chunks[: first + 1]:
        gap.feed(*c)
    with pytest.raises(CheckpointFilesError, match="model.pt: a chunk at offset 8192, expected 4096"):
        gap.feed("model.pt", 8192, b"x", False)
    (tmp_path / "b").mkdir()
    wrong = cf.Download(tmp_path / "b", _entries(FILES), "sha256:" + "0" * 64)
    for c in chunks[:-1]:
        wrong.feed(*c)
    with pytest.raises(CheckpointFilesError, match="digest is sha256:.*expected sha256:0000"):
        wrong.feed(*chunks[-1])


def test_an_empty_checkpoint_downloads_as_one_empty_last_chunk(tmp_path: Path) -> None:
    dl = cf.Download(tmp_path, [], _expected_digest({}))
    assert dl.feed("", 0, b"", True)


# ---- the keeper --------------------------------------------------------------------------


class Link(CheckpointLink):
    """The session's side, recorded: each CheckpointSaved is answered by ``answer(saved)``
    (None: recorded; a string: refused), at once or when the test resolves it."""

    def __init__(self, answer: Callable[[SavedCheckpoint], str | None] | None = None) -> None:
        self.answer = answer or (lambda s: None)
        self.uploads: list[tuple[str, int, Path, list[str]]] = []
        self.saved: list[SavedCheckpoint] = []
        self.fetches: list[tuple[str, int, str, int]] = []
        self.pending: list[asyncio.Future[str | None]] = []
        self.hold = False

    def checkpoint_upload(self, trial_id: str, step: int, directory: Path, files: Sequence[FileEntry]) -> None:
        # Chunks are read when sent: the files must be there now.
        assert all((directory / f.path).stat().st_size == f.size for f in files)
        self.uploads.append((trial_id, step, directory, [f.path for f in files]))

    def checkpoint_saved(self, saved: SavedCheckpoint) -> asyncio.Future[str | None]:
        self.saved.append(saved)
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        if self.hold:
            self.pending.append(fut)
        else:
            fut.set_result(self.answer(saved))
        return fut

    def fetch_checkpoint(self, trial_id: str, step: int, path: str, offset: int) -> None:
        self.fetches.append((trial_id, step, path, offset))


class Replies:
    """A trial's answer socket, as the SDK binds it."""

    def __init__(self) -> None:
        self.name = f"@trialkeeper-test-{os.getpid()}-{os.urandom(6).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(trial.socket_address(self.name))
        self.sock.setblocking(False)

    async def next(self, timeout: float = 20.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        data = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), timeout)
        answer: dict[str, Any] = json.loads(data)
        return answer


async def _save(keeper: CheckpointKeeper, trial_id: str, step: object, index: int = 0) -> dict[str, Any]:
    replies = Replies()
    try:
        keeper.request_save(trial_id, step, replies.name, index)
        return await replies.next()
    finally:
        replies.sock.close()


def _keeper(tmp_path: Path, link: Link, **settings: Any) -> CheckpointKeeper:
    keeper = CheckpointKeeper(tmp_path / "agent", link)
    keeper.configure(**{"experiment_id": "exp1", "checkpoint_dir": "", "checkpoint_storage": "", "max_bytes": 0,
                        **settings})
    return keeper


def test_a_save_moves_the_files_whole_into_the_cache_and_uploads_them(tmp_path: Path) -> None:
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link)
        env = await keeper.open_trial("t1", 1, None)
        live = Path(env[trial.ENV_CHECKPOINT_DIR])
        assert live.is_dir() and not any(live.iterdir()) and trial.ENV_CHECKPOINT_STEP not in env
        inode = (_tree(live, FILES) / "model.pt").stat().st_ino
        assert await _save(keeper, "t1", 3, index=7) == {"ok": True, "pause": False}
        assert live.is_dir() and not any(live.iterdir())  # empty again, at the same path
        copy = tmp_path / "agent" / CACHE_DIR / "t1" / "3"
        assert (copy / "model.pt").stat().st_ino == inode  # moved, not copied
        [saved] = link.saved
        assert (saved.step, saved.metric_index, saved.location) == (3, 7, "")
        # Uploaded: the coordinator takes its digest from what it got, off the save's way; this
        # copy's index gets it as it is computed meanwhile.
        assert saved.manifest.digest == ""
        assert link.uploads == [("t1", 3, copy, sorted(FILES))]
        index = copy.parent / "3.json"
        await async_wait_until(index.exists, 10.0, message="the local copy's index was not written")
        assert json.loads(index.read_text())["digest"] == _expected_digest(FILES)
        await keeper.close()

    run_async(body)


def test_only_the_newest_local_copy_is_kept_and_steps_must_increase(tmp_path: Path) -> None:
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link)
        live = Path((await keeper.open_trial("t1", 1, None))[trial.ENV_CHECKPOINT_DIR])
        for step in (1, 2):
            _tree(live, {"s": str(step).encode()})
            assert (await _save(keeper, "t1", step))["ok"]
        trial_cache = tmp_path / "agent" / CACHE_DIR / "t1"
        kept = lambda: sorted(p.name for p in trial_cache.iterdir() if not p.name.startswith("live-"))
        await _until(lambda: kept() == ["2", "2.json"])
        _tree(live, {"s": b"again"})
        answer = await _save(keeper, "t1", 2)
        assert answer["ok"] is False and "step 2 is not after step 2" in answer["error"]
        assert (live / "s").read_bytes() == b"again"  # nothing was taken
        for bad in (-1, 1.5, "3", True):
            answer = await _save(keeper, "t1", bad)
            assert answer["ok"] is False and "step must be a whole number" in answer["error"]
        await keeper.close()

    run_async(body)


def test_clearing_older_copies_leaves_a_later_step_being_saved(tmp_path: Path) -> None:
    # Step 3's clean-up runs in the background once step 3 is recorded; by then step 4 may be
    # placed and uploading. Only the steps before the kept one go.
    for name, files in {"2": ["s"], "3": ["s"], "4": ["s", "blob"]}.items():
        _tree(tmp_path / name, {f: b"x" for f in files})
        (tmp_path / f"{name}.json").write_text("{}")
    (tmp_path / "live-2-abc").mkdir()
    cf.drop_older(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "3.json", "4", "4.json", "live-2-abc"]
    assert sorted(p.name for p in (tmp_path / "4").iterdir()) == ["blob", "s"]


def test_a_refused_save_gives_the_files_back_with_the_reason(tmp_path: Path) -> None:
    link = Link(lambda s: "no room left on the coordinator's disk")

    async def body() -> None:
        keeper = _keeper(tmp_path, link, max_bytes=10_000)
        live = Path((await keeper.open_trial("t1", 1, None))[trial.ENV_CHECKPOINT_DIR])
        _tree(live, {"big": b"x" * 10_001})
        answer = await _save(keeper, "t1", 1)
        assert answer["ok"] is False
        assert "10001 bytes, more than the experiment's maxCheckpointSize (10000 bytes)" in answer["error"]
        assert "back in the checkpoint directory" in answer["error"]
        assert (live / "big").stat().st_size == 10_001 and link.saved == []
        (live / "big").unlink()
        _tree(live, {"small": b"y"})
        answer = await _save(keeper, "t1", 1)
        assert answer["ok"] is False and "the coordinator refused it: no room left" in answer["error"]
        assert (live / "small").read_bytes() == b"y"
        assert not (tmp_path / "agent" / CACHE_DIR / "t1" / "1").exists()
        os.symlink("/etc/hostname", live / "link")
        answer = await _save(keeper, "t1", 2)
        assert answer["ok"] is False and "link is a symbolic link" in answer["error"]
        await keeper.close()

    run_async(body)


def _ref(owner: str, step: int, files: dict[str, bytes], location: str = "") -> CheckpointRef:
    return CheckpointRef(owner, step, 5, location, _expected_digest(files), sum(map(len, files.values())),
                         tuple(_entries(files)))


def test_a_continued_trial_gets_its_own_local_copy_without_a_download(tmp_path: Path) -> None:
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link)
        live = Path((await keeper.open_trial("t1", 1, None))[trial.ENV_CHECKPOINT_DIR])
        _tree(live, FILES)
        assert (await _save(keeper, "t1", 4))["ok"]
        keeper.close_trial("t1")
        env = await keeper.open_trial("t1", 2, _ref("t1", 4, FILES))
        again = Path(env[trial.ENV_CHECKPOINT_DIR])
        assert again != live and env[trial.ENV_CHECKPOINT_STEP] == "4"
        assert {p.name for p in again.iterdir()} == {"model.pt", "opt", "a", "z.json"}
        assert (again / "opt" / "state.bin").read_bytes() == FILES["opt/state.bin"]
        assert link.fetches == []
        # The copy stays whole for the next continuation.
        assert (tmp_path / "agent" / CACHE_DIR / "t1" / "4" / "model.pt").exists()
        answer = await _save(keeper, "t1", 4)
        assert "not after step 4" in answer["error"]
        await keeper.close()

    run_async(body)


def _shared(tmp_path: Path, experiment_id: str = "exp1") -> Path:
    shared = tmp_path / "shared" / "checkpoints"
    shared.mkdir(parents=True)
    (shared / cf.MARKER_FILE).write_text(experiment_id + "\n")
    return shared


def test_on_shared_storage_the_live_directory_lies_there_and_a_save_is_a_rename(tmp_path: Path) -> None:
    shared = _shared(tmp_path)
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link, checkpoint_dir=str(shared))
        live = Path((await keeper.open_trial("t1", 1, None))[trial.ENV_CHECKPOINT_DIR])
        assert live.parent == shared / "t1" and live.name.startswith("live-1-")
        _tree(live, FILES)
        assert (await _save(keeper, "t1", 2))["ok"]
        assert (shared / "t1" / "2" / "model.pt").read_bytes() == FILES["model.pt"]
        assert link.uploads == [] and link.saved[0].location == ""
        assert not (tmp_path / "agent" / CACHE_DIR / "t1").exists()
        keeper.close_trial("t1")
        await _until(lambda: not live.exists())
        # Another trial forked from it continues from the shared copy.
        env = await keeper.open_trial("t2", 1, _ref("t1", 2, FILES))
        fork = Path(env[trial.ENV_CHECKPOINT_DIR])
        assert fork.parent == shared / "t2" and (fork / "z.json").read_bytes() == b"{}"
        assert link.fetches == []
        await keeper.close()

    run_async(body)


def test_on_shared_storage_a_save_is_digested_and_each_step_refuses_with_its_own_reason(tmp_path: Path) -> None:
    shared = _shared(tmp_path)
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link, checkpoint_dir=str(shared), max_bytes=200_000)
        live = Path((await keeper.open_trial("t1", 1, None))[trial.ENV_CHECKPOINT_DIR])
        _tree(live, {"big": b"x" * 200_001})
        answer = await _save(keeper, "t1", 1)
        assert "200001 bytes, more than the experiment's maxCheckpointSize" in answer["error"]
        assert "back in the checkpoint directory" in answer["error"] and (live / "big").exists()
        (live / "big").unlink()
        _tree(live, FILES)
        assert (await _save(keeper, "t1", 1))["ok"]
        assert link.saved[0].manifest.digest == _expected_digest(FILES)
        live.rmdir()  # nothing to take: the save is refused before any file moved
        answer = await _save(keeper, "t1", 2)
        assert answer == {"ok": False, "error": f"cannot take the files of {live}: No such file or directory"}
        assert len(link.saved) == 1 and not (shared / "t1" / "2").exists()
        await keeper.close()

    run_async(body)


def test_a_marker_of_another_experiment_means_no_shared_storage(tmp_path: Path) -> None:
    shared = _shared(tmp_path, "another")

    async def body() -> None:
        keeper = _keeper(tmp_path, Link(), checkpoint_dir=str(shared))
        live = Path((await keeper.open_trial("t1", 1, None))[trial.ENV_CHECKPOINT_DIR])
        assert live.parent == tmp_path / "agent" / CACHE_DIR / "t1"
        await keeper.close()

    run_async(body)


def test_without_a_copy_the_checkpoint_is_downloaded_and_resumed_after_a_reconnect(tmp_path: Path) -> None:
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link)
        opening = asyncio.ensure_future(keeper.open_trial("t9", 1, _ref("t1", 6, FILES)))
        await _until(lambda: link.fetches)
        assert link.fetches == [("t9", 6, "", 0)]
        chunks = _chunks(FILES, 8192)
        for c in chunks[:5]:
            keeper.on_chunk("t9", 6, *c)
        keeper.on_reconnect()
        path, offset = link.fetches[-1][2:]
        assert (path, offset) == (chunks[5][0], chunks[5][1])
        for c in chunks[5:]:
            keeper.on_chunk("t9", 6, *c)
        env = await opening
        live = Path(env[trial.ENV_CHECKPOINT_DIR])
        assert (live / "opt" / "state.bin").read_bytes() == FILES["opt/state.bin"]
        await keeper.close()

    run_async(body)


def test_a_checkpoint_that_cannot_be_had_fails_the_start_with_the_reason(tmp_path: Path) -> None:
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link)
        opening = asyncio.ensure_future(keeper.open_trial("t9", 1, _ref("t1", 6, FILES)))
        await _until(lambda: link.fetches)
        keeper.on_refused("t9", 6, "it was removed")
        with pytest.raises(CheckpointUnavailable, match="step 6 of trial t1: the coordinator cannot send it: it was"):
            await opening
        bad = CheckpointRef("t1", 1, 0, "", "sha256:x", 1, (FileEntry("../escape", 1),))
        with pytest.raises(CheckpointUnavailable, match="manifest cannot be used: path '../escape'"):
            await keeper.open_trial("t8", 1, bad)
        await keeper.close()

    run_async(body)


def test_a_pause_is_answered_by_the_next_safe_save_or_overdue_past_the_grace(tmp_path: Path) -> None:
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link)
        await keeper.open_trial("t1", 1, None)
        await keeper.open_trial("t2", 1, None)
        overdue: list[str] = []
        keeper.pause("t1", 30.0, "paused by the user", overdue.append)
        link.hold = True
        answering = asyncio.ensure_future(_save(keeper, "t1", 1))
        await _until(lambda: link.pending)
        assert keeper.paused_reason("t1") == ""  # not safe yet
        link.pending[0].set_result(None)  # the Ack
        assert await answering == {"ok": True, "pause": True}
        assert keeper.paused_reason("t1") == "paused after its checkpoint of step 1: paused by the user"
        keeper.pause("t2", 0.05, "paused by the user", overdue.append)
        await _until(lambda: overdue)
        assert overdue == ["saved no checkpoint within 0.05 s of being asked to pause"]
        await keeper.close()

    run_async(body)


async def _until(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    from conftest import async_wait_until

    return await async_wait_until(predicate, timeout=timeout, interval=0.01)


# ---- the SDK and a real runner ---------------------------------------------------------------

# A runner in a process of its own (it becomes its trials' subreaper and ends strays, which
# the test process must not), with the session's side recorded: each CheckpointSaved is
# acked at once, or refused when the config names its step.
DRIVER = r"""
import asyncio, json, sys
from pathlib import Path
from trialkeeper.agent.metric_socket import socket_name
from trialkeeper.agent.runner import RunnerEvents, TrialRunner
from trialkeeper.agent.trialfiles import TrialSpec

cfg = json.loads(sys.argv[1])
out = []

class Events(RunnerEvents):
    def __init__(self):
        self.done = asyncio.Event()
    def trial_started(self, trial_id, pid, started_at, address="", port=0):
        if cfg.get("pause_grace") is not None:
            runner.pause(trial_id, cfg["pause_grace"], "paused by the test")
            Path(cfg["gate"]).touch()
    def metrics(self, trial_id, kind, first_index, values, value_jsons):
        out.append(["metrics", kind, first_index, len(values)])
    def log(self, *args):
        pass
    def trial_ended(self, r):
        out.append(["ended", r.outcome, r.exit_code, r.reason])
        self.done.set()
    def checkpoint_upload(self, trial_id, step, directory, files):
        out.append(["upload", step, [f.path for f in files]])
    def checkpoint_saved(self, s):
        out.append(["saved", s.step, s.metric_index, s.manifest.digest])
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(cfg.get("refuse", {}).get(str(s.step)))
        return answer
    def fetch_checkpoint(self, *args):
        out.append(["fetch", *args])

async def main():
    global runner
    events = Events()
    workdir = Path(cfg["workdir"])
    runner = TrialRunner(workdir, events, socket_name=socket_name(workdir, "env"), stream_logs=False)
    await runner.open()
    runner.checkpoints.configure(experiment_id="exp", checkpoint_dir="", checkpoint_storage="", max_bytes=0)
    runner.start(TrialSpec(trial_id="t1", sequence_id=0, experiment_id="exp", command=cfg["command"],
                           parameters_json="{}", working_directory=cfg["cwd"]))
    await asyncio.wait_for(events.done.wait(), 60)
    await runner.close()
    print(json.dumps(out))

asyncio.run(main())
"""


def _run_trial(tmp_path: Path, script: str, **cfg: Any) -> tuple[list[list[Any]], str]:
    (tmp_path / "trial.py").write_text(textwrap.dedent(script))
    config = {"workdir": str(tmp_path / "agent"), "cwd": str(tmp_path), "command": f"{sys.executable} trial.py",
              "gate": str(tmp_path / "gate"), **cfg}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(config)], capture_output=True, text=True,
                          timeout=90, check=False)
    assert done.returncode == 0, done.stderr
    stderr = (tmp_path / "agent" / "trials" / "t1" / "stderr.log").read_text()
    return json.loads(done.stdout.strip().splitlines()[-1]), stderr


SAVER = """
import os
from pathlib import Path
from trialkeeper.agent import trial

ckpt = Path(trial.get_checkpoint_dir())
assert trial.checkpoint_step() is None and not any(ckpt.iterdir())
for i in range(3):
    trial.report_intermediate_result(float(i))  # batched: flushed before the save
(ckpt / "state").write_text("after three")
trial.save_checkpoint(1)
assert not any(ckpt.iterdir()), "the directory is empty again"
trial.report_intermediate_result(3.0)
(ckpt / "state").write_text("refused")
try:
    trial.save_checkpoint(2)
except trial.CheckpointError as e:
    print("refused:", e, flush=True)
    assert (ckpt / "state").read_text() == "refused"
trial.report_final_result(4.0)
"""


def test_the_sdk_saves_through_the_runner_with_the_results_reported_before(tmp_path: Path) -> None:
    out, _ = _run_trial(tmp_path, SAVER, refuse={"2": "too many checkpoints today"})
    saved = [e for e in out if e[0] == "saved"]
    assert [(s[1], s[2]) for s in saved] == [(1, 3), (2, 4)]  # three results came before the first save
    assert saved[0][3] == ""  # uploaded: the coordinator takes its digest
    assert [e[1] for e in out if e[0] == "upload"] == [1, 2]
    assert out[-1][:3] == ["ended", "succeeded", 0]
    stdout = (tmp_path / "agent" / "trials" / "t1" / "stdout.log").read_text()
    assert "refused: the coordinator refused it: too many checkpoints today" in stdout


PAUSER = """
import os, pathlib, time
from trialkeeper.agent import trial

gate = pathlib.Path(os.environ["GATE"])
deadline = time.monotonic() + 60
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
trial.report_intermediate_result(1.0)
pathlib.Path(trial.get_checkpoint_dir(), "w").write_text("x")
trial.save_checkpoint(5)
print("not reached", flush=True)
"""


def test_a_trial_asked_to_pause_ends_cleanly_at_its_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATE", str(tmp_path / "gate"))
    out, stderr = _run_trial(tmp_path, PAUSER, pause_grace=60.0)
    assert ["saved", 5, 1] == out[[e[0] for e in out].index("saved")][:3]
    assert out[-1] == ["ended", "paused", 0, "paused after its checkpoint of step 5: paused by the test"]
    assert "paused after its checkpoint at step 5 was saved" in stderr
    assert "not reached" not in (tmp_path / "agent" / "trials" / "t1" / "stdout.log").read_text()


def test_a_trial_that_saves_nothing_within_the_pause_grace_is_stopped(tmp_path: Path) -> None:
    out, _ = _run_trial(tmp_path, "import time\ntime.sleep(120)\n", pause_grace=0.2)
    assert out[-1][1] == "paused"
    assert out[-1][3] == "saved no checkpoint within 0.2 s of being asked to pause"


def test_standalone_mode_keeps_the_files_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for name in (trial.ENV_CHECKPOINT_DIR, trial.ENV_CHECKPOINT_STEP, trial.ENV_TRIAL_ID):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(trial.ENV_STANDALONE, "1")
    monkeypatch.chdir(tmp_path)
    directory = Path(trial.get_checkpoint_dir())
    assert directory == tmp_path / "checkpoint" and directory.is_dir()
    (directory / "f").write_text("kept")
    trial.save_checkpoint(3)
    assert (directory / "f").read_text() == "kept"
    assert "checkpoint at step 3: standalone mode keeps the files" in capsys.readouterr().err
    assert trial.checkpoint_step() is None
    monkeypatch.setenv(trial.ENV_CHECKPOINT_STEP, "7")
    assert trial.checkpoint_step() == 7
    with pytest.raises(ValueError, match="0 or more"):
        trial.save_checkpoint(-1)
    with pytest.raises(TypeError):
        trial.save_checkpoint(1.5)  # type: ignore[arg-type]


def test_outside_an_agent_a_save_says_how_to_run_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (trial.ENV_STANDALONE, trial.ENV_TRIAL_ID):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(trial.TrialSdkError, match="TRIALKEEPER_STANDALONE=1"):
        trial.save_checkpoint(1)
    with pytest.raises(trial.TrialSdkError, match="TRIALKEEPER_STANDALONE=1"):
        trial.get_checkpoint_dir()


# ---- the session's side -----------------------------------------------------------------------


def test_the_wire_numbers_chunks_reads_them_when_sent_and_answers_saves_by_ack_or_refusal(tmp_path: Path) -> None:
    from trialkeeper.agent.checkpoint_link import CheckpointWire, with_file_data
    from trialkeeper.protos.v1 import coordinator_pb2 as pb

    files = {"a/empty": b"", "big": bytes(range(256)) * 4097, "small": b"xyz"}  # big: 1 MiB and 256 bytes
    _tree(tmp_path, files)

    async def body() -> None:
        journal: list[pb.AgentMessage] = []
        ranges: dict[int, tuple[Path, int]] = {}
        woken: list[int] = []

        def enqueue(msg: pb.AgentMessage) -> None:
            msg.seq = len(journal) + 1
            journal.append(msg)

        wire = CheckpointWire(enqueue, ranges, lambda: woken.append(1))
        wire.upload("t1", 7, tmp_path, _entries(files))
        sent = [with_file_data(m, ranges) for m in journal]
        assert all(not m.checkpoint_chunk.data for m in journal)  # the journal holds no bytes
        chunks = [(m.checkpoint_chunk.path, m.checkpoint_chunk.offset, len(m.checkpoint_chunk.data),
                   m.checkpoint_chunk.last) for m in sent]
        assert chunks == [("a/empty", 0, 0, False), ("big", 0, cf.CHUNK_BYTES, False),
                          ("big", cf.CHUNK_BYTES, 256, False), ("small", 0, 3, True)]
        assert b"".join(m.checkpoint_chunk.data for m in sent if m.checkpoint_chunk.path == "big") == files["big"]
        manifest = cf.make_manifest(tmp_path)
        recorded = wire.saved(SavedCheckpoint("t1", 7, 2, manifest, "", 1.0))
        refused = wire.saved(SavedCheckpoint("t1", 8, 3, manifest, "", 2.0))
        saved = journal[-2].checkpoint_saved
        assert (saved.step, saved.metric_index, saved.digest, saved.size_bytes) == (
            7, 2, manifest.digest, manifest.size_bytes)
        assert [(f.path, f.size) for f in saved.files] == [(f.path, f.size) for f in manifest.files]
        wire.acked(journal[-2].seq)
        assert recorded.done() and recorded.result() is None and not refused.done()
        wire.refused("t1", 8, "no room")
        wire.acked(journal[-1].seq)
        assert refused.result() == "no room"
        wire.fetch("t2", 3, "big", 4096)
        assert woken and [m.fetch_checkpoint.offset for m in wire.take_once()] == [4096]
        wire.fetch("t2", 3, "big", 8192)
        wire.new_stream()  # asked again by the keeper on the new stream, not twice
        assert wire.take_once() == []

    run_async(body)


def test_what_an_ended_trial_left_is_saved_after_its_own_saves_and_nothing_is_saved_for_nothing(
    tmp_path: Path,
) -> None:
    # NNI's PBT trials save by leaving their files in save_checkpoint_dir as they exit.
    link = Link()

    async def body() -> None:
        keeper = _keeper(tmp_path, link)
        env = await keeper.open_trial("t1", 1, None)
        live = Path(env[trial.ENV_CHECKPOINT_DIR])
        assert await keeper.save_left("t1", 2, 1) == ""  # an empty directory: nothing to save
        assert link.saved == []
        _tree(live, FILES)
        assert (await _save(keeper, "t1", 5))["ok"]
        _tree(live, FILES)
        assert await keeper.save_left("t1", 2, 4) == ""  # after its own step 5
        assert [(s.step, s.metric_index) for s in link.saved] == [(5, 0), (6, 4)]
        assert (tmp_path / "agent" / CACHE_DIR / "t1" / "6" / "model.pt").is_file()
        refusing = _keeper(tmp_path / "refused", Link(lambda s: "no room"))
        env = await refusing.open_trial("t2", 1, None)
        _tree(Path(env[trial.ENV_CHECKPOINT_DIR]), FILES)
        assert "the coordinator refused it: no room" in await refusing.save_left("t2", 0, 1)
        keeper.close_trial("t1")
        refusing.close_trial("t2")
        await keeper.close()
        await refusing.close()

    run_async(body)
