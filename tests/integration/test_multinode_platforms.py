"""Multi-node trials beyond this machine's own agents: two machines over the real sshd
(tests/sshd.py), two jobs of the real local Slurm (tests/slurm.py). Each runs a real
collective across its two ranks (JAX's multi-process CPU backend over gloo)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import run_async
from test_multinode import EXAMPLE, WAIT_S, jax_python, ranks_output
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


@pytest.mark.slow
def test_a_two_node_trial_on_two_slurm_jobs(tmp_path: Path, cluster: Any) -> None:  # noqa: F811
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(EXAMPLE, code / "collective.py")
    data = {
        "trialCommand": f"{jax_python()} collective.py", "trialCodeDirectory": str(code), "trialConcurrency": 1,
        "trialNodes": 2, "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trainingService": {
            "platform": "slurm", "reuseMode": True, "environmentCount": 2, "partition": "debug",
            "timeLimit": "10m", "cpusPerTask": 1, "memory": "512MiB", "pollInterval": "0.5s",
        },
    }
    _run_one(parse_config(data, code), tmp_path / "exp", 2)
