"""Numbered messages that arrive together are stored in one transaction, and each is
acknowledged only once it is stored; agents joining together share commits too, and each
is welcomed only once its join is stored (real gRPC, a raw client playing the agents)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from conftest import async_wait_until, build_config, run_async, write_script
from test_hostile import BLOCKER, RawSession, _metric, _register, _token
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.store.store import Store
from trialkeeper.protos.v1 import coordinator_pb2 as pb

WAIT_S = 30.0
MESSAGES = 400


def _count_commits(store: Store) -> dict[str, int]:
    """Count the store's outermost transactions from now on (in ``["n"]``)."""
    commits = {"n": 0}
    transaction = store.transaction

    class Counting:
        def __enter__(self) -> None:
            if store._depth == 0:
                commits["n"] += 1
            transaction().__enter__()

        def __exit__(self, *exc: object) -> None:
            transaction().__exit__(*exc)

    store.transaction = Counting  # type: ignore[method-assign, assignment]
    return commits


def test_messages_arriving_together_share_a_commit_and_each_ack_follows_its_commit(tmp_path: Path) -> None:
    write_script(tmp_path, "blocker.py", BLOCKER)
    config = build_config(tmp_path, trialConcurrency=3, trainingService={"environmentCount": 1})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.store is not None
            store = c.store
            commits = _count_commits(store)
            reader_db = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True, timeout=10)

            sessions: list[RawSession] = []
            trials: list[str] = []
            streams: list[tuple[RawSession, str]] = []
            blocker = await c.submit({}, command=f"python blocker.py {tmp_path / 'never'}")
            await async_wait_until(lambda: blocker.info.status is TrialStatus.RUNNING, WAIT_S)
            for name in ("raw-a", "raw-b"):
                s = RawSession(c.address, _token(c))
                await s.send(_register(name, instance=name))
                welcome = await s.read()
                assert welcome is not None and welcome.HasField("welcome")
                sessions.append(s)
            for _ in sessions:
                await c.submit({"x": 1})
            for s in sessions:  # one trial for each of them (one slot each)
                start = None
                while start is None:
                    m = await asyncio.wait_for(s.read(), WAIT_S)
                    assert m is not None
                    start = m.start_trial if m.HasField("start_trial") else None
                trials.append(start.trial_id)
                streams.append((s, start.trial_id))

            stored_at_ack: list[bool] = []

            async def flood(s: RawSession, trial_id: str) -> None:
                frames = [
                    pb.AgentMessage(seq=i + 1, metrics=pb.MetricBatch(metrics=[_metric(trial_id, i, float(i))]))
                    for i in range(MESSAGES)
                ]
                writer = asyncio.create_task(s.send(*frames))
                acked = 0
                while acked < MESSAGES:
                    m = await asyncio.wait_for(s.read(), WAIT_S)
                    assert m is not None
                    if m.HasField("ack"):
                        acked = m.ack.seq
                        # Everything acknowledged is in the store, as another reader sees it.
                        (count,) = reader_db.execute(
                            "SELECT coalesce(sum(n), 0) FROM metric_runs WHERE trial_id = ? AND idx < ?",
                            (trial_id, acked),
                        ).fetchone()
                        stored_at_ack.append(count == acked)
                await writer

            before = commits["n"]
            t0 = time.monotonic()
            await asyncio.gather(*(flood(s, tid) for s, tid in streams))
            elapsed = time.monotonic() - t0
            used = commits["n"] - before
            reader_db.close()
            assert stored_at_ack and all(stored_at_ack)
            # 800 messages from two streams: far fewer commits than messages.
            assert used < 2 * MESSAGES / 2, (used, elapsed)
            ro = Store(store.path, readonly=True)
            try:
                for tid in trials:
                    assert len(ro.metrics(tid)) == MESSAGES
            finally:
                ro.close()
            (tmp_path / "never").write_text("")
            for s in sessions:
                await s.outcome()

    run_async(body, timeout=120)


JOINS = 40


def test_agents_joining_together_share_a_commit_and_each_welcome_follows_its_commit(tmp_path: Path) -> None:
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"environmentCount": 1})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.store is not None
            commits = _count_commits(c.store)
            reader_db = sqlite3.connect(f"file:{c.store.path}?mode=ro", uri=True, timeout=10)
            sessions = [RawSession(c.address, _token(c)) for _ in range(JOINS)]
            stored_at_welcome: list[bool] = []

            async def join(i: int, s: RawSession) -> None:
                name = f"joiner-{i}"
                await s.send(_register(name, instance=name))
                m = await asyncio.wait_for(s.read(), WAIT_S)
                assert m is not None and m.HasField("welcome")
                # The join is in the store, as another reader sees it, when its Welcome arrives.
                row = reader_db.execute(
                    "SELECT connected, agent_instance_id FROM environments WHERE id = ?", (name,)
                ).fetchone()
                stored_at_welcome.append(row == (1, name))

            try:
                # Connected first, so that the registrations arrive together.
                await asyncio.wait_for(asyncio.gather(*(s._channel.channel_ready() for s in sessions)), WAIT_S)
                before = commits["n"]
                await asyncio.gather(*(join(i, s) for i, s in enumerate(sessions)))
                used = commits["n"] - before
            finally:
                reader_db.close()
                for s in sessions:
                    await s.close()
            assert len(stored_at_welcome) == JOINS and all(stored_at_welcome)
            # One transaction per join would be JOINS commits at least.
            assert used < JOINS, used

    run_async(body, timeout=120)
