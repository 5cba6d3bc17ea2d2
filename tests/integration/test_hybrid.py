"""One experiment on several platforms at once (NNI's `trainingService` as a list).

Real processes throughout: local agents on this machine, remote agents started over SSH by
a real sshd on 127.0.0.1, the coordinator as `trialkeeper run` where it is killed. Where
sshd cannot start, the tests that need it skip with the reason; in CI they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    async_wait_until,
    pid_gone,
    quickstart_code,
    run_async,
    stored_rows,
    wait_until,
    write_script,
)
from dashboard import get_json, stored_dashboard
from nni_python import nni_python
from sshd import Credentials, Machine, one_machine
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.store.store import Store

WAIT_S = 60.0
MANUAL = Path(__file__).resolve().parents[2] / "docs" / "hybrid.md"

# Each trial marks that it runs, then waits (60 s at most) until `together` trials have
# run at once: with one slot per environment that puts trials on every environment. With
# "hold" it then waits for the file "go" as well, so a test can act mid-trial.
TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
gate = pathlib.Path(os.environ["GATE_DIR"])
(gate / f"ran-{os.environ['NNI_TRIAL_JOB_ID']}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while len(list(gate.glob("ran-*"))) < int(os.environ.get("TOGETHER", "1")) and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_intermediate_result(p["x"] + 0.5)
while os.environ.get("HOLD") and not (gate / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(p["x"])
"""


@dataclass
class Lab:
    machine: Machine
    creds: Credentials
    known_hosts: Path

    def remote(self, **extra: Any) -> dict[str, Any]:
        """A remote section with this one machine."""
        m, creds = self.machine, self.creds
        entry: dict[str, Any] = {"host": m.host, "port": m.port, "user": creds.user, "pythonPath": sys.executable}
        if creds.password:  # cheaper than decrypting the key at every login
            entry["password"] = creds.password
        else:
            entry.update(sshKeyFile=str(creds.key_file), sshPassphrase=creds.passphrase)
        return {"platform": "remote", "knownHostsFile": str(self.known_hosts), "machineList": [entry], **extra}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with one_machine(tmp_path_factory.mktemp("sshd"), "the hybrid tests with a remote platform") as (
        machine,
        creds,
        known_hosts,
    ):
        yield Lab(machine, creds, known_hosts)


def _data(
    tmp_path: Path, training_service: Any, *, trials: int = 4, together: int = 2, hold: bool = False
) -> dict[str, Any]:
    # The code apart from what trials and the coordinator write: its content (what a machine
    # is sent, by hash) changes only when a test changes it.
    (tmp_path / "code").mkdir(exist_ok=True)
    write_script(tmp_path / "code", "trial.py", TRIAL)
    (tmp_path / "gate").mkdir(exist_ok=True)
    env = {"GATE_DIR": str(tmp_path / "gate"), "TOGETHER": str(together)}
    if hold:
        env["HOLD"] = "1"
    return {
        "experimentName": "hybrid",
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path / "code"),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trialConcurrency": 2,
        "maxTrialNumber": trials,
        "searchSpace": {"x": {"_type": "choice", "_value": list(range(1, trials + 1))}},
        "tuner": {"name": "grid"},
        "trialEnv": env,
        # Loose timers: a loaded machine must not make a slow agent look lost.
        "coordinator": {"heartbeatInterval": 0.3, "agentLostTimeout": 10, "trialLostTimeout": 30},
        "trainingService": training_service,
    }


def _platform_of_trials(exp: Path) -> dict[str, str]:
    envs = {e["id"]: e["platform"] for e in stored_rows(exp, "envs")}
    return {t["id"]: envs.get(t["environment_id"], "") for t in stored_rows(exp, "trials")}


