"""The gRPC edge keeps from the coordinator's core what it must not get: a metric that is not
one is refused alone, with a note in its trial's stderr log, and the rest of its batch is
stored; a message over a limit of protos/limits.py ends its stream with INVALID_ARGUMENT
naming the limit. The agents here are hand-written gRPC clients holding the experiment
token, as an operator's agent or a hostile one would be."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from conftest import async_wait_until, build_config, run_async, write_script
from google.protobuf.message import Message
from test_cli import _json, tk
from test_hostile import BLOCKER, TRIAL, RawSession, _attack, _register, _still_serving, _token
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.protos import limits
from trialkeeper.protos.v1 import coordinator_pb2 as pb

WAIT_S = 30.0
FINAL = pb.METRIC_KIND_FINAL
INTERMEDIATE = pb.METRIC_KIND_INTERMEDIATE


def _m(trial_id: str, index: int, value: float, value_json: str, kind: int = INTERMEDIATE, **more: float) -> pb.Metric:
    return pb.Metric(
        trial_id=trial_id, kind=kind, index=index, value=value, value_json=value_json,
        reported_at=more.get("reported_at", time.time()),
    )


@dataclass
class HandAgent:
    """A raw session registered as an extra environment, reading what the coordinator sends."""

    raw: RawSession
    received: list[pb.CoordinatorMessage] = field(default_factory=list)

    async def read_all(self) -> None:
        while (m := await self.raw.read()) is not None:
            self.received.append(m)

    def acked(self, seq: int) -> bool:
        return any(m.HasField("ack") and m.ack.seq >= seq for m in self.received)

    def started(self) -> list[pb.StartTrial]:
        return [m.start_trial for m in self.received if m.HasField("start_trial")]


@contextlib.asynccontextmanager
async def _hand_agent_with_a_trial(c: Coordinator, release: Path) -> AsyncIterator[tuple[HandAgent, str]]:
    """A hand agent that has been given a trial (the real agent is kept busy by a blocker)."""
    blocker = await c.submit({}, command=f"python blocker.py {release}")
    await async_wait_until(lambda: blocker.info.status is TrialStatus.RUNNING, WAIT_S)
    agent = HandAgent(RawSession(c.address, _token(c)))
    await agent.raw.send(_register("by-hand", instance="hand-1"))
    reader = asyncio.create_task(agent.read_all())
    try:
        await async_wait_until(lambda: any(m.HasField("welcome") for m in agent.received), WAIT_S)
        mine = await c.submit({"x": 5})
        await async_wait_until(lambda: agent.started(), WAIT_S)
        assert agent.started()[0].trial_id == mine.id
        await agent.raw.send(
            pb.AgentMessage(seq=1, trial_started=pb.TrialStarted(trial_id=mine.id, pid=1, started_at=time.time()))
        )
        yield agent, mine.id
    finally:
        await agent.raw.close()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader
        release.touch()
        await blocker.wait(WAIT_S)


# (value_json, value, words the note must hold)
NOT_METRICS = [
    ("}{", 0.0, "its value_json '}{' is not JSON"),
    ("[1]", 1.0, "got list"),
    ('{"x":1}', 1.0, "needs a 'default' key"),
    ("NaN", math.nan, "must be a finite number, got nan"),
    ("2.5", 3.5, "its value 3.5 is not the number in its value_json (2.5)"),
    ('{"default": 1, "tag": "a"}', 1.0, "'tag' must be a number, got str"),
    ("1e999", math.inf, "must be a finite number, got inf"),
]


def test_metrics_that_are_not_metrics_are_refused_alone_with_a_note(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    write_script(tmp_path, "blocker.py", BLOCKER)
    config = build_config(tmp_path, trialConcurrency=2, trainingService={"environmentCount": 1})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c, _hand_agent_with_a_trial(
            c, tmp_path / "release"
        ) as (agent, tid):
            assert c.store is not None
            batch = [_m(tid, 0, 1.0, "1.0"), _m(tid, 1, 0.0, "}{", FINAL)]
            batch += [_m(tid, 2 + i, value, text) for i, (text, value, _) in enumerate(NOT_METRICS[1:])]
            batch += [
                _m(tid, 2**64 - 1, 2.0, "2.0"),  # an index SQLite cannot hold
                _m(tid, 20, 2.0, "2.0", reported_at=math.nan),
                _m(tid, 21, 2.0, "2.0", kind=7),
                _m(tid, 30, 4.0, '{"default": 4.0, "loss": 0.5}'),
            ]
            await agent.raw.send(pb.AgentMessage(seq=2, metrics=pb.MetricBatch(metrics=batch)))
            await async_wait_until(lambda: agent.acked(2), WAIT_S)
            # The good ones of the batch are stored, and only they.
            rows = [(r.index, r.kind, r.value, r.value_json) for r in c.store.metrics(tid)]
            assert rows == [
                (0, "intermediate", 1.0, "1.0"),
                (30, "intermediate", 4.0, '{"default": 4.0, "loss": 0.5}'),
            ], rows
            assert c.trial(tid).final_metric is None
            stderr = c.experiment_dir / "trials" / tid / "stderr.log"
            notes = stderr.read_text().splitlines()
            assert (
                notes[0]
                == "[trialkeeper] refused a final result from the agent (index 1): its value_json '}{' is not JSON"
            )
            for (_, _, words), note in zip(NOT_METRICS[1:], notes[1:], strict=False):
                assert (
                    note.startswith("[trialkeeper] refused an intermediate result from the agent") and words in note
                ), note
            assert f"(index {2**64 - 1}): its index {2**64 - 1} is beyond" in notes[7], notes
            assert "reported_at nan is not a finite time" in notes[8] and "kind 7 is neither" in notes[9], notes
            assert len(notes) == 10, notes

            # The experiment can be read while it runs.
            status = await asyncio.to_thread(tk, "status", c.experiment_dir)
            assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
            rows_listed = _json(await asyncio.to_thread(tk, "trials", c.experiment_dir, "--json"))
            assert isinstance(rows_listed, list)
            listed = {r["id"]: r for r in rows_listed}
            assert listed[tid]["status"] == "RUNNING" and listed[tid]["final_metric"] is None, listed[tid]

            # Many refusals in one message: a few notes, then one line for the rest.
            flood = [_m(tid, 100 + i, 1.0, "}{") for i in range(25)]
            await agent.raw.send(
                pb.AgentMessage(seq=3, metrics=pb.MetricBatch(metrics=[*flood, _m(tid, 200, 6.0, "6")]))
            )
            await async_wait_until(lambda: agent.acked(3), WAIT_S)
            notes = stderr.read_text().splitlines()[10:]
            assert (
                len(notes) == 11
                and notes[-1] == "[trialkeeper] refused 15 more results from the agent in the same message"
            ), notes
            assert [r.index for r in c.store.metrics(tid)] == [0, 30, 200]

            # The trial goes on to its end, and the experiment with it.
            await agent.raw.send(
                pb.AgentMessage(seq=4, metrics=pb.MetricBatch(metrics=[_m(tid, 201, 9.0, "9", FINAL)])),
                pb.AgentMessage(
                    seq=5, trial_ended=pb.TrialEnded(trial_id=tid, outcome=pb.TRIAL_OUTCOME_SUCCEEDED, started=True)
                ),
            )
            info = await c.wait(tid, WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED and info.final_metric == 9.0, (info.status, info.reason)
            await agent.raw.send(pb.AgentMessage(heartbeat=pb.Heartbeat(draining=True)))  # no more trials for it
            await async_wait_until(
                lambda: any(e.id == "by-hand" and e.status is EnvStatus.DRAINING for e in c.environments()), WAIT_S
            )
            (tmp_path / "release").touch()  # the real agent is free again
            await _still_serving(c, 1)

    run_async(body)


# ---- limits ---------------------------------------------------------------------------------

# Where each message type of limits.FIELD_LIMITS sits in an AgentMessage.
HOLDERS: dict[str, Callable[[pb.AgentMessage], Message]] = {
    "Register": lambda m: m.register,
    "GpuInfo": lambda m: m.register.gpus.add(),
    "Heartbeat": lambda m: m.heartbeat,
    "GpuSample": lambda m: m.heartbeat.gpus.add(),
    "GpuProcess": lambda m: m.heartbeat.gpus.add().processes.add(),
    "TrialStarted": lambda m: m.trial_started,
    "MetricBatch": lambda m: m.metrics,
    "Metric": lambda m: m.metrics.metrics.add(),
    "MetricRun": lambda m: m.metrics.runs.add(),
    "LogChunk": lambda m: m.log,
    "TrialEnded": lambda m: m.trial_ended,
    "CheckpointChunk": lambda m: m.checkpoint_chunk,
    "CheckpointSaved": lambda m: m.checkpoint_saved,
    "CheckpointFile": lambda m: m.checkpoint_saved.files.add(),
    "FetchCheckpoint": lambda m: m.fetch_checkpoint,
}


def message_at(key: str, size: int, env_id: str) -> pb.AgentMessage:
    """An AgentMessage whose field ``key`` (an entry of limits.FIELD_LIMITS) has ``size``
    characters, bytes or entries, and which is otherwise valid."""
    type_name, name = key.removesuffix("[]").split(".")
    msg = pb.AgentMessage(seq=1)
    if type_name in ("Register", "GpuInfo"):
        msg = _register(env_id, instance=f"{env_id}-1")
    holder = HOLDERS[type_name](msg)
    f = holder.DESCRIPTOR.fields_by_name[name]
    if type_name == "MetricRun" and name != "trial_id":
        # A run of valid results, one JSON and one time per value; the field named has
        # `size` entries (or characters, for one JSON), the others are within their limit.
        n = 1 if key.endswith("[]") else min(size, limits.MAX_METRICS_PER_BATCH)
        holder.values.extend([1.0] * (size if name == "values" else n))
        holder.reported_at.extend([1.0] * (size if name == "reported_at" else n))
        holder.value_json.extend(
            ["1" + " " * (size - 1)] if key.endswith("[]") else ["1"] * (size if name == "value_json" else n)
        )
    elif key.endswith("[]"):
        getattr(holder, name).append("t" * size)
    elif f.type == f.TYPE_MESSAGE:
        for _ in range(size):
            getattr(holder, name).add()
    elif f.is_repeated:
        getattr(holder, name).extend(["t"] * size)
    elif f.type == f.TYPE_BYTES:
        setattr(holder, name, b"x" * size)
    elif key == "Register.environment_id":
        msg.register.environment_id = env_id + "e" * (size - len(env_id))
    elif key == "Metric.value_json":
        holder.value_json = "1" + " " * (size - 1)  # valid JSON of any length: 1 and blanks
    else:
        setattr(holder, name, "x" * size)
    if type_name == "Metric":
        msg.metrics.metrics[0].value = 1.0
        msg.metrics.metrics[0].value_json = msg.metrics.metrics[0].value_json or "1"
    return msg


def test_each_limit_is_refused_naming_it_and_a_message_at_the_limit_is_accepted(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            for n, (key, limit_name) in enumerate(limits.FIELD_LIMITS.items()):
                limit = getattr(limits, limit_name)
                env_id = f"lim-{n}"
                frames = [message_at(key, limit + 1, env_id)]
                if not key.startswith(("Register.", "GpuInfo.")):
                    frames.insert(0, _register(env_id, instance="over"))
                code, details = await _attack(c, *frames)
                what = key.removesuffix("[]").split(".")[1]
                assert code is grpc.StatusCode.INVALID_ARGUMENT and limit_name in details and what in details, (
                    key,
                    code,
                    details,
                )

                at_limit = [message_at(key, limit, f"ok-{n}")]
                if not key.startswith(("Register.", "GpuInfo.")):
                    at_limit.insert(0, _register(f"ok-{n}", instance="at"))
                assert await _attack(c, *at_limit) == (grpc.StatusCode.OK, ""), key
            for name, body_msg in [
                (
                    "started_at",
                    pb.AgentMessage(seq=1, trial_started=pb.TrialStarted(trial_id="t", started_at=math.nan)),
                ),
                ("ended_at", pb.AgentMessage(seq=1, trial_ended=pb.TrialEnded(trial_id="t", ended_at=math.inf))),
            ]:
                code, details = await _attack(c, _register(f"time-{name}"), body_msg)
                assert code is grpc.StatusCode.INVALID_ARGUMENT and f"{name} is not a finite time" in details, details
            await _still_serving(c, 1)

    run_async(body, timeout=120.0)


def test_the_largest_messages_allowed_are_handled_and_acknowledged(tmp_path: Path) -> None:
    """A full MetricBatch (MAX_METRICS_PER_BATCH valid metrics filling MAX_MESSAGE_BYTES) and
    a full Heartbeat are handled and acknowledged, and every metric of the batch is stored."""
    write_script(tmp_path, "trial.py", TRIAL)
    write_script(tmp_path, "blocker.py", BLOCKER)
    config = build_config(tmp_path, trialConcurrency=2, trainingService={"environmentCount": 1})
    # Each metric's value_json fills its share of the message, less room for its other fields.
    room = (limits.MAX_MESSAGE_BYTES - 64 * 1024) // limits.MAX_METRICS_PER_BATCH - 40
    value = '{"default":1.5' + "".join(f',"k{j:05}":{j}' for j in range(room // 14))
    value += " " * (room - len(value) - 1) + "}"

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c, _hand_agent_with_a_trial(
            c, tmp_path / "release"
        ) as (agent, tid):
            assert c.store is not None
            metrics = [_m(tid, i, 1.5, value) for i in range(limits.MAX_METRICS_PER_BATCH)]
            big = pb.AgentMessage(seq=2, metrics=pb.MetricBatch(metrics=metrics))
            assert limits.MAX_MESSAGE_BYTES - 256 * 1024 < big.ByteSize() < limits.MAX_MESSAGE_BYTES
            sample = pb.GpuSample(uuid="G" * limits.MAX_ID_CHARS, processes=[
                pb.GpuProcess(pid=i, used_memory_bytes=2**40, trial_id="t" * limits.MAX_ID_CHARS)
                for i in range(limits.MAX_PROCESSES_PER_GPU)
            ])
            beat = pb.AgentMessage(heartbeat=pb.Heartbeat(gpus=[sample] * limits.MAX_GPUS))
            for msg, seq in [(big, 2), (beat, 0)]:
                await agent.raw.send(msg)
                if not seq:  # a heartbeat is not acknowledged: a small message behind it is
                    seq = 3
                    await agent.raw.send(
                        pb.AgentMessage(seq=seq, metrics=pb.MetricBatch(metrics=[_m(tid, 99_999, 1.0, "1")]))
                    )
                await async_wait_until(lambda s=seq: agent.acked(s), WAIT_S)  # type: ignore[misc]
            assert len(c.store.metrics(tid)) == limits.MAX_METRICS_PER_BATCH + 1
            # Each acknowledged within WAIT_S, on a stream that goes on: the coordinator does not hang on
            # them. How fast is a figure of scripts/bench/limitsbench.py (docs/operations.md gives it).

    run_async(body)


def test_an_agent_with_more_gpus_than_the_limit_reports_the_first_ones(tmp_path: Path) -> None:
    """A real agent on a machine with more GPUs than MAX_GPUS joins with MAX_GPUS of them
    (its Register and heartbeats stay within the limit) and runs trials."""
    write_script(tmp_path, "trial.py", TRIAL)
    config = build_config(
        tmp_path, trialConcurrency=1, trainingService={"environmentCount": 1, "simulatedGpus": limits.MAX_GPUS + 3}
    )

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await _still_serving(c, 1)
            (env,) = c.environments()
            assert len(env.gpus) == limits.MAX_GPUS and env.connected, (len(env.gpus), env.status)
            await async_wait_until(  # a heartbeat came, and its samples were stored
                lambda: all(g.sampled_at for g in c.environments()[0].gpus), WAIT_S
            )

    run_async(body)
