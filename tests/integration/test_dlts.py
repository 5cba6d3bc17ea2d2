"""The DLTS platform against the fake dashboard of tests/fake_dlts.py.

The fake runs each job's command as local processes, so the agents are real and dial back to
a real coordinator: the quickstart runs end to end, jobs that fail, are killed or vanish
outside trialkeeper are handled as lost environments, and no secret leaks on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    GATED_TRIAL,
    async_wait_until,
    environment,
    quickstart_code,
    quickstart_data,
    run_async,
    write_script,
)
from fake_dlts import FakeDlts, running, section, shell_words
from fake_openpai import leaks_in_files, leaks_in_processes
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, config_to_dict, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.dlts import DltsEnvironmentService
from trialkeeper.coordinator.store.store import Store

WAIT_S = 45.0

@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeDlts]:
    with running(tmp_path_factory.mktemp("fake-dlts")) as server:
        yield server


def _config_data(fake: FakeDlts, tmp_path: Path, **ts: Any) -> dict[str, Any]:
    quickstart_code(tmp_path)
    return quickstart_data(tmp_path, "dlts", section(fake, **ts))


def test_quickstart_end_to_end_leaks_no_secret(
    fake: FakeDlts, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    data = _config_data(fake, tmp_path)
    config_file = tmp_path / "code" / "config.yml"
    config_file.write_text(yaml.safe_dump(data))
    exp_dir = tmp_path / "exp"

    rc = cli.main(["run", str(config_file), "--quiet", "--experiment-dir", str(exp_dir)])
    out = capfd.readouterr()
    assert rc == 0, out

    store = Store.in_dir(exp_dir, readonly=True)
    try:
        experiment_id = store.experiment()["id"]
        trials, envs = store.trials(), store.envs()
    finally:
        store.close()
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
    assert len(envs) == 2, [(e["id"], e["status"], e["reason"]) for e in envs]
    ours = [b for b in fake.submitted if b["jobName"].startswith(f"tk-{experiment_id}-")]
    assert sorted(e["platform_id"] for e in envs) == sorted(fake.job_named(b["jobName"]).job_id for b in ours)
    # The GPU type came from the cluster's metadata, as NNI asked it.
    assert {b["gpuType"] for b in ours} == {"P40"} and {b["resourcegpu"] for b in ours} == {0}
    token = (exp_dir / ".token").read_text().strip()
    for b in ours:  # the agent reads the token from a 0600 file; the job holds only its path
        words = shell_words(b["cmd"])
        assert token not in b["cmd"] and token not in str(b["env"])
        token_file = Path(words[words.index("--token-file") + 1])
        assert token_file.read_text() == token and token_file.stat().st_mode & 0o777 == 0o600
    assert all(fake.job_named(b["jobName"]).run.exit_code is not None for b in ours)
    secrets = {"experiment token": token, "DLTS password": fake.password}
    assert leaks_in_files(secrets, exp_dir) == []
    assert not [w for w, v in secrets.items() if v in caplog.text or v in out.out or v in out.err]


@pytest.mark.parametrize("how", ["failed", "killed", "deleted"])
def test_a_job_ended_outside_trialkeeper_is_a_lost_environment(fake: FakeDlts, tmp_path: Path, how: str) -> None:
    data = _config_data(fake, tmp_path, reuseMode=False)
    write_script(tmp_path / "code", "trial.py", GATED_TRIAL)
    data.update(trialCommand="python3 trial.py", trialEnv={"GATE": str(tmp_path / "gate")}, searchSpace={},
                maxTrialNumber=None, trialConcurrency=1)
    del data["searchSpaceFile"]
    config = parse_config(data, tmp_path / "code")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            victim = await c.submit({"x": 1, "wait": True})
            await async_wait_until(lambda: victim.info.status is TrialStatus.RUNNING, WAIT_S, message="trial never ran")
            env = next(e for e in c.environments() if e.id == victim.info.environment_id)
            name = f"tk-{c.experiment_id}-{env.id}"
            assert fake.job_named(name).run.pids(), "the job runs no process"
            token = (tmp_path / "exp" / ".token").read_text().strip()
            assert leaks_in_processes({"experiment token": token, "DLTS password": fake.password}) == []

            {"failed": fake.fail_job, "killed": fake.kill_outside, "deleted": fake.delete_job}[how](name)

            info = await victim.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED and "environment lost" in info.reason, info.reason
            await async_wait_until(lambda: environment(c, env.id).status is EnvStatus.FAILED, WAIT_S, message=env.id)
            env = environment(c, env.id)
            assert {"failed": "evicted", "killed": "stopped outside", "deleted": "gone"}[how] in env.reason, env.reason
            after = await c.submit({"x": 2})
            done = await after.wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED, done.reason
            assert done.environment_id != env.id

    run_async(body, timeout=120)


def test_refusals_are_errors_as_data_without_the_password(fake: FakeDlts, tmp_path: Path) -> None:
    data = _config_data(fake, tmp_path, password="not-the-password")
    service = create_service(parse_config(data, tmp_path / "code"), tmp_path / "exp")
    assert isinstance(service, DltsEnvironmentService)
    request = EnvironmentRequest(
        env_id="env-1", experiment_id="x1", coordinator_address="127.0.0.1:1", token="tok-secret-1"
    )
    result = run_async(service.start(request))
    assert result.error is not None and "403" in result.error and "Forbidden" in result.error, result.error
    assert "not-the-password" not in result.error and "tok-secret-1" not in result.error

    typed = _config_data(fake, tmp_path, gpuType="A100")
    result = run_async(create_service(parse_config(typed, tmp_path / "code"), tmp_path / "exp2").start(request))
    assert result.error is not None and "gpuType 'A100' is not a GPU type" in result.error, result.error


def test_config_fields_and_redaction(fake: FakeDlts, tmp_path: Path) -> None:
    data = _config_data(fake, tmp_path)
    config = parse_config(data, tmp_path / "code")
    assert config_to_dict(config, redact=True)["trainingService"]["password"] == "***"
    assert fake.password not in repr(config.training_service)
    assert config.training_service.cluster == fake.cluster  # type: ignore[attr-defined]
    broken = {**data["trainingService"], "email": "nobody", "dashboard": "ftp://x"}
    with pytest.raises(ConfigError) as raised:
        parse_config({**data, "trainingService": broken}, tmp_path / "code")
    assert "trainingService.email" in str(raised.value) and "trainingService.dashboard" in str(raised.value)


def test_a_new_service_adopts_a_running_job_and_stops_it(fake: FakeDlts, tmp_path: Path) -> None:
    """After a coordinator restart (``resume``) the job it had started is polled and stopped."""
    config = parse_config(_config_data(fake, tmp_path), tmp_path / "code")
    first, second = create_service(config, tmp_path / "exp"), create_service(config, tmp_path / "exp")
    request = EnvironmentRequest(env_id="env-1", experiment_id="ad2", coordinator_address="127.0.0.1:9",
                                 token="tok-4", agent_args=("--reconnect-window", "40"))

    async def body() -> None:
        await first.prepare()
        started = await first.start(request)
        assert started.error is None and started.platform_id == fake.job_named("tk-ad2-env-1").job_id
        second.adopt("env-1", started.platform_id)
        assert (await second.poll(["env-1"]))["env-1"].state == "running"
        await second.stop("env-1", 0.0)
        seen = (await second.poll(["env-1"]))["env-1"]
        assert (seen.state, seen.detail) == ("exited", "stopped")
        assert fake.job_named("tk-ad2-env-1").run.exit_code is not None

    run_async(body)
