"""A coordinator killed with kill -9 while a gang waits for the group of environments started
for it (one PyTorchJob per trial, ``jobPerTrial``), on the real Kubernetes test cluster with
Kubeflow's real training operator: ``trialkeeper resume`` knows the group from the store, so
the gang starts on it, and no second PyTorchJob is made for the trial."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import stored_rows, wait_until, write_script
from kube.cluster import KubeCluster, section

WAIT_S = 240.0
NODES = 2
RANK = """
import os
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)
"""


def _cli(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait(timeout=30)


def _launched_group(exp: Path) -> list[dict[str, Any]] | None:
    """The environments of a group started for a trial, once the platform made its object."""
    envs = [e for e in stored_rows(exp, "envs") if e["group_for"] and e["platform_id"]]
    return envs if len(envs) == NODES else None


@pytest.mark.slow
def test_a_waiting_gang_keeps_its_pytorchjob_across_a_kill_9_of_the_coordinator(
    kube_cluster: KubeCluster, kubeflow_operator: Any, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    write_script(code, "rank.py", RANK)
    config = {
        "trialCommand": "python3 rank.py", "trialConcurrency": 1, "trialNodes": NODES, "maxTrialNumber": 1,
        "searchSpace": {"x": {"_type": "choice", "_value": [1]}}, "tuner": {"name": "grid"},
        "trialCodeDirectory": str(code), "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 30, "trialLostTimeout": 60},
        # Room for a second group: a coordinator that forgot the first would ask for one.
        "trainingService": section(kube_cluster, "kubeflow", tmp_path, operator="pytorchjob", jobPerTrial=True,
                                   environmentCount=2 * NODES),
    }
    path = tmp_path / "config.yml"
    path.write_text(json.dumps(config))
    exp = tmp_path / "exp"
    first = _cli("run", str(path), "--experiment-dir", str(exp), "--quiet")
    resumed = None
    try:
        group = wait_until(lambda: _launched_group(exp) or first.poll() is not None, WAIT_S,
                           message="the trial's PyTorchJob was never made")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert group is not True, first.communicate()[0].decode(errors="replace")[-3000:]
        (trial,) = stored_rows(exp, "trials")
        # Killed while the gang waited for its group's agents (they take seconds to come up).
        assert trial["status"] == "WAITING", trial
        assert {e["group_for"] for e in group} == {trial["id"]} and len({e["group_id"] for e in group}) == 1

        resumed = _cli("resume", str(exp), "--quiet")
        out, _ = resumed.communicate(timeout=WAIT_S)
        text = out.decode(errors="replace")
        assert resumed.returncode == 0, text[-4000:]
        (trial,) = stored_rows(exp, "trials")
        assert trial["status"] == "SUCCEEDED", (trial["reason"], trial["stderr_tail"])
        ranks = json.loads(str(trial["ranks_json"]))
        assert sorted(r[1] for r in ranks) == sorted(e["id"] for e in group), ranks  # on its group
        envs = stored_rows(exp, "envs")
        # The group's two replicas of one PyTorchJob, and no other.
        assert sorted(e["id"] for e in envs) == sorted(e["id"] for e in group), envs
        assert len({e["platform_id"] for e in envs}) == 1, envs
        lines = [(exp / "trials" / str(trial["id"]) / sub / "stdout.log").read_text().split() for sub in ("", "rank1")]
        assert [ln[:4] for ln in lines] == [["rank", "0", "of", "2"], ["rank", "1", "of", "2"]], lines
    finally:
        _kill(first)
        _kill(resumed)
