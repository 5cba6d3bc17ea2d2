"""The coordinator dies (kill -9) mid-experiment; `trialkeeper resume` carries on.

Real processes throughout: the coordinator is the `trialkeeper run` command, the agents it
started keep running while it is down, and `trialkeeper resume` takes them back.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from conftest import pid_gone, stored_rows, wait_until, write_script
from trialkeeper.coordinator.store.store import Store, StoreError

WAIT_S = 60.0

# Reports one result, waits for "phase1" (the coordinator is dead by then) and reports one
# more, which the agent must keep until a coordinator acks it; waits for "phase2" (the new
# coordinator is up) and finishes.
TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
gate = pathlib.Path(os.environ["GATE_DIR"])

def wait_for(name):
    deadline = time.monotonic() + 90
    while not (gate / name).exists() and time.monotonic() < deadline:
        time.sleep(0.02)

trial.report_intermediate_result(p["x"] + 0.1)
wait_for("phase1")
trial.report_intermediate_result(p["x"] + 0.2)
wait_for("phase2")
trial.report_intermediate_result(p["x"] + 0.3)
trial.report_final_result(p["x"])
"""


def _config(tmp_path: Path, **coordinator: object) -> Path:
    write_script(tmp_path, "trial.py", TRIAL)
    cfg = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 2,
        "maxTrialNumber": 6,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3, 4, 5, 6]}},
        "tuner": {"name": "grid"},
        "trialEnv": {"GATE_DIR": str(tmp_path / "gate")},
        "trainingService": {"platform": "local", "environmentCount": 2},
        "coordinator": {"heartbeatInterval": 0.2, "agentLostTimeout": 2, "trialLostTimeout": 20, **coordinator},
    }
    (tmp_path / "gate").mkdir()
    path = tmp_path / "config.yml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )


_rows = stored_rows  # the store as the running coordinator has written it so far


def _agent_pids(exp: Path) -> dict[str, int]:
    return {
        str(e["id"]): int(json.loads(str(e["info_json"]))["pid"]) for e in _rows(exp, "envs") if e["info_json"] != "{}"
    }


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_kill_9_then_resume_finishes_with_every_trial_and_metric(tmp_path: Path) -> None:
    config = _config(tmp_path)
    exp = tmp_path / "exp"
    first = _cli("run", str(config), "--experiment-dir", str(exp), "--quiet")
    resumed = None
    try:
        running = wait_until(
            lambda: [t for t in _rows(exp, "trials") if t["status"] == "RUNNING"] if len(
                [t for t in _rows(exp, "trials") if t["status"] == "RUNNING"]) == 2 else None,
            WAIT_S, message="two trials never ran",
        )
        store = Store.in_dir(exp, readonly=True)
        wait_until(lambda: all(store.metrics(str(t["id"])) for t in running), WAIT_S)
        store.close()
        agents = _agent_pids(exp)
        assert len(agents) == 2
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        # While no coordinator runs, the trials report again: the agents keep it.
        (tmp_path / "gate" / "phase1").write_text("")
        resumed = _cli("resume", str(exp), "--quiet")
        wait_until(
            lambda: all(r["status"] in ("READY", "BUSY") for r in _rows(exp, "envs")[:2]) or resumed.poll() is not None,
            WAIT_S, message="the agents did not reconnect",
        )
        (tmp_path / "gate" / "phase2").write_text("")
        out, _ = resumed.communicate(timeout=WAIT_S)
        text = out.decode(errors="replace")
        assert resumed.returncode == 0, text
        # The agents that ran before the crash are the ones that finished their trials.
        for pid in agents.values():
            assert pid_gone(pid) or psutil.Process(pid).is_running()
        trials = _rows(exp, "trials")
        assert len(trials) == 6, trials
        assert {t["status"] for t in trials} == {"SUCCEEDED"}, [(t["id"], t["status"], t["reason"]) for t in trials]
        by_id = {t["id"]: t for t in trials}
        for t in running:
            assert by_id[t["id"]]["attempts"] == 1 and by_id[t["id"]]["environment_id"] == t["environment_id"]
        # Every metric once, in order: 3 intermediate and 1 final per trial.
        store = Store.in_dir(exp, readonly=True)
        try:
            for t in trials:
                params = json.loads(str(t["parameters_json"]))
                got = [(m.kind, round(m.value, 6)) for m in store.metrics(str(t["id"]))]
                x = params["x"]
                assert got == [
                    ("intermediate", x + 0.1),
                    ("intermediate", x + 0.2),
                    ("intermediate", x + 0.3),
                    ("final", x),
                ], got
            assert sorted(json.loads(str(t["parameters_json"]))["x"] for t in trials) == [1, 2, 3, 4, 5, 6]
            assert store.experiment()["status"] == "DONE"  # type: ignore[index]
        finally:
            store.close()
    finally:
        _kill(first)
        if resumed is not None:
            _kill(resumed)


