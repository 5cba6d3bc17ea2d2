"""Multi-node trials on the local platform: several real agents on this machine, one trial
process on each, joined by a real collective (JAX's multi-process CPU backend over gloo,
installed in the interpreter $TRIALKEEPER_JAX_PYTHON names: see .ci/run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_config, run_async
from trialkeeper.coordinator.config import ConfigError
from trialkeeper.coordinator.core import Coordinator, TrialRefused
from trialkeeper.coordinator.engine.states import TrialStatus

WAIT_S = 240.0
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multinode" / "collective.py"


def jax_python() -> str:
    python = os.environ.get("TRIALKEEPER_JAX_PYTHON")
    if not python:
        pytest.fail("TRIALKEEPER_JAX_PYTHON is not set: python3 -m venv .venv-jax && "
                    ".venv-jax/bin/pip install jax -e . && export TRIALKEEPER_JAX_PYTHON=$PWD/.venv-jax/bin/python")
    return python


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
        trainingService={"environmentCount": nodes},
    )
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
