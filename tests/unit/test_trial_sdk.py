"""The trial SDK: metric checks, standalone mode, errors outside an agent, cheap import."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from trialkeeper.agent import trial
from trialkeeper.agent.trial import TrialSdkError, check_metric

SDK_ENV = [
    "TRIALKEEPER_TRIAL_ID", "TRIALKEEPER_SEQUENCE_ID", "TRIALKEEPER_EXPERIMENT_ID",
    "TRIALKEEPER_PARAMETER_FILE", "TRIALKEEPER_OUTPUT_DIR", "TRIALKEEPER_SOCKET",
    "TRIALKEEPER_STANDALONE", "TRIALKEEPER_PARAMETERS",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SDK_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", [0, 1, -2, 0.5, 1e300, {"default": 1.0}, {"default": 3, "loss": 0.1, "epoch": 2}])
def test_valid_metrics(value: object) -> None:
    assert check_metric(value) is None


@pytest.mark.parametrize(
    "value,words",
    [
        ("abc", "got str"),
        (None, "got NoneType"),
        (True, "got bool"),
        ([1.0], "got list"),
        ({"x": 1}, "'default' key"),
        ({"default": "1"}, "'default' must be a number, got str"),
        ({"default": False}, "'default' must be a number, got bool"),
        (math.nan, "finite"),
        (math.inf, "finite"),
        (-math.inf, "finite"),
        ({"default": math.nan}, "finite"),
        ({"default": 1.0, "extra": "text"}, "'extra' must be a number, got str (a dict metric holds numbers only)"),
        ({"default": 1.0, "loss": math.inf}, "'loss' must be a finite number"),
        ({"default": 1.0, "nested": {"a": 1}}, "'nested' must be a number, got dict"),
    ],
)
def test_invalid_metrics(value: object, words: str) -> None:
    problem = check_metric(value)
    assert problem is not None and words in problem, problem


def test_outside_an_agent_raises_a_helpful_error() -> None:
    with pytest.raises(TrialSdkError) as info:
        trial.get_next_parameter()
    message = str(info.value)
    assert "TRIALKEEPER_TRIAL_ID" in message and "TRIALKEEPER_STANDALONE=1" in message
    with pytest.raises(TrialSdkError, match="not running under a trialkeeper agent"):
        trial.report_intermediate_result(1.0)
    with pytest.raises(TrialSdkError):
        trial.report_final_result(1.0)
    with pytest.raises(TrialSdkError):
        trial.get_trial_id()


def test_invalid_value_is_refused_before_anything_else(capsys: pytest.CaptureFixture[str]) -> None:
    # Even outside an agent an invalid value is refused (False), not an exception.
    assert trial.report_intermediate_result("abc") is False
    assert trial.report_final_result({"x": 1}) is False
    err = capsys.readouterr().err
    assert "intermediate result refused" in err and "final result refused" in err


def test_standalone_mode(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRIALKEEPER_STANDALONE", "1")
    assert trial.get_next_parameter() == {}
    monkeypatch.setenv("TRIALKEEPER_PARAMETERS", '{"lr": 0.1, "layers": 3}')
    assert trial.get_next_parameter() == {"lr": 0.1, "layers": 3}
    assert trial.get_trial_id() == "STANDALONE"
    assert trial.get_experiment_id() == "STANDALONE"
    assert trial.get_sequence_id() == 0
    assert trial.report_intermediate_result(0.5) is True
    assert trial.report_final_result({"default": 0.9, "loss": 0.1}) is True
    assert trial.report_final_result(math.nan) is False
    err = capsys.readouterr().err
    assert "intermediate result: 0.5" in err
    assert 'final result: {"default": 0.9, "loss": 0.1}' in err
    assert "final result refused" in err


@pytest.mark.parametrize("flag", ["", "0", "false"])
def test_standalone_off_values(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    monkeypatch.setenv("TRIALKEEPER_STANDALONE", flag)
    with pytest.raises(TrialSdkError):
        trial.get_next_parameter()


def test_under_an_agent_reads_parameters_and_sends_datagrams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = tmp_path / "parameter.json"
    params.write_text(json.dumps({"x": 2}))
    sock_path = tmp_path / "a.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(sock_path))
    server.settimeout(5.0)
    try:
        monkeypatch.setenv("TRIALKEEPER_TRIAL_ID", "t1")
        monkeypatch.setenv("TRIALKEEPER_SEQUENCE_ID", "7")
        monkeypatch.setenv("TRIALKEEPER_PARAMETER_FILE", str(params))
        monkeypatch.setenv("TRIALKEEPER_SOCKET", str(sock_path))
        monkeypatch.setattr(trial, "_channel", trial._Channel())
        assert trial.get_next_parameter() == {"x": 2}
        assert trial.get_trial_id() == "t1" and trial.get_sequence_id() == 7
        assert trial.report_intermediate_result(1.5) is True
        assert trial.report_final_result({"default": 2, "acc": 0.9}) is True
        first = json.loads(server.recv(65536))
        second = json.loads(server.recv(65536))
        assert first == {"trial": "t1", "kind": "intermediate", "value": 1.5}
        assert second == {"trial": "t1", "kind": "final", "value": {"default": 2, "acc": 0.9}}
        # A value too large for one datagram is refused, not truncated.
        assert trial.report_final_result({"default": 1, **{f"k{i}": i for i in range(7000)}}) is False
    finally:
        server.close()


def test_parameter_file_that_is_not_an_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = tmp_path / "parameter.json"
    params.write_text("[1, 2]")
    monkeypatch.setenv("TRIALKEEPER_TRIAL_ID", "t1")
    monkeypatch.setenv("TRIALKEEPER_PARAMETER_FILE", str(params))
    with pytest.raises(TrialSdkError, match="JSON object"):
        trial.get_next_parameter()
    monkeypatch.delenv("TRIALKEEPER_PARAMETER_FILE")
    with pytest.raises(TrialSdkError, match="TRIALKEEPER_PARAMETER_FILE"):
        trial.get_next_parameter()


def test_importing_the_sdk_does_not_import_grpc() -> None:
    code = (
        "import sys, trialkeeper.agent.trial; "
        "heavy = sorted(m for m in ('grpc', 'google.protobuf', 'psutil') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIALKEEPER_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr


class _Writes:
    """A stderr that keeps each write() call apart, as an unbuffered stream does."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_refusals_are_written_as_whole_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    # The agent appends its own notes to the trial's stderr file: a refusal written as text
    # then newline (print() under PYTHONUNBUFFERED) could have a note land mid-line.
    writes = _Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    monkeypatch.setenv("TRIALKEEPER_STANDALONE", "1")
    assert trial.report_intermediate_result(math.nan) is False
    assert trial.report_final_result(2.0) is True
    assert len(writes.calls) == 2, writes.calls
    assert all(c.startswith("trialkeeper: ") and c.endswith("\n") and c.count("\n") == 1 for c in writes.calls), (
        writes.calls
    )


