"""Trial scripts written for NNI, run unchanged with NNI's real package, from NNI-style
config files through ``trialkeeper run``: on local and on remote over a real sshd, reuse
mode on and off, nni 3.0 and (where it installs) 2.10.1. ``import nni`` costs each trial
about 2 s, so each experiment runs few trials."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import stored_metrics, wait_until
from nni_python import nni_python
from sshd import Credentials, Machine, one_machine
from trialkeeper.coordinator import cli

RUN_TIMEOUT_S = 180.0

# scikit-learn on a data set it ships, as NNI's sklearn example does; a dict final metric.
SKLEARN_TRIAL = """
import nni
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.svm import SVC

params = nni.get_next_parameter()
print("ids", nni.get_trial_id(), nni.get_experiment_id(), nni.get_sequence_id(), flush=True)
X, y = load_digits(return_X_y=True)
X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=99, test_size=0.25)
model = SVC(C=params["C"], gamma=params["gamma"]).fit(X_train, y_train)
score = model.score(X_test, y_test)
print("score", score, flush=True)
nni.report_final_result({"default": score, "train_size": len(X_train)})
"""

# Many intermediate results, then a plain number; iris this time.
MANY_RESULTS_TRIAL = """
import nni
from sklearn.datasets import load_iris
from sklearn.linear_model import SGDClassifier

params = nni.get_next_parameter()
print("ids", nni.get_trial_id(), nni.get_experiment_id(), nni.get_sequence_id(), flush=True)
X, y = load_iris(return_X_y=True)
model = SGDClassifier(alpha=params["alpha"], random_state=0)
for epoch in range({epochs}):
    model.partial_fit(X, y, classes=[0, 1, 2])
    nni.report_intermediate_result({{"default": model.score(X, y), "epoch": epoch}})
nni.report_final_result(model.score(X, y))
"""

SEARCH_SPACE = {
    "C": {"_type": "choice", "_value": [0.5, 1.0, 10.0]},
    "gamma": {"_type": "choice", "_value": [0.0005, 0.001]},
    "alpha": {"_type": "choice", "_value": [0.0001, 0.001]},
}


def _nni_config(code: Path, command: str, service: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """An NNI v2 config as `nnictl create` takes it (NNI spellings and forms)."""
    return {
        "experimentName": "from-nni",
        "experimentType": "hpo",
        "searchSpaceFile": "search_space.json",
        "trialCommand": command,
        "trialCodeDirectory": ".",
        "trial_concurrency": 2,  # NNI compares keys without case or underscores
        "maxTrialNumber": 2,
        "maxExperimentDuration": "10m",
        "maxTrialDuration": "2m",
        "useAnnotation": False,
        "debug": False,
        "logLevel": "info",
        "experimentWorkingDirectory": str(code.parent / "nni-experiments"),
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize", "seed": 3}},
        "trainingService": service,
        **extra,
    }


def _write(code: Path, script: str, config: dict[str, Any]) -> Path:
    code.mkdir(parents=True, exist_ok=True)
    (code / "trial.py").write_text(textwrap.dedent(script).lstrip())
    (code / "search_space.json").write_text(json.dumps(SEARCH_SPACE))
    (code / "config.yml").write_text(yaml.safe_dump(config))
    return code / "config.yml"


def _run(config_file: Path, exp: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "trialkeeper"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNI_")}
    return subprocess.run(
        [str(script), "run", str(config_file), "--quiet", "--experiment-dir", str(exp)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL, check=False,
    )


def _stored(exp: Path) -> tuple[str, list[sqlite3.Row], dict[str, list[dict[str, Any]]]]:
    db = sqlite3.connect(f"file:{exp / 'trialkeeper.db'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    with db:
        exp_id = db.execute("SELECT id FROM experiment").fetchone()["id"]
        trials = db.execute("SELECT * FROM trials ORDER BY seq").fetchall()
    db.close()
    metrics = {t["id"]: stored_metrics(exp, t["id"]) for t in trials}
    return exp_id, trials, metrics


def _check_ids(stdout: str, trial: sqlite3.Row, exp_id: str) -> None:
    """nni.get_trial_id() and friends returned this experiment's ids."""
    line = next(line for line in stdout.splitlines() if line.startswith("ids "))
    assert line.split()[1:] == [trial["id"], exp_id, str(trial["seq"])], (line, dict(trial))


