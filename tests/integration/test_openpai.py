"""The OpenPAI platform against the fake REST server of tests/fake_openpai.py.

The fake runs each job's commands as local processes, so the agents are real and dial back
to a real coordinator: the quickstart runs end to end, jobs that fail or are stopped from
outside are handled as lost environments, and no secret leaks on the way.
"""

from __future__ import annotations

import asyncio
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
from fake_openpai import FakeOpenPai, leaks_in_files, leaks_in_processes, running, section
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, config_to_dict, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services._rest import RestClient, RestError
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.openpai import OpenPaiEnvironmentService
from trialkeeper.coordinator.store.store import Store

WAIT_S = 45.0

@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeOpenPai]:
    with running(tmp_path_factory.mktemp("fake-openpai")) as server:
        yield server


def _config_data(fake: FakeOpenPai, tmp_path: Path, **ts: Any) -> dict[str, Any]:
    quickstart_code(tmp_path)
    return quickstart_data(tmp_path, "openpai", section(fake, tmp_path, **ts))


def _ours(fake: FakeOpenPai, experiment_id: str) -> list[str]:
    return [name for (_, name) in fake.jobs if name.startswith(f"tk-{experiment_id}-")]


@pytest.mark.parametrize(
    ("reuse", "tls"), [(True, False), (False, False), (True, True)], ids=["reuse", "no-reuse", "reuse-tls"]
)
def test_quickstart_end_to_end_leaks_no_secret(
    fake: FakeOpenPai,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    reuse: bool,
    tls: bool,
) -> None:
    caplog.set_level(logging.DEBUG)
    data = _config_data(fake, tmp_path, reuseMode=reuse)
    data["coordinator"]["tls"] = tls
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
    assert len(envs) == (2 if reuse else 4), [(e["id"], e["status"], e["reason"]) for e in envs]
    jobs = _ours(fake, experiment_id)
    user = data["trainingService"]["username"]
    assert sorted(e["platform_id"] for e in envs) == sorted(f"{user}~{j}" for j in jobs)
    # Every job ended (the agents exited or were stopped); nothing is left running.
    assert all(fake.job(j).run.exit_code is not None for j in jobs)
    # The experiment token reached the jobs only as an OpenPAI secret, never in a command.
    token = (exp_dir / ".token").read_text().strip()
    sent = [yaml.safe_load(t) for t in fake.submitted if f"tk-{experiment_id}-" in t]
    assert sent and all(p["secrets"]["trialkeeper_token"] == token for p in sent)
    assert all(token not in "\n".join(p["taskRoles"]["agent"]["commands"]) for p in sent)
    secrets = {"experiment token": token, "OpenPAI token": data["trainingService"]["token"]}
    assert leaks_in_files(secrets, exp_dir) == []
    assert not [w for w, v in secrets.items() if v in caplog.text or v in out.out or v in out.err]


@pytest.mark.parametrize("how", ["failed", "stopped", "deleted"])
def test_a_job_ended_outside_trialkeeper_is_a_lost_environment(fake: FakeOpenPai, tmp_path: Path, how: str) -> None:
    data = _config_data(fake, tmp_path)
    (tmp_path / "code" / "trial.py").unlink(missing_ok=True)
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
            assert fake.job(name).run.pids(), "the job runs no process"
            token = (tmp_path / "exp" / ".token").read_text().strip()
            assert (
                leaks_in_processes({"experiment token": token, "OpenPAI token": data["trainingService"]["token"]}) == []
            )

            {"failed": fake.fail_job, "stopped": fake.stop_outside, "deleted": fake.delete_job}[how](name)

            info = await victim.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED and "environment lost" in info.reason, info.reason
            await async_wait_until(lambda: environment(c, env.id).status is EnvStatus.FAILED, WAIT_S, message=env.id)
            env = environment(c, env.id)
            assert {"failed": "failed", "stopped": "stopped outside", "deleted": "gone"}[how] in env.reason, env.reason
            # A replacement environment takes the next trial.
            after = await c.submit({"x": 2})
            done = await after.wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED, done.reason
            assert done.environment_id != env.id

    run_async(body, timeout=120)


