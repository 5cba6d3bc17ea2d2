"""Multi-node trials on the local platform: several real agents on this machine, one trial
process on each, joined by a real collective (JAX's multi-process CPU backend over gloo,
installed in the interpreter $TRIALKEEPER_JAX_PYTHON names: see .ci/run)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import async_wait_until, build_config, run_async
from interpreters import jax_python
from trialkeeper.coordinator.config import ConfigError
from trialkeeper.coordinator.core import Coordinator, TrialRefused
from trialkeeper.coordinator.engine.states import TrialStatus

WAIT_S = 240.0
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multinode" / "collective.py"


def ranks_output(exp: Path, trial_id: str, nodes: int) -> list[dict]:
    found = []
    for rank in range(nodes):
        d = exp / "trials" / trial_id / (f"rank{rank}" if rank else "")
        lines = [ln for ln in (d / "stdout.log").read_text().splitlines() if ln.startswith("{")]
        assert lines, (rank, (d / "stdout.log").read_text(), (d / "stderr.log").read_text()[-2000:])
        found.append(json.loads(lines[-1]))
    return found


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_trial_of_n_nodes_runs_a_real_collective_across_n_local_agents(tmp_path: Path, nodes: int) -> None:
    shutil.copy(EXAMPLE, tmp_path / "collective.py")
    config = build_config(
        tmp_path, trialCommand=f"{jax_python()} collective.py", trialConcurrency=1, trialNodes=nodes,
    )  # environmentCount left out: trialConcurrency x trialNodes environments
    exp = tmp_path / "exp"
    ids: list[str] = []

    async def body() -> None:
        async with Coordinator(config, experiment_dir=exp) as c:
            h = await c.submit({"x": 2.0})
            ids.append(h.id)
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
            expected = 2.0 * sum(range(1, nodes + 1))
            assert info.final_metric == expected
            outs = ranks_output(exp, h.id, nodes)
            assert [o["total"] for o in outs] == [expected] * nodes  # the collective ran on every node
            envs = [o["env"] for o in outs]
            assert [e["RANK"] for e in envs] == [str(r) for r in range(nodes)]
            assert [e["NODE_RANK"] for e in envs] == [e["TRIALKEEPER_NODE_RANK"] for e in envs]
            assert {e["WORLD_SIZE"] for e in envs} == {e["NNODES"] for e in envs} == {str(nodes)}
            assert {e["LOCAL_RANK"] for e in envs} == {"0"}
            assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
            assert {e["NNI_TRIAL_JOB_ID"] for e in envs} == {h.id}  # NNI's variables on every node
            # Results are rank 0's: another rank's report is ignored, said once in its log.
            assert [r.value for r in c.store.metrics(h.id)] == [expected]
            assert next(t for t in c.store.trials() if t["id"] == h.id)["nodes"] == nodes  # kept for a resume
            note = (exp / "trials" / h.id / "rank1" / "stderr.log").read_text()
            assert note.count("results are taken from rank 0") == 1

    run_async(body())
    # Each rank's environment and state, and each rank's output, by the command line.
    shown = subprocess.run([sys.executable, "-m", "trialkeeper.coordinator.cli", "trial", str(exp), ids[0]],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    ranks = [ln.strip() for ln in shown.splitlines() if ln.strip().startswith("rank ")]
    assert len(ranks) == nodes and all(ln.endswith("ended (succeeded)") for ln in ranks), shown
    assert len({ln.split(":")[1] for ln in ranks}) == nodes  # each on an environment of its own
    for rank in range(nodes):
        out = subprocess.run([sys.executable, "-m", "trialkeeper.coordinator.cli", "logs", str(exp), ids[0],
                              "--rank", str(rank)], capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"rank {rank} of {nodes} up" in out


def test_a_gang_that_can_never_fit_is_refused_at_start_and_at_submit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trialNodes|trial_nodes"):
        build_config(tmp_path, trialNodes=3, trainingService={"environmentCount": 2})
    config = build_config(tmp_path, trainingService={"environmentCount": 2})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            with pytest.raises(TrialRefused, match="needs 3 environments at once"):
                await c.submit({"x": 1}, nodes=3)
            with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
                await c.submit({"x": 1}, nodes=0)

    run_async(body())


FAST = {"heartbeatInterval": 0.2, "agentLostTimeout": 1.0, "trialLostTimeout": 2.5}

# Joins the collective, says it runs, holds until the file named by "go" exists, then joins a
# second collective and reports its sum (rank 0's is the trial's).
HOLD_COLLECTIVE = """
import os, pathlib, time
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
jax.distributed.initialize(coordinator_address=os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"],
                           num_processes=world, process_id=rank, initialization_timeout=120)
