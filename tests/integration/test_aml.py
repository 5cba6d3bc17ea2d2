"""Azure ML (`platform: aml`) against the fake adapter of tests/fake_cloud_sdks.py.

The fake runs each run's command as a local process, so the agents are real and dial a
real coordinator: the quickstart runs end to end, runs that fail or are canceled in the
portal are lost environments, and the token is greppable nowhere it must not be.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import (
    GATED_TRIAL,
    async_wait_until,
    environment,
    quickstart_code,
    quickstart_data,
    run_async,
)
from fake_cloud_sdks import FakeAml, aml_installed, aml_section, argv_holding, files_holding
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, config_to_dict, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.aml.service import MISSING_SDK, AmlEnvironmentService
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.store.store import Store

WAIT_S = 45.0

@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeAml]:
    with aml_installed(tmp_path / "aml") as installed:
        yield installed


def _is_running(handle: Any) -> Callable[[], bool]:
    return lambda: handle.info.status is TrialStatus.RUNNING


def _has_failed(c: Any, env_id: str) -> Callable[[], bool]:
    return lambda: environment(c, env_id).status is EnvStatus.FAILED


def _config_data(tmp_path: Path, **ts: Any) -> dict[str, Any]:
    return quickstart_data(tmp_path, "aml-quickstart", aml_section(**ts))


@pytest.mark.parametrize(("reuse", "inside", "tls"), [(True, False, False), (False, False, False), (True, True, True)],
                         ids=["reuse", "no-reuse", "experiment-inside-code-tls"])
def test_quickstart_end_to_end(
    fake: FakeAml, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    reuse: bool, inside: bool, tls: bool,
) -> None:
    caplog.set_level(logging.DEBUG)
    quickstart_code(tmp_path)
    config_file = tmp_path / "code" / "config.yml"
    data = _config_data(tmp_path, reuseMode=reuse)
    # Inside: the runs must upload the code without the experiment's directory (its token).
    exp_dir = tmp_path / "code" / "experiments" / "exp" if inside else tmp_path / "exp"
    if inside:
        data["experimentWorkingDirectory"] = str(tmp_path / "code" / "experiments")
    data["coordinator"]["tls"] = tls  # with TLS the agents pin the certificate's fingerprint
    config_file.write_text(yaml.safe_dump(data))

    assert cli.main(["run", str(config_file), "--quiet", "--experiment-dir", str(exp_dir)]) == 0, capfd.readouterr()

    store = Store.in_dir(exp_dir, readonly=True)
    try:
        experiment_id = store.experiment()["id"]
        trials, envs = store.trials(), store.envs()
    finally:
        store.close()
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
    assert len(envs) == (2 if reuse else 4), [(e["id"], e["status"], e["reason"]) for e in envs]
    ours = {j.job_id for j in fake.jobs.values() if j.experiment_id == experiment_id}
    assert {e["platform_id"] for e in envs} == ours  # `trialkeeper envs` shows the run ids
    capfd.readouterr()
    assert cli.main(["logs", str(exp_dir), trials[0]["id"]]) == 0
    assert "held-out accuracy" in capfd.readouterr().out
    assert fake.running(experiment_id) == []
    # Each run: the agent on the compute target, in the image, tagged with both ids.
    spec = fake.specs[-1]
    assert spec.compute_target == "cpu-cluster" and spec.docker_image == "registry.example/trialkeeper:test"
    assert (
        spec.command[:3] == ("python3", "-m", "trialkeeper.agent")
        and spec.experiment_name == f"trialkeeper-{experiment_id}"
    )
    # The token reached the agents through the run's environment only.
    token = (exp_dir / ".token").read_text().strip()
    assert all(s.environment_variables["TRIALKEEPER_TOKEN"] == token for s in fake.specs)
    assert not [s for s in fake.specs if token in " ".join(s.command)]
    assert files_holding(exp_dir, token, skip=(".token",)) == []
    assert files_holding(fake.root, token) == []  # the agents' own logs, the uploaded snapshots
    assert {s.source_directory for s in fake.specs} == {str(exp_dir / "aml-code" if inside else tmp_path / "code")}
    assert all(("--tls-fingerprint" in s.command) == tls for s in fake.specs)
    if tls:  # nor the certificate's private key
        key_line = (exp_dir / "coordinator-key.pem").read_text().splitlines()[1]
        assert files_holding(fake.root, key_line) == []
    assert token not in caplog.text


def test_a_run_failed_or_canceled_outside_is_a_lost_environment(fake: FakeAml, tmp_path: Path) -> None:
    code = quickstart_code(tmp_path, GATED_TRIAL)
    data = _config_data(tmp_path)
    data.update(
        trialCommand="python3 trial.py", trialEnv={"GATE": str(tmp_path / "gate")}, searchSpace={}, maxTrialNumber=None
    )
    del data["searchSpaceFile"]
    config = parse_config(data, code)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            token = (tmp_path / "exp" / ".token").read_text().strip()
            for how in ("fail", "cancel"):
                victim = await c.submit({"x": 1, "wait": True})
                await async_wait_until(_is_running(victim), WAIT_S, message="trial never ran")
                env = next(e for e in c.environments() if e.id == victim.info.environment_id)
                job = fake.job_of(c.experiment_id, env.id)
                pids = fake.pids(job.job_id)
                assert pids and not argv_holding(token)
                if how == "fail":
                    fake.fail_outside(job.job_id, "the node was preempted")
                else:
                    fake.cancel_outside(job.job_id)
                info = await victim.wait(WAIT_S)
                assert info.status is TrialStatus.FAILED and "environment lost" in info.reason, info.reason
                await async_wait_until(_has_failed(c, env.id), WAIT_S, message=env.id)
                env = environment(c, env.id)
                expected = "preempted" if how == "fail" else "canceled outside trialkeeper"
                assert expected in env.reason, env.reason
                assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)
            # The experiment goes on: replacements take the next trials.
            after = await c.submit({"x": 2})
            done = await after.wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED, done.reason

    run_async(body)


def test_a_refused_submission_is_a_start_error(fake: FakeAml, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    config = parse_config(_config_data(tmp_path, computeTarget="no-such-cluster"), tmp_path / "code")
    service = create_service(config, tmp_path / "exp")
    assert isinstance(service, AmlEnvironmentService)

    async def body() -> None:
        request = EnvironmentRequest("env-1", "exp1", "127.0.0.1:1", token="tok-" + os.urandom(8).hex())
        result = await service.start(request)
        assert result.error is not None and "ComputeTargetNotFound" in result.error, result
        seen = (await service.poll(["env-1"]))["env-1"]
        assert seen.state == "failed" and "ComputeTargetNotFound" in seen.detail
        assert request.token not in result.error
        await service.stop("env-1")
        await service.close()

    run_async(body)


def test_the_platform_is_asked_at_most_once_per_poll_interval(fake: FakeAml, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    service = create_service(
        parse_config(_config_data(tmp_path, pollInterval="30s"), tmp_path / "code"), tmp_path / "exp"
    )

    async def body() -> None:
        request = EnvironmentRequest("env-1", "exp1", "127.0.0.1:1", token="tok", agent_args=("--no-such-option",))
        job_id = (await service.start(request)).platform_id
        for _ in range(10):
            assert (await service.poll(["env-1"]))["env-1"].platform_id == job_id
        assert fake.calls.count(("get", job_id)) == 1
        await service.stop("env-1", 0.0)  # a stop is seen at once, whatever the interval
        assert (await service.poll(["env-1"]))["env-1"].state in ("exited", "failed")
        await service.close()

    run_async(body)


def test_without_azureml_core_it_is_one_clear_line(tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    config_file = tmp_path / "code" / "config.yml"
    config_file.write_text(yaml.safe_dump(_config_data(tmp_path)))
    # The import is blocked even where azureml-core is installed.
    program = (
        "import sys; sys.modules['azureml'] = None\n"
        "from trialkeeper.coordinator.cli.app import main\n"
        f"sys.exit(main(['run', {str(config_file)!r}, '--quiet']))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [f"trialkeeper: {MISSING_SDK}"], done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_the_service_never_imports_the_sdk_until_used() -> None:
    program = (
        "import sys\n"
        "from trialkeeper.coordinator.services.aml import sdk, service\n"
        "assert not [m for m in sys.modules if m.startswith('azureml')], 'azureml imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_config_takes_nni_fields_and_reports_every_problem(tmp_path: Path) -> None:
    base = {"trialCommand": "python3 t.py", "trialConcurrency": 1}
    ts = parse_config({**base, "trainingService": aml_section(maxTrialNumberPerGpu=2)}, tmp_path).training_service
    assert (
        ts.subscription_id,
        ts.resource_group,
        ts.workspace_name,
        ts.compute_target,
        ts.max_trial_number_per_gpu,
    ) == ("00000000-0000-0000-0000-000000000000", "trialkeeper-test", "trialkeeper-ws", "cpu-cluster", 2)
    assert ts.reuse_mode is True
    (tmp_path / "config.json").write_text("{}")
    from_file = {"platform": "aml", "configFile": "config.json", "computeTarget": "gpu", "dockerImage": "img"}
    assert (
        parse_config({**base, "trainingService": from_file}, tmp_path).training_service.config_file
        == tmp_path / "config.json"
    )
    with pytest.raises(ConfigError) as e:
        parse_config({**base, "trainingService": {"platform": "aml", "subscriptionId": "s", "computeTarget": "",
                                                  "maxTrialNumberPerGpu": 0}}, tmp_path)
    where = {i.path for i in e.value.issues}
    assert {"trainingService.resourceGroup", "trainingService.workspaceName", "trainingService.computeTarget",
            "trainingService.maxTrialNumberPerGpu", "trainingService.dockerImage"} <= where, e.value
    with pytest.raises(ConfigError, match="configFile or the workspace's three names"):
        parse_config({**base, "trainingService": {**from_file, "workspaceName": "w"}}, tmp_path)
    stored = config_to_dict(parse_config({**base, "trainingService": aml_section()}, tmp_path), redact=True)
    assert stored["trainingService"]["computeTarget"] == "cpu-cluster"
