"""The Slurm platform against a real single-node Slurm (munged, slurmctld, slurmd; see tests/slurm.py).

Where Slurm cannot start these tests skip with the reason; in CI (``CI`` set) they fail.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import (
    QUICKSTART,
    async_wait_until,
    environment,
    pid_gone,
    run_async,
    service_from_config,
    stored_rows,
    wait_until,
    write_script,
)
from slurm import SlurmCluster, SlurmUnavailable, acquire_cluster, release_cluster
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.slurm import SlurmEnvironmentService
from trialkeeper.coordinator.services.slurm_config import SlurmConfig
from trialkeeper.coordinator.store.store import Store
from trialkeeper.protos.wire import TOKEN_ENV

# A real Slurm cluster: slow to start, left out of the fast subset.
pytestmark = pytest.mark.slow

WAIT_S = 45.0

# Hangs until the gate file exists (a deadline keeps it from outliving a failed test).
GATED = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
trial.report_intermediate_result(0.5)
gate = pathlib.Path(os.environ["GATE"])
deadline = time.monotonic() + 90
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
trial.report_final_result(float(p.get("x", 1)))
"""


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


def _quickstart(tmp_path: Path, *, reuse: bool, trials: int, **overrides: Any) -> Path:
    code = tmp_path / "code"
    shutil.copytree(QUICKSTART, code, ignore=shutil.ignore_patterns("__pycache__"))
    data = yaml.safe_load((code / "config.yml").read_text())
    data["maxTrialNumber"] = trials
    data["experimentWorkingDirectory"] = str(tmp_path / "experiments")
    data["trainingService"] = {
        "platform": "slurm", "reuseMode": reuse, "partition": "debug", "timeLimit": "10m",
        "cpusPerTask": 1, "memory": "512MiB", "pollInterval": "0.5s",
        "sbatchOptions": ["#SBATCH --nice=0"],
    }
    data.update(overrides)
    config = code / "config.yml"
    config.write_text(yaml.safe_dump(data))
    return config


def _experiment_jobs(cluster: SlurmCluster, experiment_id: str) -> list[tuple[str, str, str]]:
    return cluster.jobs(f"tk-{experiment_id}-")


_rows = stored_rows  # the store as the running coordinator has written it so far


# ---- the quickstart, end to end ----------------------------------------------------------


@pytest.mark.parametrize(("reuse", "trials"), [(True, 24), (False, 4)], ids=["reuse", "no-reuse"])
def test_quickstart_runs_on_slurm(
    tmp_path: Path, cluster: SlurmCluster, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    reuse: bool, trials: int,
) -> None:
    # A user's own sbatch defaults cannot rename the jobs or keep the token from them.
    monkeypatch.setenv("SBATCH_JOB_NAME", "someone-elses")
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")
    config = _quickstart(tmp_path, reuse=reuse, trials=trials)
    exp = tmp_path / "exp"
    rc = cli.main(["run", str(config), "--quiet", "--experiment-dir", str(exp)])
    assert rc == 0, capfd.readouterr()

    trials_rows = _rows(exp, "trials")
    assert [t["status"] for t in trials_rows] == ["SUCCEEDED"] * trials, [
        (t["id"], t["status"], t["reason"]) for t in trials_rows
    ]
    envs = _rows(exp, "envs")
    # Reuse mode: the two jobs of environmentCount took every trial; otherwise a job per trial.
    assert len(envs) == (2 if reuse else trials), [(e["id"], e["status"], e["reason"]) for e in envs]
    assert all(e["platform_id"].startswith("job ") for e in envs)
    assert all(e["status"] == "STOPPED" for e in envs), [(e["id"], e["status"], e["reason"]) for e in envs]
    job_ids = {e["platform_id"].split()[1] for e in envs}
    assert len(job_ids) == len(envs)
    store = Store.in_dir(exp, readonly=True)
    experiment_id = store.experiment()["id"]  # type: ignore[index]
    store.close()
    assert _experiment_jobs(cluster, experiment_id) == []
    # Each job ran the script written for it, with the configured resources.
    script = (exp / "envs" / envs[0]["id"] / "job.sh").read_text()
    for line in ("--partition=debug", "--time=0-00:10:00", "--cpus-per-task=1", "--mem=512M", "--nice=0"):
        assert f"#SBATCH {line}\n" in script
    shown = cluster.command("scontrol", "show", "job", "--oneliner", next(iter(job_ids))).stdout
    assert f"JobName=tk-{experiment_id}-" in shown and "JobState=COMPLETED" in shown, shown
    # `trialkeeper logs` reads what a trial printed in its job.
    capfd.readouterr()
    assert cli.main(["logs", str(exp), trials_rows[0]["id"]]) == 0
    assert "held-out accuracy" in capfd.readouterr().out