def _check_sklearn(exp: Path, proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    exp_id, trials, metrics = _stored(exp)
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 2, [(t["status"], t["reason"]) for t in trials]
    for t in trials:
        stdout = (exp / "trials" / t["id"] / "stdout.log").read_text()
        _check_ids(stdout, t, exp_id)
        score = float(next(line for line in stdout.splitlines() if line.startswith("score ")).split()[1])
        [final] = metrics[t["id"]]
        assert final["kind"] == "final" and final["value"] == pytest.approx(score)
        assert json.loads(final["value_json"]) == {"default": pytest.approx(score), "train_size": 1347}
        assert t["final_metric"] == pytest.approx(score) and 0.5 < score <= 1.0
        stderr = exp / "trials" / t["id"] / "stderr.log"  # an empty one is not streamed from remote
        assert not stderr.exists() or "[trialkeeper]" not in stderr.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_sklearn_trial_with_dict_metrics_on_local(tmp_path: Path, reuse: bool) -> None:
    python = nni_python()
    service = {
        "platform": "local",
        "useActiveGpu": False,
        "maxTrialNumberPerGpu": 1,
        "gpuIndices": "0",
        "reuseMode": reuse,
    }
    config = _write(tmp_path / "code", SKLEARN_TRIAL, _nni_config(tmp_path / "code", f"{python} trial.py", service))
    _check_sklearn(tmp_path / "exp", _run(config, tmp_path / "exp"))


@pytest.mark.slow
@pytest.mark.parametrize("variable", ["TRIALKEEPER_NNI_PYTHON", "TRIALKEEPER_NNI2_PYTHON"], ids=["nni3", "nni2"])
def test_many_intermediate_results_on_local(tmp_path: Path, variable: str) -> None:
    python = nni_python(variable)
    epochs = 300
    # The trial's settings inside trainingService, as NNI allows.
    service = {
        "platform": "local",
        "trialCommand": f"{python} trial.py",
        "trialGpuNumber": 0,
        "nniManagerIp": "127.0.0.1",
    }
    data = _nni_config(tmp_path / "code", "unused", service)
    del data["trialCommand"]
    config = _write(tmp_path / "code", MANY_RESULTS_TRIAL.format(epochs=epochs), data)
    exp = tmp_path / "exp"
    proc = _run(config, exp)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    exp_id, trials, metrics = _stored(exp)
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 2, [(t["status"], t["reason"]) for t in trials]
    for t in trials:
        _check_ids((exp / "trials" / t["id"] / "stdout.log").read_text(), t, exp_id)
        rows = metrics[t["id"]]
        assert [r["idx"] for r in rows] == list(range(epochs + 1))
        assert [r["kind"] for r in rows] == ["intermediate"] * epochs + ["final"]
        assert [json.loads(r["value_json"])["epoch"] for r in rows[:-1]] == list(range(epochs))
        assert all(0.0 <= r["value"] <= 1.0 for r in rows)
        assert rows[-1]["value"] == pytest.approx(json.loads(rows[-2]["value_json"])["default"])


BAD_LINES_TRIAL = r"""
import json, sys
def line(kind, value):
    message = {"parameter_id": 0, "trial_job_id": "x", "type": kind, "sequence": 0, "value": json.dumps(value)}
    print("NNISDK_MEb'" + json.dumps(message) + "'", flush=True)
print("before", flush=True)
print("NNISDK_MEb'{not json'", flush=True)
print("NNISDK_MEb'" + "x" * 1_100_000, flush=True)
line("PERIODICAL", "not a number")
line("PERIODICAL", 0.25)
line("FINAL", 0.5)
line("FINAL", 0.75)
print("after", flush=True)
"""


def test_malformed_and_oversized_lines_become_notes_and_the_trial_goes_on(tmp_path: Path) -> None:
    service = {"platform": "local"}
    data = _nni_config(tmp_path / "code", f"{sys.executable} trial.py", service, maxTrialNumber=1, trialConcurrency=1)
    del data["trial_concurrency"]
    config = _write(tmp_path / "code", BAD_LINES_TRIAL, data)
    exp = tmp_path / "exp"
    proc = _run(config, exp)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    _, [trial], metrics = _stored(exp)
    assert trial["status"] == "SUCCEEDED", dict(trial)
    assert [(r["kind"], r["value"]) for r in metrics[trial["id"]]] == [("intermediate", 0.25), ("final", 0.5)]
    notes = [
        line
        for line in (exp / "trials" / trial["id"] / "stderr.log").read_text().splitlines()
        if line.startswith("[trialkeeper]")
    ]
    assert len(notes) == 4, notes
    assert "not JSON" in notes[0] and "longer than 1000000 bytes" in notes[1]
    assert "intermediate result refused" in notes[2] and "already reported" in notes[3]
    # `trialkeeper logs` leaves the result lines out unless asked for them.
    script = Path(sys.executable).parent / "trialkeeper"
    shown = subprocess.run(
        [str(script), "logs", str(exp), trial["id"]], capture_output=True, timeout=60, check=True
    ).stdout
    assert shown == b"before\nafter\n", shown[:300]
    everything = subprocess.run(
        [str(script), "logs", str(exp), trial["id"], "--nni-results"], capture_output=True, timeout=60, check=True
    ).stdout
    assert (
        everything == (exp / "trials" / trial["id"] / "stdout.log").read_bytes()
        and everything.count(b"NNISDK_MEb") == 6
    )


# ---- remote over a real sshd --------------------------------------------------------------


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Machine, Credentials, Path]]:
    with one_machine(tmp_path_factory.mktemp("sshd"), "the remote NNI tests") as found:
        yield found


