"""PAI-DLC (`platform: dlc`) against the fake adapter of tests/fake_cloud_sdks.py.

The fake runs each job's command as a local process with the NAS "mounted" (a directory of
the test), so the agents are real and dial a real coordinator: the quickstart runs end to
end, jobs that fail or are stopped outside trialkeeper are lost environments, and neither
the access key secret nor the experiment token is greppable where it must not be.
"""

from __future__ import annotations

import logging
import os
import shlex
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
from fake_cloud_sdks import DlcSetup, argv_holding, dlc_installed, dlc_section, files_holding
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, config_to_dict, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services._cloud_jobs import CloudSetupError
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.dlc.config import ID_ENV, SECRET_ENV, DlcConfig
from trialkeeper.coordinator.services.dlc.service import (
    MISSING_SDK,
    DlcEnvironmentService,
    access_key,
)
from trialkeeper.coordinator.store.store import Store

WAIT_S = 45.0

@pytest.fixture
def setup(tmp_path: Path) -> Iterator[DlcSetup]:
    with dlc_installed(tmp_path / "dlc") as installed:
        yield installed


def _is_running(handle: Any) -> Callable[[], bool]:
    return lambda: handle.info.status is TrialStatus.RUNNING


def _has_failed(c: Any, env_id: str) -> Callable[[], bool]:
    return lambda: environment(c, env_id).status is EnvStatus.FAILED


def _config_data(setup: DlcSetup, tmp_path: Path, **ts: Any) -> dict[str, Any]:
    return quickstart_data(tmp_path, "dlc-quickstart", dlc_section(setup, **ts))


@pytest.mark.parametrize(
    ("reuse", "tls"), [(True, False), (False, False), (True, True)], ids=["reuse", "no-reuse", "tls"]
)
def test_quickstart_end_to_end_and_no_secret_anywhere(
    setup: DlcSetup,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    reuse: bool,
    tls: bool,
) -> None:
    caplog.set_level(logging.DEBUG)
    quickstart_code(tmp_path)
    config_file = tmp_path / "code" / "config.yml"
    data = _config_data(setup, tmp_path, reuseMode=reuse)
    data["coordinator"]["tls"] = tls
    config_file.write_text(yaml.safe_dump(data))
    exp_dir = tmp_path / "exp"

    assert (
        cli.main(["run", str(config_file), "--quiet", "--experiment-dir", str(exp_dir), "--log-level", "DEBUG"]) == 0
    ), capfd.readouterr()

    store = Store.in_dir(exp_dir, readonly=True)
    try:
        experiment_id = store.experiment()["id"]
        trials, envs = store.trials(), store.envs()
    finally:
        store.close()
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
    assert len(envs) == (2 if reuse else 4), [(e["id"], e["status"], e["reason"]) for e in envs]
    ours = {j.job_id for j in setup.fake.jobs.values() if j.experiment_id == experiment_id}
    assert {e["platform_id"] for e in envs} == ours
    captured = capfd.readouterr()
    assert cli.main(["logs", str(exp_dir), trials[0]["id"]]) == 0
    assert "held-out accuracy" in capfd.readouterr().out
    assert setup.fake.running(experiment_id) == []
    # Each job: the agent in the image, on the NAS, named so that sweep finds it.
    spec = setup.fake.specs[-1]
    argv = shlex.split(spec.user_command)
    assert argv[:3] == ["python3", "-m", "trialkeeper.agent"] and "--copy-working-directory" in argv
    assert ("--tls-fingerprint" in argv) == tls
    assert argv[argv.index("--workdir") + 1].startswith(str(setup.nas) + "/trialkeeper/")
    assert spec.display_name.startswith(f"tk-{experiment_id}-") and spec.job_type == "PyTorchJob"
    assert (spec.nas_data_source_id, spec.nas_mount_path) == ("nas-fake-1", str(setup.nas))
    # Neither secret is on a command line, in the store, in a log, in captured output.
    token = (exp_dir / ".token").read_text().strip()
    assert all(s.envs["TRIALKEEPER_TOKEN"] == token for s in setup.fake.specs)
    for secret in (token, setup.secret):
        assert not [s for s in setup.fake.specs if secret in s.user_command]
        assert files_holding(exp_dir, secret, skip=(".token",)) == []
        assert files_holding(setup.fake.root, secret) == []  # the agents' own logs
        assert files_holding(setup.nas, secret) == []
        assert secret not in caplog.text and secret not in captured.out + captured.err
    stored = store_config(exp_dir)["trainingService"]
    assert stored["accessKeyId"] == "***" and stored["accessKeySecretFile"] == str(setup.secret_file)


