"""The shell around the decision core, with a real store: what it writes before it
acknowledges, and what it does when a write fails."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import async_wait_until
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.engine import Engine
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.rows import MetricRun
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services.base import EnvironmentRequest, EnvironmentService, StartResult
from trialkeeper.coordinator.shell import Shell
from trialkeeper.coordinator.store.store import Store


class Link:
    """A stream as the transport gives it to the shell, recording what it is told."""

    def __init__(self, link_id: int) -> None:
        self.id = link_id
        self.acks: list[int] = []
        self.sent: list[ev.ToAgent] = []
        self.failed = ""

    def send(self, message: ev.ToAgent) -> None:
        self.sent.append(message)

    def ack(self, seq: int, *, now: bool = False) -> None:
        self.acks.append(seq)

    def close(self) -> None:
        pass

    def fail(self, details: str) -> None:
        self.failed = details


def _shell(tmp_path: Path) -> tuple[Shell, Link, str]:
    store = Store.in_dir(tmp_path)
    store.create_experiment("exp", None, {})
    engine = Engine(Policy(
        experiment_id="exp", trial_concurrency=1,
        platforms=(PlatformPolicy(name="manual", reuse=True, environment_count=1, trial_slots=1),),
    ))
    shell = Shell(engine, store, service=None, experiment_dir=tmp_path, request_for=lambda env_id: None)  # type: ignore[arg-type]
    link = Link(1)
    registered = ev.AgentRegistered("by-hand", 1, "i-1", "host", 1, "", (), "", frozenset(), {})
    assert shell.agent_connected(registered, link) is None
    shell.handle(ev.TrialSubmitted("t1", {"x": 1}, "python trial.py", 0, 0))
    shell.handle(ev.Ticked())
    assert any(isinstance(m, ev.StartTrial) for m in link.sent)
    return shell, link, "by-hand"


def _run(body: Any) -> None:
    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_log_chunk_that_cannot_be_written_loses_only_itself(tmp_path: Path) -> None:
    async def body() -> None:
        shell, link, env_id = _shell(tmp_path)
        (tmp_path / "trials").write_text("a file where the trials' directories would go")
        waiter = shell.done.setdefault("t1", asyncio.Event())  # as Coordinator.wait registers one
        batch = [
            ev.TrialStartReported("t1", 42, 0.0),
            ev.LogReported("t1", "stdout", 0, b"hello\n"),
            ev.TrialEndReported("t1", ev.Outcome.SUCCEEDED, 0, None, "", "", 0.0),
        ]
        for seq, report in enumerate(batch, start=1):
            shell.agent_event(ev.AgentReported(env_id, link.id, seq, report), link)
        shell.drain_inbox()  # the three arrived together: one batch
        assert link.acks and max(link.acks) == 3
        assert shell.engine.trials["t1"].status is TrialStatus.SUCCEEDED
        assert waiter.is_set() and not shell.failure
        row = shell.store.trial("t1")
        assert row is not None and row["status"] == "SUCCEEDED"

    _run(body)


def test_a_store_that_refuses_a_write_ends_the_experiment_and_nothing_is_acknowledged(tmp_path: Path) -> None:
    async def body() -> None:
        shell, link, env_id = _shell(tmp_path)
        reasons: list[str] = []
        shell.on_failure = reasons.append

        def refuse(rows: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        shell.store.add_runs = refuse  # type: ignore[method-assign]
        shell.agent_event(ev.AgentReported(env_id, link.id, 1, ev.TrialStartReported("t1", 42, 0.0)), link)
        shell.agent_event(
            ev.AgentReported(
                env_id, link.id, 2, ev.MetricsReported((MetricRun("t1", "final", 0, [0.5], None, [0.0]),))
            ),
            link,
        )
        shell.drain_inbox()
        assert link.acks == []  # the agent keeps both and replays them to a resumed coordinator
        assert "disk is full" in shell.failure and reasons == [shell.failure]
        row = shell.store.envs()[0]
        assert row["last_seq"] == 0  # the batch was rolled back whole

    _run(body)


def test_a_stream_that_ends_after_the_store_closed_touches_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        shell, link, env_id = _shell(tmp_path)
        await shell.close()
        shell.store.close()
        shell.agent_disconnected(env_id, link)  # no error from the closed store
        late = Link(2)
        refusal = shell.agent_connected(ev.AgentRegistered("late", 2, "i-2", "h", 1, "", (), "", frozenset(), {}), late)
        assert refusal is not None and refusal.why is ev.Refusal.NOT_NOW

    _run(body)


def test_a_batch_of_messages_writes_its_agents_last_sequence_number_once_and_right(tmp_path: Path) -> None:
    async def body() -> None:
        shell, link, env_id = _shell(tmp_path)
        statements: list[str] = []
        shell.store._db.set_trace_callback(statements.append)
        batch = [
            ev.TrialStartReported("t1", 42, 0.0),
            ev.LogReported("t1", "stdout", 0, b"one\n"),
            ev.LogReported("t1", "stdout", 4, b"two\n"),
        ]
        for seq, report in enumerate(batch, start=1):
            shell.agent_event(ev.AgentReported(env_id, link.id, seq, report), link)
        shell.drain_inbox()
        shell.store._db.set_trace_callback(None)
        assert max(link.acks) == 3
        # Three numbered messages in one transaction: the agent's row is written once, with
        # the last of them (what a replay after a crash must resume from).
        assert sum("last_seq" in s and s.lstrip().upper().startswith("UPDATE") for s in statements) == 1
        (row,) = [e for e in shell.store.envs() if e["id"] == env_id]
        assert row["last_seq"] == 3
        assert (tmp_path / "trials" / "t1" / "stdout.log").read_bytes() == b"one\ntwo\n"

    _run(body)


class _GroupingPlatform(EnvironmentService[Any]):
    """A platform that starts environments as groups, recording each group it is asked for."""

    platform = "grouping"
    groups_environments = True

    def __init__(self, *, own_group_start: bool) -> None:
        self.groups: list[tuple[str, list[str]]] = []
        self.singles: list[str] = []
        self.own = own_group_start

    def working_directory(self) -> str:
        return "/work"

    async def start(self, request: EnvironmentRequest) -> StartResult:
        self.singles.append(request.env_id)
        return StartResult(platform_id=f"one-{request.env_id}")

    async def start_group(self, group: str, requests: Sequence[EnvironmentRequest]) -> list[StartResult]:
        if not self.own:
            return await super().start_group(group, requests)
        self.groups.append((group, [r.env_id for r in requests]))
        return [StartResult(platform_id=f"job-{group}")] * (len(requests) - 1) + [StartResult(error="no room")]

    async def poll(self, env_ids: Sequence[str]) -> dict[str, ev.Observation]:
        return {}

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        pass


@pytest.mark.parametrize("own_group_start", [True, False])
def test_a_group_of_environments_is_started_in_one_call_and_each_member_answered(
    tmp_path: Path, own_group_start: bool
) -> None:
    async def body() -> None:
        loop_time = asyncio.get_running_loop().time
        store = Store.in_dir(tmp_path)
        store.create_experiment("exp", None, {})
        engine = Engine(Policy(experiment_id="exp", trial_concurrency=1, platforms=(PlatformPolicy(
            name="grouping", reuse=True, environment_count=3, trial_slots=1, groups_environments=True),)))
        service = _GroupingPlatform(own_group_start=own_group_start)
        shell = Shell(engine, store, service=service, experiment_dir=tmp_path,
                      request_for=lambda env_id: EnvironmentRequest(env_id, "exp", "127.0.0.1:1", "token"))
        shell.apply(engine.start(now=loop_time(), wall=1.7e9))  # as the coordinator does
        shell.handle(ev.TrialSubmitted("g", {"x": 1}, "python trial.py", 0, 0, nodes=3))
        shell.handle(ev.Ticked())
        await async_wait_until(
            lambda: engine.envs and not any(e.status is EnvStatus.REQUESTED for e in engine.envs.values()), 20.0,
            interval=0.01, message="the group's environments were never started")
        states = {e.id: (e.status, e.platform_id) for e in engine.envs.values()}
        ids = sorted(states)
        assert len(ids) == 3
        if own_group_start:
            assert service.groups == [(ids[0], ids)] and service.singles == []
            job = (EnvStatus.STARTING, f"job-{ids[0]}")
            assert states == {ids[0]: job, ids[1]: job, ids[2]: (EnvStatus.FAILED, "")}
            assert engine.envs[ids[2]].reason == "no room"
        else:  # a service without its own group start has each member started on its own
            assert sorted(service.singles) == ids
            assert all(s == (EnvStatus.STARTING, f"one-{i}") for i, s in states.items())
        await shell.close()
        store.close()

    _run(body)