@pytest.mark.slow
@pytest.mark.parametrize(
    "reuse,trial_python",
    [(True, ""), (False, ""), (True, "TRIALKEEPER_NNI2_PYTHON")],
    ids=["reuse", "no-reuse", "nni2-trial"],
)
def test_sklearn_trial_on_remote_with_nnis_python_path(
    tmp_path: Path,
    machine: tuple[Machine, Credentials, Path],
    reuse: bool,
    trial_python: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    m, creds, known_hosts = machine
    bindir = nni_python().parent
    # The agent runs under pythonPath; a trial may name another interpreter (nni 2.10.1).
    command = f"{nni_python(trial_python)} trial.py" if trial_python else "python3 trial.py"
    entry = {
        "host": m.host, "port": m.port, "user": creds.user, "sshKeyFile": str(creds.key_file),
        "sshPassphrase": creds.passphrase,
        # NNI's meaning: a directory put first on PATH, so the plain `python3` below is NNI's.
        "pythonPath": str(bindir),
    }
    service = {"platform": "remote", "reuseMode": reuse, "knownHostsFile": str(known_hosts), "machineList": [entry]}
    data = _nni_config(tmp_path / "code", command, service, nniManagerIp="127.0.0.1")
    config = _write(tmp_path / "code", SKLEARN_TRIAL, data)
    exp = tmp_path / "exp"
    rc = cli.main(["run", str(config), "--quiet", "--experiment-dir", str(exp)])
    out = capfd.readouterr()
    _check_sklearn(exp, subprocess.CompletedProcess([], rc, out.out, out.err))
    wait_until(lambda: not m.processes(), timeout=15.0, message="processes left on the machine")


@pytest.mark.slow
def test_an_nni_hybrid_config_runs_on_local_and_remote(
    tmp_path: Path, machine: tuple[Machine, Credentials, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    m, creds, known_hosts = machine
    python = nni_python()
    # NNI's hybrid mode as its docs write it: a list of services, each carrying NNI's
    # per-service fields (the trial's command, nniManagerIp, GPU settings, reuseMode).
    per_service = {"trialCommand": f"{python} trial.py", "trialGpuNumber": 0, "nniManagerIp": "127.0.0.1"}
    entry = {"host": m.host, "port": m.port, "user": creds.user, "sshKeyFile": str(creds.key_file),
             "sshPassphrase": creds.passphrase, "pythonPath": str(python.parent), "useActiveGpu": False}
    services = [
        {
            "platform": "remote",
            "reuseMode": True,
            "knownHostsFile": str(known_hosts),
            "machineList": [entry],
            **per_service,
        },
        {
            "platform": "local",
            "reuseMode": True,
            "useActiveGpu": False,
            "maxTrialNumberPerGpu": 1,
            "environmentCount": 1,
            **per_service,
        },
    ]
    data = _nni_config(tmp_path / "code", "unused", services, maxTrialNumber=4)
    del data["trialCommand"]
    config = _write(tmp_path / "code", SKLEARN_TRIAL, data)
    exp = tmp_path / "exp"
    rc = cli.main(["run", str(config), "--quiet", "--experiment-dir", str(exp)])
    out = capfd.readouterr()
    assert rc == 0, (out.out, out.err)
    exp_id, trials, metrics = _stored(exp)
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["status"], t["reason"]) for t in trials]
    db = sqlite3.connect(f"file:{exp / 'trialkeeper.db'}?mode=ro", uri=True)
    with db:
        platforms = dict(db.execute("SELECT id, platform FROM environments").fetchall())
    db.close()
    assert {platforms[t["environment_id"]] for t in trials} == {"local", "remote"}, platforms
    for t in trials:
        _check_ids((exp / "trials" / t["id"] / "stdout.log").read_text(), t, exp_id)
        [final] = metrics[t["id"]]
        assert final["kind"] == "final" and json.loads(final["value_json"])["train_size"] == 1347
    wait_until(lambda: not m.processes(), timeout=15.0, message="processes left on the machine")


# ---- the benchmark's NNI stage ------------------------------------------------------------


@pytest.mark.slow
def test_the_nni_benchmark_stage_runs_both_sides_and_produces_figures(tmp_path: Path) -> None:
    python = nni_python()
    bench = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "run.py"
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(bench), "--smoke", "--only", "nni", "--nni-python", str(python), "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    results = data["results"]["nni"]
    for side in ("trialkeeper", "nni"):
        [r] = results[side]
        assert "error" not in r, r
        assert r["ok"] == results["n"] and r["wall_s"] > 0 and r["start_s"] and r["floor_start_s"], r
    assert (
        results["trialkeeper"][0]["metrics_stored"] == 4 * results["n"]
        and len(results["trialkeeper"][0]["floor_wall_s"]) == 2
    )
    figures = [row["figure"] for row in data["table"]]
    assert (
        sum(f.startswith("9. NNI trial start") for f in figures) == 2 and sum(": wall (s)" in f for f in figures) == 2
    ), figures
