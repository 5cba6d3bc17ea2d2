"""What a killed coordinator leaves running is found by the experiment id and removed:
by `trialkeeper clean`, and by `trialkeeper resume` for what the store no longer counts on.

Real processes throughout: the coordinator is `trialkeeper run` in a subprocess, killed with
SIGKILL; its local agents and their trials keep running until something removes them.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import pid_gone, wait_until, write_script
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.store.store import Store, StoreError
from trialkeeper.protos.wire import ENVIRONMENT_ENV, EXPERIMENT_ENV

WAIT_S = 60.0

# Writes its pid where the test finds it, then waits (with a deadline) for "go".
TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
gate = pathlib.Path(os.environ["GATE_DIR"])
(gate / f"pid-{os.getpid()}").write_text("")
deadline = time.monotonic() + 90
while not (gate / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(p["x"])
"""


def _config(tmp_path: Path) -> Path:
    write_script(tmp_path, "trial.py", TRIAL)
    (tmp_path / "gate").mkdir()
    cfg = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trialConcurrency": 2,
        "maxTrialNumber": 2,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2]}},
        "tuner": {"name": "grid"},
        "trialEnv": {"GATE_DIR": str(tmp_path / "gate")},
        "trainingService": {"platform": "local", "environmentCount": 2},
        "coordinator": {"heartbeatInterval": 0.2, "agentLostTimeout": 2, "trialLostTimeout": 30},
    }
    path = tmp_path / "config.yml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _cli(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def _envs(exp: Path) -> list[dict[str, object]]:
    if not (exp / Store.FILENAME).exists():
        return []
    try:
        store = Store.in_dir(exp, readonly=True)
    except StoreError:
        return []  # created, its schema not yet written
    try:
        return store.envs()
    except sqlite3.Error:
        return []
    finally:
        store.close()


def _trial_pids(tmp_path: Path) -> list[int]:
    return [int(p.name.removeprefix("pid-")) for p in (tmp_path / "gate").glob("pid-*")]


def _agent_pids(exp: Path) -> dict[str, int]:
    return {str(e["id"]): int(json.loads(str(e["info_json"]))["pid"]) for e in _envs(exp) if e["info_json"] != "{}"}


def _experiment(tmp_path: Path) -> Path | None:
    found = list((tmp_path / "experiments").glob(f"*/{Store.FILENAME}"))
    return found[0].parent if found else None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


@pytest.fixture
def crashed(tmp_path: Path) -> Iterator[tuple[Path, dict[str, int], list[int], subprocess.Popen[bytes]]]:
    """An experiment whose coordinator is running two trials on two agents; the test kills it.

    Gives (experiment dir, agent pids by environment, trial pids, the coordinator process)."""
    config = _config(tmp_path)
    run = _cli("run", str(config), "--quiet")
    try:
        wait_until(lambda: len(_trial_pids(tmp_path)) == 2 or run.poll() is not None, WAIT_S, message="no trials ran")
        assert run.poll() is None, run.communicate(timeout=30)[0].decode(errors="replace")
        exp = _experiment(tmp_path)
        assert exp is not None
        agents = wait_until(lambda: (a := _agent_pids(exp)) and len(a) == 2 and a, WAIT_S)
        yield exp, agents, _trial_pids(tmp_path), run
    finally:
        _kill(run)
        (tmp_path / "gate" / "go").write_text("")  # whatever failed, let the trials end


def test_clean_refuses_a_live_coordinator_then_removes_what_a_killed_one_left(
    tmp_path: Path, crashed: tuple[Path, dict[str, int], list[int], subprocess.Popen[bytes]],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    exp, agents, trials, run = crashed
    assert cli.main(["clean", str(exp)]) == 1
    err = capsys.readouterr().err
    assert "refusing to clean" in err and "its coordinator answers on" in err, err
    assert not any(pid_gone(pid) for pid in [*agents.values(), *trials])

    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    # By experiment id, under the default working directory (~/trialkeeper-experiments).
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "trialkeeper-experiments").symlink_to(exp.parent)
    assert cli.main(["clean", exp.name]) == 0
    out = capsys.readouterr().out
    assert f"experiment {exp.name}: removed 2 environment(s) from local: env-1, env-2" in out, out
    for pid in [*agents.values(), *trials]:
        wait_until(lambda pid=pid: pid_gone(pid), 10.0, message=f"pid {pid} still runs")

    assert cli.main(["clean", str(exp)]) == 0
    assert "nothing left to remove" in capsys.readouterr().out
    # What the store records no checkpoint of goes: an interrupted upload, a step let go, the
    # local agents' copies.
    for rel in ("checkpoints/t1/.incoming-3/model.pt", "checkpoints/t1/2/model.pt", "checkpoint-cache/t1/2/m"):
        (exp / rel).parent.mkdir(parents=True, exist_ok=True)
        (exp / rel).write_bytes(b"12345")
    assert cli.main(["clean", str(exp)]) == 0
    assert "removed 3 checkpoint director(ies) no longer needed (15 bytes)" in capsys.readouterr().out
    assert not (exp / "checkpoints" / "t1").exists() and not (exp / "checkpoint-cache").exists()
    assert cli.main(["clean", "no-such-experiment"]) == 1
    assert "no experiment 'no-such-experiment'" in capsys.readouterr().err


def test_resume_removes_agents_the_store_does_not_count_on(
    tmp_path: Path, crashed: tuple[Path, dict[str, int], list[int], subprocess.Popen[bytes]],
) -> None:
    exp, agents, trials, run = crashed
    store = Store.in_dir(exp, readonly=True)
    experiment_id, address = str(store.experiment()["id"]), store.meta("bound_address")  # type: ignore[index]
    store.close()
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    # An agent of this experiment the store knows nothing of: the local service started it
    # (so it carries the experiment's marks) as the coordinator died. It keeps dialing.
    env = {**os.environ, "TRIALKEEPER_TOKEN": (exp / ".token").read_text().strip(),
           EXPERIMENT_ENV: experiment_id, ENVIRONMENT_ENV: "env-9"}
    with open(tmp_path / "orphan.log", "wb") as log:
        orphan = subprocess.Popen(
            [sys.executable, "-m", "trialkeeper.agent", "--coordinator", str(address), "--environment-id", "env-9",
             "--workdir", str(exp), "--reconnect-window", "60"],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    resumed = None
    try:
        resumed = _cli("resume", str(exp), "--quiet")
        wait_until(lambda: orphan.poll() is not None, WAIT_S, message="resume left the orphaned agent running")
        assert orphan.returncode == -signal.SIGKILL
        # The agents the store counts on were kept: they reconnect and finish their trials.
        wait_until(
            lambda: all(e["status"] in ("READY", "BUSY") for e in _envs(exp)) or resumed.poll() is not None,
            WAIT_S, message="the kept agents did not reconnect",
        )
        assert not any(pid_gone(pid) for pid in [*agents.values(), *trials])
        (tmp_path / "gate" / "go").write_text("")
        out, _ = resumed.communicate(timeout=WAIT_S)
        assert resumed.returncode == 0, out.decode(errors="replace")
        store = Store.in_dir(exp, readonly=True)
        try:
            assert [t["status"] for t in store.trials()] == ["SUCCEEDED", "SUCCEEDED"]
            assert sorted(str(e["id"]) for e in store.envs()) == ["env-1", "env-2"]
        finally:
            store.close()
    finally:
        if orphan.poll() is None:
            orphan.kill()
        orphan.wait(timeout=30)
        if resumed is not None:
            _kill(resumed)