def _cli(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "trialkeeper.coordinator.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket is closed


def _run_to_the_end(tmp_path: Path, training_service: Any, capsys: pytest.CaptureFixture[str]) -> Path:
    """`trialkeeper run` of 4 trials on these platforms; checks they all succeeded."""
    config = tmp_path / "config.yml"
    config.write_text(json.dumps(_data(tmp_path, training_service)))
    exp = tmp_path / "exp"
    assert cli.main(["run", str(config), "--quiet", "--experiment-dir", str(exp)]) == 0, capsys.readouterr()
    trials = stored_rows(exp, "trials")
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
    return exp


# ---- local + remote ----------------------------------------------------------------------------


@pytest.mark.slow
def test_nni_list_of_local_and_remote_runs_trials_on_both(
    tmp_path: Path, lab: Lab, capsys: pytest.CaptureFixture[str]
) -> None:
    # NNI's form: a list of platform sections, each with its own fields.
    exp = _run_to_the_end(tmp_path, [{"platform": "local", "environmentCount": 1}, lab.remote(reuseMode=True)], capsys)
    envs = stored_rows(exp, "envs")
    # Each platform started and kept its own environment.
    assert sorted(e["platform"] for e in envs) == ["local", "remote"], [
        (e["id"], e["platform"], e["reason"]) for e in envs
    ]
    assert set(_platform_of_trials(exp).values()) == {"local", "remote"}
    capsys.readouterr()
    assert cli.main(["envs", str(exp)]) == 0
    shown = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.split("\u2502")[1:-1]] for line in shown.splitlines()]
    assert sorted((r[0], r[1]) for r in rows if r and r[0]) == sorted((e["id"], e["platform"]) for e in envs), shown
    # The dashboard's environments page, through a real server: each environment's platform,
    # and the trials each ran.
    with stored_dashboard(exp) as served:
        answer = get_json(served.url + "/api/environments")
    listed = {e["id"]: e for e in answer["environments"]}
    assert {i: e["platform"] for i, e in listed.items()} == {e["id"]: e["platform"] for e in envs}, answer
    ran: dict[str, set[str]] = {}
    for t in stored_rows(exp, "trials"):
        ran.setdefault(t["environment_id"], set()).add(t["id"])
    assert {i: set(e["trials"]) for i, e in listed.items() if e["trials"]} == ran, answer
    remote = next(e for e in listed.values() if e["platform"] == "remote")
    assert remote["hostname"], remote  # where it runs, beside the platform


