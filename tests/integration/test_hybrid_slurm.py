"""Local agents and a real single-node Slurm (tests/slurm.py) in one experiment: local
first, Slurm when local is full; a job cancelled under its trial is a lost environment whose
trial is retried wherever there is room, and Slurm replaces its own job."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import async_wait_until, quickstart_code, run_async, stored_rows, wait_until
from slurm import SlurmCluster
from test_hybrid import _data, readme_config
from test_slurm import (
    _experiment_jobs,
    cluster,  # noqa: F401 - the fixture
)
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.store.store import Store

# A real Slurm cluster: left out of the fast subset.
pytestmark = pytest.mark.slow

WAIT_S = 60.0


@pytest.mark.slow
def test_local_first_then_slurm_and_a_cancelled_job_s_trial_is_retried(
    tmp_path: Path, cluster: SlurmCluster,  # noqa: F811 - the fixture imported above
) -> None:
    slurm = {
        "platform": "slurm",
        "environmentCount": 1,
        "pollInterval": "0.5s",
        "partition": "debug",
        "timeLimit": "10m",
    }
    data = _data(tmp_path, [{"platform": "local", "environmentCount": 1}, slurm], hold=True)
    data["maxTrialRetries"] = 1
    config = parse_config(data, tmp_path)

    async def body() -> str:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await async_wait_until(
                lambda: sorted(e.status.value for e in c.environments() if e.status) == ["READY", "READY"], WAIT_S,
                message="the local agent and the Slurm job did not both come up",
            )
            first = await c.submit({"x": 1})
            second = await c.submit({"x": 2})
            await async_wait_until(
                lambda: first.info.status is TrialStatus.RUNNING and second.info.status is TrialStatus.RUNNING,
                WAIT_S, message="the two trials did not run at once",
            )
            platform = {e.id: e.platform for e in c.environments()}
            # Local is preferred (listed first); the trial it had no room for went to Slurm.
            assert platform[first.info.environment_id or ""] == "local"
            lost = next(e for e in c.environments() if e.id == second.info.environment_id)
            assert lost.platform == "slurm" and lost.platform_id.startswith("job ")
            cluster.command("scancel", lost.platform_id.split()[1])
            await async_wait_until(lambda: second.info.attempts == 2, WAIT_S, message=f"not retried: {second.info}")
            (tmp_path / "gate" / "go").write_text("")
            for h in (first, second):
                assert (await h.wait(WAIT_S)).status is TrialStatus.SUCCEEDED, h.info
            envs = c.environments()
            # Slurm replaced its own lost job; local kept its one environment.
            assert sorted(e.platform for e in envs) == ["local", "slurm", "slurm"], [(e.id, e.platform) for e in envs]
            return c.experiment_id

    experiment_id = run_async(body, timeout=150)
    wait_until(lambda: not _experiment_jobs(cluster, experiment_id), WAIT_S, message="Slurm jobs left behind")


@pytest.mark.slow
def test_the_readme_s_hybrid_config_runs_as_it_is(
    tmp_path: Path, cluster: SlurmCluster, capfd: pytest.CaptureFixture[str],  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = quickstart_code(tmp_path)
    text = readme_config("hybrid-config")
    data = yaml.safe_load(text)
    assert isinstance(data["trainingService"], list)  # NNI's list form
    config = code / "config.yml"
    config.write_text(text)  # as written: experiments are kept in ~, a home of this test's own
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.main(["run", str(config), "--quiet"]) == 0, capfd.readouterr()
    (exp,) = (tmp_path / "home" / "trialkeeper-experiments").iterdir()
    trials = stored_rows(exp, "trials")
    assert len(trials) == data["maxTrialNumber"]
    assert {t["status"] for t in trials} == {"SUCCEEDED"}, [(t["id"], t["status"], t["reason"]) for t in trials]
    assert sorted(e["platform"] for e in stored_rows(exp, "envs")) == ["local", "slurm", "slurm"]
    store = Store.in_dir(exp, readonly=True)
    experiment_id = str(store.experiment()["id"])  # type: ignore[index]
    store.close()
    wait_until(lambda: not _experiment_jobs(cluster, experiment_id), WAIT_S, message="Slurm jobs left behind")


@pytest.mark.slow
def test_a_trial_needing_gpus_goes_to_the_platform_that_has_them(
    tmp_path: Path, cluster: SlurmCluster,  # noqa: F811 - the fixture imported above
) -> None:
    # Slurm preferred, but its jobs have no GPUs here; the local agent pretends to have two.
    slurm = {"platform": "slurm", "environmentCount": 1, "pollInterval": "0.5s"}
    local = {"platform": "local", "environmentCount": 1, "simulatedGpus": 2}
    config = parse_config(_data(tmp_path, [slurm, local], together=1), tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await async_wait_until(
                lambda: sorted(e.status.value for e in c.environments() if e.status) == ["READY", "READY"], WAIT_S,
                message="the local agent and the Slurm job did not both come up",
            )
            gpu = await c.submit({"x": 1}, gpu_number=2)
            cpu = await c.submit({"x": 2})
            for h in (gpu, cpu):
                assert (await h.wait(WAIT_S)).status is TrialStatus.SUCCEEDED, h.info
            platform = {e.id: e.platform for e in c.environments()}
            assert platform[gpu.info.environment_id or ""] == "local" and gpu.info.gpu_indices == (0, 1)
            assert platform[cpu.info.environment_id or ""] == "slurm"
            # Too large for both, which have registered: it fails saying so, and nothing else does.
            big = await (await c.submit({"x": 3}, gpu_number=3)).wait(WAIT_S)
            assert big.status is TrialStatus.FAILED, big
            assert "trial asks for 3 GPUs but no environment offers more than 2" in big.reason, big.reason

    run_async(body, timeout=120)
