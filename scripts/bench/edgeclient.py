"""A client that floods one coordinator stream with MetricBatch messages (one run each, as
an agent sends them), as fast as
gRPC lets it, and reports when the last one is acknowledged. It registers, waits for a
StartTrial (the caller submits one trial), then sends ``--messages`` batches of
``--batch`` metrics each for that trial.

    python edgeclient.py --coordinator HOST:PORT --token-file F --messages 20000 --batch 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path

import grpc
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc
from trialkeeper.protos.wire import PROTOCOL_VERSION


async def main(a: argparse.Namespace) -> None:
    token = Path(a.token_file).read_text().strip()
    async with grpc.aio.insecure_channel(a.coordinator) as channel:
        call = pb_grpc.CoordinatorStub(channel).Session(metadata=(("x-trialkeeper-token", token),))
        await call.write(
            pb.AgentMessage(
                register=pb.Register(
                    protocol_version=PROTOCOL_VERSION,
                    environment_id=a.env_id,
                    agent_instance_id=uuid.uuid4().hex,
                    hostname="edge",
                )
            )
        )
        welcome = await asyncio.wait_for(call.read(), 30)
        assert welcome.HasField("welcome"), welcome
        trial_id = "bare"
        if not a.bare:
            while True:
                msg = await asyncio.wait_for(call.read(), 30)
                if msg.HasField("start_trial"):
                    trial_id = msg.start_trial.trial_id
                    break
        seq = 1
        await call.write(
            pb.AgentMessage(seq=seq, trial_started=pb.TrialStarted(trial_id=trial_id, pid=1, started_at=time.time()))
        )
        last = seq + a.messages
        done = asyncio.get_running_loop().create_future()
        acks = {"n": 0}

        async def reader() -> None:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return
                if msg.HasField("ack"):
                    acks["n"] += 1
                    if msg.ack.seq >= last and not done.done():
                        done.set_result(time.perf_counter())

        r = asyncio.create_task(reader())
        msgs = []
        index = 0
        for _ in range(a.messages):
            seq += 1
            # As an agent sends them: one run of the trial's results, one after another.
            run = pb.MetricRun(trial_id=trial_id, kind=pb.METRIC_KIND_INTERMEDIATE, first_index=index,
                               values=[0.5] * a.batch, reported_at=[time.time()] * a.batch)
            index += a.batch
            msgs.append(pb.AgentMessage(seq=seq, metrics=pb.MetricBatch(runs=[run])))
        t0 = time.perf_counter()
        for m in msgs:
            await call.write(m)
        sent = time.perf_counter()
        end = await asyncio.wait_for(done, a.timeout)
        r.cancel()
        print(json.dumps({
            "messages": a.messages, "batch": a.batch, "acks": acks["n"],
            "send_s": sent - t0, "acked_s": end - t0,
            "messages_per_s": a.messages / (end - t0), "metrics_per_s": a.messages * a.batch / (end - t0),
        }), flush=True)
        # The bare server ends the call as soon as it has acked the last message.
        with contextlib.suppress(Exception):
            await call.done_writing()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--env-id", default="env-1")
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--bare", action="store_true")
    p.add_argument("--timeout", type=float, default=120)
    asyncio.run(main(p.parse_args()))