def test_agents_whose_coordinator_never_returns_stop_their_trials_and_exit(tmp_path: Path) -> None:
    config = _config(tmp_path, reconnectWindow=2)
    exp = tmp_path / "exp"
    first = _cli("run", str(config), "--experiment-dir", str(exp), "--quiet")
    try:
        wait_until(lambda: sum(t["status"] == "RUNNING" for t in _rows(exp, "trials")) == 2, WAIT_S)
        agents = _agent_pids(exp)
        trial_pids = [
            p.pid for a in agents.values() for p in psutil.Process(a).children(recursive=True)
        ]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        for pid in [*agents.values(), *trial_pids]:
            wait_until(lambda pid=pid: pid_gone(pid), WAIT_S, message=f"pid {pid} still runs")
        log = textwrap.shorten((exp / "envs" / "env-1" / "agent.log").read_text(), 100000)
        assert "reconnect window" in log, log[-2000:]
    finally:
        _kill(first)
        # Nothing of this test may outlive it, whatever failed above.
        for p in psutil.process_iter(["cmdline"]):
            if str(tmp_path) in " ".join(p.info["cmdline"] or ()):
                os.kill(p.pid, signal.SIGKILL)


FLOOD = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
for i in range(p["n"]):
    trial.report_intermediate_result(float(i))
    if i >= p["n"] // 2 and i % 10 == 0:
        time.sleep(0.003)  # the second half goes on for seconds: the kill lands while it does
gate = pathlib.Path(os.environ["GATE_DIR"]) / "phase2"
deadline = time.monotonic() + 90
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(float(p["n"]))
"""


def _metric_indices(exp: Path) -> dict[str, list[int]]:
    store = Store.in_dir(exp, readonly=True)
    try:
        out: dict[str, list[int]] = {}
        for m in store.metrics():
            out.setdefault(m.trial_id, []).append(m.index)
        return out
    finally:
        store.close()


def test_store_survives_kill_9_during_heavy_ingest(tmp_path: Path) -> None:
    n = 20_000
    write_script(tmp_path, "flood.py", FLOOD)
    config = _config(tmp_path)
    data = json.loads(config.read_text())
    data.update(
        trialCommand=f"{sys.executable} flood.py", maxTrialNumber=2,
        searchSpace={"n": {"_type": "choice", "_value": [n, n + 1]}}, tuner={"name": "grid"},
    )
    config.write_text(json.dumps(data))
    exp = tmp_path / "exp"
    first = _cli("run", str(config), "--experiment-dir", str(exp), "--quiet")
    resumed = None
    try:
        def stored() -> int:  # the count the store keeps: a look that takes no time to speak of
            try:
                store = Store.in_dir(exp, readonly=True)
            except (StoreError, sqlite3.Error):
                return 0
            try:
                return store.metric_count()
            except sqlite3.Error:
                return 0
            finally:
                store.close()

        wait_until(lambda: stored() > 4000, WAIT_S, message="no ingest")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        # What was committed is intact and has no holes: acks follow commits, so the
        # agents still hold everything after each trial's stored prefix.
        store = Store.in_dir(exp, readonly=True)
        assert store.integrity_check() == "ok"
        store.close()
        before = _metric_indices(exp)
        for indices in before.values():
            assert indices == list(range(len(indices)))
        assert sum(map(len, before.values())) < 2 * n + 1, "the kill came too late to test anything"
        resumed = _cli("resume", str(exp), "--quiet")
        wait_until(lambda: stored() >= 2 * n + 1 or resumed.poll() is not None, WAIT_S)
        (tmp_path / "gate" / "phase2").write_text("")
        out, _ = resumed.communicate(timeout=WAIT_S)
        assert resumed.returncode == 0, out.decode(errors="replace")
        store = Store.in_dir(exp, readonly=True)
        try:
            assert store.integrity_check() == "ok"
            trials = store.trials()
            assert [t["status"] for t in trials] == ["SUCCEEDED", "SUCCEEDED"]
            for t in trials:
                want = json.loads(t["parameters_json"])["n"]
                got = store.metrics(t["id"])
                assert [m.index for m in got] == list(range(want + 1))
                assert [m.value for m in got[:-1]] == [float(i) for i in range(want)]
                assert got[-1].kind == "final" and got[-1].value == float(want)
        finally:
            store.close()
    finally:
        _kill(first)
        if resumed is not None:
            _kill(resumed)


# Writes the WANDB_API_KEY it sees to seen/X.txt, then waits for "phase1" and finishes.
SECRET_TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
gate = pathlib.Path(os.environ["GATE_DIR"])
seen = gate.parent / "seen"
(seen / f"{p['x']}.tmp").write_text(os.environ.get("WANDB_API_KEY", "<unset>"))
(seen / f"{p['x']}.tmp").rename(seen / f"{p['x']}.txt")
deadline = time.monotonic() + 90
while not (gate / "phase1").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(p["x"])
"""