@pytest.mark.slow
def test_preference_and_allowed_platforms(tmp_path: Path, lab: Lab) -> None:
    data = _data(
        tmp_path,
        {
            "platform": "hybrid",
            # Remote first: trials go there while it has room, then to local.
            "trialPlatforms": ["remote", "local"],
            "platforms": [{"platform": "local", "environmentCount": 1}, lab.remote()],
        },
        together=1,
    )
    config = parse_config(data, tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            first = await c.submit({"x": 1})
            assert (await first.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            only_local = await c.submit({"x": 2}, platforms=["local"])
            assert (await only_local.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            with pytest.raises(ValueError, match="platforms"):
                await c.submit({"x": 3}, platforms=["slurm"])
            platform = {e.id: e.platform for e in c.environments()}
            # Each platform keeps its own environment; the first trial went to whichever was
            # ready first (remote takes longer to set up), the restricted one to local.
            assert platform[c.trial(only_local.id).environment_id or ""] == "local"
            assert sorted(platform.values()) == ["local", "remote"]
            assert platform[c.trial(first.id).environment_id or ""] in ("local", "remote")
            await async_wait_until(
                lambda: all(e.status is EnvStatus.READY for e in c.environments()), WAIT_S,
                message="the environments of both platforms did not become ready",
            )
            preferred = await c.submit({"x": 4})
            await preferred.wait(WAIT_S)
            # Both platforms are up now: the preferred one takes it.
            assert platform[c.trial(preferred.id).environment_id or ""] == "remote"

    run_async(body(), timeout=120.0)


@pytest.mark.slow
def test_a_platform_without_reuse_beside_one_with_it(
    tmp_path: Path, lab: Lab, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = _run_to_the_end(tmp_path, [{"platform": "local", "reuseMode": False}, lab.remote()], capsys)
    trials = stored_rows(exp, "trials")
    envs = {e["id"]: e for e in stored_rows(exp, "envs")}
    ran: dict[str, int] = {}
    for t in trials:
        ran[t["environment_id"]] = ran.get(t["environment_id"], 0) + 1
    # Local gave each trial an environment of its own; the machine kept one for all of its.
    local = [e for e in envs.values() if e["platform"] == "local"]
    assert local and all(ran.get(e["id"], 0) <= 1 for e in local), ran
    assert len([e for e in envs.values() if e["platform"] == "remote"]) == 1
    assert all(e["status"] in ("STOPPED", "FAILED") for e in envs.values())


@pytest.mark.parametrize("broken", ["unreachable", "unpreparable"])
def test_a_platform_that_cannot_start_environments_leaves_the_experiment_to_the_others(
    tmp_path: Path, broken: str
) -> None:
    # A machine nobody listens on (each start fails), or a code directory over the
    # platform's limit (the platform cannot even be prepared).
    port = _closed_port()
    unreachable = {
        "platform": "remote", "sshTimeout": 2,
        "machineList": [{"host": "127.0.0.1", "port": port, "user": "nobody", "password": "x"}],
        **({"maxCodeDirSizeMb": 0.000001} if broken == "unpreparable" else {}),
    }
    data = _data(tmp_path, [unreachable, {"platform": "local", "environmentCount": 2}], trials=3)
    config = parse_config(data, tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            handles = [await c.submit({"x": x}) for x in (1, 2, 3)]
            for h in handles:
                assert (await h.wait(WAIT_S)).status is TrialStatus.SUCCEEDED, h.info
            assert "local" not in c.platform_errors
            why = c.platform_errors["remote"]
            assert ("could not be prepared" in why) == (broken == "unpreparable"), why
            assert str(port) in why or broken == "unpreparable", why
            assert not c.environment_error  # the experiment goes on
            envs = c.environments()
            # Unreachable, its starts failed; unpreparable, it started none.
            failed = {e.platform for e in envs if e.status and e.status.value == "FAILED"}
            assert failed == (set() if broken == "unpreparable" else {"remote"}), [
                (e.id, e.platform, e.status) for e in envs
            ]
            assert {e.platform for e in envs if e.status and e.status.value in ("READY", "BUSY")} == {"local"}

    run_async(body(), timeout=120.0)


# ---- the manual's configs (docs/hybrid.md) ---------------------------------------------------


def readme_config(marker: str) -> str:
    """The YAML block after ``<!-- marker -->`` in docs/hybrid.md, as written there."""
    text = MANUAL.read_text(encoding="utf-8")
    return text.split(f"<!-- {marker} -->", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]


# NNI's own reading of a config: its ExperimentConfig, validated as `nnictl create` does.
NNI_READS = """
import sys, yaml
from nni.experiment.config import ExperimentConfig
config = ExperimentConfig(**yaml.safe_load(sys.stdin.read()))
config.validate()
print(" ".join(ts.platform for ts in config.training_service))
"""


@pytest.mark.slow
def test_the_readme_s_nni_hybrid_config_is_read_by_nni_and_runs_here(
    tmp_path: Path, lab: Lab, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = readme_config("hybrid-nni-config")
    code = quickstart_code(tmp_path)
    # A home of its own: NNI checks that the key file exists, and experiments are kept there.
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(lab.creds.key_file, home / ".ssh" / "id_ed25519")
    nni = subprocess.run(
        [nni_python(), "-c", NNI_READS], input=text, cwd=code, env={**os.environ, "HOME": str(home)},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert nni.returncode == 0 and nni.stdout.split() == ["local", "remote"], nni.stdout + nni.stderr

    # Here, only the machine's login differs: this test's sshd has a port, user, key and
    # Python of its own (and a known_hosts file with its host key).
    data = yaml.safe_load(text)
    local, remote = data["trainingService"]
    assert local == {"platform": "local"} and remote["machineList"][0]["host"] == lab.machine.host
    remote.update(lab.remote())
    config = code / "config.yml"
    config.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("HOME", str(home))
    exp = tmp_path / "exp"
    assert cli.main(["run", str(config), "--quiet", "--experiment-dir", str(exp)]) == 0, capsys.readouterr()
    trials = stored_rows(exp, "trials")
    assert len(trials) == data["maxTrialNumber"]
    assert {t["status"] for t in trials} == {"SUCCEEDED"}, [(t["id"], t["status"], t["reason"]) for t in trials]
    assert {e["platform"] for e in stored_rows(exp, "envs")} == {"local", "remote"}
    assert "coordinatorAddress is not set" not in caplog.text  # the machine dials nniManagerIp


# ---- a crash: resume and clean -------------------------------------------------------------------


def _run_until(
    tmp_path: Path, data: dict[str, Any], ready: Callable[[Path], bool], what: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """`trialkeeper run` of ``data`` in the background until ``ready(experiment dir)``."""
    config = tmp_path / "config.yml"
    config.write_text(json.dumps(data))
    exp = tmp_path / "exp"
    proc = _cli("run", str(config), "--experiment-dir", str(exp), "--quiet")
    try:
        wait_until(lambda: ready(exp) or proc.poll() is not None, WAIT_S, message=what)
        assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc, exp


def _run_until_both_platforms_hold_a_trial(tmp_path: Path, lab: Lab) -> tuple[subprocess.Popen[bytes], Path]:
    # The local agent is up well before the machine is set up (SSH, probe, upload): local,
    # preferred, takes the first trial; the second finds it full and goes to the machine.
    data = _data(tmp_path, [{"platform": "local", "environmentCount": 1}, lab.remote()], hold=True)

    def both_running(exp: Path) -> bool:
        running = [t for t in stored_rows(exp, "trials") if t["status"] == "RUNNING"]
        platforms = _platform_of_trials(exp)
        return len(running) == 2 and {platforms[t["id"]] for t in running} == {"local", "remote"}

    return _run_until(tmp_path, data, both_running, "trials never ran on both platforms")


def _came_back(exp: Path, env_id: str) -> bool:
    store = Store.in_dir(exp, readonly=True)
    try:
        return any(e["old"] == "LOST" and e["new"] in ("READY", "BUSY") for e in store.events(env_id))
    finally:
        store.close()


def _trial_pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in (tmp_path / "gate").glob("ran-*")]


@pytest.mark.slow
def test_kill_9_then_resume_each_platform_takes_back_its_own(tmp_path: Path, lab: Lab) -> None:
    first, exp = _run_until_both_platforms_hold_a_trial(tmp_path, lab)
    resumed = None
    try:
        before = {e["id"]: e["platform"] for e in stored_rows(exp, "envs")}
        running = {t["id"]: t["environment_id"] for t in stored_rows(exp, "trials") if t["status"] == "RUNNING"}
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        # The stored config has the SSH password redacted: the file gives it back.
        resumed = _cli("resume", str(exp), "--quiet", "--config", str(tmp_path / "config.yml"))
        # Back from LOST (what the resumed coordinator took them for until they reconnect).
        wait_until(
            lambda: all(_came_back(exp, env_id) for env_id in before) or resumed.poll() is not None,
            WAIT_S, message="the agents did not reconnect",
        )
        (tmp_path / "gate" / "go").write_text("")
        out, _ = resumed.communicate(timeout=WAIT_S * 2)
        assert resumed.returncode == 0, out.decode(errors="replace")
        trials = stored_rows(exp, "trials")
        assert {t["status"] for t in trials} == {"SUCCEEDED"}, [(t["id"], t["status"], t["reason"]) for t in trials]
        by_id = {t["id"]: t for t in trials}
        for trial_id, env_id in running.items():
            # The trials running at the crash went on where they were, on both platforms.
            assert by_id[trial_id]["attempts"] == 1 and by_id[trial_id]["environment_id"] == env_id
        # No environment was replaced: each platform re-adopted its own, and stopped it at the end.
        assert {e["id"]: e["platform"] for e in stored_rows(exp, "envs")} == before
        wait_until(lambda: not lab.machine.processes(), 30.0, message="the adopted agent still runs on the machine")
    finally:
        for proc in (first, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        cli.main(["clean", str(exp), "--config", str(tmp_path / "config.yml")])  # after a failure


@pytest.mark.slow
def test_resume_after_the_code_changed_uploads_it_to_the_adopted_machine(tmp_path: Path, lab: Lab) -> None:
    # One platform (not specific to a mix): every trial after the resume runs on the machine
    # whose agent the first coordinator started, in a code directory that has changed since.
    data = _data(tmp_path, lab.remote(), trials=3, together=1, hold=True)
    first, exp = _run_until(
        tmp_path,
        data,
        lambda exp: any(t["status"] == "RUNNING" for t in stored_rows(exp, "trials")),
        "no trial ran on the machine",
    )
    config = tmp_path / "config.yml"
    resumed = None
    try:
        (env,) = stored_rows(exp, "envs")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        write_script(tmp_path / "code", "trial.py", TRIAL + "\n# changed after the first run\n")
        (tmp_path / "gate" / "go").write_text("")
        resumed = _cli("resume", str(exp), "--quiet", "--config", str(config))
        out, _ = resumed.communicate(timeout=WAIT_S * 2)
        assert resumed.returncode == 0, out.decode(errors="replace")
        trials = stored_rows(exp, "trials")
        assert [t["status"] for t in trials] == ["SUCCEEDED"] * 3, [(t["id"], t["status"], t["reason"]) for t in trials]
        # All on the adopted environment: none was replaced to get the new code there.
        assert {t["environment_id"] for t in trials} == {env["id"]}
        assert [e["id"] for e in stored_rows(exp, "envs")] == [env["id"]]
        wait_until(lambda: not lab.machine.processes(), 30.0, message="the adopted agent still runs on the machine")
    finally:
        for proc in (first, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        cli.main(["clean", str(exp), "--config", str(config)])


@pytest.mark.slow
def test_clean_after_kill_9_removes_what_each_platform_still_runs(
    tmp_path: Path, lab: Lab, capsys: pytest.CaptureFixture[str]
) -> None:
    first, exp = _run_until_both_platforms_hold_a_trial(tmp_path, lab)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    try:
        pids = wait_until(lambda: len(_trial_pids(tmp_path)) == 2 and _trial_pids(tmp_path), WAIT_S)
        assert lab.machine.processes(), "the remote agent and its trial should outlive the coordinator"
    finally:
        assert cli.main(["clean", str(exp), "--config", str(tmp_path / "config.yml")]) == 0
    out = capsys.readouterr().out
    envs = stored_rows(exp, "envs")
    removed = next(line for line in out.splitlines() if "environment(s)" in line)
    assert sorted(e["id"] for e in envs) == sorted(removed.split(": ")[-1].strip().split(", ")), out
    wait_until(
        lambda: all(pid_gone(p) for p in pids), 30.0, message=f"trial processes {pids}: some still run after clean"
    )
    wait_until(lambda: not lab.machine.processes(), 30.0, message="the remote machine still runs processes")
