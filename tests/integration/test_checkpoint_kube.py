"""Checkpoints end to end on Kubernetes: the real control plane of tests/kube with the
stand-in kubelet as its node, running the experiment of examples/checkpoints while the pods
of its agents are deleted again and again (grace 0: the node kills every process of the pod).
Agents upload checkpoints over their streams and the agent that continues a trial, in another
pod, downloads it. Every trial ends SUCCEEDED with one complete curve, and the epochs computed
in all stay within 1.3 times those of an undisturbed run (tests/checkpoint_chaos.py).

Where the cluster cannot start these tests skip with the reason; in CI (``CI`` set) they fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_chaos import Seen, check_finished, cli, end, finish, take_environments, workload
from conftest import pid_gone, wait_until
from kube.cluster import KubeCluster, section
from trialkeeper.coordinator.read.model import EnvSnapshot, ReadModel
from trialkeeper.coordinator.services.kubernetes.objects import selector

# On the Kubernetes test cluster, which the session starts for the first test that needs it.
pytestmark = [pytest.mark.slow, pytest.mark.kube]

WAIT_S = 60.0
RUN_S = 180.0
NS = "default"


@pytest.mark.timeout(360)
def test_pods_deleted_again_and_again_continue_from_downloaded_checkpoints(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    w = workload(tmp_path, trials=4, epochs=6)
    config = w.write_config(section(kube_cluster, "kubernetes", tmp_path, workload="pod"))
    deleted: list[list[int]] = []

    def delete_pod(env: EnvSnapshot, now: Seen) -> None:
        assert now.experiment is not None
        pods = kube_cluster.objects("pods", selector=selector(now.experiment.id, env.id))
        assert len(pods) == 1, pods
        name = pods[0]["metadata"]["name"]
        pids = kube_cluster.node.pod_pids(NS, name)
        assert pids, f"pod {name} runs no process"
        kube_cluster.delete_pod(NS, name, grace_s=0)
        deleted.append(pids)

    run = cli("run", str(config), "--experiment-dir", str(w.exp), "--quiet")
    try:
        losses = take_environments(w, run, 3, delete_pod, timeout=WAIT_S)
        finish(run, RUN_S, "trialkeeper run")
    finally:
        end(run)
    summary = check_finished(w, losses)
    for loss in losses.taken:
        assert summary["attempts"][loss.trial_id] >= 2, (loss, summary)
    # Uploaded: the coordinator holds each trial's last checkpoint in the experiment's directory.
    with ReadModel.open(w.exp) as model:
        experiment = model.experiment()
        for trial_id in summary["attempts"]:
            last = model.checkpoints(trial_id)[-1]
            assert last.step == w.epochs and last.location == "", last
            assert (w.exp / "checkpoints" / trial_id / str(last.step) / "state.pkl").is_file(), last
    assert experiment is not None
    assert len(deleted) == 3 and all(pid_gone(p) for pids in deleted for p in pids), deleted
    wait_until(lambda: not kube_cluster.objects("pods", selector=selector(experiment.id)), timeout=WAIT_S,
               message="the experiment's pods are still there")