def store_config(exp_dir: Path) -> dict[str, Any]:
    import json

    store = Store.in_dir(exp_dir, readonly=True)
    try:
        return dict(json.loads(store.experiment()["config_json"]))
    finally:
        store.close()


def test_a_job_failed_or_stopped_outside_is_a_lost_environment(setup: DlcSetup, tmp_path: Path) -> None:
    code = quickstart_code(tmp_path, GATED_TRIAL)
    data = _config_data(setup, tmp_path)
    data.update(
        trialCommand="python3 trial.py", trialEnv={"GATE": str(tmp_path / "gate")}, searchSpace={}, maxTrialNumber=None
    )
    del data["searchSpaceFile"]
    config = parse_config(data, code)
    fake = setup.fake

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            for how in ("fail", "stop"):
                victim = await c.submit({"x": 1, "wait": True})
                await async_wait_until(_is_running(victim), WAIT_S, message="trial never ran")
                env = next(e for e in c.environments() if e.id == victim.info.environment_id)
                job = fake.job_of(c.experiment_id, env.id)
                pids = fake.pids(job.job_id)
                assert pids and not argv_holding(setup.secret)
                if how == "fail":
                    fake.fail_outside(job.job_id, "ECS instance released")
                else:
                    fake.cancel_outside(job.job_id)
                info = await victim.wait(WAIT_S)
                assert info.status is TrialStatus.FAILED and "environment lost" in info.reason, info.reason
                await async_wait_until(_has_failed(c, env.id), WAIT_S, message=env.id)
                env = environment(c, env.id)
                expected = "ECS instance released" if how == "fail" else "Stopped (canceled outside trialkeeper)"
                assert expected in env.reason, env.reason
                assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)
            after = await c.submit({"x": 2})
            done = await after.wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED, done.reason

    run_async(body)


