"""The ``trialkeeper`` console script, driven as a user drives it: a subprocess per command."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import _describe, _leftovers, counted_metrics, stored_metrics, wait_until

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart"
# A run of the quickstart takes 2-3 s; the rest are reads of the store.
RUN_TIMEOUT_S = 90.0
COMMAND_TIMEOUT_S = 30.0
TERMINAL = {"SUCCEEDED", "FAILED", "USER_CANCELED", "EARLY_STOPPED", "SYS_CANCELED"}


def _script() -> str:
    """The installed console script: beside the interpreter running the tests, else on PATH."""
    beside = Path(sys.executable).parent / "trialkeeper"
    found = str(beside) if beside.exists() else shutil.which("trialkeeper")
    assert found, "the trialkeeper console script is not installed (pip install -e .)"
    return found


def tk(
    *args: str | Path, timeout: float = COMMAND_TIMEOUT_S, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``trialkeeper ARGS`` and return what it did (stdout, stderr, exit status)."""
    env = dict(os.environ)
    env.pop("TRIALKEEPER_TOKEN", None)
    env["COLUMNS"] = "200"  # tables may be wide; error lines must never depend on the width
    return subprocess.run(
        [_script(), *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """A refused command: non-zero status, no traceback, one line on stderr naming the problem."""
    assert proc.returncode != 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("trialkeeper"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def assert_no_leftovers(root: Path) -> None:
    """Fixtures shared by a module are not covered by the per-test leak check: check here."""
    try:
        wait_until(lambda: not _leftovers(root), timeout=10.0)
    except AssertionError:
        left = _leftovers(root)
        for p in left:
            p.kill()
        pytest.fail("processes left running: " + "; ".join(_describe(p) for p in left))


@dataclass(frozen=True)
class Run:
    proc: subprocess.CompletedProcess[str]
    exp: Path

    def db(self) -> sqlite3.Connection:
        db = sqlite3.connect(f"file:{self.exp / 'trialkeeper.db'}?mode=ro", uri=True)
        db.row_factory = sqlite3.Row
        return db

    def trials(self) -> list[sqlite3.Row]:
        with self.db() as db:
            return db.execute("SELECT * FROM trials ORDER BY seq").fetchall()

    def metrics(self, trial_id: str) -> list[dict[str, Any]]:
        return stored_metrics(self.exp, trial_id)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The quickstart, run once for the module from a copy of examples/quickstart."""
    root = tmp_path_factory.mktemp("quickstart")
    code = root / "code"
    shutil.copytree(QUICKSTART, code, ignore=shutil.ignore_patterns("__pycache__"))
    exp = root / "exp"
    try:
        proc = tk("run", code / "config.yml", "--experiment-dir", exp, timeout=RUN_TIMEOUT_S, cwd=root)
    finally:
        assert_no_leftovers(root)
    return Run(proc, exp)


FAILING_TRIAL = """
import sys
sys.stderr.write("boom: the trial gave up\\n")
print("about to fail", flush=True)
sys.exit(1)
"""


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """An experiment whose every trial exits 1."""
    root = tmp_path_factory.mktemp("failing")
    (root / "fail.py").write_text(textwrap.dedent(FAILING_TRIAL).lstrip())
    (root / "config.yml").write_text(
        textwrap.dedent(
            """
            trialCommand: python3 fail.py
            trialCodeDirectory: .
            trialConcurrency: 2
            maxTrialNumber: 3
            searchSpace:
              x: {_type: choice, _value: [1, 2, 3]}
            trainingService:
              platform: local
            """
        )
    )
    exp = root / "exp"
    try:
        proc = tk("run", root / "config.yml", "--experiment-dir", exp, timeout=RUN_TIMEOUT_S, cwd=root)
    finally:
        assert_no_leftovers(root)
    return Run(proc, exp)


def _json(proc: subprocess.CompletedProcess[str]) -> object:
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    return json.loads(proc.stdout)


# ---- run ------------------------------------------------------------------------------------


def test_run_quickstart_succeeds_and_prints_the_best_trial(quickstart: Run) -> None:
    proc = quickstart.proc
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    rows = quickstart.trials()
    succeeded = [r for r in rows if r["status"] == "SUCCEEDED"]
    assert len(succeeded) >= 20, [(r["id"], r["status"], r["reason"]) for r in rows]
    assert {r["status"] for r in rows} <= TERMINAL
    assert f"{len(succeeded)} SUCCEEDED" in proc.stdout, proc.stdout

    match = re.search(r"^best trial: (\w+) final metric ([0-9.e+-]+) parameters (\{.*\})$", proc.stdout, re.MULTILINE)
    assert match, proc.stdout
    best_id, best_value, best_params = match.group(1), float(match.group(2)), json.loads(match.group(3))
    top = max(r["final_metric"] for r in succeeded)  # optimize_mode: maximize
    best = next(r for r in rows if r["id"] == best_id)
    assert best["final_metric"] == top
    assert best_value == pytest.approx(top, rel=1e-5)
    assert best_params == json.loads(best["parameters_json"])
    assert f"experiment directory: {quickstart.exp.resolve()}" in proc.stdout

    with quickstart.db() as db:
        exp = db.execute("SELECT * FROM experiment").fetchone()
        envs = db.execute("SELECT * FROM environments").fetchall()
    assert (exp["name"], exp["status"]) == ("quickstart", "DONE")
    assert exp["id"] in proc.stdout
    assert len(envs) == 2 and {e["status"] for e in envs} == {"STOPPED"}  # environmentCount: 2


def test_the_store_holds_every_metric_the_trials_reported(quickstart: Run) -> None:
    total = 0
    for row in quickstart.trials():
        if row["status"] != "SUCCEEDED":
            continue
        params = json.loads(row["parameters_json"])
        epochs = params["epochs"]
        metrics = quickstart.metrics(row["id"])
        total += len(metrics)
        intermediate = [m for m in metrics if m["kind"] == "intermediate"]
        assert len(intermediate) == epochs, (row["id"], params, len(intermediate))
        assert [m["idx"] for m in metrics] == list(range(epochs + 1))
        assert [m["kind"] for m in metrics] == ["intermediate"] * epochs + ["final"]

        # train.py prints each epoch's loss and the accuracy it reports (3 decimals), and the
        # final accuracy: the intermediate results measure what the final one does (maximized).
        out = (quickstart.exp / "trials" / row["id"] / "stdout.log").read_text()
        epoch_line = r"^epoch \d+/\d+: training loss ([0-9.]+), held-out accuracy ([0-9.]+)$"
        printed = [(float(a), float(b)) for a, b in re.findall(epoch_line, out, re.MULTILINE)]
        assert len(printed) == epochs, out
        for m, (_, acc) in zip(intermediate, printed):
            assert m["value"] == pytest.approx(acc, abs=5.1e-4) and 0.0 <= m["value"] <= 1.0
            assert json.loads(m["value_json"]) == m["value"]
        accuracy = float(re.search(r"^held-out accuracy ([0-9.]+)$", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
        final = metrics[-1]
        assert final["value"] == row["final_metric"] == pytest.approx(accuracy, abs=5.1e-4)
        value = json.loads(final["value_json"])
        assert value["default"] == final["value"] == intermediate[-1]["value"]
        assert value["loss"] == pytest.approx(printed[-1][0], abs=5.1e-5)
        assert json.loads(row["final_metric_json"]) == value
        times = [m["reported_at"] for m in metrics]
        assert times == sorted(times)
    with quickstart.db() as db:
        assert counted_metrics(db) == total


# ---- reading an experiment -----------------------------------------------------------------


def test_trials_json(quickstart: Run) -> None:
    listed = _json(tk("trials", quickstart.exp, "--json"))
    assert isinstance(listed, list)
    stored = {r["id"]: r for r in quickstart.trials()}
    assert [t["id"] for t in listed] == list(stored)
    for t in listed:
        assert {"id", "status", "parameters", "final_metric", "environment_id"} <= set(t), t
        row = stored[t["id"]]
        assert t["status"] == row["status"]
        assert t["parameters"] == json.loads(row["parameters_json"])
        assert set(t["parameters"]) == {"lr", "batch_size", "epochs", "l2"}
        assert t["final_metric"] == row["final_metric"]
        assert t["environment_id"] == row["environment_id"] and t["environment_id"].startswith("env-")

    only = _json(tk("trials", quickstart.exp, "--json", "--status", "succeeded"))
    assert [t["id"] for t in only] == [t["id"] for t in listed if t["status"] == "SUCCEEDED"]
    assert _json(tk("trials", quickstart.exp, "--json", "--status", "FAILED")) == []

    table = tk("trials", quickstart.exp)
    assert table.returncode == 0, table.stderr
    assert all(t["id"] in table.stdout for t in listed)

    lines = tk("trials", quickstart.exp, "--jsonl", "--limit", "0")  # JSON Lines: one trial a line
    assert lines.returncode == 0, lines.stderr
    assert [json.loads(line) for line in lines.stdout.splitlines()] == listed
    assert tk("trials", quickstart.exp, "--json", "--jsonl").returncode == 2  # one or the other


def test_status(quickstart: Run) -> None:
    rows = quickstart.trials()
    best = max((r for r in rows if r["final_metric"] is not None), key=lambda r: r["final_metric"])
    with quickstart.db() as db:
        exp_id = db.execute("SELECT id FROM experiment").fetchone()[0]
        metric_count = counted_metrics(db)

    text = tk("status", quickstart.exp)
    assert text.returncode == 0, text.stderr
    assert f"experiment {exp_id} (quickstart): DONE" in text.stdout
    assert f"{len(rows)} SUCCEEDED" in text.stdout
    assert f"metrics stored: {metric_count}; environments: 2" in text.stdout
    assert f"best trial: {best['id']}" in text.stdout

    # By its id, as the steering commands take it (run put it in this machine's index).
    by_id = tk("status", exp_id)
    assert by_id.returncode == 0 and by_id.stdout == text.stdout, (by_id.stdout, by_id.stderr)
    # resume takes the id as well: the finished experiment is refused as finished (3), not as missing.
    again = tk("resume", exp_id, cwd=quickstart.exp.parent)
    assert again.returncode == 3 and "DONE" in again.stderr, (again.returncode, again.stderr)

    info = _json(tk("status", quickstart.exp, "--json"))
    assert isinstance(info, dict)
    assert (info["id"], info["name"], info["status"]) == (exp_id, "quickstart", "DONE")
    assert info["trials"] == {"SUCCEEDED": len(rows)}
    assert info["metrics"] == metric_count
    assert info["environments"] == 2
    assert info["best"]["final_metric"] == best["final_metric"]
    assert info["best"]["parameters"] == json.loads(best["parameters_json"])


def test_envs(quickstart: Run) -> None:
    envs = _json(tk("envs", quickstart.exp, "--json"))
    assert isinstance(envs, list)
    assert [e["id"] for e in envs] == ["env-1", "env-2"]
    for e in envs:
        assert (e["platform"], e["status"], e["running_trials"]) == ("local", "STOPPED", [])
        assert e["platform_id"].startswith("pid ")
        assert isinstance(e["gpus"], list)
    used = {r["environment_id"] for r in quickstart.trials()}
    assert used <= {e["id"] for e in envs}

    table = tk("envs", quickstart.exp)
    assert table.returncode == 0, table.stderr
    assert "env-1" in table.stdout and "env-2" in table.stdout
    # Each environment's row counts the trials that ran on it and names the latest.
    rows = quickstart.trials()
    for e in envs:
        mine = [r["id"] for r in rows if r["environment_id"] == e["id"]]
        assert mine and e["trials"] == mine
        line = next(line for line in table.stdout.splitlines() if f" {e['id']} " in line)
        assert f" {len(mine)}: {mine[-1]}" in line or f" {len(mine)}: " in line, line
    assert all(r["id"] in table.stdout for r in rows[-1:])


def test_logs(quickstart: Run, failing: Run) -> None:
    trial_id = quickstart.trials()[0]["id"]
    out = tk("logs", quickstart.exp, trial_id)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (quickstart.exp / "trials" / trial_id / "stdout.log").read_text()
    assert "held-out accuracy" in out.stdout and "epoch 1/" in out.stdout
    with quickstart.db() as db:
        exp_id = db.execute("SELECT id FROM experiment").fetchone()[0]
    assert tk("logs", exp_id, trial_id).stdout == out.stdout  # by the experiment's id too
    # A rank the trial does not have (a single-node trial has rank 0 only) is refused, not an empty log.
    for rank in ("1", "-1"):
        bad = tk("logs", quickstart.exp, trial_id, "--rank", rank)
        assert bad.returncode == 2
        assert_one_line_error(bad, f"--rank {rank}: trial {trial_id} has rank 0 only")

    failed_id = failing.trials()[0]["id"]
    err = tk("logs", failing.exp, failed_id, "--stderr")
    assert err.returncode == 0, err.stderr
    assert "boom: the trial gave up" in err.stdout
    assert "about to fail" not in err.stdout
    out = tk("logs", failing.exp, failed_id)
    assert out.stdout == "about to fail\n"

    # --follow on an ended trial prints everything and returns.
    followed = tk("logs", failing.exp, failed_id, "--stderr", "--follow")
    assert followed.returncode == 0 and followed.stdout == err.stdout


# ---- failing trials --------------------------------------------------------------------------


def test_run_with_failed_trials_completes_and_says_why(failing: Run) -> None:
    """An experiment whose trials failed has run (as NNI's): exit 0, the failures said last."""
    rows = failing.trials()
    assert len(rows) == 3 and {r["status"] for r in rows} == {"FAILED"}, [(r["status"], r["reason"]) for r in rows]
    assert failing.proc.returncode == 0, (failing.proc.stdout, failing.proc.stderr)
    assert "Traceback" not in failing.proc.stderr, failing.proc.stderr
    line = failing.proc.stderr.strip().splitlines()[-1]
    assert line.startswith("trialkeeper: 3 of 3 trials failed (first: trial "), line
    assert rows[0]["id"] in line and "exit code 1: boom: the trial gave up" in line, line
    assert "--status FAILED" in line
    listed = _json(tk("trials", failing.exp, "--json", "--status", "failed"))
    assert isinstance(listed, list) and len(listed) == 3
    assert all(t["exit_code"] == 1 and "exit code 1" in t["reason"] for t in listed)
    assert all(t["failure_summary"] == "exit code 1: boom: the trial gave up" for t in listed), listed
    status = _json(tk("status", failing.exp, "--json"))
    assert isinstance(status, dict)
    assert status["trials"] == {"FAILED": 3} and status["best"] is None


BROKEN_TRIAL = """
import atexit
import os
import sys

from trialkeeper.agent import trial

x = trial.get_next_parameter()["x"]


def train(step):
    if step > 2:
        raise RuntimeError("diverged")
    train(step + 1)


if x == 1:
    # After the traceback: a note of the agent's kind and a blank line, which say nothing.
    atexit.register(lambda: sys.stderr.write("[trialkeeper] trial: no checkpoint saved\\n\\n"))
    train(0)
elif x == 2:
    os.execvp(sys.executable, [sys.executable, "trian.py"])  # a typo of the script's name
else:
    trial.report_final_result(0.5)
"""


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A trial that raises, one whose command names a missing script, one that succeeds:
    run with --fail-on-trial-failure."""
    root = tmp_path_factory.mktemp("broken")
    (root / "broken.py").write_text(textwrap.dedent(BROKEN_TRIAL).lstrip())
    (root / "config.yml").write_text(
        textwrap.dedent(
            """
            trialCommand: python3 broken.py
            trialCodeDirectory: .
            trialConcurrency: 3
            maxTrialNumber: 3
            searchSpace:
              x: {_type: choice, _value: [1, 2, 3]}
            tuner: {name: grid}
            trainingService:
              platform: local
            """
        )
    )
    exp = root / "exp"
    try:
        proc = tk(
            "run", root / "config.yml", "--experiment-dir", exp, "--fail-on-trial-failure",
            timeout=RUN_TIMEOUT_S, cwd=root,
        )
    finally:
        assert_no_leftovers(root)
    return Run(proc, exp)


def test_failure_reasons_show_the_last_meaningful_line_of_stderr(broken: Run) -> None:
    """`run`, `trials` (table and JSON), `trial` (text and JSON) and the dashboard's trial JSON
    show each failed trial's exit code with the line of its stderr that says why."""
    from trialkeeper.coordinator.read.model import ReadModel
    from trialkeeper.coordinator.ui import views as dashboard

    rows = {json.loads(r["parameters_json"])["x"]: r for r in broken.trials()}
    assert [rows[x]["status"] for x in (1, 2, 3)] == ["FAILED", "FAILED", "SUCCEEDED"], rows
    raised, typo = rows[1]["id"], rows[2]["id"]
    assert "Traceback" in rows[1]["stderr_tail"] and "[trialkeeper]" in rows[1]["stderr_tail"]
    expected = {
        raised: "exit code 1: RuntimeError: diverged",
        typo: "exit code 2: ",  # then Python's own words: "...: can't open file '.../trian.py': [Errno 2] ..."
    }

    # --fail-on-trial-failure: 1 when a trial FAILED, the failures said on the last line.
    assert broken.proc.returncode == 1, (broken.proc.stdout, broken.proc.stderr)
    last = broken.proc.stderr.strip().splitlines()[-1]
    assert last.startswith("trialkeeper: 2 of 3 trials failed (first: trial "), last
    assert expected[raised] in last or "can't open file" in last, last

    listed = _json(tk("trials", broken.exp, "--json", "--status", "FAILED"))
    assert isinstance(listed, list)
    summaries = {t["id"]: t["failure_summary"] for t in listed}
    assert summaries[raised] == expected[raised], summaries
    assert summaries[typo].startswith(expected[typo]) and "can't open file" in summaries[typo], summaries
    assert "trian.py" in summaries[typo] and "Traceback" not in "".join(summaries.values())
    lines = tk("trials", broken.exp, "--jsonl").stdout.splitlines()
    assert [json.loads(line)["failure_summary"] for line in lines] == [
        summaries.get(r["id"], "") for r in broken.trials()
    ]
    table = tk("trials", broken.exp)
    assert "RuntimeError: diverged" in table.stdout and "can't open file" in table.stdout, table.stdout

    text = tk("trial", broken.exp, raised)
    assert text.returncode == 0 and f"FAILED - {expected[raised]}" in text.stdout, text.stdout
    detail = _json(tk("trial", broken.exp, typo, "--json"))
    assert isinstance(detail, dict) and detail["failure_summary"] == summaries[typo]

    with ReadModel.open(broken.exp) as model:  # what the dashboard's /api/trials/ID answers
        assert dashboard.trial(model, raised)["failure_summary"] == expected[raised]
        assert dashboard.trial(model, rows[3]["id"])["failure_summary"] == ""


# ---- help and bad arguments ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["", "run", "agent", "trials", "status", "envs", "logs"])
def test_help(command: str) -> None:
    proc = tk(*([command] if command else []), "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: trialkeeper{' ' + command if command else ''}"), proc.stdout
    assert proc.stderr == ""


def test_no_command_prints_usage() -> None:
    proc = tk()
    assert proc.returncode == 2
    assert "usage: trialkeeper" in proc.stdout and "run" in proc.stdout


def test_unknown_command_and_missing_argument() -> None:
    for args, needle in ((("bogus",), "invalid choice: 'bogus'"), (("trials",), "required: EXP")):
        proc = tk(*args)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        # argparse: the usage line, then the one line saying what is wrong.
        usage, error = proc.stderr.strip().splitlines()
        assert usage.startswith("usage: trialkeeper") and needle in error, proc.stderr


def test_run_with_a_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yml"
    assert_one_line_error(tk("run", missing, "--experiment-dir", tmp_path / "exp"), str(missing), "file not found")
    assert not (tmp_path / "exp").exists()


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "config.yml"
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def test_run_with_a_config_error_names_the_field(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        """
        trialCommand: python3 trial.py
        trialConcurrency: 1
        trainingService:
          platform: local
          environmentCount: zero
        """,
    )
    line = assert_one_line_error(tk("run", config, "--experiment-dir", tmp_path / "exp"), "invalid config")
    assert "trainingService.environmentCount: expected a non-negative integer, got 'zero'" in line
    assert not (tmp_path / "exp").exists()


def test_run_with_several_config_errors_lists_each_field(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        """
        trialCommand: python3 trial.py
        trialConcurrency: -1
        trainingService:
          platform: nowhere
        """,
    )
    proc = tk("run", config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    head, *issues = proc.stderr.strip().splitlines()
    assert head.startswith("trialkeeper: invalid config")
    assert len(issues) == 2, proc.stderr
    assert issues[0].strip().startswith("trialConcurrency:")
    assert issues[1].strip().startswith("trainingService.platform:")


def test_run_with_invalid_yaml(tmp_path: Path) -> None:
    config = _config(tmp_path, "trialCommand: [\n")
    assert_one_line_error(tk("run", config), "invalid YAML", f"{config}:2")


def test_run_into_a_directory_that_holds_an_experiment(quickstart: Run) -> None:
    config = QUICKSTART / "config.yml"
    assert_one_line_error(tk("run", config, "--experiment-dir", quickstart.exp), "already holds an experiment")


@pytest.mark.parametrize("command", ["trials", "status", "envs", "logs", "resume", "clean", "ui", "tensorboard"])
def test_reading_a_directory_without_an_experiment(tmp_path: Path, command: str) -> None:
    extra = ["some-trial"] if command == "logs" else []
    # Neither a path that is there nor an id any experiment has: named as such.
    for missing in (str(tmp_path / "no-such-dir"), "no-such-experiment-id"):
        line = assert_one_line_error(tk(command, missing, *extra, cwd=tmp_path), f"no experiment {missing!r}")
        assert line.endswith(
            "neither a directory holding one nor a known experiment id (`trialkeeper list` shows them)")
    if command in ("resume", "clean", "ui", "tensorboard"):
        return
    empty = tmp_path / "empty"  # a directory, without a store
    empty.mkdir(exist_ok=True)
    assert_one_line_error(tk(command, empty, *extra), "no experiment store", str(empty))
    # A directory whose store is not an SQLite file at all.
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "trialkeeper.db").write_text("not a database\n" * 200)
    assert_one_line_error(tk(command, junk, *extra), "cannot open the experiment store")


def test_logs_of_an_unknown_trial(quickstart: Run) -> None:
    line = assert_one_line_error(tk("logs", quickstart.exp, "no-such-trial"), "no trial 'no-such-trial'")
    assert quickstart.trials()[0]["id"] in line  # it names some trials that do exist


def test_steering_an_experiment_that_has_ended_says_so_and_how_to_extend_it(failing: Run) -> None:
    """No coordinator runs an experiment that is DONE: a steering command says it has ended,
    that there is nothing to do, and how to extend it, with the status `resume` exits with."""
    trial_id = failing.trials()[0]["id"]
    for args, nothing in (
        (("pause", failing.exp, trial_id), "nothing to pause"),
        (("cancel", failing.exp, trial_id), "nothing to cancel"),
        (("stop", failing.exp), "nothing to stop"),
        (("update", failing.exp, "--concurrency", "3"), "its limits change as it is resumed"),
    ):
        proc = tk(*args)
        line = assert_one_line_error(proc, "has ended: DONE", f"no coordinator runs it: {nothing}")
        assert proc.returncode == 3, (args, proc.returncode, line)
        assert f"`trialkeeper resume {failing.exp} --max-trials N` (N above 3)" in line, line
        assert "it ended or crashed" not in line, line
    resumed = tk("resume", failing.exp)
    assert resumed.returncode == 3 and "--max-trials N` (N above 3)" in resumed.stderr, resumed.stderr


# ---- the live view -------------------------------------------------------------------------

NOISY_TUNER = """
import logging
import warnings

from trialkeeper.coordinator.search.tuners import Tuner


class Noisy(Tuner):
    def generate_parameters(self, parameter_id):
        warnings.warn("noisy tuner: a deprecated option", UserWarning)
        logging.getLogger("noisy.library").warning("noisy library: retrying")
        logging.getLogger("trialkeeper.noisy").warning("noisy trialkeeper module: slow")
        return {"x": parameter_id}
"""


def _on_a_terminal(args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``trialkeeper ARGS`` with a pseudo-terminal as its stdout and stderr, as a person
    at a terminal runs it; returns its exit status and everything the terminal showed."""
    import pty
    import select
    import time

    main_fd, sub_fd = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "160", "LINES": "50"}
    env.pop("TRIALKEEPER_TOKEN", None)
    proc = subprocess.Popen(
        [_script(), *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=sub_fd, stderr=sub_fd,
    )
    os.close(sub_fd)
    shown = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main_fd], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main_fd)
    return proc.returncode, shown.decode(errors="replace")


def test_warnings_go_to_the_experiment_log_while_the_live_view_is_up(tmp_path: Path) -> None:
    (tmp_path / "noisy_tuner.py").write_text(textwrap.dedent(NOISY_TUNER).lstrip())
    (tmp_path / "trial.py").write_text("from trialkeeper.agent import trial\ntrial.report_final_result(1.0)\n")
    (tmp_path / "config.yml").write_text(textwrap.dedent(
        f"""
        trialCommand: python3 trial.py
        trialCodeDirectory: .
        trialConcurrency: 2
        maxTrialNumber: 3
        searchSpace:
          x: {{_type: choice, _value: [1, 2, 3]}}
        tuner: {{className: "noisy_tuner:Noisy", codeDirectory: "{tmp_path}"}}
        trainingService:
          platform: local
        """
    ))
    exp = tmp_path / "exp"
    try:
        code, shown = _on_a_terminal(
            ["run", "config.yml", "--experiment-dir", str(exp)], tmp_path, RUN_TIMEOUT_S
        )
    finally:
        assert_no_leftovers(tmp_path)
    assert code == 0, shown
    assert "best trial:" in shown  # the live view and the summary were on the terminal
    assert "noisy" not in shown, shown  # nothing the tuner logged or warned tore the view
    log = (exp / "experiment.log").read_text()
    assert "noisy tuner: a deprecated option" in log and "noisy library: retrying" in log, log
    # A trialkeeper module's warning is in the file once: the experiment's own log handler has it.
    assert log.count("noisy trialkeeper module: slow") == 3, log  # one per trial proposed
    assert f"in {exp.resolve() / 'experiment.log'}" in shown or f"in {exp / 'experiment.log'}" in shown, shown
