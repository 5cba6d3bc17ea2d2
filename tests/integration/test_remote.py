"""The remote platform against real OpenSSH servers on 127.0.0.1, two of them as two machines.

Where sshd cannot start these tests skip with the reason; in CI (``CI`` set) they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import (
    QUICKSTART,
    async_wait_until,
    environment,
    run_async,
    service_from_config,
    wait_until,
    write_script,
)
from sshd import Credentials, Machine, SshdUnavailable, make_credentials, start_machine
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ExperimentConfig, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services._codedir import CodeDirError, pack, scan
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.remote.service import (
    RemoteEnvironmentService,
    RemoteSetupError,
)
from trialkeeper.coordinator.store.store import Store

# A real sshd per test: left out of the fast subset.
pytestmark = pytest.mark.slow

WAIT_S = 45.0

HANG_OR_PASS = """
import sys, time
from trialkeeper.agent import trial

params = trial.get_next_parameter()
print("trial", params, flush=True)
if params.get("hang"):
    time.sleep(120)
trial.report_final_result(float(params.get("x", 1)))
"""

# Waits (with a deadline) until every machine has started its agent.
GATE = """
import glob, sys, time

deadline = time.monotonic() + 60
while not all(glob.glob(p) for p in {patterns!r}):
    if time.monotonic() > deadline:
        sys.exit("not every machine started an agent within 60 s")
    time.sleep(0.05)
