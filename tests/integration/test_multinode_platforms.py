"""Multi-node trials beyond this machine's own agents: two machines over the real sshd
(tests/sshd.py), two jobs of the real local Slurm (tests/slurm.py), and one Slurm job of two
nodes (``jobPerTrial``: ``sbatch --nodes=2``, an agent on each node through ``srun``). Each
runs a real collective across its two ranks (JAX's multi-process CPU backend over gloo)."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import async_wait_until, run_async, stored_rows
from slurm import NODES
from test_multinode import EXAMPLE, FAST, HOLD_COLLECTIVE, WAIT_S, _agent_pid, jax_python, ranks_output
from test_remote import _code_dir, _config, lab  # noqa: F401 - lab: the two sshd machines
from test_slurm import cluster  # noqa: F401 - cluster: the real local Slurm
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus


def _run_one(config: Any, exp: Path, nodes: int) -> None:
    async def body() -> None:
        async with Coordinator(config, experiment_dir=exp) as c:
            h = await c.submit({"x": 1.5})
            info = await h.wait(WAIT_S * 2)
            assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
            expected = 1.5 * sum(range(1, nodes + 1))
            assert info.final_metric == expected
            # Each rank's output came back to the experiment's directory, its own file each.
            outs = ranks_output(exp, h.id, nodes)
            assert [o["total"] for o in outs] == [expected] * nodes
            assert [o["env"]["RANK"] for o in outs] == [str(r) for r in range(nodes)]
            assert len({(o["env"]["MASTER_ADDR"], o["env"]["MASTER_PORT"]) for o in outs}) == 1
            assert len({r.environment_id for r in info.ranks}) == nodes

    run_async(body(), timeout=WAIT_S * 3)


def test_a_two_node_trial_on_two_remote_machines(tmp_path: Path, lab: Any) -> None:  # noqa: F811
    code = _code_dir(tmp_path)
    shutil.copy(EXAMPLE, code / "collective.py")
    data = _config(tmp_path, lab, [lab.entry(0), lab.entry(1)], trialCommand=f"{jax_python()} collective.py",
                   trialConcurrency=1, trialNodes=2)
    _run_one(parse_config(data, code), tmp_path / "exp", 2)


def _slurm_data(tmp_path: Path, **platform: Any) -> dict[str, Any]:
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(EXAMPLE, code / "collective.py")
    return {
        "trialCommand": f"{jax_python()} collective.py", "trialCodeDirectory": str(code), "trialConcurrency": 1,
        "trialNodes": 2, "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trainingService": {
            "platform": "slurm", "reuseMode": True, "environmentCount": 2, "partition": "debug",
            "timeLimit": "10m", "cpusPerTask": 1, "memory": "512MiB", "pollInterval": "0.5s", **platform,
        },
    }


@pytest.mark.slow
def test_a_two_node_trial_on_two_slurm_jobs(tmp_path: Path, cluster: Any) -> None:  # noqa: F811
    data = _slurm_data(tmp_path)
    _run_one(parse_config(data, tmp_path / "code"), tmp_path / "exp", 2)


@pytest.mark.slow
def test_a_two_node_trial_in_one_slurm_job_of_two_nodes(tmp_path: Path, cluster: Any) -> None:  # noqa: F811
    data = _slurm_data(tmp_path, jobPerTrial=True)
    exp = tmp_path / "exp"
    _run_one(parse_config(data, tmp_path / "code"), exp, 2)
    envs = stored_rows(exp, "envs")
    # Both ranks' environments are the one job's two tasks, one on each of the two nodes.
    assert len(envs) == 2 and len({e["platform_id"] for e in envs}) == 1, envs
    job_id = envs[0]["platform_id"].removeprefix("job ")
    shown = cluster.command("scontrol", "show", "job", "--oneliner", job_id).stdout
    assert "NumNodes=2 " in shown and f"NodeList={NODES[0][:-2]}-[1-2]" in shown, shown
    script = (exp / "envs" / envs[0]["id"] / "job.sh").read_text()
    assert "#SBATCH --nodes=2\n" in script and "exec srun " in script, script
    for e in envs:  # each agent wrote its own log and, once stopped, its own exit status
        assert (exp / "envs" / e["id"] / "agent.exit").read_text() == "0", e


@pytest.mark.slow
def test_a_rank_killed_in_a_slurm_job_of_two_nodes_ends_the_job_and_the_trial_runs_again_on_a_new_one(
    tmp_path: Path, cluster: Any  # noqa: F811
) -> None:
    """kill -9 of one rank's agent: its srun task fails, so srun ends the other (the job ends as
    one), and the trial is retried whole in a new job of two nodes."""
    data = _slurm_data(tmp_path, jobPerTrial=True)
    code = tmp_path / "code"
    (code / "trial.py").write_text(HOLD_COLLECTIVE)
    go = tmp_path / "go"
    data.update(trialCommand=f"{jax_python()} trial.py", maxTrialRetries=1, coordinator=FAST)

    async def body() -> None:
        async with Coordinator(parse_config(data, code), experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({"go": str(go)})
            started = [c.experiment_dir / "trials" / h.id / d / "output" / "started" for d in ("", "rank1")]
            await async_wait_until(lambda: all(p.exists() for p in started), WAIT_S * 2, message="both ranks run")
            first = {r.environment_id for r in h.info.ranks}
            started[0].unlink()
            os.kill(_agent_pid(c, h.info.ranks[1].environment_id), signal.SIGKILL)
            await async_wait_until(lambda: h.info.attempts == 2 and started[0].exists(), WAIT_S * 2)
            again = {r.environment_id for r in h.info.ranks}
            assert not again & first, (first, again)  # a whole new group, not the survivor
            go.write_text("")
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
            assert info.final_metric == 3.0 and info.attempts == 2
            envs = {e["id"]: e for e in stored_rows(c.experiment_dir, "envs")}
            assert len({envs[e]["platform_id"] for e in first}) == 1, envs
            assert len({envs[e]["platform_id"] for e in again}) == 1, envs
            # The first job ended as one (srun ends the other task, or the coordinator the job),
            # its other agent with it.
            assert {envs[e]["status"] for e in first} <= {"FAILED", "STOPPED"}, [envs[e] for e in first]
            shown = cluster.command("scontrol", "show", "job", "--oneliner",
                                    envs[next(iter(first))]["platform_id"].removeprefix("job ")).stdout
            assert re.search(r"JobState=(FAILED|CANCELLED) ", shown), shown

    run_async(body(), timeout=WAIT_S * 4)