# ---- a job cancelled under a running trial ------------------------------------------------


@pytest.mark.parametrize("how", ["scancel", "agent-killed"])
def test_a_job_ended_mid_trial_is_a_lost_environment(tmp_path: Path, cluster: SlurmCluster, how: str) -> None:
    """An agent killed inside its job leaves no word: the trial is lost with its
    environment and retried (``maxTrialRetries``). ``scancel`` ends a job by SIGTERM to all
    its processes, the agent's included: the agent reports its trial lost with the
    environment, not failed, so it is retried without ``retryFailedTrials``."""
    write_script(tmp_path, "trial.py", GATED)
    gate = tmp_path / "gate"
    config = parse_config(
        {
            "trialCommand": f"{sys.executable} trial.py",
            "trialCodeDirectory": str(tmp_path),
            "trialConcurrency": 1,
            "maxTrialRetries": 1,
            "trialEnv": {"GATE": str(gate)},
            "experimentWorkingDirectory": str(tmp_path / "experiments"),
            "trainingService": {"platform": "slurm", "pollInterval": "0.5s"},
        },
        tmp_path,
    )

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            handle = await c.submit({"x": 3})
            await async_wait_until(lambda: handle.info.status is TrialStatus.RUNNING, WAIT_S,
                                   message="the trial never ran")
            env = next(e for e in c.environments() if e.id == handle.info.environment_id)
            job_id = env.platform_id.split()[1]

            # The token is in no command line, no job script and nothing Slurm shows.
            token = (tmp_path / "exp" / ".token").read_text().strip()
            for p in psutil.process_iter(["cmdline"]):
                try:
                    assert token not in " ".join(p.info["cmdline"] or ())
                except psutil.Error:
                    continue
            assert token not in (tmp_path / "exp" / "envs" / env.id / "job.sh").read_text()
            assert token not in cluster.command("scontrol", "show", "job", "-d", job_id).stdout

            first_attempt = _trial_pids(tmp_path)
            assert first_attempt
            if how == "scancel":
                cluster.command("scancel", job_id)
            else:
                os.kill(_agent_pid(tmp_path, env.id), signal.SIGKILL)
            await async_wait_until(
                lambda: environment(c, env.id).status.terminal, WAIT_S, message="the cancelled job went unnoticed"
            )
            env = environment(c, env.id)
            if how == "scancel":
                assert "cancelled" in env.reason and job_id in env.reason, env.reason
            else:
                assert f"Slurm job {job_id} failed" in env.reason and "status 137" in env.reason, env.reason
            # The trial went with its job, before the gate that ends it was opened.
            await async_wait_until(lambda: all(pid_gone(p) for p in first_attempt), WAIT_S,
                                   message="the first attempt's trial outlived its job")
            # The trial is run again, on the job that replaced the lost one.
            await async_wait_until(lambda: handle.info.attempts == 2 and handle.info.status is TrialStatus.RUNNING,
                                   WAIT_S, message=f"the trial was not retried: {handle.info}")
            gate.write_text("")
            info = await handle.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, info
            assert info.environment_id != env.id
            replacement = next(e for e in c.environments() if e.id == info.environment_id)
            assert replacement.platform_id != env.platform_id
            experiment_id = c.experiment_id
        wait_until(lambda: not _experiment_jobs(cluster, experiment_id), WAIT_S)

    run_async(body, timeout=120)


