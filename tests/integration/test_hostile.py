"""Hostile and broken input: the coordinator refuses it clearly and keeps serving.

Raw bytes go to the Session method through a generic client (identity serializers), so
nothing on the client side checks them. After every attack a normal trial, run by a real
agent process, still completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Iterable
from pathlib import Path

import grpc
from conftest import async_wait_until, build_config, environment, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.transport.server import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    TOKEN_METADATA_KEY,
)
from trialkeeper.protos.v1 import coordinator_pb2 as pb

WAIT_S = 30.0
RPC_TIMEOUT_S = 20.0
METHOD = "/trialkeeper.protos.v1.Coordinator/Session"

TRIAL = """
from trialkeeper.agent import trial

x = trial.get_next_parameter().get("x", 0)
trial.report_intermediate_result(x)
trial.report_final_result(x + 1)
"""


def _token(c: Coordinator) -> str:
    return (c.experiment_dir / ".token").read_text()


def _register(env_id: str, instance: str = "raw", **fields: object) -> pb.AgentMessage:
    return pb.AgentMessage(
        register=pb.Register(
            protocol_version=PROTOCOL_VERSION,
            environment_id=env_id,
            agent_instance_id=instance,
            pid=os.getpid(),
            **fields,
        )
    )


def _metric(trial_id: str, index: int, value: float, kind: int = pb.METRIC_KIND_INTERMEDIATE) -> pb.Metric:
    return pb.Metric(
        trial_id=trial_id, kind=kind, index=index, value=value, value_json=repr(value), reported_at=time.time()
    )


class RawSession:
    """One Session stream from a generic client: bytes in, bytes out, nothing checked."""

    def __init__(self, address: str, token: str) -> None:
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        multi = self._channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
        self.call = multi(metadata=((TOKEN_METADATA_KEY, token),), timeout=RPC_TIMEOUT_S)

    async def send(self, *frames: bytes | pb.AgentMessage) -> None:
        for f in frames:
            await self.call.write(f if isinstance(f, bytes) else f.SerializeToString())

    async def read(self) -> pb.CoordinatorMessage | None:
        raw = await self.call.read()
        return None if raw is grpc.aio.EOF else pb.CoordinatorMessage.FromString(raw)

    async def outcome(self) -> tuple[grpc.StatusCode, str]:
        """End our side and read until the stream ends; returns its status."""
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await self.call.done_writing()
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await self.call.read() is not grpc.aio.EOF:
                pass
        return await self.call.code(), (await self.call.details()) or ""

    async def close(self) -> None:
        self.call.cancel()
        await self._channel.close()


async def _attack(c: Coordinator, *frames: bytes | pb.AgentMessage) -> tuple[grpc.StatusCode, str]:
    raw = RawSession(c.address, _token(c))
    try:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await raw.send(*frames)  # the server may end the stream before it has all of them
        return await raw.outcome()
    finally:
        await raw.close()


async def _still_serving(c: Coordinator, x: int) -> None:
    """The proof after each attack: a normal trial on a real agent runs to its end."""
    info = await (await c.submit({"x": x})).wait(WAIT_S)
    assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, info.stderr_tail)
    assert info.final_metric == x + 1


def _garbage(seed: int, count: int) -> Iterable[bytes]:
    rng = random.Random(seed)
    for _ in range(count):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        try:
            pb.AgentMessage.FromString(data)
        except Exception:  # noqa: BLE001 - we want exactly the bytes that do not parse
            yield data


def test_garbage_truncated_and_oversized_messages_get_clear_errors(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    config = build_config(tmp_path, trialConcurrency=1)
    register = _register("truncated", instance="x" * 40).SerializeToString()
    batch = pb.AgentMessage(seq=1, metrics=pb.MetricBatch(metrics=[_metric("t" * 30, 0, 1.0)])).SerializeToString()

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await _still_serving(c, 0)
            bad = list(_garbage(seed=5, count=40))
            assert len(bad) >= 20
            # Before Register: whatever does not parse ends the stream, nothing is created.
            for data in bad:
                code, details = await _attack(c, data)
                assert code is grpc.StatusCode.INVALID_ARGUMENT and "could not be parsed" in details, (
                    data,
                    code,
                    details,
                )
            attacks: list[tuple[str, list[bytes | pb.AgentMessage], grpc.StatusCode, str]] = [
                ("truncated Register", [register[:-5]], grpc.StatusCode.INVALID_ARGUMENT, "could not be parsed"),
                ("empty message", [b""], grpc.StatusCode.INVALID_ARGUMENT, "must be Register"),
                (
                    "heartbeat first",
                    [pb.AgentMessage(heartbeat=pb.Heartbeat())],
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "must be Register",
                ),
                ("slash in id", [_register("../../etc")], grpc.StatusCode.INVALID_ARGUMENT, "environment_id"),
                ("huge id", [_register("e" * 5000)], grpc.StatusCode.INVALID_ARGUMENT, "environment_id"),
                ("control char id", [_register("a\nb")], grpc.StatusCode.INVALID_ARGUMENT, "environment_id"),
                (
                    "oversized first",
                    [b"\x0a" * (MAX_MESSAGE_BYTES + 1)],
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "larger than max",
                ),
                # After a valid Register: the same, on an open session.
                (
                    "garbage later",
                    [_register("h-garbage"), bad[0]],
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "could not be parsed",
                ),
                (
                    "truncated later",
                    [_register("h-trunc"), batch[:-4]],
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "could not be parsed",
                ),
                (
                    "seq out of range",
                    [_register("h-seq"), pb.AgentMessage(seq=2**64 - 1, trial_started=pb.TrialStarted(trial_id="x"))],
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "out of range",
                ),
                (
                    "number beyond SQLite in Register",
                    [_register("h-num", gpus=[pb.GpuInfo(uuid="GPU-x", memory_total_bytes=2**64 - 1)])],
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "gpus[0].memory_total_bytes is out of range",
                ),
                (
                    "number beyond SQLite in Heartbeat",
                    [
                        _register("h-hb"),
                        pb.AgentMessage(heartbeat=pb.Heartbeat(gpus=[pb.GpuSample(uuid="x", memory_used_bytes=2**63)])),
                    ],
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "out of range",
                ),
                (
                    "oversized later",
                    [_register("h-big"), b"\x0a" * (MAX_MESSAGE_BYTES + 1)],
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "larger than max",
                ),
            ]
            for x, (name, frames, want, words) in enumerate(attacks, start=1):
                code, details = await _attack(c, *frames)
                assert code is want and words in details, (name, code, details)
                await _still_serving(c, x)
            ids = {e.id for e in c.environments()}
            assert not ids & {"truncated", "../../etc", "e" * 5000, "a\nb"}, ids
            # Unknown fields and unknown message kinds are ignored, not fatal.
            raw = RawSession(c.address, _token(c))
            try:
                await raw.send(
                    _register("h-unknown"),
                    b"\xf8\x06\x01",
                    pb.AgentMessage(seq=1),
                    pb.AgentMessage(heartbeat=pb.Heartbeat()),
                )
                welcome = await raw.read()
                assert welcome is not None and welcome.HasField("welcome")
                assert await raw.outcome() == (grpc.StatusCode.OK, "")
            finally:
                await raw.close()
            await _still_serving(c, 99)

    run_async(body)


BLOCKER = """
import os, sys, time
from trialkeeper.agent import trial

release = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.02)  # the trial polls for the test's go-ahead
trial.report_final_result(1.0)
"""


def test_unknown_trials_other_sessions_and_replays_are_ignored(tmp_path: Path) -> None:
    """A raw client that plays agent: it may report only for the trial placed on it, and
    only once per sequence number; whatever it says about other trials is ignored."""
    write_script(tmp_path, "trial.py", TRIAL)
    write_script(tmp_path, "blocker.py", BLOCKER)
    release = tmp_path / "release"
    config = build_config(tmp_path, trialConcurrency=2, trainingService={"environmentCount": 1})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.store is not None
            blocker = await c.submit({}, command=f"python blocker.py {release}")
            await async_wait_until(lambda: blocker.info.status is TrialStatus.RUNNING, WAIT_S)
            real_env = blocker.info.environment_id
            assert real_env

            # Taking over the real agent's session is refused.
            code, details = await _attack(c, _register(real_env, instance="impostor"))
            assert code is grpc.StatusCode.FAILED_PRECONDITION and "already has a connected agent" in details, (
                code,
                details,
            )

            fake = RawSession(c.address, _token(c))
            received: list[pb.CoordinatorMessage] = []

            async def read_all() -> None:
                while (m := await fake.read()) is not None:
                    received.append(m)

            await fake.send(_register("fake", instance="fake-1"))
            reader = asyncio.create_task(read_all())
            try:
                await async_wait_until(lambda: any(m.HasField("welcome") for m in received), WAIT_S)
                mine = await c.submit({"x": 5})  # the real agent is full: it goes to the fake
                await async_wait_until(lambda: any(m.HasField("start_trial") for m in received), WAIT_S)
                start = next(m.start_trial for m in received if m.HasField("start_trial"))
                assert start.trial_id == mine.id and mine.info.environment_id == "fake"
                theirs = blocker.id

                script = [
                    pb.AgentMessage(
                        seq=1, trial_started=pb.TrialStarted(trial_id=mine.id, pid=1, started_at=time.time())
                    ),
                    pb.AgentMessage(seq=2, metrics=pb.MetricBatch(metrics=[_metric(mine.id, 0, 1.0)])),
                    pb.AgentMessage(seq=2, metrics=pb.MetricBatch(metrics=[_metric(mine.id, 0, 99.0)])),  # replayed seq
                    pb.AgentMessage(seq=1, trial_started=pb.TrialStarted(trial_id=mine.id, pid=2)),  # older seq
                    pb.AgentMessage(seq=0, metrics=pb.MetricBatch(metrics=[_metric(mine.id, 5, 5.0)])),  # no seq
                    pb.AgentMessage(seq=3, metrics=pb.MetricBatch(metrics=[_metric("no-such-trial", 0, 7.0)])),
                    pb.AgentMessage(seq=4, metrics=pb.MetricBatch(metrics=[_metric(theirs, 0, 666.0)])),
                    pb.AgentMessage(seq=5, trial_ended=pb.TrialEnded(trial_id=theirs, outcome=pb.TRIAL_OUTCOME_FAILED)),
                    pb.AgentMessage(
                        seq=6, log=pb.LogChunk(trial_id=theirs, stream=pb.LOG_STREAM_STDOUT, data=b"pwned")
                    ),
                    pb.AgentMessage(
                        seq=7, trial_ended=pb.TrialEnded(trial_id="no-such-trial", outcome=pb.TRIAL_OUTCOME_SUCCEEDED)
                    ),
                    _register("fake", instance="fake-2"),  # a second Register on an open stream
                    pb.AgentMessage(
                        seq=8, metrics=pb.MetricBatch(metrics=[_metric(mine.id, 1, 2.0, pb.METRIC_KIND_FINAL)])
                    ),
                    pb.AgentMessage(
                        seq=9,
                        trial_ended=pb.TrialEnded(
                            trial_id=mine.id, outcome=pb.TRIAL_OUTCOME_SUCCEEDED, has_exit_code=True, started=True
                        ),
                    ),
                ]
                await fake.send(*script)
                info = await mine.wait(WAIT_S)
                assert info.status is TrialStatus.SUCCEEDED and info.final_metric == 2.0, (info.status, info.reason)
                # Everything replayed once more: acknowledged, stored nothing new.
                await fake.send(*[m for m in script if m.seq])
                # A new message behind the replays: once it is acked, the replays were handled.
                await fake.send(
                    pb.AgentMessage(seq=10, metrics=pb.MetricBatch(metrics=[_metric("no-such-trial", 1, 1.0)]))
                )
                await async_wait_until(lambda: any(m.HasField("ack") and m.ack.seq == 10 for m in received), WAIT_S)
                rows = [(r.index, r.kind, r.value) for r in c.store.metrics(mine.id)]
                assert rows == [(0, "intermediate", 1.0), (1, "final", 2.0)], rows
                assert c.store.metrics(theirs) == []
                assert "no-such-trial" not in {t["id"] for t in c.store.trials()}
                assert blocker.info.status is TrialStatus.RUNNING and blocker.info.environment_id == real_env
            finally:
                await fake.close()
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await reader
            await async_wait_until(lambda: not any(e.id == "fake" and e.connected for e in c.environments()), WAIT_S)

            release.touch()
            done = await blocker.wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED and done.final_metric == 1.0, (done.status, done.reason)
            assert [(r.index, r.value) for r in c.store.metrics(blocker.id)] == [(0, 1.0)]
            stdout = c.experiment_dir / "trials" / blocker.id / "stdout.log"
            assert not stdout.exists() or b"pwned" not in stdout.read_bytes()
            await _still_serving(c, 1)

    run_async(body)


def test_a_flooding_agent_does_not_starve_the_others(tmp_path: Path) -> None:
    """One authenticated client writes as fast as it can and never reads; a real agent
    runs trials meanwhile. Flow control holds the flooder back (it can never get far
    ahead of what the coordinator has handled) and the real agent's trials complete."""
    write_script(tmp_path, "trial.py", TRIAL)
    config = build_config(tmp_path, trialConcurrency=1)
    blob = b"z" * 1024

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await _still_serving(c, 0)
            flooder = RawSession(c.address, _token(c))
            # Draining at once: the coordinator places nothing on it.
            await flooder.send(_register("flood"), pb.AgentMessage(heartbeat=pb.Heartbeat(draining=True)))
            await async_wait_until(
                lambda: any(e.id == "flood" and e.status is EnvStatus.DRAINING for e in c.environments()), WAIT_S
            )
            env = next(e for e in c.environments() if e.id == "flood")
            stats = {"written": 0, "max_bytes_ahead": 0}
            written_bytes = [0]  # after message n, n bytes in all
            stop = asyncio.Event()

            async def flood() -> None:
                seq = 0
                while not stop.is_set():
                    seq += 1
                    ghost = f"ghost-{seq}"
                    if seq % 3 == 0:
                        msg = pb.AgentMessage(heartbeat=pb.Heartbeat(memory_used_bytes=seq, draining=True))
                    elif seq % 3 == 1:
                        msg = pb.AgentMessage(
                            seq=seq, metrics=pb.MetricBatch(metrics=[_metric(ghost, i, i) for i in range(20)])
                        )
                    else:
                        msg = pb.AgentMessage(
                            seq=seq, log=pb.LogChunk(trial_id=ghost, stream=pb.LOG_STREAM_STDOUT, data=blob)
                        )
                    await flooder.send(msg)
                    written_bytes.append(written_bytes[-1] + msg.ByteSize())
                    stats["written"] = seq
                    assert c._engine is not None  # what the coordinator has handled, as it goes
                    ahead = written_bytes[-1] - written_bytes[min(c._engine.envs[env.id].last_seq, seq)]
                    stats["max_bytes_ahead"] = max(stats["max_bytes_ahead"], ahead)

            task = asyncio.create_task(flood())
            try:
                await async_wait_until(lambda: stats["written"] >= 2000 or task.done(), WAIT_S)
                assert not task.done(), task.exception()
                for x in range(1, 4):
                    await _still_serving(c, x)
                assert not task.done(), task.exception()
            finally:
                stop.set()
                with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                    await asyncio.wait_for(task, WAIT_S)
                await flooder.close()
            written = stats["written"]
            assert written >= 2000, stats
            # Backpressure: the flooder is never more than a few flow-control windows (and
            # socket buffers) ahead of what the coordinator has handled, however long it writes.
            assert stats["max_bytes_ahead"] < 32 * 1024 * 1024, stats
            assert c.store is not None and next(r for r in c.store.envs() if r["id"] == env.id)["last_seq"] > 0
            await async_wait_until(lambda: not environment(c, env.id).connected, WAIT_S)
            await _still_serving(c, 10)

    run_async(body)


