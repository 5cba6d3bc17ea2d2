"""The coordinator's bulk port for uploads' bytes and the agent's sender, over real loopback
sockets: files land whole in the trial's incoming checkpoint; a wrong token, an unsafe path, a
trial not placed there and a file over the limit are refused, and the sender says why."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from trialkeeper.agent.bulk import send_files
from trialkeeper.agent.checkpoint_files import FileEntry
from trialkeeper.coordinator.engine.checkpoints import CheckpointFile
from trialkeeper.coordinator.store.checkpointfiles import CheckpointFiles
from trialkeeper.coordinator.transport.bulk import BulkReceiver

PLACED = {("env-1", "t1")}


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    files = CheckpointFiles(tmp_path / "root", "exp")
    receiver = BulkReceiver("secret", files.incoming_dir, lambda env, trial: (env, trial) in PLACED, 1 << 30)
    yield receiver.start("127.0.0.1")
    receiver.close()


def _files(tmp_path: Path) -> tuple[Path, list[FileEntry]]:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "big.bin").write_bytes(bytes(range(256)) * 40_000)
    (src / "sub" / "small").write_bytes(b"abc")
    (src / "empty").write_bytes(b"")
    return src, [FileEntry("big.bin", 10_240_000), FileEntry("empty", 0), FileEntry("sub/small", 3)]


def test_files_go_whole_into_the_trials_incoming_checkpoint(tmp_path: Path, port: int) -> None:
    src, files = _files(tmp_path)
    sent, why = send_files(("127.0.0.1", port), "secret", "env-1", "t1", 7, src, files)
    assert (sent, why) == ({"big.bin", "empty", "sub/small"}, "")
    incoming = tmp_path / "root" / "t1" / ".incoming-7"
    for f in files:
        assert (incoming / f.path).read_bytes() == (src / f.path).read_bytes()
    # The stream's check finds it whole, as for pieces that came by the stream.
    manifest = tuple(CheckpointFile(f.path, f.size) for f in files)
    assert CheckpointFiles(tmp_path / "root", "exp").finish("t1", 7, manifest) == ""
    assert (tmp_path / "root" / "t1" / "7" / "big.bin").stat().st_size == 10_240_000


@pytest.mark.parametrize(("header", "why"), [
    ({"token": "wrong"}, "wrong experiment token"),
    ({"env": "env-2"}, "trial t1 is not placed on env-2"),
    ({"trial": "../t1"}, "is not a plain relative path"),
    ({"path": "../../escape"}, "is not a plain relative path"),
    ({"offset": -1}, "a negative step, offset or size"),
    ({"step": "x"}, "an unreadable header"),
])
def test_what_the_port_refuses_it_says_and_writes_nothing(
    tmp_path: Path, port: int, header: dict[str, object], why: str
) -> None:
    h = {"token": "secret", "env": "env-1", "trial": "t1", "step": 1, "path": "a.bin", "offset": 0, "size": 1, **header}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(json.dumps(h).encode() + b"\n")
        conn.settimeout(10)
        answer = conn.recv(4096).decode()
    assert answer.startswith("no ") and why in answer, answer
    assert not [p for p in (tmp_path / "root").rglob("*") if p.is_file()] and not (tmp_path / "escape").exists()


def test_a_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path / "root", "exp")
    receiver = BulkReceiver("secret", files.incoming_dir, lambda env, trial: True, 1000)
    try:
        p = receiver.start("127.0.0.1")
        src, entries = _files(tmp_path)
        sent, why = send_files(("127.0.0.1", p), "secret", "env-1", "t1", 1, src, entries)
        assert sent == set() and "maxCheckpointSize (1000 bytes)" in why
    finally:
        receiver.close()


def test_a_port_nobody_listens_on_sends_nothing_and_says_so(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    src, files = _files(tmp_path)
    sent, why = send_files(("127.0.0.1", free), "secret", "env-1", "t1", 1, src, files)
    assert sent == set() and f"bulk port at 127.0.0.1:{free}" in why


def _send(port: int, header: dict[str, object], data: bytes) -> str:
    """Header and bytes in one write (the receiver finds the first bytes behind the header);
    the port's last answer."""
    h = {"token": "secret", "env": "env-1", "trial": "t1", "step": 2, **header}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.settimeout(10)
        conn.sendall(json.dumps(h).encode() + b"\n" + data)
        answers = b""
        while not answers.endswith(b"\n") or answers.count(b"\n") < 2:
            more = conn.recv(4096)
            if not more:
                break
            answers += more
    return answers.decode().strip().splitlines()[-1]


def test_bytes_behind_the_header_and_a_later_offset_land_in_place(tmp_path: Path, port: int) -> None:
    big = bytes(range(256)) * 8192  # 2 MiB: more than one pipe's worth after the first bytes
    assert _send(port, {"path": "a.bin", "offset": 0, "size": 4}, b"abcd") == "done 4"
    assert _send(port, {"path": "a.bin", "offset": 4, "size": len(big)}, big) == f"done {len(big)}"
    got = (CheckpointFiles(tmp_path / "root", "exp").incoming_dir("t1", 2) / "a.bin").read_bytes()
    assert got == b"abcd" + big


def test_a_sender_gone_mid_file_leaves_a_file_the_save_cannot_be_recorded_from(tmp_path: Path, port: int) -> None:
    files = CheckpointFiles(tmp_path / "root", "exp")
    target = files.incoming_dir("t1", 2) / "a.bin"
    h = {"token": "secret", "env": "env-1", "trial": "t1", "step": 2, "path": "a.bin", "offset": 0, "size": 1 << 20}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.settimeout(10)
        conn.sendall(json.dumps(h).encode() + b"\n")
        assert conn.recv(16) == b"ok\n"
        conn.sendall(b"x" * 1000)
    wait_until(lambda: target.exists() and target.stat().st_size == 1000, timeout=30,
               message="the receiver did not write what came before the sender went away")
    problem = files.finish("t1", 2, (CheckpointFile("a.bin", 1 << 20),))
    assert problem == f"the coordinator did not get all of it: a.bin has 1000 bytes, not {1 << 20}"


def test_an_empty_files_two_answers_in_one_packet_are_read_as_two(tmp_path: Path) -> None:
    """For an empty file the coordinator answers "ok" and "done 0" at once: read together,
    they are still two answers (they were once read as one, and the upload stopped there)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)

    def answer_both_at_once() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            header = b""
            while not header.endswith(b"\n"):
                header += conn.recv(4096)
            conn.sendall(b"ok\ndone 0\n")

    serving = threading.Thread(target=answer_both_at_once, daemon=True)
    serving.start()
    try:
        (tmp_path / "empty").write_bytes(b"")
        sent, why = send_files(server.getsockname()[:2], "secret", "env-1", "t1", 1, tmp_path, [FileEntry("empty", 0)])
        assert (sent, why) == ({"empty"}, "")
    finally:
        serving.join(10)
        server.close()