class _Clock:
    """time.monotonic for the SDK, moved by the test: when reports come is what decides
    whether they share a datagram."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def agent_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    sock_path = tmp_path / "a.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(sock_path))
    server.setblocking(False)
    monkeypatch.setenv("TRIALKEEPER_TRIAL_ID", "t1")
    monkeypatch.setenv("TRIALKEEPER_SOCKET", str(sock_path))
    monkeypatch.setattr(trial, "_channel", trial._Channel())
    clock = _Clock()
    monkeypatch.setattr(trial, "time", clock)
    yield server, clock
    server.close()


def _queued(server: socket.socket) -> list[dict[str, object]]:
    """The datagrams already in the agent's queue (sent datagrams are there once send returns)."""
    out = []
    while True:
        try:
            out.append(json.loads(server.recv(65536)))
        except BlockingIOError:
            return out


def test_a_trial_reporting_slowly_sends_each_result_at_once(agent_socket) -> None:  # type: ignore[no-untyped-def]
    server, clock = agent_socket
    for i in range(5):
        clock.now += 2 * trial.BATCH_LINGER_S  # the last datagram went out this long ago
        assert trial.report_intermediate_result(float(i))
        assert _queued(server) == [{"trial": "t1", "kind": "intermediate", "value": float(i)}]