METRICS_TRIAL = """
import json, os, socket, sys, time
from trialkeeper.agent import trial

me = os.environ["TRIALKEEPER_TRIAL_ID"]
path = os.environ["TRIALKEEPER_SOCKET"]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

def raw(data):
    try:
        sock.sendto(data, path)
    except OSError as e:  # a datagram too large for the socket: refused by the kernel
        print("raw send refused:", e, flush=True)

def report(kind, value):
    raw(json.dumps({"trial": me, "kind": kind, "value": value}).encode())

# Output stopped mid-line (a progress bar): the agent's notes still start a line of their own.
sys.stderr.write("progress 10%")
sys.stderr.flush()
raw(('{"trial": "%s", "kind": "intermediate", "value": "ten"}' % me).encode())
deadline = time.monotonic() + 30
while "[trialkeeper]" not in open("/proc/self/fd/2").read():  # the agent's note, appended to our stderr
    assert time.monotonic() < deadline, "no note from the agent"
    time.sleep(0.01)

# Straight to the agent's socket, past the SDK's checks.
raw(b"\\xff\\xfe not json")
raw(b"")
raw(b"[" * 60000)                                      # nested too deeply for json
raw(('{"trial": "%s", "kind": "intermediate", "value": %s}' % (me, "9" * 500)).encode())  # beyond a float
raw(('{"trial": "%s", "kind": "intermediate", "value": {"default": %s}}' % (me, "9" * 500)).encode())
raw(('{"trial": "%s", "kind": "intermediate", "value": NaN}' % me).encode())
raw(('{"trial": "%s", "kind": "intermediate", "value": -Infinity}' % me).encode())
report("intermediate", [1, 2])
report("intermediate", {"no": "default"})
report("intermediate", True)
report("sideways", 1.0)
raw(json.dumps({"trial": "someone-else", "kind": "intermediate", "value": 1.0}).encode())
raw(json.dumps([me, "intermediate", 1.0]).encode())
raw(json.dumps({"trial": [me], "kind": "intermediate", "value": 1.0}).encode())
raw(b'{"trial": "' + me.encode() + b'", "kind": "intermediate", "value": 1.0' + b" " * 200000 + b"}")  # oversized
# Fits a datagram, but its keys are escaped as JSON: 6 characters for each 2 bytes.
escaped = {"trial": me, "kind": "intermediate", "value": {"default": 1.0, "\u00e9" * 25000: 1}}
raw(json.dumps(escaped, ensure_ascii=False).encode())

# Through the SDK: refused with False, never an exception.
assert trial.report_intermediate_result(10**400) is False
assert trial.report_intermediate_result({"default": 1.0, **{f"k{j}": j for j in range(7000)}}) is False

# Large and many, all valid: every one must arrive.
for i in range(100):
    assert trial.report_intermediate_result({"default": float(i), **{f"k{j}": j for j in range(4500)}})
for i in range(2000):
    assert trial.report_intermediate_result(1000.0 + i)
assert trial.report_final_result(7.0)
assert trial.report_final_result(8.0)                     # a second final is refused by the agent
"""


