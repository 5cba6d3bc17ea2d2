"""Checkpoints end to end on a real single-node Slurm (tests/slurm.py): the experiment of
examples/checkpoints while its agents' jobs are ended with ``scancel`` again and again, which
signals every process of the job, trial and agent at once. Jobs see the experiment's
directory, so checkpoints are saved there by rename. Every trial ends SUCCEEDED with one
complete curve, and the epochs computed in all stay within 1.3 times those of an undisturbed
run (tests/checkpoint_chaos.py).

Where Slurm cannot start these tests skip with the reason; in CI (``CI`` set) they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoint_chaos import Seen, check_finished, cli, end, finish, take_environments, workload
from conftest import stored_rows, wait_until
from slurm import SlurmCluster, SlurmUnavailable, acquire_cluster, release_cluster
from trialkeeper.coordinator.read.model import EnvSnapshot, ReadModel

# A real Slurm cluster: slow to start, left out of the fast subset.
pytestmark = pytest.mark.slow

WAIT_S = 60.0
RUN_S = 150.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        found = acquire_cluster(lambda: tmp_path_factory.mktemp("slurm-cluster"))
    except SlurmUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"the Slurm tests need slurm-wlm and munge and could not start them: {e}")
        pytest.skip(f"Slurm cannot run here: {e}")
    try:
        yield found
    finally:
        release_cluster()


@pytest.mark.timeout(300)
def test_jobs_cancelled_again_and_again_continue_from_their_checkpoints(tmp_path: Path, cluster: SlurmCluster) -> None:
    w = workload(tmp_path, trials=4, epochs=6)
    config = w.write_config({
        "platform": "slurm", "reuseMode": True, "partition": cluster.partition, "timeLimit": "10m",
        "cpusPerTask": 1, "memory": "512MiB", "pollInterval": "0.5s",
    })
    cancelled: list[str] = []

    def scancel(env: EnvSnapshot, now: Seen) -> None:
        kind, job_id = env.platform_id.split()
        assert kind == "job", env.platform_id
        cluster.command("scancel", job_id)
        cancelled.append(job_id)

    run = cli("run", str(config), "--experiment-dir", str(w.exp), "--quiet")
    try:
        losses = take_environments(w, run, 3, scancel, timeout=WAIT_S)
        finish(run, RUN_S, "trialkeeper run")
    finally:
        end(run)
    summary = check_finished(w, losses)
    for loss in losses.taken:
        assert summary["attempts"][loss.trial_id] >= 2, (loss, summary)
    envs = {e["id"]: e for e in stored_rows(w.exp, "envs")}
    for loss in losses.taken:
        assert envs[loss.env_id]["status"] == "FAILED" and "cancelled" in envs[loss.env_id]["reason"], envs[loss.env_id]
    # Saved by rename on the file system the jobs share with the coordinator.
    with ReadModel.open(w.exp) as model:
        for trial_id in summary["attempts"]:
            last = model.checkpoints(trial_id)[-1]
            assert last.step == w.epochs and last.location == "", last
            assert (w.exp / "checkpoints" / trial_id / str(last.step) / "state.pkl").is_file(), last
    jobs = {e["platform_id"].split()[1] for e in envs.values()}
    assert set(cancelled) <= jobs, (cancelled, jobs)
    wait_until(lambda: not [j for j in cluster.jobs("tk-") if j[0] in jobs], timeout=WAIT_S,
               message=f"the experiment's jobs are still in squeue: {cluster.jobs('tk-')}")
