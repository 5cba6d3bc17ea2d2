"""Agents started by hand: a second agent of an environment already served from the same
work dir is refused at once, and leaves the first one's socket and trials alone; an agent
its operator drains finishes its trial and its environment ends STOPPED (one whose Leaving's
ack was lost is told it had left when it dials again, after a coordinator restart too); one started again
after a stop and a resume joins under its own id; an experiment of such agents only
(environmentCount: 0) runs its trials on them, a trial of two nodes across two of them once
both joined (one that may use only local too, on agents that report another platform), and
`run --detach` says where they dial."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import (
    async_wait_until,
    build_config,
    environment,
    pid_gone,
    run_async,
    stored_rows,
    wait_until,
    write_script,
)
from holding_proxy import HoldingProxy
from test_cli import tk
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus

START_S = 30.0
# Short timers: an environment taken for lost would be LOST within a second, FAILED soon after.
FAST = {"heartbeatInterval": 0.2, "agentLostTimeout": 1.0, "trialLostTimeout": 2.5}
# Runs until the file named by its parameter "go" exists (or 60 s pass).
HOLD = """
import os, pathlib, time
from trialkeeper.agent import trial
p = trial.get_next_parameter()
out = pathlib.Path(os.environ["TRIALKEEPER_OUTPUT_DIR"])
(out / "started").write_text("")
deadline = time.monotonic() + 60
while not pathlib.Path(p["go"]).exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(1.0)
"""


# Each rank writes the variables torchrun's would read into the directory named by "out".
RANKS = """
import json, os, pathlib
from trialkeeper.agent import trial
p = trial.get_next_parameter()
names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
seen = json.dumps({n: os.environ.get(n, "") for n in names})
(pathlib.Path(p["out"]) / f"rank{os.environ['RANK']}.json").write_text(seen)
trial.report_final_result(1.0)
"""


def _agent(workdir: Path, env_id: str) -> list[str]:
    # A coordinator that never answers: the agent keeps dialling it within its reconnect window.
    return [sys.executable, "-m", "trialkeeper.agent", "--coordinator", "127.0.0.1:9", "--environment-id", env_id,
            "--workdir", str(workdir), "--no-gpu", "--reconnect-window", "120"]


def test_a_second_agent_of_one_environment_in_one_work_dir_is_refused_before_it_touches_anything(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "TRIALKEEPER_TOKEN": "t" * 32}
    first = subprocess.Popen(_agent(tmp_path, "box-a"), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        sock = tmp_path / "sockets" / "box-a.sock"
        wait_until(sock.exists, START_S, message="the first agent never bound its metric socket")
        second = subprocess.run(_agent(tmp_path, "box-a"), env=env, capture_output=True, text=True,
                                timeout=START_S, check=False)
        assert second.returncode == 2, second.stderr
        assert (f"trialkeeper agent: another agent of environment box-a runs in {tmp_path} (pid {first.pid}): "
                "give each agent its own --environment-id") in second.stderr, second.stderr
        assert sock.exists(), "the refused agent took the first one's socket away"
        assert first.poll() is None
        # Another environment in the same work dir is an agent of its own (local environments share one).
        other = subprocess.Popen(_agent(tmp_path, "box-b"), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            wait_until((tmp_path / "sockets" / "box-b.sock").exists, START_S, message="box-b never started")
        finally:
            other.kill()
            other.wait(START_S)
    finally:
        first.kill()
        first.wait(START_S)
    # Its lock went with it, kill -9 and all: the environment's next agent starts.
    assert pid_gone(first.pid)
    again = subprocess.Popen(_agent(tmp_path, "box-a"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / ".agent-box-a.lock").read_text() == str(again.pid), START_S,
                   message="the next agent of box-a did not take the environment")
        assert again.poll() is None
    finally:
        again.send_signal(signal.SIGKILL)
        again.wait(START_S)


async def _hand_agent(c: Coordinator, workdir: Path, env_id: str, address: str = "",
                      platform: str = "") -> asyncio.subprocess.Process:
    """An agent an operator starts on a worker, as docs/operations.md shows (dialling ``address``,
    a proxy, where given; reporting ``platform``, where given)."""
    token = (c.experiment_dir / ".token").read_text()
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trialkeeper.agent", "--coordinator", address or c.address, "--environment-id", env_id,
        "--workdir", str(workdir), "--no-gpu", *(["--platform", platform] if platform else []),
        env={**os.environ, "TRIALKEEPER_TOKEN": token},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )


async def _said(agent: asyncio.subprocess.Process, text: str, timeout: float) -> str:
    """What the agent logged up to its first line with ``text`` (within ``timeout`` seconds)."""
    assert agent.stderr is not None
    lines: list[str] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while not lines or text not in lines[-1]:
        left = deadline - asyncio.get_running_loop().time()
        line = await asyncio.wait_for(agent.stderr.readline(), max(left, 0.001))
        assert line, f"the agent exited without saying {text!r}: {''.join(lines)}"
        lines.append(line.decode())
    return "".join(lines)


def _status(c: Coordinator, env_id: str) -> EnvStatus | None:
    return next((e.status for e in c.environments() if e.id == env_id), None)


def test_a_hand_agent_drained_by_its_operator_finishes_its_trial_and_its_environment_is_stopped(
    tmp_path: Path,
) -> None:
    write_script(tmp_path, "trial.py", HOLD)
    go = tmp_path / "go"
    config = build_config(tmp_path, trialConcurrency=2, trainingService={"environmentCount": 1}, coordinator=FAST)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            agent = await _hand_agent(c, tmp_path / "box", "box-a")
            try:
                await async_wait_until(lambda: _status(c, "box-a") is EnvStatus.READY, START_S,
                                       message="the hand agent never joined")
                await async_wait_until(lambda: _status(c, "env-1") is EnvStatus.READY, START_S)
                trials = [await c.submit({"go": str(go)}) for _ in range(2)]
                await async_wait_until(lambda: all(t.info.started_at for t in trials), START_S)
                (mine,) = [t for t in trials if t.info.environment_id == "box-a"]
                agent.send_signal(signal.SIGTERM)  # the operator drains it
                await async_wait_until(lambda: _status(c, "box-a") is EnvStatus.DRAINING, START_S)
                go.write_text("")
                assert (await mine.wait(START_S)).status is TrialStatus.SUCCEEDED
                _, stderr = await asyncio.wait_for(agent.communicate(), START_S)
                assert agent.returncode == 0, stderr.decode()
                # Stopped: not lost, then failed for want of heartbeats.
                await async_wait_until(lambda: _status(c, "box-a") is not EnvStatus.DRAINING, START_S)
                box = environment(c, "box-a")
                assert (box.status, box.reason) == (
                    EnvStatus.STOPPED, "its agent drained and left (its operator stopped it)"), box
            finally:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()

    run_async(body)


async def _told_it_left(agent: asyncio.subprocess.Process, c: Coordinator, said: str) -> None:
    """The agent, refused as the one that had left, exits 0 and says so; its environment stays stopped."""
    _, stderr = await asyncio.wait_for(agent.communicate(), START_S)
    said += stderr.decode()
    assert agent.returncode == 0, said
    assert "environment box-a ended as this agent left it (its ack was lost): exiting" in said, said
    assert "refused this agent" not in said, said
    box = environment(c, "box-a")
    assert (box.status, box.reason) == (EnvStatus.STOPPED, "its agent drained and left (its operator stopped it)"), box


@pytest.mark.parametrize("restart", [False, True], ids=["same-coordinator", "coordinator-restarted"])
def test_a_drained_hand_agent_whose_leaving_was_not_acknowledged_exits_cleanly_when_refused(
    tmp_path: Path, restart: bool
) -> None:
    # Long loss timers: an agent silent for a while on a loaded machine must not be found lost
    # (then FAILED) before its Leaving arrives.
    patient = {"agentLostTimeout": 60.0, "trialLostTimeout": 120.0}
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"environmentCount": 0}, coordinator=patient)

    async def body() -> None:
        proxy = await HoldingProxy().start()
        agent: asyncio.subprocess.Process | None = None
        try:
            async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
                host, port = c.address.rsplit(":", 1)
                proxy.target = (host, int(port))
                agent = await _hand_agent(c, tmp_path / "box", "box-a", f"127.0.0.1:{proxy.port}")
                # Joined, and its Welcome through the proxy before anything is held.
                said = await _said(agent, "registered with coordinator", START_S)
                proxy.hold_down_messages()  # what the agent sends is stored; no ack reaches it
                agent.send_signal(signal.SIGTERM)  # the operator drains it: it has no trial, it leaves
                # Cut at once (the agent waits 5 s for that ack before it exits anyway).
                await async_wait_until(lambda: _status(c, "box-a") is EnvStatus.STOPPED, START_S, interval=0.01,
                                       message="the coordinator never heard the agent leave")
                if restart:  # it dials again while the coordinator restarts, and reaches the new one
                    proxy.hold_new_connections()
                proxy.cut()  # the ack of its Leaving is lost with the connection; it dials again
                if not restart:
                    await _told_it_left(agent, c, said)
                    return
            # Resumed, the coordinator knows of the agent only what the store kept.
            async with Coordinator.resume(c.experiment_dir) as r:
                host, port = r.address.rsplit(":", 1)
                proxy.connect_held((host, int(port)))
                await _told_it_left(agent, r, said)
        finally:
            if agent is not None and agent.returncode is None:
                agent.kill()
                await agent.wait()
            await proxy.close()

    run_async(body)


def test_a_hand_agent_started_again_after_a_stop_and_a_resume_joins_under_its_own_id(tmp_path: Path) -> None:
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"environmentCount": 1}, coordinator=FAST)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            agent = await _hand_agent(c, tmp_path / "box", "box-a")
            try:
                await async_wait_until(lambda: _status(c, "box-a") is EnvStatus.READY, START_S)
                await c.stop(pause_trials=True)  # trialkeeper stop: its agent is shut down
                await asyncio.wait_for(agent.wait(), START_S)
            finally:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()
            exp = c.experiment_dir
        async with Coordinator.resume(exp) as r:
            assert _status(r, "box-a") is EnvStatus.STOPPED
            again = await _hand_agent(r, tmp_path / "box", "box-a")
            try:
                await async_wait_until(lambda: _status(r, "box-a") is EnvStatus.READY or again.returncode is not None,
                                       START_S)
                assert again.returncode is None, (await again.communicate())[1].decode()
                box = environment(r, "box-a")
                assert (box.connected, box.ended_at) == (True, None), box
            finally:
                again.kill()
                await again.wait()

    run_async(body)


def test_a_trial_of_two_nodes_waits_for_two_hand_agents_then_runs_across_them(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", RANKS)
    out = tmp_path / "out"
    out.mkdir()
    # Agents started by hand only: the config bounds no number of environments.
    config = build_config(tmp_path, trialConcurrency=1, trialNodes=2, trainingService={"environmentCount": 0})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            agents = [await _hand_agent(c, tmp_path / "box-a", "box-a")]
            try:
                await async_wait_until(lambda: _status(c, "box-a") is EnvStatus.READY, START_S,
                                       message="the first hand agent never joined")
                h = await c.submit({"out": str(out)})  # of trialNodes: 2
                await async_wait_until(lambda: "waiting for 2 environments" in h.info.waiting_reason, START_S,
                                       message="the trial did not wait for a second environment")
                assert h.info.started_at is None
                agents.append(await _hand_agent(c, tmp_path / "box-b", "box-b"))
                info = await h.wait(START_S * 4)
                assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
                assert sorted(r.environment_id for r in info.ranks) == ["box-a", "box-b"], info.ranks
                seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
                assert [(s["RANK"], s["WORLD_SIZE"]) for s in seen] == [("0", "2"), ("1", "2")], seen
                assert seen[0]["MASTER_ADDR"] and seen[0]["MASTER_PORT"], seen
                assert [(s["MASTER_ADDR"], s["MASTER_PORT"]) for s in seen[1:]] == [
                    (seen[0]["MASTER_ADDR"], seen[0]["MASTER_PORT"])], seen
            finally:
                await _killed(agents)

    run_async(body)


def test_a_trial_that_may_use_only_local_runs_across_hand_agents_that_report_another_platform(
    tmp_path: Path,
) -> None:
    # Agents of --platform gpu-farm in an experiment of local only count as local's: a trial
    # submitted with platforms=["local"] runs on them (it waited for ever).
    write_script(tmp_path, "trial.py", RANKS)
    out = tmp_path / "out"
    out.mkdir()
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"environmentCount": 0})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            agents = []
            try:
                for env_id in ("box-a", "box-b"):
                    agents.append(await _hand_agent(c, tmp_path / env_id, env_id, platform="gpu-farm"))
                await async_wait_until(
                    lambda: all(_status(c, e) is EnvStatus.READY for e in ("box-a", "box-b")), START_S,
                    message="the hand agents never joined")
                assert {e.platform for e in c.environments()} == {"gpu-farm"}
                h = await c.submit({"out": str(out)}, platforms=["local"], nodes=2)
                await async_wait_until(lambda: h.info.started_at, START_S * 2,
                                       message="the trial that may use only local never started on them")
                info = await h.wait(START_S * 4)
                assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
                assert sorted(r.environment_id for r in info.ranks) == ["box-a", "box-b"], info.ranks
                assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json"]
            finally:
                await _killed(agents)

    run_async(body)


async def _killed(agents: list[asyncio.subprocess.Process]) -> None:
    for agent in agents:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


def test_an_experiment_of_hand_agents_only_launches_none_and_run_detach_says_where_they_dial(
    tmp_path: Path,
) -> None:
    write_script(tmp_path, "trial.py", "from trialkeeper.agent import trial\n"
                                       "trial.report_final_result(float(trial.get_next_parameter()['x']))\n")
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump({
        "trialCommand": f"{sys.executable} trial.py", "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 1, "maxTrialNumber": 2,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3]}}, "tuner": {"name": "random"},
        "trainingService": {"platform": "local", "environmentCount": 0},
        "coordinator": {"address": "127.0.0.1:0"},
    }))
    exp = tmp_path / "exp"
    started = tk("run", config, "--detach", "--experiment-dir", exp, timeout=START_S * 4)
    assert started.returncode == 0, started.stdout + started.stderr
    lines = started.stdout.splitlines()
    pid = int(lines[0].rsplit("(pid ", 1)[1].rstrip(")"))
    (said,) = [line for line in lines if line.startswith("coordinator: ")]
    address = said.split()[1]
    assert said == (f"coordinator: {address} (agents started by hand dial it: "
                    f"trialkeeper agent --coordinator {address} --environment-id ID)"), lines
    env = {**os.environ, "TRIALKEEPER_TOKEN": (exp / ".token").read_text()}
    agent = subprocess.Popen(
        [sys.executable, "-m", "trialkeeper.agent", "--coordinator", address, "--environment-id", "box-a",
         "--workdir", str(tmp_path / "box"), "--no-gpu"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # The run ends by itself once its two trials ran, on the hand agent: the only environment.
        wait_until(lambda: pid_gone(pid), START_S * 4, message="the detached run did not end")
        trials = stored_rows(exp, "trials")
        assert [(t["status"], t["environment_id"]) for t in trials] == [("SUCCEEDED", "box-a")] * 2, trials
        assert [e["id"] for e in stored_rows(exp, "environments")] == ["box-a"]
        _, stderr = agent.communicate(timeout=START_S)  # told to shut down with the experiment
        assert agent.returncode == 0, stderr
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(START_S)
        if not pid_gone(pid):
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: pid_gone(pid), START_S * 4, message="the detached run ended after SIGTERM")