"""


@dataclass
class Lab:
    """The two sshd machines and how to log in to them."""

    machines: list[Machine]
    creds: Credentials
    known_hosts: Path

    def entry(self, i: int, *, auth: str = "key", **extra: Any) -> dict[str, Any]:
        m = self.machines[i]
        out: dict[str, Any] = {"host": m.host, "port": m.port, "user": self.creds.user, "pythonPath": sys.executable}
        if auth == "password":
            assert self.creds.password is not None
            out["password"] = self.creds.password
        else:
            out.update(sshKeyFile=str(self.creds.key_file), sshPassphrase=self.creds.passphrase)
        out.update(extra)
        return out

    def second_auth(self) -> str:
        """Machine 2 logs in with the password where this host can offer password logins."""
        return "password" if self.creds.password else "key"

    def secrets(self) -> list[str]:
        return [s for s in (self.creds.password, self.creds.passphrase) if s]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    base = tmp_path_factory.mktemp("sshd")
    machines: list[Machine] = []
    try:
        creds = make_credentials(base / "credentials")
        for name in ("m1", "m2"):
            machines.append(start_machine(name, base, creds))
    except SshdUnavailable as e:
        for m in machines:
            m.stop()
        if os.environ.get("CI"):
            pytest.fail(f"the remote-platform tests need sshd and could not start it: {e}")
        pytest.skip(f"sshd cannot run here: {e}")
    known_hosts = base / "known_hosts"
    known_hosts.write_text("".join(m.known_hosts_line + "\n" for m in machines))
    try:
        yield Lab(machines, creds, known_hosts)
    finally:
        for m in machines:
            m.stop()


def _code_dir(tmp_path: Path, *, script: str | None = None) -> Path:
    code = tmp_path / "code"
    shutil.copytree(QUICKSTART, code, ignore=shutil.ignore_patterns("__pycache__"))
    (code / ".nniignore").write_text("data/\n*.ckpt\n")
    (code / "data").mkdir()
    (code / "data" / "big.bin").write_bytes(b"\0" * 4096)
    (code / "model.ckpt").write_text("ignored")
    (code / "unique.txt").write_text(tmp_path.name)  # a content hash of its own per test
    if script:
        write_script(code, "trial.py", script)
    return code


def _config(tmp_path: Path, lab: Lab, machines: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    ts = overrides.pop("trainingService", {})
    data: dict[str, Any] = {
        "experimentName": "remote-quickstart",
        "searchSpaceFile": "search_space.json",
        "trialCommand": "python3 train.py",
        "trialConcurrency": 2,
        "maxTrialNumber": 6,
        "trialCodeDirectory": str(tmp_path / "code"),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize", "seed": 7}},
        "trainingService": {
            "platform": "remote", "reuseMode": True, "knownHostsFile": str(lab.known_hosts),
            "machineList": machines, **ts,
        },
    }
    data.update(overrides)
    return data


def _parse(data: dict[str, Any], tmp_path: Path) -> ExperimentConfig:
    return parse_config(data, tmp_path / "code")


def _remote_exp(m: Machine, experiment_id: str) -> Path:
    return m.home / "trialkeeper-experiments" / experiment_id


def _files_containing(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits += [f"{path}" for n in needles if n.encode() in data]
    return hits


def _no_processes_left(lab: Lab) -> None:
    wait_until(
        lambda: not any(m.processes() for m in lab.machines),
        timeout=15.0,
        message="processes left on the machines: "
        f"{[(p.pid, p.cmdline()) for m in lab.machines for p in m.processes()]}",
    )


# ---- end to end --------------------------------------------------------------------------


def test_quickstart_in_reuse_mode_on_two_machines(
    tmp_path: Path, lab: Lab, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _code_dir(tmp_path)
    # Trials are short: without this gate, a loaded machine could finish all of them on
    # the first agent before the second machine's agent is up.
    homes = [str(m.home / "trialkeeper-experiments" / "*" / "envs" / "*" / "agent.pid") for m in lab.machines]
    write_script(tmp_path / "code", "gate.py", GATE.format(patterns=homes))
    data = _config(
        tmp_path, lab, [lab.entry(0), lab.entry(1, auth=lab.second_auth())],
        trialCommand="python3 gate.py && python3 train.py && echo mine > written-by-the-trial.txt",
    )
    # Kept in the code directory as the quickstart does: it holds the password, and so
    # must not be uploaded.
    config_file = tmp_path / "code" / "config.yml"
    config_file.write_text(yaml.safe_dump(data))
    exp_dir = tmp_path / "exp"
    precious = [m.home / "precious.txt" for m in lab.machines]
    for p in precious:
        p.write_text("the user's own file")

    rc = cli.main(["run", str(config_file), "--quiet", "--experiment-dir", str(exp_dir), "--log-level", "DEBUG"])
    assert rc == 0, capfd.readouterr()

    store = Store.in_dir(exp_dir, readonly=True)
    experiment_id = store.experiment()["id"]
    trials = store.trials()
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 6, [(t["id"], t["status"], t["reason"]) for t in trials]
    envs = store.envs()
    # Reuse mode: one environment per machine, kept for the whole experiment.
    assert len(envs) == 2, [(e["id"], e["status"], e["reason"]) for e in envs]
    ports = sorted(next(m.port for m in lab.machines if f":{m.port} " in e["platform_id"]) for e in envs)
    assert ports == sorted(m.port for m in lab.machines)
    for m in lab.machines:
        remote = _remote_exp(m, experiment_id)
        assert len(list((remote / "envs").iterdir())) == 1, "each machine ran exactly one agent"
        snapshot = next((remote / "code").iterdir())
        assert (snapshot / "train.py").exists()
        assert not (snapshot / "config.yml").exists(), "the config holding the secrets was uploaded"
        assert not (snapshot / "data").exists() and not (snapshot / "model.ckpt").exists(), (
            ".nniignore'd files were uploaded"
        )
        assert len(list((m.home / "trialkeeper-experiments" / ".cache").glob("code-*.tar.gz"))) == 1
        # Every trial worked in its own copy of the code; once it ended, what it left as
        # copied was removed and what it wrote was kept.
        trial_dirs = list((remote / "envs").glob("*/trials/*"))
        assert trial_dirs
        for trial_dir in trial_dirs:
            assert sorted(p.name for p in (trial_dir / "code").iterdir()) == ["written-by-the-trial.txt"]
    assert {t["environment_id"] for t in trials} <= {e["id"] for e in envs}

    # `trialkeeper logs` shows what a trial printed remotely.
    capfd.readouterr()
    assert cli.main(["logs", str(exp_dir), trials[0]["id"]]) == 0
    assert "held-out accuracy" in capfd.readouterr().out

    _no_processes_left(lab)
    assert all(p.read_text() == "the user's own file" for p in precious)
    out = capfd.readouterr()
    for secret in lab.secrets():
        assert secret not in out.out + out.err
        assert secret not in caplog.text
    assert _files_containing(exp_dir, lab.secrets()) == []
    for m in lab.machines:
        assert _files_containing(m.home, lab.secrets()) == []


def test_quickstart_without_reuse_and_content_addressed_upload(tmp_path: Path, lab: Lab) -> None:
    _code_dir(tmp_path)
    data = _config(
        tmp_path, lab, [lab.entry(0), lab.entry(1)], maxTrialNumber=4, trainingService={"reuseMode": False}
    )
    config = _parse(data, tmp_path)

    async def one_experiment(name: str) -> tuple[RemoteEnvironmentService, list[Any], list[Any]]:
        exp_dir = tmp_path / name
        service = service_from_config(RemoteEnvironmentService, config, exp_dir)
        async with Coordinator(config, experiment_dir=exp_dir, service=service) as c:
            handles = [await c.submit({"lr": 0.1 * (i + 1), "batch_size": 32, "epochs": 5, "l2": 0}) for i in range(4)]
            infos = [await h.wait(WAIT_S) for h in handles]
        return service, infos, c.environments()  # as they were when the experiment stopped

    service, infos, envs = run_async(lambda: one_experiment("first"))
    assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 4, [(i.status, i.reason) for i in infos]
    # Each trial had an environment (an agent) of its own, which ended with it.
    assert len({i.environment_id for i in infos}) == 4
    assert all(e.status is EnvStatus.STOPPED for e in envs), [(e.id, e.status, e.reason) for e in envs]
    code_uploads = sorted(m for m, path in service.uploads if "/.cache/code-" in path)
    assert code_uploads == sorted(f"{lab.creds.user}@127.0.0.1:{m.port}" for m in lab.machines)

    # The same code again: the machines have it, nothing is sent.
    again, infos, _ = run_async(lambda: one_experiment("second"))
    assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 4
    assert again.uploads == []
    _no_processes_left(lab)


def test_killed_agent_fails_its_trial_and_the_experiment_goes_on(tmp_path: Path, lab: Lab) -> None:
    _code_dir(tmp_path, script=HANG_OR_PASS)
    dead_port = _closed_port()
    machines = [
        lab.entry(0),
        lab.entry(1, auth=lab.second_auth()),
        {"host": "127.0.0.1", "port": dead_port, "user": lab.creds.user, "password": "unused-pw"},
    ]
    data = _config(
        tmp_path, lab, machines, trialCommand="python3 trial.py",
        # Long enough that the SSH check, not the missing heartbeat, explains the loss.
        coordinator={"agentLostTimeout": "10s"},
    )
    config = _parse(data, tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            hang = await c.submit({"hang": True})
            await async_wait_until(lambda: hang.info.status is TrialStatus.RUNNING, WAIT_S, message="trial never ran")
            env = next(e for e in c.environments() if e.id == hang.info.environment_id)
            victim = next(m for m in lab.machines if f":{m.port} " in env.platform_id)
            survivor = await async_wait_until(
                lambda: next((e for e in c.environments() if e.id != env.id and e.status is EnvStatus.READY), None),
                WAIT_S, message="the second machine's agent never registered",
            )

            # No secret in any process's arguments, nor the token in its environment.
            token = (tmp_path / "exp" / ".token").read_text()
            for p in psutil.process_iter(["cmdline"]):
                with _suppress_psutil():
                    text = " ".join(p.info["cmdline"] or ())
                    assert token not in text and not any(s in text for s in lab.secrets())
                    if victim.home.as_posix() in text:
                        assert token.encode() not in _environ_bytes(p.pid)

            env_dir = _remote_exp(victim, c.experiment_id) / "envs" / env.id
            agent_pid = int((env_dir / "agent.pid").read_text())
            agent = psutil.Process(agent_pid)
            assert env.id in " ".join(agent.cmdline())
            # Detached: a session of its own, outliving the SSH session that started it.
            assert os.getsid(agent_pid) == agent_pid and agent.parent().name() != "sshd"
            trial_pid = _trial_pid(victim, hang.id)
            os.kill(agent_pid, signal.SIGKILL)

            info = await hang.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED
            assert "environment lost" in info.reason and "died without an exit status" in info.reason, info.reason
            env = environment(c, env.id)
            assert env.status is EnvStatus.FAILED and "SIGKILL" in env.reason, env.reason
            # The trial the dead agent left behind was stopped over SSH.
            await async_wait_until(lambda: not psutil.pid_exists(trial_pid) or _zombie(trial_pid), 10.0)

            # The unreachable machine failed its environment with the reason.
            dead = [e for e in c.environments() if e.status is EnvStatus.FAILED and f":{dead_port}" in e.reason]
            assert dead and "connection refused" in dead[0].reason, [
                (e.id, e.status, e.reason) for e in c.environments()
            ]

            rest = [await c.submit({"x": x}) for x in (2, 3)]
            infos = [await h.wait(WAIT_S) for h in rest]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 2, [(i.status, i.reason) for i in infos]
            assert survivor.id in {i.environment_id for i in infos}

    run_async(body)
    _no_processes_left(lab)


# ---- logging in and checking the machine ------------------------------------------------


def _service(tmp_path: Path, lab: Lab, machine: dict[str, Any], **ts: Any) -> RemoteEnvironmentService:
    if not (tmp_path / "code").exists():
        _code_dir(tmp_path)
    config = _parse(_config(tmp_path, lab, [machine], trainingService=ts), tmp_path)
    return service_from_config(RemoteEnvironmentService, config, tmp_path / "exp")


def _request(env_id: str = "env-1") -> EnvironmentRequest:
    # Nothing listens at this address: an agent that starts gives up after a second.
    return EnvironmentRequest(
        env_id=env_id, experiment_id="checks", coordinator_address="127.0.0.1:9", token="t0ken-for-tests",
        agent_args=("--reconnect-window", "1"),
    )


async def _start_once(service: RemoteEnvironmentService) -> str:
    await service.prepare()
    try:
        result = await service.start(_request())
        await service.stop("env-1", 0.0)
        return result.error or ""
    finally:
        await service.close()


def test_stopping_while_a_machine_is_set_up_leaves_no_unretrieved_error(tmp_path: Path, lab: Lab) -> None:
    # A Python that answers only once let through: the machine is still being set up (its
    # probe under way) when the experiment stops, and the setup fails once SSH is closed.
    started, go = tmp_path / "probe-started", tmp_path / "probe-go"
    slow = tmp_path / "slow-python"
    slow.write_text(
        f"#!/bin/sh\ntouch {started}\ni=0\n"
        f"while [ ! -e {go} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\n"
        f"exec {sys.executable} \"$@\"\n"
    )
    slow.chmod(0o755)
    _code_dir(tmp_path, script=HANG_OR_PASS)
    data = _config(tmp_path, lab, [lab.entry(0, pythonPath=str(slow))], trialCommand="python3 trial.py")
    config = _parse(data, tmp_path)

    async def body() -> list[str]:
        problems: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: problems.append(str(ctx.get("message"))))
        service = service_from_config(RemoteEnvironmentService, config, tmp_path / "exp")
        async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
            await c.submit({"x": 1})
            await async_wait_until(started.exists, WAIT_S, message="the machine's setup never reached its probe")
        go.touch()
        setups = [m.setup for m in service.machines if m.setup is not None]
        assert setups, "no setup was under way"
        await asyncio.wait(setups, timeout=WAIT_S)
        assert all(s.done() for s in setups)
        # An exception nobody retrieved is reported when its task is collected.
        del setups, service, c
        gc.collect()
        return problems

    problems = run_async(body(), timeout=120.0)
    assert not [p for p in problems if "never retrieved" in p], problems


def test_resume_with_a_machine_unreachable_logs_why_and_goes_on(
    tmp_path: Path, lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    # The code cannot be sent to the machine of an adopted environment: said, not raised;
    # the machine is marked as failing, so starts there wait and try it again.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    service = _service(tmp_path, lab, lab.entry(0, port=port), sshTimeout=2)
    (m,) = service.machines

    async def body() -> None:
        await service.prepare()
        try:
            service.adopt("env-1", f"{m.label} pid 4242")
            service.adopt("env-2", "elsewhere:22 pid 1")  # a machine no longer in the config
            await service.ready_adopted("resumed")
        finally:
            await service.close()

    caplog.set_level(logging.WARNING)
    run_async(body(), timeout=60.0)
    assert m.error and str(port) in m.error, m.error
    assert f"{m.label}: could not upload the code for its resumed environments" in caplog.text, caplog.text
    assert "environment env-2: no machine 'elsewhere:22'" in caplog.text, caplog.text


def test_a_start_waiting_for_a_failing_machine_is_canceled_by_a_stop(
    tmp_path: Path, lab: Lab
) -> None:
    # Reuse mode: the start that stands for a failing machine waits for it, with no
    # deadline, while the other machine works; a stop ends that wait at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    _code_dir(tmp_path)
    machines = [lab.entry(0), lab.entry(1, port=port)]
    config = _parse(_config(tmp_path, lab, machines, trainingService={"sshTimeout": 2}), tmp_path)
    service = service_from_config(RemoteEnvironmentService, config, tmp_path / "exp")

    async def body() -> None:
        await service.prepare()
        try:
            assert (await service.start(_request("env-1"))).error is None
            failed = (await service.start(_request("env-2"))).error or ""
            assert f":{port}" in failed, failed
            waiting = asyncio.ensure_future(service.start(_request("env-3")))
            seen = await async_wait_until(
                lambda: _waiting_for(service, "env-3"), 10.0, message="env-3 never waited")
            assert seen.state == "starting" and f":{port}" in seen.detail, seen
            # Unstopped, the start waits for as long as the machine fails: its answer proves the stop ended it.
            await asyncio.wait_for(service.stop("env-3", 0.0), 30.0)
            assert (await asyncio.wait_for(waiting, 30.0)).error == "the start was canceled"
            seen = (await service.poll(["env-3"]))["env-3"]
            assert seen.state == "exited" and "stopped before" in seen.detail, seen
            await service.stop("env-1", 0.0)
        finally:
            await service.close()

    run_async(body(), timeout=60.0)
    _no_processes_left(lab)


async def _waiting_for(service: RemoteEnvironmentService, env_id: str) -> Any:
    seen = (await service.poll([env_id]))[env_id]
    return seen if seen.detail.startswith("waiting for ") and "machine" not in seen.detail else None


def test_wrong_password_is_a_clear_error(tmp_path: Path, lab: Lab) -> None:
    if not lab.creds.password:
        pytest.skip(lab.creds.password_unavailable)
    wrong = "wrong-" + lab.creds.password
    error = run_async(_start_once(_service(tmp_path, lab, lab.entry(1, auth="password", password=wrong))))
    assert "authentication" in error and "password was refused" in error, error
    assert wrong not in error and lab.creds.password not in error


def test_password_login_works(tmp_path: Path, lab: Lab) -> None:
    if not lab.creds.password:
        pytest.skip(lab.creds.password_unavailable)
    assert run_async(_start_once(_service(tmp_path, lab, lab.entry(1, auth="password")))) == ""


def test_unknown_host_key_is_refused_unless_accepted(
    tmp_path: Path, lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    m = lab.machines[0]
    error = run_async(_start_once(_service(tmp_path, lab, lab.entry(0), knownHostsFile=str(empty))))
    assert "host key is unknown" in error and m.host_fingerprint in error and "acceptUnknownHostKeys" in error, error

    caplog.set_level(logging.WARNING)
    error = run_async(
        _start_once(_service(tmp_path, lab, lab.entry(0), knownHostsFile=str(empty), acceptUnknownHostKeys=True))
    )
    assert error == ""
    assert any(m.host_fingerprint in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), (
        caplog.text
    )


def test_changed_host_key_is_refused_even_when_unknown_keys_are_accepted(tmp_path: Path, lab: Lab) -> None:
    other = lab.machines[1]
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(f"[127.0.0.1]:{lab.machines[0].port} {other.host_key_line}\n")
    service = _service(tmp_path, lab, lab.entry(0), knownHostsFile=str(wrong), acceptUnknownHostKeys=True)
    error = run_async(_start_once(service))
    assert "host key has CHANGED" in error, error


def test_missing_python_and_missing_trialkeeper_are_explained(tmp_path: Path, lab: Lab) -> None:
    error = run_async(_start_once(_service(tmp_path, lab, lab.entry(0, pythonPath="/nonexistent/bin/python3"))))
    assert "pythonPath '/nonexistent/bin/python3'" in error and "machineList[0].pythonPath" in error, error

    # A Python that cannot see trialkeeper: the same interpreter without site-packages.
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    error = run_async(_start_once(_service(tmp_path, lab, lab.entry(0, pythonPath=str(bare)))))
    assert "trialkeeper is not importable" in error and "bootstrap: true" in error and "pip install" in error, error


def test_bootstrap_installs_this_trialkeeper_into_a_virtualenv(tmp_path: Path, lab: Lab) -> None:
    _code_dir(tmp_path, script=HANG_OR_PASS)
    data = _config(tmp_path, lab, [lab.entry(0)], trialCommand="python3 trial.py", trainingService={"bootstrap": True})
    config = _parse(data, tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            infos = [await (await c.submit({"x": x})).wait(WAIT_S) for x in (1, 2)]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 2, [(i.status, i.reason) for i in infos]
            remote = _remote_exp(lab.machines[0], c.experiment_id)
            venvs = list(remote.glob("venv-*"))
            assert len(venvs) == 1
            env_dir = remote / "envs" / infos[0].environment_id
            agent = psutil.Process(int((env_dir / "agent.pid").read_text()))
            assert agent.cmdline()[0].startswith(str(venvs[0])), agent.cmdline()
            installed = list(venvs[0].glob("lib/python*/site-packages/trialkeeper/agent/session.py"))
            assert installed, "the wheel was not unpacked into the virtualenv"

    run_async(body)
    _no_processes_left(lab)


# ---- the code directory ------------------------------------------------------------------


def test_version_mismatch_is_explained(tmp_path: Path) -> None:
    data = {
        "trialCommand": "x", "trialConcurrency": 1, "trialCodeDirectory": str(tmp_path),
        "trainingService": {"platform": "remote", "machineList": [{"host": "gpu1", "user": "u"}]},
    }
    service = service_from_config(RemoteEnvironmentService, parse_config(data, tmp_path), tmp_path / "exp")
    m = service.machines[0]
    with pytest.raises(Exception, match=r"gpu1:22: /opt/py has trialkeeper 9\.1\.0 \(protocol 99\).*bootstrap: true"):
        m.check_trialkeeper({"python": "/opt/py", "trialkeeper": "9.1.0", "protocol": 99})
    run_async(service.close())


def test_loopback_coordinator_is_refused_for_other_hosts(tmp_path: Path) -> None:
    data = {
        "trialCommand": "x", "trialConcurrency": 1, "trialCodeDirectory": str(tmp_path),
        "trainingService": {"platform": "remote", "machineList": [{"host": "10.1.2.3", "user": "u"}]},
    }
    service = service_from_config(RemoteEnvironmentService, parse_config(data, tmp_path), tmp_path / "exp")

    async def body() -> None:
        with pytest.raises(RemoteSetupError, match="coordinator.address to 0.0.0.0:0"):
            await service.prepare()
        await service.close()

    run_async(body)


def test_ignore_files_and_limits(tmp_path: Path) -> None:
    code = tmp_path / "code"
    (code / "src").mkdir(parents=True)
    (code / "src" / "model.py").write_text("x = 1\n")
    (code / "runs").mkdir()
    for i in range(5):
        (code / "runs" / f"r{i}.log").write_text("log\n")
    (code / "weights.pt").write_bytes(b"\1" * 300_000)
    (code / ".nniignore").write_text("*.log\n")
    (code / ".trialkeeperignore").write_text("/weights.pt\n")
    names = {e.relpath for e in scan(code)}
    assert "src/model.py" in names and "runs/r0.log" not in names and "weights.pt" not in names
    assert "src/model.py" not in {e.relpath for e in scan(code, exclude=(code / "src",))}
    (code / "src" / "config.yml").write_text("password: s3cret-pw\n")
    packed = pack(code, tmp_path / "ok", max_files=100, max_bytes=10**6, secrets=("s3cret-pw",))
    assert packed.withheld == ("src/config.yml",)
    (code / "src" / "config.yml").unlink()

    (code / ".trialkeeperignore").unlink()
    with pytest.raises(CodeDirError) as err:
        pack(code, tmp_path / "out", max_files=100, max_bytes=100_000)
    assert "weights.pt" in str(err.value) and ".nniignore" in str(err.value)
    (code / ".nniignore").write_text("")
    with pytest.raises(CodeDirError) as err:
        pack(code, tmp_path / "out", max_files=4, max_bytes=10**9)
    assert "runs/ (5 files)" in str(err.value)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_over_limit_code_dir_is_refused_before_any_connection(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    for i in range(30):
        (code / f"f{i}.py").write_text("")
    data = {
        "trialCommand": "python3 f0.py", "trialConcurrency": 1, "trialCodeDirectory": str(code),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trainingService": {
            "platform": "remote", "maxCodeDirFiles": 10,
            "machineList": [{"host": "127.0.0.1", "port": _closed_port(), "user": "nobody", "password": "pw"}],
        },
    }
    config = parse_config(data, tmp_path)
    service = service_from_config(RemoteEnvironmentService, config, tmp_path / "exp")

    async def body() -> None:
        with pytest.raises(CodeDirError, match="30 files, more than the limit of 10"):
            await service.prepare()
        assert service.uploads == [] and all(m.connecting is None for m in service.machines)
        await service.close()

    run_async(body)


# ---- helpers -------------------------------------------------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again at once: nothing listens there


def _trial_pid(m: Machine, trial_id: str) -> int:
    def find() -> int:
        for p in m.processes():
            with _suppress_psutil():
                if p.environ().get("TRIALKEEPER_TRIAL_ID") == trial_id or f"/trials/{trial_id}/" in p.cwd() + "/":
                    return p.pid
        return 0

    return int(wait_until(find, 10.0, message=f"no process of trial {trial_id}"))


def _environ_bytes(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _suppress_psutil() -> contextlib.suppress:
    return contextlib.suppress(psutil.Error, OSError)