def test_trials_writing_huge_or_invalid_metrics(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    write_script(tmp_path, "metrics.py", METRICS_TRIAL)
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.store is not None
            await _still_serving(c, 0)
            agents = {e.id: e.instance_id for e in c.environments()}
            info = await (await c.submit({}, command="python metrics.py")).wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, info.stderr_tail)
            assert info.final_metric == 7.0
            rows = c.store.metrics(info.id)
            assert [r.index for r in rows] == list(range(2101))
            assert [r.value for r in rows] == [float(i) for i in range(100)] + [1000.0 + i for i in range(2000)] + [7.0]
            assert all(len(r.value_json) > 50000 for r in rows[:100])
            err = (c.experiment_dir / "trials" / info.id / "stderr.log").read_text()
            notes = [ln for ln in err.splitlines() if ln.startswith("[trialkeeper]")]
            # 4 not a metric, 4 beyond a float or not finite, 1 unknown kind, 1 too large as
            # JSON, 1 second final.
            assert len(notes) == 11, notes
            assert any("larger than 65536 characters as JSON" in n for n in notes), notes
            assert "progress 10%\n[trialkeeper] intermediate result refused" in err, err[:500]
            assert any("too large for a float" in n for n in notes), notes
            assert any("already reported" in n for n in notes), notes
            sdk = [ln for ln in err.splitlines() if ln.startswith("trialkeeper: intermediate result refused")]
            assert len(sdk) == 2, err
            # The same agent (not a restarted one) goes on serving.
            await _still_serving(c, 1)
            assert {e.id: e.instance_id for e in c.environments()} == agents

    run_async(body)