import jax.numpy as jnp
from jax.experimental import multihost_utils
from trialkeeper.agent import trial
p = trial.get_next_parameter()
multihost_utils.process_allgather(jnp.array([1.0]))
out = pathlib.Path(os.environ["TRIALKEEPER_OUTPUT_DIR"])
(out / "started.tmp").write_text(str(os.getpid()))
(out / "started.tmp").replace(out / "started")
deadline = time.monotonic() + 120
while not pathlib.Path(p["go"]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
trial.report_final_result(float(multihost_utils.process_allgather(jnp.array([rank + 1.0])).sum()))
jax.distributed.shutdown()
"""

# Works for `s` seconds (the trial's length, the thing the scheduler plans around), then succeeds.
SHORT = """
import time
from trialkeeper.agent import trial
p = trial.get_next_parameter()
time.sleep(p["s"])
trial.report_final_result(1.0)
"""


def _agent_pid(c: Coordinator, env_id: str) -> int:
    assert c.store is not None
    row = next(e for e in c.store.envs() if e["id"] == env_id)
    return int(json.loads(row["info_json"])["pid"])


def test_a_rank_whose_agent_is_killed_stops_the_others_and_the_trial_is_retried_whole(tmp_path: Path) -> None:
    (tmp_path / "trial.py").write_text(HOLD_COLLECTIVE)
    go = tmp_path / "go"
    config = build_config(
        tmp_path, trialCommand=f"{jax_python()} trial.py", trialConcurrency=1, trialNodes=2, maxTrialRetries=1,
        trainingService={"environmentCount": 2}, coordinator=FAST,
    )

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({"go": str(go)})
            started = [c.experiment_dir / "trials" / h.id / d / "output" / "started" for d in ("", "rank1")]
            await async_wait_until(lambda: all(p.exists() for p in started), WAIT_S, message="both ranks run")
            rank0_pid = int(started[0].read_text())
            doomed = h.info.ranks[1].environment_id
            started[0].unlink()
            os.kill(_agent_pid(c, doomed), signal.SIGKILL)
            # Rank 0's process is stopped once rank 1's environment is lost, and the trial
            # placed again, whole, on the survivor and the replacement.
            await async_wait_until(lambda: not psutil.pid_exists(rank0_pid), WAIT_S, message="rank 0 still runs")
            await async_wait_until(lambda: h.info.attempts == 2 and started[0].exists(), WAIT_S)
            assert doomed not in {r.environment_id for r in h.info.ranks}
            go.write_text("")
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
            assert info.final_metric == 3.0 and info.attempts == 2

    run_async(body())


def test_two_gangs_competing_for_too_few_environments_both_finish(tmp_path: Path) -> None:
    (tmp_path / "trial.py").write_text(SHORT)
    config = build_config(tmp_path, trialConcurrency=3, trainingService={"environmentCount": 3})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            gangs = [await c.submit({"s": 1.0}, nodes=2) for _ in range(2)]
            infos = [await g.wait(WAIT_S) for g in gangs]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 2, [i.reason for i in infos]
            # One waited for the other: never both at once on three environments.
            first, second = sorted(infos, key=lambda i: i.started_at or 0)
            assert (second.started_at or 0) >= (first.ended_at or 0) - 0.5

    run_async(body())


def test_a_stream_of_small_trials_does_not_starve_a_waiting_gang(tmp_path: Path) -> None:
    (tmp_path / "trial.py").write_text(SHORT)
    config = build_config(tmp_path, trialConcurrency=3, trainingService={"environmentCount": 3})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            small = [await c.submit({"s": 2.0}) for _ in range(3)]
            await async_wait_until(lambda: all(s.info.status is TrialStatus.RUNNING for s in small), WAIT_S)
            gang = await c.submit({"s": 0.5}, nodes=3)
            # Small trials keep coming, always more than the environments can take.
            while gang.info.status is TrialStatus.WAITING:
                waiting = sum(1 for s in small if s.info.status is TrialStatus.WAITING)
                if waiting < 3:
                    small.append(await c.submit({"s": 2.0}))
                await asyncio.sleep(0.1)
                assert time.time() - (gang.info.submitted_at or 0) < WAIT_S, gang.info.waiting_reason
            # It started once the trials running when it came had ended: every small trial
            # submitted after it waited for it (they have no time limit, so none could backfill
            # its reserved environments). An order, not a time, so load cannot fail it.
            later = small[3:]
            assert later, "no small trial was submitted while the gang waited"
            gang_started = gang.info.started_at or 0
            assert all((s.info.started_at or float("inf")) >= gang_started for s in later), [
                (s.info.status, s.info.started_at, gang_started) for s in later
            ]
            assert (await gang.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            for s in small:
                assert (await s.wait(WAIT_S)).status is TrialStatus.SUCCEEDED

    run_async(body())


def test_a_trials_own_time_limit_ends_it(tmp_path: Path) -> None:
    (tmp_path / "trial.py").write_text(SHORT)
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            with pytest.raises(ValueError, match="max_duration must be a number of seconds > 0"):
                await c.submit({"s": 1.0}, max_duration=0)
            info = await (await c.submit({"s": 60.0}, max_duration=1.0)).wait(WAIT_S)
            assert info.status is TrialStatus.FAILED and "max duration of 1 s" in info.reason, info.reason

    run_async(body())
