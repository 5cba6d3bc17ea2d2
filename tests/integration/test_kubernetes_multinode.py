"""Multi-node trials on the real Kubernetes test cluster (tests/kube): a trial of 2 nodes runs
one process in each of 2 pods, joined by a real collective (JAX's multi-process CPU backend
over gloo, as in test_multinode.py), as plain Pods, as PyTorchJobs run by Kubeflow's training
operator and as Frameworks run by FrameworkController (one object per node; FrameworkController
where a binary of it is given, see tests/kube/operators.py).

The stand-in kubelet runs each pod as a local process, so MASTER_ADDR is the address rank 0's
agent reaches the coordinator from, as in a pod of a real cluster (its pod IP)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import run_async
from interpreters import jax_python
from kube.cluster import KubeCluster, section
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.store.store import Store

WAIT_S = 300.0
NODES = 2
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multinode" / "collective.py"
FLAVOURS = [
    pytest.param("kubernetes", {}, id="pod"),
    # The training operator gives a PyTorchJob's pods MASTER_ADDR, WORLD_SIZE and RANK of their
    # own job (of one pod here): a trial's ranks get the gang's, not those.
    pytest.param("kubeflow", {"operator": "pytorchjob"}, id="pytorchjob"),
    # jobPerTrial: one PyTorchJob per trial, a Master and a Worker, each replica one agent.
    pytest.param("kubeflow", {"operator": "pytorchjob", "jobPerTrial": True}, id="pytorchjob-per-trial"),
    pytest.param("frameworkcontroller", {}, id="framework"),
    # jobPerTrial: one Framework per trial, its task role a task per node.
    pytest.param("frameworkcontroller", {"jobPerTrial": True}, id="framework-per-trial"),
]
# The one object of a trial with jobPerTrial, and how many pods of each role it asks for.
GROUPS = {"kubeflow": ("pytorchjobs", "kubeflow.org", lambda spec: {
              r: s["replicas"] for r, s in spec["pytorchReplicaSpecs"].items()}),
          "frameworkcontroller": ("frameworks", "frameworkcontroller.microsoft.com", lambda spec: {
              r["name"]: r["taskNumber"] for r in spec["taskRoles"]})}
EXPECTED_ROLES = {"kubeflow": {"Master": 1, "Worker": NODES - 1}, "frameworkcontroller": {"agent": NODES}}
OPERATORS = {"kubeflow": "kubeflow_operator", "frameworkcontroller": "framework_controller"}


def _rank_lines(exp: Path, trial_id: str) -> list[dict[str, Any]]:
    """Each rank's last JSON line and the trial directory it ran in, rank 0 first."""
    found = []
    for rank in range(NODES):
        log = exp / "trials" / trial_id / (f"rank{rank}" if rank else "") / "stdout.log"
        text = log.read_text()
        dirs = [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("trial dir=")]
        lines = [ln for ln in text.splitlines() if ln.startswith("{")]
        assert dirs and lines, (rank, text[-2000:])
        found.append({**json.loads(lines[-1]), "dir": dirs[-1]})
    return found


@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
@pytest.mark.slow
def test_a_two_node_trial_runs_a_real_collective_across_two_pods(
    kube_cluster: KubeCluster, tmp_path: Path, request: pytest.FixtureRequest, platform: str, extra: dict[str, Any]
) -> None:
    if platform in OPERATORS:
        request.getfixturevalue(OPERATORS[platform])
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(EXAMPLE, code / "collective.py")
    command = f"echo trial dir=$TRIALKEEPER_TRIAL_DIR && {jax_python()} collective.py"
    data = {
        "trialCommand": command, "trialConcurrency": 1, "trialNodes": NODES, "searchSpace": {},
        "trialCodeDirectory": str(code), "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 10, "trialLostTimeout": 30},
        "trainingService": section(kube_cluster, platform, tmp_path, environmentCount=NODES, **extra),
    }
    config = parse_config(data, code)
    exp = tmp_path / "exp"

    async def body() -> None:
        async with Coordinator(config, experiment_dir=exp) as c:
            h = await c.submit({"x": 2.0})
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
            expected = 2.0 * sum(range(1, NODES + 1))
            assert info.final_metric == expected
            outs = _rank_lines(exp, h.id)
            assert [o["total"] for o in outs] == [expected] * NODES  # the collective ran on every node
            assert [o["env"]["RANK"] for o in outs] == [str(r) for r in range(NODES)]
            assert {o["env"]["WORLD_SIZE"] for o in outs} == {o["env"]["NNODES"] for o in outs} == {str(NODES)}
            assert len({(o["env"]["MASTER_ADDR"], o["env"]["MASTER_PORT"]) for o in outs}) == 1
            # Each rank ran in a pod of its own: its own agent, its own trial directory.
            assert len({o["dir"] for o in outs}) == NODES, outs
            if extra.get("jobPerTrial"):  # one object ran both ranks: a Master and a Worker, or two tasks
                plural, group, roles = GROUPS[platform]
                jobs = [o for o in kube_cluster.objects(plural, group=group)
                        if o["metadata"]["annotations"].get("trialkeeper/experiment-id") == c.experiment_id]
                assert len(jobs) == 1, jobs
                assert roles(jobs[0]["spec"]) == EXPECTED_ROLES[platform]
                pods = kube_cluster.objects("pods", selector=f"trialkeeper/experiment={c.experiment_id}")
                assert len(pods) == NODES, [p["metadata"]["name"] for p in pods]

    run_async(body, timeout=WAIT_S + 120)
    store = Store.in_dir(exp, readonly=True)
    try:
        envs = store.envs()
    finally:
        store.close()
    # Two environments, each its own workload on the cluster (a Pod, or a Framework), or both
    # replicas of the trial's one PyTorchJob.
    objects = 1 if extra.get("jobPerTrial") else NODES
    assert len(envs) == NODES and len({e["platform_id"] for e in envs}) == objects, envs