def test_resume_takes_a_redacted_trial_env_secret_from_the_environment_or_refuses(tmp_path: Path) -> None:
    secret = "wandb-0123456789abcdef"
    write_script(tmp_path, "secret_trial.py", SECRET_TRIAL)
    config = _config(tmp_path)
    data = json.loads(config.read_text())
    data["trialEnv"]["WANDB_API_KEY"] = secret
    data.update(
        trialCommand=f"{sys.executable} secret_trial.py", maxTrialNumber=4,
        searchSpace={"x": {"_type": "choice", "_value": [1, 2, 3, 4]}},
    )
    config.write_text(json.dumps(data))
    seen = tmp_path / "seen"
    seen.mkdir()
    exp = tmp_path / "exp"
    without = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}

    def values() -> dict[str, str]:
        return {p.stem: p.read_text() for p in seen.glob("*.txt")}

    first = _cli("run", str(config), "--experiment-dir", str(exp), "--quiet", env=without)
    started = [first]
    try:
        wait_until(lambda: len(values()) == 2, WAIT_S, message="two trials never ran")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        store = Store.in_dir(exp, readonly=True)
        stored = str(store.experiment()["config_json"])  # type: ignore[index]
        store.close()
        assert secret not in stored and "***" in stored
        # Neither the environment nor --config gives the secret: refused, nothing started.
        refused = _cli("resume", str(exp), "--quiet", env=without)
        started.append(refused)
        out, _ = refused.communicate(timeout=WAIT_S)
        text = out.decode(errors="replace").strip()
        assert refused.returncode == 1, text
        assert (
            "trialEnv WANDB_API_KEY: set it in the environment of `trialkeeper resume`, "
            "or pass the config file with --config FILE"
            in text
        )
        assert len(text.splitlines()) == 1 and secret not in text, text
        assert len(_rows(exp, "trials")) == 2 and values() == {"1": secret, "2": secret}
        # With the variable in its environment, resume gives the trials it starts the real value.
        (tmp_path / "gate" / "phase1").write_text("")
        resumed = _cli("resume", str(exp), "--quiet", env={**without, "WANDB_API_KEY": secret})
        started.append(resumed)
        out, _ = resumed.communicate(timeout=2 * WAIT_S)
        assert resumed.returncode == 0, out.decode(errors="replace")
        trials = _rows(exp, "trials")
        assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
        assert values() == {"1": secret, "2": secret, "3": secret, "4": secret}
    finally:
        for proc in started:
            _kill(proc)