def test_a_wrong_access_key_is_a_start_error_that_shows_no_secret(setup: DlcSetup, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    wrong = "wrong-secret-" + os.urandom(8).hex()
    data = _config_data(setup, tmp_path, accessKeySecret=wrong)
    del data["trainingService"]["accessKeySecretFile"]
    service = create_service(parse_config(data, tmp_path / "code"), tmp_path / "exp")
    assert isinstance(service, DlcEnvironmentService)
    assert wrong not in repr(service.config) and wrong not in repr(service.adapter)

    async def body() -> None:
        result = await service.start(EnvironmentRequest("env-1", "exp1", "127.0.0.1:1", token="tok"))
        assert result.error is not None and "InvalidAccessKeyId" in result.error and wrong not in result.error
        await service.close()

    run_async(body)
    assert config_to_dict(service_config(data, tmp_path), redact=True)["trainingService"]["accessKeySecret"] == "***"


def service_config(data: dict[str, Any], tmp_path: Path) -> Any:
    return parse_config(data, tmp_path / "code")


def test_the_secret_comes_from_the_config_a_file_or_the_environment(
    setup: DlcSetup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = dlc_section(setup)
    del base["accessKeySecretFile"], base["accessKeyId"]

    def key(**ts: Any) -> tuple[str, str]:
        parsed = parse_config({"trialCommand": "x", "trialConcurrency": 1, "trainingService": {**base, **ts}}, tmp_path)
        assert isinstance(parsed.training_service, DlcConfig)
        return access_key(parsed.training_service)

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(ID_ENV, raising=False)
    with pytest.raises(CloudSetupError, match="needs an access key"):
        key(accessKeyId="id")
    assert key(accessKeyId="id", accessKeySecretFile=str(setup.secret_file)) == ("id", setup.secret)
    assert key(accessKeyId="id", accessKeySecret="inline") == ("id", "inline")
    monkeypatch.setenv(ID_ENV, "env-id")
    monkeypatch.setenv(SECRET_ENV, "env-secret")
    assert key() == ("env-id", "env-secret")
    with pytest.raises(ConfigError) as e:
        key(accessKeySecret=1234, accessKeySecretFile=str(tmp_path / "missing"))
    text = str(e.value)
    assert "1234" not in text and "not both" in text and "does not exist" in text


def test_a_new_service_adopts_a_running_job_and_stops_it(setup: DlcSetup, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    config = parse_config(_config_data(setup, tmp_path), tmp_path / "code")
    first, second = create_service(config, tmp_path / "exp"), create_service(config, tmp_path / "exp")

    async def body() -> None:
        await first.prepare()
        # No coordinator answers there: the agent keeps trying, its job keeps running.
        request = EnvironmentRequest(
            "env-1", "exp1", "127.0.0.1:1", token="tok", agent_args=("--reconnect-window", "60")
        )
        job_id = (await first.start(request)).platform_id
        assert (await first.poll(["env-1"]))["env-1"].state == "running"
        second.adopt("env-1", job_id)  # as after a coordinator restart
        assert (await second.start(request)).platform_id == job_id  # not a second job
        seen = (await second.poll(["env-1", "env-2"]))
        assert (seen["env-1"].state, seen["env-1"].platform_id, seen["env-2"].state) == ("running", job_id, "unknown")
        await second.stop("env-1", 0.0)
        assert setup.fake.jobs[job_id].status == "Stopped" and setup.fake.pids(job_id) == []
        assert (await second.poll(["env-1"]))["env-1"].state == "exited"
        assert len([j for j in setup.fake.jobs.values() if j.experiment_id == "exp1"]) == 1
        await first.close()
        await second.close()

    run_async(body)


def test_without_the_sdk_it_is_one_clear_line(setup: DlcSetup, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    config_file = tmp_path / "code" / "config.yml"
    config_file.write_text(yaml.safe_dump(_config_data(setup, tmp_path)))
    program = (
        "import sys; sys.modules['alibabacloud_pai_dlc20201203'] = None\n"
        "from trialkeeper.coordinator.cli.app import main\n"
        f"sys.exit(main(['run', {str(config_file)!r}, '--quiet']))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [f"trialkeeper: {MISSING_SDK}"], done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_config_takes_nni_fields_and_reports_every_problem(setup: DlcSetup, tmp_path: Path) -> None:
    base = {"trialCommand": "python3 t.py", "trialConcurrency": 1}
    ts = parse_config(
        {**base, "trainingService": dlc_section(setup, ossDataSourceId="oss-1")}, tmp_path
    ).training_service
    assert isinstance(ts, DlcConfig)
    assert (ts.type, ts.image, ts.job_type, ts.pod_count, ts.ecs_spec, ts.region, ts.workspace_id) == (
        "Worker", "registry.example/trialkeeper:test", "PyTorchJob", 1, "ecs.c6.large", "cn-hangzhou", "ws-fake")
    assert (ts.nas_data_source_id, ts.oss_data_source_id, ts.local_storage_mount_point) == (
        "nas-fake-1",
        "oss-1",
        setup.nas,
    )
    with pytest.raises(ConfigError) as e:
        parse_config({**base, "trainingService": {"platform": "dlc", "podCount": 0, "containerStorageMountPoint": "rel",
                                                  "localStorageMountPoint": str(tmp_path / "nowhere")}}, tmp_path)
    where = {i.path for i in e.value.issues}
    assert {
        "trainingService.image",
        "trainingService.ecsSpec",
        "trainingService.region",
        "trainingService.nasDataSourceId",
        "trainingService.podCount",
        "trainingService.containerStorageMountPoint",
        "trainingService.localStorageMountPoint",
    } <= where, e.value
