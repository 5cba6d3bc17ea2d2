"""The largest messages an agent may send, timed from write to acknowledgement.

Starts a coordinator on loopback whose one environment is this process: it registers over
the agent protocol (as edgeclient.py does), is given a trial, and reports for it. Then, in
turn, ``--repeats`` times:

- the largest MetricBatch allowed (protos/limits.py): MAX_METRICS_PER_BATCH (10,000) dict
  metrics filling all but 64 KiB of MAX_MESSAGE_BYTES (8 MiB), each checked and stored;
- the largest Heartbeat: MAX_GPUS (128) samples of MAX_PROCESSES_PER_GPU (256) processes,
  every id at its longest. A heartbeat is not acknowledged: a one-metric batch follows it,
  and that one's acknowledgement ends the time;
- that one-metric batch alone: the floor, what any message costs from write to acknowledgement.

Each message is serialised before its clock starts. Prints, per kind, the median, p90, min
and max of the wall time and of this process's CPU time (the coordinator's and the small
client's, which a loaded machine does not stretch), then one JSON object as the last line.
docs/operations.md ("Limits on one message") quotes these figures.

    python scripts/bench/limitsbench.py [--repeats 10] [--timeout 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import grpc
from common import percentile, summary
from stages import NullService, make_config, until, workdir
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.gcpolicy import tune_for_fleets
from trialkeeper.protos import limits
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.wire import PROTOCOL_VERSION, TOKEN_METADATA_KEY

METHOD = "/trialkeeper.protos.v1.Coordinator/Session"
KINDS = ("metrics", "heartbeat", "floor")
LONE_INDEX = 10**9  # the one-metric batches' indices, from here on: clear of the large batches'


def largest_batch(trial_id: str, first_index: int) -> pb.MetricBatch:
    """MAX_METRICS_PER_BATCH dict metrics whose value_json fill the message, less room for
    the other fields."""
    room = (limits.MAX_MESSAGE_BYTES - 64 * 1024) // limits.MAX_METRICS_PER_BATCH - 40
    value = '{"default":1.5' + "".join(f',"k{j:05}":{j}' for j in range(room // 14))
    value += " " * (room - len(value) - 1) + "}"
    now = time.time()
    return pb.MetricBatch(metrics=[
        pb.Metric(trial_id=trial_id, kind=pb.METRIC_KIND_INTERMEDIATE, index=first_index + i, value=1.5,
                  value_json=value, reported_at=now)
        for i in range(limits.MAX_METRICS_PER_BATCH)
    ])


def one_metric(trial_id: str, index: int) -> pb.MetricBatch:
    return pb.MetricBatch(metrics=[pb.Metric(trial_id=trial_id, kind=pb.METRIC_KIND_INTERMEDIATE, index=index,
                                             value=1.0, value_json="1", reported_at=time.time())])


def largest_heartbeat() -> pb.Heartbeat:
    sample = pb.GpuSample(uuid="G" * limits.MAX_ID_CHARS, processes=[
        pb.GpuProcess(pid=i, used_memory_bytes=2**40, trial_id="t" * limits.MAX_ID_CHARS)
        for i in range(limits.MAX_PROCESSES_PER_GPU)
    ])
    return pb.Heartbeat(gpus=[sample] * limits.MAX_GPUS)


class HandAgent:
    """One agent stream by hand: serialised messages out, acknowledgements timed as they come."""

    def __init__(self, address: str, token: str) -> None:
        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        session = self.channel.stream_stream(
            METHOD, request_serializer=None, response_deserializer=pb.CoordinatorMessage.FromString
        )
        self.call = session(metadata=((TOKEN_METADATA_KEY, token),))
        self.inbox: asyncio.Queue[pb.CoordinatorMessage] = asyncio.Queue()
        self.seq = 0
        self._want = 0
        self._acked: asyncio.Future[tuple[float, float]] | None = None
        self.ended = ""
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                if not msg.HasField("ack"):
                    self.inbox.put_nowait(msg)
                elif self._acked is not None and msg.ack.seq >= self._want and not self._acked.done():
                    self._acked.set_result((time.perf_counter(), time.process_time()))
            self.ended = "the coordinator ended the stream"
        except grpc.aio.AioRpcError as e:
            self.ended = f"the coordinator ended the stream: {e.code().name} {e.details()}"
        if self._acked is not None and not self._acked.done():
            self._acked.set_exception(RuntimeError(self.ended))

    async def expect(self, field: str, timeout: float) -> pb.CoordinatorMessage:
        """The next message from the coordinator that carries ``field`` (others are passed over)."""

        async def find() -> pb.CoordinatorMessage:
            while True:
                msg = await self.inbox.get()
                if msg.HasField(field):
                    return msg

        return await asyncio.wait_for(find(), timeout)

    def numbered(self, **body: Any) -> bytes:
        self.seq += 1
        return pb.AgentMessage(seq=self.seq, **body).SerializeToString()

    async def timed(self, frames: list[bytes], timeout: float) -> tuple[float, float]:
        """Write ``frames``; wall and CPU seconds until the last numbered one is acknowledged."""
        if self.ended:
            raise RuntimeError(self.ended)
        self._want, self._acked = self.seq, asyncio.get_running_loop().create_future()
        wall, cpu = time.perf_counter(), time.process_time()
        for frame in frames:
            await self.call.write(frame)
        acked_wall, acked_cpu = await asyncio.wait_for(self._acked, timeout)
        return acked_wall - wall, acked_cpu - cpu

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.channel.close()


async def join_with_a_trial(c: Coordinator, agent: HandAgent, timeout: float) -> str:
    """Register as the coordinator's environment and start the trial it is given; its id."""
    await until(lambda: c.environments(), timeout, "the environment asked for")
    register = pb.Register(protocol_version=PROTOCOL_VERSION, environment_id=c.environments()[0].id,
                           agent_instance_id="limitsbench", hostname="limitsbench", pid=os.getpid())
    await agent.call.write(pb.AgentMessage(register=register).SerializeToString())
    await agent.expect("welcome", timeout)
    await c.submit({})
    trial_id = (await agent.expect("start_trial", timeout)).start_trial.trial_id
    started = pb.TrialStarted(trial_id=trial_id, pid=1, started_at=time.time())
    await agent.timed([agent.numbered(trial_started=started)], timeout)
    return trial_id


