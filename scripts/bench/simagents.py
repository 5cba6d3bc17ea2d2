"""Simulated agents: light clients that speak the real protocol and run no processes.

Each registers with simulated GPUs, heartbeats at the interval the coordinator's Welcome
gives (leaving out GPU samples that did not change, as the real agent does: agent/beats.py),
and answers StartTrial with TrialStarted (and TrialEnded after ``--hold`` seconds; a negative
hold keeps the trial "running" until it is canceled). Every agent has its own stream; by
default its own channel (its own TCP connection) too, as real agents do, or with
``--per-channel K`` K agents share one (HTTP/2 streams over one connection: cheaper for the
floor as for the coordinator, but here some streams of a shared connection were seen never
to start during a join of thousands, so the stages use one connection per agent).

    python simagents.py --coordinator HOST:PORT --token-file F --count N --first-id-index 0
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

import grpc
from trialkeeper.agent.beats import GpuReport
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc
from trialkeeper.protos.wire import PROTOCOL_VERSION

TOKEN_KEY = "x-trialkeeper-token"
CONNECT_TIMEOUT_S = 10.0  # the real agent's default (AgentOptions.connect_timeout_s)


class Stats:
    def __init__(self) -> None:
        self.connected = 0
        self.failed = 0
        self.retries = 0
        self.writing = 0  # Register being written
        self.waiting = 0  # Register written, no Welcome yet
        self.ended = 0  # streams the coordinator ended
        self.refusals: list[str] = []
        self.heartbeats = 0
        self.starts = 0
        self.acks = 0
        self.errors: list[str] = []


class SimAgent:
    def __init__(self, env_id: str, args: argparse.Namespace, token: str, stats: Stats) -> None:
        self.env_id = env_id
        self.interval = 1.0  # what the coordinator asks for (Welcome, then Settings)
        self.a = args
        self.token = token
        self.stats = stats
        self.seq = 0
        self.running: set[str] = set()
        self.lock = asyncio.Lock()
        self.instance_id = uuid.uuid4().hex
        self.report = GpuReport()
        self.gpus = [
            pb.GpuInfo(
                index=g, uuid=f"GPU-{env_id}-{g}", name="Simulated A100", memory_total_bytes=80 << 30, simulated=True
            )
            for g in range(args.gpus)
        ]

    async def write(self, call: grpc.aio.StreamStreamCall, msg: pb.AgentMessage) -> None:
        async with self.lock:
            await call.write(msg)

    async def seq_msg(self, call: grpc.aio.StreamStreamCall, **body: object) -> None:
        async with self.lock:
            self.seq += 1
            await call.write(pb.AgentMessage(seq=self.seq, **body))

    async def dial(self, channel: grpc.aio.Channel) -> tuple[grpc.aio.StreamStreamCall, pb.CoordinatorMessage]:
        """Register; as the real agent does (agent/session.py), a stream with no Welcome
        within the connect timeout is given up and dialled again after a jittered, growing
        pause."""
        register = pb.AgentMessage(
            register=pb.Register(
                protocol_version=PROTOCOL_VERSION, environment_id=self.env_id, agent_instance_id=self.instance_id,
                hostname=f"sim-{self.env_id}", pid=os.getpid(), cpu_count=32, memory_total_bytes=256 << 30,
                gpus=self.gpus, agent_version="sim", platform="sim",
            )
        )
        attempt = 0
        while True:
            call = pb_grpc.CoordinatorStub(channel).Session(metadata=((TOKEN_KEY, self.token),))
            try:
                self.stats.writing += 1
                try:
                    await asyncio.wait_for(call.write(register), CONNECT_TIMEOUT_S)
                finally:
                    self.stats.writing -= 1
                self.stats.waiting += 1
                try:
                    first = await asyncio.wait_for(call.read(), CONNECT_TIMEOUT_S)
                finally:
                    self.stats.waiting -= 1
                return call, first
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError) as e:
                call.cancel()
                self.stats.retries += 1
                self.note(e)
                await asyncio.sleep(min(5.0, 0.05 * 2 ** min(attempt, 7)) * random.uniform(0.5, 1.0))
                attempt += 1

    async def live(self, call: grpc.aio.StreamStreamCall, first: pb.CoordinatorMessage) -> None:
        try:
            if first is grpc.aio.EOF or not first.HasField("welcome"):
                self.stats.failed += 1
                self.stats.refusals.append(f"{self.env_id}: {call.code()} {call.details()}"[:300])
                return
            self.stats.connected += 1
            self.interval = first.welcome.heartbeat_interval_s or 1.0
            self.report.new_stream(first.welcome.gpu_sample_interval_s)
            beat = asyncio.create_task(self.heartbeats(call))
            try:
                await self.read(call)
            finally:
                beat.cancel()
            self.stats.ended += 1
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError, asyncio.CancelledError) as e:
            # A cancelled gRPC call raises CancelledError: counted too, never silently lost.
            self.stats.failed += 1
            self.note(e)

    def note(self, e: BaseException) -> None:
        if len(self.stats.errors) < 5:
            self.stats.errors.append(f"{self.env_id}: {type(e).__name__}: {str(e)[:200]}")

    async def heartbeats(self, call: grpc.aio.StreamStreamCall) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))  # spread agents over the interval
        while True:
            samples = [
                pb.GpuSample(uuid=g.uuid, utilization_percent=random.uniform(0, 100), memory_used_bytes=1 << 30)
                for g in self.gpus
            ]
            hb = self.report.outgoing(pb.Heartbeat(memory_used_bytes=8 << 30, gpus=samples), time.monotonic())
            await self.write(call, pb.AgentMessage(heartbeat=hb))
            self.stats.heartbeats += 1
            await asyncio.sleep(self.interval)

    async def read(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            kind = msg.WhichOneof("body")
            if kind == "ack":
                self.stats.acks += 1
            elif kind == "start_trial":
                st = msg.start_trial
                self.stats.starts += 1
                self.running.add(st.trial_id)
                await self.seq_msg(
                    call, trial_started=pb.TrialStarted(trial_id=st.trial_id, pid=1, started_at=time.time())
                )
                if self.a.hold >= 0:
                    asyncio.get_running_loop().call_later(
                        self.a.hold,
                        lambda t=st.trial_id: asyncio.ensure_future(self.end(call, t, pb.TRIAL_OUTCOME_SUCCEEDED)),
                    )
            elif kind == "settings":
                self.interval = msg.settings.heartbeat_interval_s or self.interval
                if msg.settings.gpu_sample_interval_s > 0:
                    self.report.interval_s = msg.settings.gpu_sample_interval_s
            elif kind == "cancel_trial":
                await self.end(call, msg.cancel_trial.trial_id, pb.TRIAL_OUTCOME_CANCELED)
            elif kind == "shutdown":
                return

    async def end(self, call: grpc.aio.StreamStreamCall, trial_id: str, outcome: int) -> None:
        if trial_id not in self.running:
            return
        self.running.discard(trial_id)
        ended = pb.TrialEnded(
            trial_id=trial_id, outcome=outcome, has_exit_code=True, exit_code=0, ended_at=time.time(), started=True
        )
        try:
            await self.seq_msg(call, trial_ended=ended)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            pass


async def main(args: argparse.Namespace) -> None:
    token = Path(args.token_file).read_text().strip()
    stats = Stats()
    ids = [
        "env-1" if (i == 0 and args.claim_env_1) else f"sim-{i:05d}"
        for i in range(args.first_id_index, args.first_id_index + args.count)
    ]
    agents = [SimAgent(i, args, token, stats) for i in ids]
    opts = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000), ("grpc.enable_retries", 0)]
    # A channel option no other channel has: each group gets a connection of its own
    # (channels with the same target and options would share one subchannel).
    channels = [
        grpc.aio.insecure_channel(args.coordinator, options=[*opts, ("trialkeeper.sim.group", g)])
        for g in range(-(-len(agents) // args.per_channel))
    ]
    tasks: list[asyncio.Task[None]] = []
    queue = collections.deque(enumerate(agents))

    async def dialer() -> None:
        # --connect-parallel of these dial agents in turn (a worker pool rather than a
        # semaphore: every agent waits its turn, none is passed over).
        while queue:
            i, agent = queue.popleft()
            call, first = await agent.dial(channels[i // args.per_channel])
            tasks.append(asyncio.create_task(agent.live(call, first)))

    dialers = [asyncio.create_task(dialer()) for _ in range(args.connect_parallel)]
    t0 = time.monotonic()
    while not all(t.done() for t in dialers) or not all(t.done() for t in tasks):
        await asyncio.sleep(args.report_s)
        line = {
            "t": round(time.monotonic() - t0, 2),
            "connected": stats.connected,
            "failed": stats.failed,
            "retries": stats.retries,
            "writing": stats.writing,
            "waiting": stats.waiting,
            "ended": stats.ended,
            "refusals": stats.refusals[:3],
            "heartbeats": stats.heartbeats,
            "starts": stats.starts,
            "acks": stats.acks,
            "errors": stats.errors,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--first-id-index", type=int, default=0)
    p.add_argument("--claim-env-1", action="store_true", help="the first agent takes the id env-1")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--hold", type=float, default=-1.0, help="seconds a trial 'runs'; <0: until canceled")
    p.add_argument("--connect-parallel", type=int, default=100)
    p.add_argument("--per-channel", type=int, default=1, help="agents sharing one channel (TCP connection)")
    p.add_argument("--report-s", type=float, default=1.0)
    try:
        asyncio.run(main(p.parse_args()))
    except KeyboardInterrupt:
        sys.exit(130)
