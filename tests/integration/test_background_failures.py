"""An operator's agent named like ours, and a background task that dies: neither may hang
an experiment (real coordinator, real agents, real trial processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
from pathlib import Path

import psutil
from conftest import async_wait_until, build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator, CoordinatorError
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.experiment import run_experiment
from trialkeeper.coordinator.store.store import Store

WAIT_S = 60.0


def _agent_pid(c: Coordinator, env_id: str) -> int:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--environment-id" in cmd and cmd[cmd.index("--environment-id") + 1] == env_id and c.address in cmd:
            return p.pid
    raise AssertionError(f"no agent process for {env_id}")


def test_an_agent_started_by_hand_as_env_3_does_not_collide_with_the_replacements(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", "from trialkeeper.agent import trial\ntrial.report_final_result(1.0)\n")
    config = build_config(
        tmp_path, trialConcurrency=2, trainingService={"environmentCount": 2},
        coordinator={"heartbeatInterval": 0.2, "agentLostTimeout": 1.0, "trialLostTimeout": 2.0},
    )

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await async_wait_until(
                lambda: sum(e.status is EnvStatus.READY for e in c.environments()) == 2, WAIT_S,
                message="the coordinator's two agents never registered",
            )
            token = (tmp_path / "exp" / ".token").read_text()
            hand = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trialkeeper.agent", "--coordinator", c.address, "--environment-id", "env-3",
                "--workdir", str(tmp_path / "hand"), "--no-gpu",
                env={**os.environ, "TRIALKEEPER_TOKEN": token}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                await async_wait_until(
                    lambda: any(e.id == "env-3" and e.status is EnvStatus.READY for e in c.environments()),
                    WAIT_S, message="the hand-started agent never joined",
                )
                for env_id in ("env-1", "env-2"):
                    os.kill(_agent_pid(c, env_id), signal.SIGKILL)
                # The hand-started agent counts towards environmentCount: one replacement, under
                # an id of its own, and trials run.
                await async_wait_until(
                    lambda: sum(e.status is EnvStatus.READY for e in c.environments()) >= 2
                    and all(e.status.terminal for e in c.environments() if e.id in ("env-1", "env-2")),
                    WAIT_S, message="the killed agents were never replaced",
                )
                ids = [e.id for e in c.environments()]
                assert len(ids) == len(set(ids)) and len(ids) >= 4, ids
                handles = [await c.submit({"x": i}) for i in range(4)]
                infos = [await h.wait(WAIT_S) for h in handles]
                assert {i.status for i in infos} == {TrialStatus.SUCCEEDED}, [(i.status, i.reason) for i in infos]
                assert not c.failure
            finally:
                hand.kill()
                await hand.wait()

    run_async(body, timeout=120)


def test_a_background_task_that_dies_ends_the_experiment_with_the_reason(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", "import time\ntime.sleep(60)\n")
    config = build_config(
        tmp_path, trialConcurrency=1, maxTrialNumber=1, searchSpace={"x": {"_type": "choice", "_value": [1]}},
        coordinator={"heartbeatInterval": 0.2, "agentLostTimeout": 1.0, "trialLostTimeout": 2.0},
    )
    real = Store.keep
    broken = {"on": False}

    def keep(self: Store, fact: ev.Fact) -> None:
        if broken["on"] and isinstance(fact, ev.EnvironmentAdded):
            raise sqlite3.IntegrityError("UNIQUE constraint failed: environments.id")
        real(self, fact)

    async def body() -> None:
        stop = asyncio.Event()
        run = asyncio.ensure_future(run_experiment(config, experiment_dir=tmp_path / "exp", stop=stop))
        store_path = tmp_path / "exp" / Store.FILENAME
        await async_wait_until(lambda: store_path.exists(), WAIT_S, message="the experiment never started")

        def running() -> bool:
            s = Store(store_path, readonly=True)
            try:
                return any(t["status"] == "RUNNING" for t in s.trials())
            finally:
                s.close()

        await async_wait_until(running, WAIT_S, message="the trial never ran")
        broken["on"] = True  # the replacement of the agent killed next cannot be stored
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "trialkeeper.agent" in " ".join(cmd) and str(tmp_path) in " ".join(cmd):
                doomed = [p, *p.children(recursive=True)]  # the agent and its trial with it
                for q in doomed:
                    q.kill()
        try:
            result = await asyncio.wait_for(run, WAIT_S)
        finally:
            stop.set()
        assert not result.ok
        assert "UNIQUE constraint failed" in result.reason, result.reason
        s = Store(store_path, readonly=True)
        try:
            exp = s.experiment()
            assert exp is not None and exp["status"] == "FAILED" and "UNIQUE" in exp["reason"], exp
        finally:
            s.close()

    Store.keep = keep  # type: ignore[method-assign]
    try:
        run_async(body, timeout=120)
    finally:
        Store.keep = real  # type: ignore[method-assign]


def test_the_embedding_api_says_why_once_the_experiment_cannot_go_on(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", "import time\ntime.sleep(60)\n")
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({"x": 1})
            assert c._shell is not None
            c._shell.fail("the monitor failed: RuntimeError: boom")
            try:
                await h.wait(WAIT_S)
            except CoordinatorError as e:
                assert "boom" in str(e)
            else:
                raise AssertionError("wait() returned although the experiment cannot go on")
            await async_wait_until(lambda: not c._started, WAIT_S, message="the coordinator did not stop")

    run_async(body, timeout=120)