async def measure(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    config = make_config(d, trialConcurrency=1, trainingService={"environmentCount": 1})
    c = Coordinator(config, experiment_dir=d / "exp", service=NullService(d))
    await c.start()
    agent = HandAgent(c.address, (c.experiment_dir / ".token").read_text().strip())
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    try:
        trial_id = await join_with_a_trial(c, agent, a.timeout)
        beat = pb.AgentMessage(heartbeat=largest_heartbeat()).SerializeToString()
        for r in range(a.repeats):
            big = agent.numbered(metrics=largest_batch(trial_id, r * limits.MAX_METRICS_PER_BATCH))
            times["metrics"].append(await agent.timed([big], a.timeout))
            after_beat = agent.numbered(metrics=one_metric(trial_id, LONE_INDEX + 2 * r))
            times["heartbeat"].append(await agent.timed([beat, after_beat], a.timeout))
            alone = agent.numbered(metrics=one_metric(trial_id, LONE_INDEX + 2 * r + 1))
            times["floor"].append(await agent.timed([alone], a.timeout))
        sizes = {"metrics": len(big), "heartbeat": len(beat), "floor": len(alone)}
        stored = c.store.metric_count() if c.store else 0
    finally:
        await agent.close()
        await asyncio.wait_for(c.stop(0.5), a.timeout)
    expected = a.repeats * (limits.MAX_METRICS_PER_BATCH + 2)
    return {"repeats": a.repeats, "stored": stored, "expected": expected, "bytes": sizes,
            "load_after": os.getloadavg(), **{kind: figures(pairs) for kind, pairs in times.items()}}


def figures(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """Median, p90, min and max of the wall and CPU seconds of each repeat."""
    walls, cpus = [w for w, _ in pairs], [c for _, c in pairs]
    return {"wall_s": {**(summary(walls) or {}), "p90": percentile(walls, 90)},
            "cpu_s": {**(summary(cpus) or {}), "p90": percentile(cpus, 90)}, "runs_wall_s": walls}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--timeout", type=float, default=60, help="seconds for any one wait")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    tune_for_fleets()  # as `trialkeeper run` does for its own process
    load_before = os.getloadavg()
    with workdir() as d:
        result = asyncio.run(measure(args, d))
    result["load_before"] = load_before
    for kind in KINDS:
        w, cpu = result[kind]["wall_s"], result[kind]["cpu_s"]
        print(f"{kind} ({result['bytes'][kind]:,} bytes): write → ack median {w['median']:.3f} s, "
              f"p90 {w['p90']:.3f}, min {w['min']:.3f}, max {w['max']:.3f}; CPU median {cpu['median']:.3f} s")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