def _trial_pids(tmp_path: Path) -> list[int]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TRIALKEEPER_TRIAL_DIR", "").startswith(str(tmp_path)):
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def _agent_pid(tmp_path: Path, env_id: str) -> int:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        # The agent itself, not the job's supervisor process that runs it.
        if cmd[1:3] == ["-m", "trialkeeper.agent"] and env_id in cmd and any(str(tmp_path) in a for a in cmd):
            return int(p.pid)
    raise AssertionError(f"no agent process for {env_id}")


# ---- resume after the coordinator died ------------------------------------------------------


@pytest.mark.parametrize("after", ["resume", "clean"])
def test_after_a_crash_resume_adopts_the_jobs_and_clean_removes_them(
    tmp_path: Path, cluster: SlurmCluster, after: str
) -> None:
    write_script(tmp_path, "trial.py", GATED)
    gate = tmp_path / "gate"
    config = tmp_path / "config.yml"
    config.write_text(json.dumps({
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3, 4]}},
        "tuner": {"name": "grid"},
        "trialEnv": {"GATE": str(gate)},
        "trainingService": {"platform": "slurm", "pollInterval": "0.5s"},
        "coordinator": {"heartbeatInterval": 0.2, "agentLostTimeout": 2, "trialLostTimeout": 30},
    }))
    exp = tmp_path / "exp"
    first = _cli("run", str(config), "--experiment-dir", str(exp), "--quiet")
    second = None
    try:
        wait_until(lambda: sum(t["status"] == "RUNNING" for t in _rows(exp, "trials")) == 2, WAIT_S,
                   message="two trials never ran")
        store = Store.in_dir(exp, readonly=True)
        experiment_id = store.experiment()["id"]  # type: ignore[index]
        store.close()
        jobs_before = {j[0] for j in _experiment_jobs(cluster, experiment_id)}
        assert len(jobs_before) == 2
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        # The jobs outlive their coordinator.
        assert {j[0] for j in _experiment_jobs(cluster, experiment_id)} == jobs_before

        if after == "clean":
            second = _cli("clean", str(exp))
            out, _ = second.communicate(timeout=WAIT_S)
            text = out.decode(errors="replace")
            assert second.returncode == 0 and "env-1" in text and "env-2" in text, text
            assert _experiment_jobs(cluster, experiment_id) == []
            return
        # A job queued just before the crash, which the store never heard of: resume removes it.
        orphan = run_async(lambda: _service(tmp_path).start(_request("env-9", experiment_id)), timeout=30)
        assert orphan.error is None, orphan
        second = _cli("resume", str(exp), "--quiet")
        resumed = second
        wait_until(lambda: sum(e["status"] in ("READY", "BUSY") for e in _rows(exp, "envs")) == 2
                   or resumed.poll() is not None, WAIT_S, message="the agents did not reconnect")
        gate.write_text("")
        out, _ = second.communicate(timeout=WAIT_S)
        assert second.returncode == 0, out.decode(errors="replace")
        trials = _rows(exp, "trials")
        assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
        envs = _rows(exp, "envs")
        # The jobs that ran before the crash finished the experiment: adopted, not replaced.
        assert {e["platform_id"].split()[1] for e in envs} == jobs_before, envs
        orphan_job = orphan.platform_id.split()[1]
        shown = cluster.command("scontrol", "show", "job", "--oneliner", orphan_job).stdout
        assert "JobState=CANCELLED" in shown, shown
        wait_until(lambda: not _experiment_jobs(cluster, experiment_id), WAIT_S,
                   message=f"jobs left in squeue: {_experiment_jobs(cluster, experiment_id)}")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        gate.write_text("")