def test_a_tight_loop_shares_datagrams_in_order_and_a_final_result_sends_what_waits(agent_socket) -> None:  # type: ignore[no-untyped-def]
    server, clock = agent_socket
    for i in range(1000):
        assert trial.report_intermediate_result(float(i) if i % 3 else {"default": i, "loss": 0.5})
    # The first goes at once; the rest wait for the ones behind them.
    assert _queued(server) == [{"trial": "t1", "kind": "intermediate", "value": {"default": 0, "loss": 0.5}}]
    clock.now += 2 * trial.BATCH_LINGER_S  # the batch is due: the next report sends it with itself
    assert trial.report_intermediate_result(1000.0)
    batch = _queued(server)
    assert len(batch) == 1 and batch[0]["kind"] == "intermediate" and batch[0]["trial"] == "t1"
    values = batch[0]["values"]
    assert isinstance(values, list) and len(values) == 1000
    assert values[:3] == [1.0, 2.0, {"default": 3, "loss": 0.5}] and values[-1] == 1000.0
    for i in range(1001, 1010):
        assert trial.report_intermediate_result(float(i))
    assert _queued(server) == []
    assert trial.report_final_result(0.75)
    sent = _queued(server)
    assert sent == [
        {"trial": "t1", "kind": "intermediate", "values": [float(i) for i in range(1001, 1010)]},
        {"trial": "t1", "kind": "final", "value": 0.75},
    ]


def test_a_batch_never_outgrows_a_datagram(agent_socket) -> None:  # type: ignore[no-untyped-def]
    server, _ = agent_socket
    server.settimeout(10.0)
    sent: list[dict[str, object]] = []

    def read() -> None:  # as the agent does, so that the socket's queue never fills
        while sum(len(d["values"]) if "values" in d else 1 for d in sent) < 20:  # type: ignore[arg-type]
            sent.append(json.loads(server.recv(65536)))

    reader = threading.Thread(target=read)
    reader.start()
    big = {"default": 1.0, **{f"k{j}": j for j in range(1500)}}  # about 17 KB as JSON
    for _ in range(20):
        assert trial.report_intermediate_result(big)
    trial.flush()
    reader.join(30.0)
    assert not reader.is_alive()
    sizes = [len(json.dumps(d, separators=(",", ":"))) for d in sent]
    assert max(sizes) <= trial.MAX_REPORT_BYTES, sizes
    # The first at once, then as many as fit in a datagram: three.
    assert [len(d["values"]) if "values" in d else 1 for d in sent] == [1, 3, 3, 3, 3, 3, 3, 1]


def test_what_waits_is_sent_by_the_helper_thread_when_the_trial_stops_reporting(agent_socket) -> None:  # type: ignore[no-untyped-def]
    server, clock = agent_socket
    for i in range(3):
        trial.report_intermediate_result(float(i))
    assert len(_queued(server)) == 1
    clock.now += 2 * trial.BATCH_LINGER_S  # due now; the thread wakes within the linger and sends
    server.settimeout(10.0)
    assert json.loads(server.recv(65536)) == {"trial": "t1", "kind": "intermediate", "values": [1.0, 2.0]}


def test_a_save_whose_agent_dies_before_answering_raises_instead_of_waiting(tmp_path: Path) -> None:
    # The agent's side of the socket, real: it takes the save request, then its process is gone
    # (its socket closed) without an answer, as an agent killed mid-save is.
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent_path = tmp_path / "agent.sock"
    agent.bind(str(agent_path))
    script = (
        "import sys, time\n"
        "from trialkeeper.agent import trial\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    trial.save_checkpoint(1)\n"
        "except trial.CheckpointError as e:\n"
        "    print('raised', round(time.monotonic() - started), e)\n"
    )
    env = {**os.environ, "TRIALKEEPER_TRIAL_ID": "t1", "TRIALKEEPER_SOCKET": str(agent_path),
           "TRIALKEEPER_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "TRIALKEEPER_CHECKPOINT_TIMEOUT": "60"}
    (tmp_path / "ckpt").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        agent.settimeout(30)
        request = json.loads(agent.recv(65536))
        assert request["kind"] == "checkpoint" and request["step"] == 1
    finally:
        agent.close()
    out, _ = proc.communicate(timeout=30)
    assert out.startswith("raised") and "the agent went away" in out, out