def test_refusals_are_errors_as_data_without_the_token(fake: FakeOpenPai, tmp_path: Path) -> None:
    data = _config_data(fake, tmp_path, virtualCluster="no-such-vc")
    service = create_service(parse_config(data, tmp_path / "code"), tmp_path / "exp")
    assert isinstance(service, OpenPaiEnvironmentService)
    request = EnvironmentRequest(
        env_id="env-1", experiment_id="x1", coordinator_address="127.0.0.1:1", token="tok-secret-1"
    )

    async def body() -> None:
        await service.prepare()
        result = await service.start(request)
        assert result.error is not None and "virtual cluster 'no-such-vc' does not exist" in result.error, result.error
        assert "tok-secret-1" not in result.error and data["trainingService"]["token"] not in result.error
        seen = (await service.poll(["env-1"]))["env-1"]
        assert (seen.state, seen.detail) == ("failed", result.error)

    run_async(body)
    wrong = {**data["trainingService"], "token": "not-the-token", "virtualCluster": "default"}
    bad = create_service(parse_config({**data, "trainingService": wrong}, tmp_path / "code"), tmp_path / "exp2")
    result = run_async(bad.start(request))
    assert result.error is not None and "401" in result.error and "UnauthorizedUserError" in result.error
    assert "not-the-token" not in result.error


def test_config_fields_and_redaction(fake: FakeOpenPai, tmp_path: Path) -> None:
    data = _config_data(fake, tmp_path, host="pai.example.com", trialMemorySize="4GiB", trialGpuNumber=1)
    config = parse_config(data, tmp_path / "code")
    ts = config.training_service
    assert ts.host == "https://pai.example.com"  # type: ignore[attr-defined]
    assert ts.resources(0) == {"cpu": 1, "memoryMB": 4096, "gpu": 1}  # type: ignore[attr-defined]
    assert config_to_dict(config, redact=True)["trainingService"]["token"] == "***"
    assert data["trainingService"]["token"] not in repr(ts)
    partial = {k: v for k, v in data["trainingService"].items() if k != "containerStorageMountPoint"}
    with pytest.raises(ConfigError, match="containerStorageMountPoint: required with storageConfigName"):
        parse_config({**data, "trainingService": partial}, tmp_path / "code")


def test_rest_client_retries_5xx_and_hides_the_query(tmp_path: Path) -> None:
    from fake_openpai import FakeHttpServer, HttpError

    class Flaky(FakeHttpServer):
        calls = 0

        def handle(self, method: str, path: str, query: dict[str, str], headers: Any, body: bytes) -> tuple[int, Any]:
            self.calls += 1
            if self.calls < 3:
                raise HttpError(503, "Busy", "try later")
            raise HttpError(400, "Bad", f"you sent {query.get('password')}")

    server = Flaky()
    server.start()
    try:
        client = RestClient(server.url, query={"password": "pw-123"}, secrets=("pw-123",), timeout=5, backoff=0.01)
        with pytest.raises(RestError) as raised:
            asyncio.run(client.call("GET", "/thing"))
        assert server.calls == 3 and raised.value.status == 400
        assert "pw-123" not in str(raised.value) and "***" in str(raised.value) and "?" not in str(raised.value)
    finally:
        server.shutdown()


def test_a_new_service_adopts_a_running_job_and_stops_it(fake: FakeOpenPai, tmp_path: Path) -> None:
    """After a coordinator restart (``resume``) the job it had started is polled and stopped."""
    config = parse_config(_config_data(fake, tmp_path), tmp_path / "code")
    first, second = create_service(config, tmp_path / "exp"), create_service(config, tmp_path / "exp")
    # Nobody answers there: the agent keeps trying for its reconnect window.
    request = EnvironmentRequest(env_id="env-1", experiment_id="ad1", coordinator_address="127.0.0.1:9",
                                 token="tok-3", agent_args=("--reconnect-window", "40"))

    async def body() -> None:
        await first.prepare()
        started = await first.start(request)
        assert started.error is None and started.platform_id.endswith("~tk-ad1-env-1")
        second.adopt("env-1", started.platform_id)
        assert (await second.poll(["env-1"]))["env-1"].state == "running"
        await second.stop("env-1", 0.0)
        seen = (await second.poll(["env-1"]))["env-1"]
        assert (seen.state, seen.detail) == ("exited", "stopped")
        assert fake.job("tk-ad1-env-1").run.exit_code is not None and not fake.job("tk-ad1-env-1").run.pids()
        # OpenPAI keeps the job's secrets to itself: its config comes back masked.
        answer = await first.client.call("GET", f"/jobs/{started.platform_id}/config")  # type: ignore[attr-defined]
        assert b"tok-3" not in answer.body and answer.json()["secrets"] == "******"

    run_async(body)
