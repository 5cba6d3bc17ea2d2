"""The control socket on its own: where it is, who may use it, what it answers, and how a
client hears that no coordinator is there. A small stand-in holds the trials' states; the
real coordinator behind the socket is tested in tests/integration/test_control.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import run_async
from trialkeeper.coordinator.cli import control
from trialkeeper.coordinator.cli.control import ControlError, ControlServer, NoCoordinator, request, socket_path


@dataclass
class _Info:
    status: Any


class _Status:
    def __init__(self, value: str) -> None:
        self.value = value


class Trials:
    """What the control server asks of a coordinator: trial states, and the four actions."""

    experiment_id = "exp1"
    address = "127.0.0.1:50051"

    def __init__(self, **states: str) -> None:
        self.states = dict(states)
        self.calls: list[tuple[str, str]] = []
        self.stopped = asyncio.Event()

    def trial(self, trial_id: str) -> _Info:
        if trial_id not in self.states:
            raise KeyError(trial_id)
        return _Info(_Status(self.states[trial_id]))

    async def pause(self, trial_id: str, *, reason: str) -> None:
        self.calls.append(("pause", trial_id))

    async def resume_trial(self, trial_id: str) -> None:
        self.calls.append(("continue", trial_id))

    async def cancel(self, trial_id: str, *, reason: str) -> None:
        if self.states[trial_id] == "RUNNING" and trial_id.startswith("stuck"):
            raise RuntimeError("the coordinator is not running")
        self.calls.append(("cancel", trial_id))


def _serving(exp: Path, trials: Trials, body: Callable[[Path], Any], stop: Any = None) -> Any:
    """Serve ``trials`` on ``exp``'s control socket, run the blocking ``body(exp)`` (the
    client) on a thread, and close the server."""

    async def main() -> Any:
        server = ControlServer(trials, exp, stop=stop)
        await server.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, body, exp)
        finally:
            await server.close()

    return run_async(main)


def test_the_socket_is_in_the_experiment_directory_when_its_path_is_short(tmp_path: Path) -> None:
    exp = tmp_path / "e"
    exp.mkdir()
    assert socket_path(exp) == exp.resolve() / "control.sock"
    link = tmp_path / "link"
    link.symlink_to(exp)
    assert socket_path(link) == socket_path(exp)


def test_a_long_directory_gets_a_private_directory_in_tmp_computed_alike(tmp_path: Path) -> None:
    exp = tmp_path / ("x" * 120)
    exp.mkdir()
    link = tmp_path / "short"
    link.symlink_to(exp)
    path = socket_path(exp)
    assert path == socket_path(link), "client and server find the same place from either name"
    assert path.parent.parent == Path(tempfile.gettempdir())
    assert path.parent.name.startswith(f"trialkeeper-{os.getuid()}-")
    assert len(os.fsencode(path)) <= control.MAX_SOCKET_PATH

    def client(exp: Path) -> dict[str, Any]:
        st = os.lstat(path.parent)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        return request(exp, "pause", ["a"])

    assert _serving(exp, Trials(a="RUNNING"), client) == {"ok": True, "done": ["a"]}
    assert not path.parent.exists(), "the private directory goes with the socket"


def test_a_temporary_directory_that_is_not_private_is_refused(tmp_path: Path) -> None:
    exp = tmp_path / ("y" * 120)
    exp.mkdir()
    path = socket_path(exp)
    path.parent.mkdir(mode=0o755)
    os.chmod(path.parent, 0o755)  # whatever the umask
    try:
        with pytest.raises(ControlError, match="not a private directory"):
            ControlServer(Trials(), exp).bind()
        with pytest.raises(ControlError, match="not a private directory"):
            request(exp, "ping")
    finally:
        path.parent.rmdir()


def test_requests_act_on_trials_in_a_state_they_apply_to(tmp_path: Path) -> None:
    trials = Trials(a="RUNNING", b="WAITING", p="PAUSED", d="SUCCEEDED")

    def client(exp: Path) -> list[dict[str, Any]]:
        assert stat.S_IMODE(os.lstat(exp / "control.sock").st_mode) == 0o600
        return [
            request(exp, "pause", ["a", "b", "a"]),
            request(exp, "continue", ["p"]),
            request(exp, "cancel", ["p", "b"]),
            request(exp, "ping"),
        ]

    answers = _serving(tmp_path, trials, client)
    assert answers[:3] == [
        {"ok": True, "done": ["a", "b"]}, {"ok": True, "done": ["p"]}, {"ok": True, "done": ["p", "b"]}
    ]
    assert answers[3] == {"ok": True, "experiment": "exp1", "address": "127.0.0.1:50051"}
    assert trials.calls == [("pause", "a"), ("pause", "b"), ("continue", "p"), ("cancel", "p"), ("cancel", "b")]
    assert not (tmp_path / "control.sock").exists(), "closing removes the socket"


def test_a_bad_trial_changes_nothing_and_is_named_with_the_states_that_apply(tmp_path: Path) -> None:
    trials = Trials(a="RUNNING", d="SUCCEEDED", p="PAUSED")

    def client(exp: Path) -> list[dict[str, Any]]:
        return [request(exp, "pause", ["a", "d", "zz"]), request(exp, "continue", ["a"])]

    paused, continued = _serving(tmp_path, trials, client)
    assert paused["ok"] is False and "done" not in paused
    assert [e["trial"] for e in paused["errors"]] == ["d", "zz"]
    assert paused["errors"][0]["error"] == "trial d is SUCCEEDED: pause applies to a trial that is WAITING or RUNNING"
    assert paused["errors"][1]["error"] == "no trial 'zz' in experiment exp1"
    assert continued["error"] == "trial a is RUNNING: continue applies to a trial that is PAUSED"
    assert trials.calls == [], "nothing was done"


def test_a_refusal_of_the_coordinator_is_told_per_trial(tmp_path: Path) -> None:
    trials = Trials(a="RUNNING", stuck="RUNNING")
    answer = _serving(tmp_path, trials, lambda exp: request(exp, "cancel", ["a", "stuck"]))
    assert answer["ok"] is False and answer["done"] == ["a"]
    assert answer["error"] == "cannot cancel trial stuck: the coordinator is not running"


def test_stop_runs_the_stop_once_and_answers_at_once(tmp_path: Path) -> None:
    trials = Trials(a="RUNNING")
    stops: list[str] = []
    release = asyncio.Event()

    async def stop() -> None:
        stops.append("stop")
        await release.wait()  # a stop takes its time: the answer does not wait for it

    def client(exp: Path) -> list[dict[str, Any]]:
        try:
            return [request(exp, "stop"), request(exp, "stop")]
        finally:
            loop.call_soon_threadsafe(release.set)

    async def main() -> list[dict[str, Any]]:
        server = ControlServer(trials, tmp_path, stop=stop)
        await server.start()
        try:
            return await loop.run_in_executor(None, client, tmp_path)
        finally:
            await server.close()

    loop = asyncio.new_event_loop()
    try:
        answers = loop.run_until_complete(asyncio.wait_for(main(), 30))
    finally:
        loop.close()
    assert answers == [{"ok": True, "stopping": True}] * 2
    assert stops == ["stop"]


def _raw(path: Path, data: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(data)
        answer = b""
        while not answer.endswith(b"\n"):
            part = s.recv(65536)
            if not part:
                break
            answer += part
    return json.loads(answer)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"not json\n", "a request is one JSON object on one line"),
        (b"[1, 2]\n", "a request is one JSON object on one line"),
        (
            b'{"op": "explode"}\n',
            "op: 'explode' is not one of pause, continue, cancel, stop, ping, update, submit, rerun",
        ),
        (b'{"op": "pause"}\n', "trials: a list of 1 to 10000 trial ids is needed"),
        (b'{"op": "pause", "trials": []}\n', "trials: a list of 1 to 10000 trial ids is needed"),
        (b'{"op": "pause", "trials": [3]}\n', "trials: a list of 1 to 10000 trial ids is needed"),
    ],
)
def test_malformed_requests_are_answered_with_what_is_wrong(tmp_path: Path, line: bytes, error: str) -> None:
    answer = _serving(tmp_path, Trials(a="RUNNING"), lambda exp: _raw(socket_path(exp), line))
    assert answer == {"ok": False, "error": error}


def test_no_socket_or_a_dead_one_says_no_coordinator_runs(tmp_path: Path) -> None:
    message = f"no coordinator is running for {tmp_path} (it ended or crashed: trialkeeper resume {tmp_path})"
    with pytest.raises(NoCoordinator) as missing:
        request(tmp_path, "pause", ["a"])
    assert str(missing.value) == message
    # What a killed coordinator leaves: the socket file, with no one listening.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(socket_path(tmp_path)))
    dead.close()
    with pytest.raises(NoCoordinator) as refused:
        request(tmp_path, "stop", shown="exp1")
    assert str(refused.value) == "no coordinator is running for exp1 (it ended or crashed: trialkeeper resume exp1)"
    assert not control.alive(tmp_path)
    # The next coordinator takes the place of the dead one's socket.
    assert _serving(tmp_path, Trials(a="RUNNING"), lambda exp: control.alive(exp)) is True


def test_a_live_socket_is_not_taken_and_a_silent_one_times_out(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(str(socket_path(tmp_path)))
        silent.listen(1)  # connections are queued, never answered
        with pytest.raises(ControlError, match="another coordinator answers"):
            ControlServer(Trials(), tmp_path).bind()
        with pytest.raises(ControlError, match="did not answer within 0.5 s"):
            request(tmp_path, "ping", timeout=0.5)
        assert control.alive(tmp_path, timeout=0.5), "busy is not gone"


def test_something_else_at_the_socket_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "control.sock").write_text("a file")
    with pytest.raises(ControlError, match="exists and is not a socket"):
        ControlServer(Trials(), tmp_path).bind()