def _cli(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


# ---- the service on its own: sweep, adopt, errors -----------------------------------------


def _service(tmp_path: Path, **section: Any) -> SlurmEnvironmentService:
    config = parse_config(
        {
            "trialCommand": "python3 trial.py",
            "trialCodeDirectory": str(tmp_path),
            "trialConcurrency": 1,
            "trainingService": {"platform": "slurm", "pollInterval": "0.2s", **section},
        },
        tmp_path,
    )
    return service_from_config(SlurmEnvironmentService, config, tmp_path / "exp")


def _request(env_id: str, experiment_id: str) -> EnvironmentRequest:
    # Nothing listens there: each agent keeps redialling within its window until stopped.
    return EnvironmentRequest(env_id=env_id, experiment_id=experiment_id, coordinator_address="127.0.0.1:9",
                              token="not-a-real-token", agent_args=("--reconnect-window", "60"))


def test_a_new_service_sweeps_and_adopts_jobs_by_experiment_id(tmp_path: Path, cluster: SlurmCluster) -> None:
    experiment_id = f"sw{os.getpid()}"

    async def body() -> None:
        first = _service(tmp_path)
        started = {e: await first.start(_request(e, experiment_id)) for e in ("env-1", "env-2", "env-3")}
        assert all(r.error is None and r.platform_id.startswith("job ") for r in started.values()), started
        # A second start of the same id is the same job.
        assert (await first.start(_request("env-1", experiment_id))).platform_id == started["env-1"].platform_id
        await async_wait_until(lambda: len(_experiment_jobs(cluster, experiment_id)) == 3, WAIT_S)

        # The coordinator "crashed": a fresh service knows nothing but the experiment id.
        second = _service(tmp_path)
        removed = await second.sweep(experiment_id, keep={"env-1"})
        assert removed == ["env-2", "env-3"]
        assert [j[1] for j in _experiment_jobs(cluster, experiment_id)] == [f"tk-{experiment_id}-env-1"]
        second.adopt("env-1", started["env-1"].platform_id)

        async def running() -> bool:
            return (await second.poll(["env-1"]))["env-1"].state == "running"

        await async_wait_until(running, WAIT_S)
        await second.stop("env-1", grace_s=0.0)
        assert not _experiment_jobs(cluster, experiment_id)
        assert (await second.poll(["env-1"]))["env-1"].state == "exited"
        assert (await second.poll(["env-9"]))["env-9"].state == "unknown"
        await second.stop("env-9")  # unknown: a no-op
        assert await second.sweep(experiment_id) == []
        await first.close()
        await second.close()

    run_async(body, timeout=90)


def test_sbatch_errors_are_returned_as_data(tmp_path: Path, cluster: SlurmCluster) -> None:
    async def body() -> None:
        service = _service(tmp_path, partition="no-such-partition")
        result = await service.start(_request("env-1", f"bad{os.getpid()}"))
        assert result.platform_id == "" and result.error is not None
        assert "sbatch could not queue" in result.error and "partition" in result.error.lower(), result.error
        # A start that failed polls as failed, saying why (as on every job platform).
        seen = (await service.poll(["env-1"]))["env-1"]
        assert seen.state == "failed" and "sbatch could not queue" in seen.detail, seen
        await service.close()

    run_async(body, timeout=60)


def test_an_agent_that_fails_at_once_is_reported_failed_with_its_output(tmp_path: Path, cluster: SlurmCluster) -> None:
    async def body() -> None:
        # The agent refuses an empty token: the job ends non-zero at once.
        service = _service(tmp_path)
        request = EnvironmentRequest(env_id="env-1", experiment_id=f"fail{os.getpid()}",
                                     coordinator_address="127.0.0.1:9", token="")

        async def ended() -> bool:
            return (await service.poll(["env-1"]))["env-1"].state in ("exited", "failed")

        assert (await service.start(request)).error is None
        await async_wait_until(ended, WAIT_S)
        obs = (await service.poll(["env-1"]))["env-1"]
        assert obs.state == "failed" and "no token" in obs.detail and "exited with status 1" in obs.detail, obs
        await service.close()

    run_async(body, timeout=60)


# ---- config ---------------------------------------------------------------------------------


def _parse(tmp_path: Path, **section: Any) -> SlurmConfig:
    config = parse_config(
        {"trialCommand": "x", "trialConcurrency": 3, "trialCodeDirectory": str(tmp_path),
         "trainingService": {"platform": "slurm", **section}},
        tmp_path,
    )
    assert isinstance(config.training_service, SlurmConfig)
    return config.training_service


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _parse(tmp_path, partiton="gpu", memory="lots", timeLimit="-1h", cpusPerTask=0,
               sbatchOptions=["constraint=a100"], gres="gpu:2", gpusPerNode=2, slurmBinDirectory="/no/such")
    paths = {issue.path: issue.message for issue in e.value.issues}
    assert "did you mean" in paths["trainingService.partiton"] and "partition" in paths["trainingService.partiton"]
    for field in ("memory", "timeLimit", "cpusPerTask", "sbatchOptions", "gres", "slurmBinDirectory"):
        assert f"trainingService.{field}" in paths, paths
    with pytest.raises(ConfigError) as e:
        _parse(tmp_path, sbatchOptions=["--exclusive", "--job-name=mine"])
    assert [issue.path for issue in e.value.issues] == ["trainingService.sbatchOptions[1]"]
    assert "set by trialkeeper" in str(e.value)
    # jobPerTrial sets each trial's job layout itself, and takes trial after trial (reuse mode).
    assert _parse(tmp_path, sbatchOptions=["--nodes=2"]).sbatch_options == ["--nodes=2"]
    with pytest.raises(ConfigError) as e:
        _parse(tmp_path, jobPerTrial=True, reuseMode=False, sbatchOptions=["--exclusive", "--nodes=2", "-n 4"])
    paths = {issue.path: issue.message for issue in e.value.issues}
    assert set(paths) == {"trainingService.sbatchOptions[1]", "trainingService.sbatchOptions[2]",
                          "trainingService.jobPerTrial"}, paths
    assert "trialNodes" in paths["trainingService.sbatchOptions[1]"]
    assert "reuseMode: true" in paths["trainingService.jobPerTrial"]


def test_config_becomes_sbatch_options(tmp_path: Path) -> None:
    ts = _parse(tmp_path, partition="gpu", account="lab", timeLimit="1.5d", memory="8GiB", cpusPerTask=4,
                trialsPerEnvironment=2, sbatchOptions=["#SBATCH --constraint=a100", "--exclusive"])
    assert ts.sbatch_directives(trial_gpu_number=1) == [
        "--partition=gpu", "--account=lab", "--time=1-12:00:00", "--gpus-per-node=2", "--cpus-per-task=4",
        "--mem=8192M", "--constraint=a100", "--exclusive",
    ]
    assert ts.effective_environment_count(3) == 2 and ts.trial_slots_per_environment(3) == 2
    assert not _parse(tmp_path).requests_gpus(0)
    assert _parse(tmp_path, gres="gpu:a100:1").sbatch_directives(0) == ["--gres=gpu:a100:1"]
    assert _parse(tmp_path, reuseMode=False, environmentCount=1).effective_environment_count(3) == 3


def test_a_group_is_one_job_of_a_node_per_member_and_ends_as_one(tmp_path: Path, cluster: SlurmCluster) -> None:
    """jobPerTrial: a group of two environments is one `sbatch --nodes=2` job whose srun runs
    each member's agent on a node of its own (the member its SLURM_PROCID names), after the
    site's prologue ran on that node; stopping one member cancels the job, and the other ends
    with it."""
    experiment_id = f"gr{os.getpid()}"
    ran = tmp_path / "prologue-ran"

    async def body() -> None:
        service = _service(tmp_path, jobPerTrial=True, prologue=[f'echo "$SLURMD_NODENAME" >> {ran}'])
        assert service.groups_environments
        members = ("env-1", "env-2")
        results = await service.start_group("env-1", [_request(e, experiment_id) for e in members])
        assert [r.error for r in results] == [None, None] and len({r.platform_id for r in results}) == 1, results
        job_id = results[0].platform_id.removeprefix("job ")
        for name in ("job.sh", "task.sh"):  # only their owner reads them
            assert (tmp_path / "exp" / "envs" / "env-1" / name).stat().st_mode & 0o077 == 0, name

        async def running() -> bool:
            return {o.state for o in (await service.poll(list(members))).values()} == {"running"}

        await async_wait_until(running, WAIT_S)
        shown = cluster.command("scontrol", "show", "job", "--oneliner", job_id).stdout
        assert "NumNodes=2 " in shown and "NumTasks=2 " in shown, shown
        # Each member's agent runs, in its own task, as that member.
        def agents() -> list[str]:
            found = []
            for p in psutil.process_iter(["cmdline"]):
                argv = p.info["cmdline"] or []
                # the agent itself, not its supervisor (whose argv carries the agent's)
                if argv[1:3] == ["-m", "trialkeeper.agent"] and str(tmp_path / "exp") in argv:
                    found.append(argv[argv.index("--environment-id") + 1])
            return sorted(found)

        await async_wait_until(lambda: agents() == list(members), WAIT_S)
        assert sorted(ran.read_text().split()) == ["node-1", "node-2"]  # once on each node, not in the job's script
        await service.stop("env-2", grace_s=0.0)
        # scancel ends the whole job (a loaded machine may take Slurm's KillWait to do it)
        await async_wait_until(lambda: not _experiment_jobs(cluster, experiment_id), WAIT_S,
                               message="the group's job still runs after one member was stopped")

        async def ended() -> bool:
            return all(o.state in ("exited", "failed") for o in (await service.poll(list(members))).values())

        await async_wait_until(ended, WAIT_S)
        await service.close()

    run_async(body, timeout=120)


def test_a_failed_group_job_says_what_srun_said(
    tmp_path: Path, cluster: SlurmCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A group whose tasks cannot start their agents (no such Python on the nodes): no agent
    ran, so none left an exit status or a word; each member's reason ends with the job's own
    log, where srun tells which task failed how, the experiment's token in it redacted."""
    experiment_id = f"gf{os.getpid()}"
    token = "a-token-that-stays-secret"
    caplog.set_level(logging.INFO, logger="trialkeeper")

    async def body() -> None:
        service = _service(tmp_path, jobPerTrial=True, pythonInterpreter=str(tmp_path / "no-such-python"),
                           prologue=[f'echo "the job has ${TOKEN_ENV}"'])
        members = ("env-1", "env-2")
        requests = [dataclasses.replace(_request(e, experiment_id), token=token) for e in members]
        results = await service.start_group("env-1", requests)
        assert [r.error for r in results] == [None, None], results
        job_id = results[0].platform_id.removeprefix("job ")

        async def ended() -> bool:
            return all(o.state in ("exited", "failed") for o in (await service.poll(list(members))).values())

        await async_wait_until(ended, WAIT_S, message="the group's job did not end")
        seen = await service.poll(list(members))
        for env_id in members:
            detail = seen[env_id].detail
            assert seen[env_id].state == "failed", seen
            assert f"Slurm job {job_id} failed; the agent left no exit status" in detail, detail
            assert "the job's log ends: " in detail and "srun: error: node-" in detail, detail
            assert token not in detail, detail
            assert "the job has ***" in detail or "the job has" not in detail, detail  # redacted, if shown
        # the job's log holds the token, which no reason shows
        assert f"the job has {token}" in (tmp_path / "exp" / "envs" / "env-1" / "job.log").read_text()
        assert f"environment env-1: Slurm job {job_id} started" in caplog.text and "job job" not in caplog.text
        await service.close()

    run_async(body, timeout=120)


def test_a_group_task_beyond_its_members_says_so(tmp_path: Path) -> None:
    service = _service(tmp_path, jobPerTrial=True)
    request = dataclasses.replace(_request("env-1", "x"), group_members=("env-1", "env-2"))
    job, task = service.scripts.group_script(request, tmp_path)
    assert "#SBATCH --nodes=2\n" in job and "#SBATCH --ntasks-per-node=1\n" in job and "--kill-on-bad-exit=1" in job
    assert f"#SBATCH --output={tmp_path / 'job.log'}\n" in job  # each agent's own output: its agent.log
    done = subprocess.run(["sh", "-c", task], env={"SLURM_PROCID": "2", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=10, check=False)
    assert (done.returncode, done.stderr.strip()) == (2, "task 2 is beyond the group")
