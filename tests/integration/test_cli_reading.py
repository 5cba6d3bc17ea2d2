"""The CLI's reading commands through the read model, driven as a user drives them (a
subprocess per command): `list`, a closed output pipe, bad rows in a real store, and waiting
reasons and connected agents shown the same from a live, a finished and a crashed experiment."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import (
    GATED_TRIAL,
    _leftovers,
    async_wait_until,
    build_config,
    run_async,
    wait_until,
    write_script,
)
from test_cli import RUN_TIMEOUT_S, _script, assert_no_leftovers
from trialkeeper.coordinator import Coordinator
from trialkeeper.coordinator.read.model import ReadModel, to_json
from trialkeeper.coordinator.store.store import Store

COMMAND_TIMEOUT_S = 30.0
WAIT_S = 60.0
CONCURRENCY_REASON = "waiting: 1 trials are running (trialConcurrency)"


def tk(*args: str | Path, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("TRIALKEEPER_TOKEN", None)
    env["COLUMNS"] = "400"  # wide enough that no reason is folded in a table
    if home is not None:
        env["HOME"] = str(home)
        env["TRIALKEEPER_HOME"] = str(home / ".trialkeeper")  # its index of experiments too
    return subprocess.run(
        [_script(), *map(str, args)], check=False, capture_output=True, text=True,
        timeout=COMMAND_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL,
    )


def ok(*args: str | Path, home: Path | None = None) -> str:
    proc = tk(*args, home=home)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.returncode, proc.stderr)
    return proc.stdout


def ok_json(*args: str | Path) -> Any:
    return json.loads(ok(*args, "--json"))


def _config(root: Path, *, trials: int, concurrency: int, gate: Path, wait: bool) -> Path:
    write_script(root, "trial.py", GATED_TRIAL)
    config = root / "config.yml"
    config.write_text(textwrap.dedent(f"""
        experimentName: reading
        trialCommand: python3 trial.py
        trialCodeDirectory: .
        trialConcurrency: {concurrency}
        maxTrialNumber: {trials}
        trialEnv: {{GATE: "{gate}"}}
        searchSpace:
          x: {{_type: choice, _value: [1, 2, 3, 4]}}
          wait: {{_type: choice, _value: [{1 if wait else 0}]}}
        tuner: {{name: random, classArgs: {{optimize_mode: maximize, seed: 3}}}}
        coordinator: {{heartbeatInterval: 0.5, agentLostTimeout: 20, trialLostTimeout: 40}}
        trainingService: {{platform: local}}
        """).lstrip())
    return config


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real experiment of 3 quick trials, run to its end; its directory."""
    root = tmp_path_factory.mktemp("finished")
    config = _config(root, trials=3, concurrency=2, gate=root / "gate", wait=False)
    exp = root / "work" / "exp"
    try:
        proc = subprocess.run(
            [_script(), "run", str(config), "--experiment-dir", str(exp), "--quiet"],
            check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=root, stdin=subprocess.DEVNULL,
        )
    finally:
        assert_no_leftovers(root)
    assert proc.returncode == 0, proc.stderr
    return exp


def _copy(exp: Path, to: Path) -> Path:
    shutil.copytree(exp, to)
    return to


# ---- list ------------------------------------------------------------------------------------


def test_list_shows_the_experiments_of_a_working_directory(finished: Path, tmp_path: Path) -> None:
    with ReadModel.open(finished) as model:
        exp = model.experiment()
    assert exp is not None and exp.best is not None
    work = tmp_path / "work"
    _copy(finished, work / "copy")
    (work / "not-an-experiment").mkdir()
    table = ok("list", "--dir", work)
    header = next(line for line in table.splitlines() if "name" in line)
    assert [w for w in header.replace("┃", " ").split()] == ["id", "name", "status", "trials", "best", "started"]
    row = next(line for line in table.splitlines() if exp.id in line)
    assert "reading" in row and "DONE" in row and " 3 " in row and exp.best.id in row

    listed = ok_json("list", "--dir", work)
    assert [(e["id"], e["name"], e["status"], e["trial_count"]) for e in listed] == [(exp.id, "reading", "DONE", 3)]
    assert listed[0]["best"]["id"] == exp.best.id and listed[0]["started_at"] == exp.started_at

    # The default directory is the config's default working directory, under $HOME.
    _copy(finished, tmp_path / "home" / "trialkeeper-experiments" / "x")
    assert exp.id in ok("list", home=tmp_path / "home")
    assert "no experiments in" in ok("list", home=tmp_path / "nobody")


# ---- output piped into a reader that goes away -------------------------------------------------


def _with_closed_pipe(*args: str | Path) -> subprocess.CompletedProcess[bytes]:
    """Run a command whose stdout's reader has gone before it writes (as `head` does after
    its lines): every write meets a closed pipe."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [_script(), *map(str, args)], stdout=write, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            timeout=COMMAND_TIMEOUT_S, check=False,
        )
    finally:
        os.close(write)


def test_output_into_a_closed_pipe_ends_quietly(finished: Path) -> None:
    trial_id = ok_json("trials", finished)[0]["id"]
    commands: list[tuple[str | Path, ...]] = [
        ("trial", finished, trial_id, "--json"), ("trial", finished, trial_id), ("trials", finished),
        ("trials", finished, "--json"), ("status", finished), ("envs", finished), ("envs", finished, "--json"),
        ("list", "--dir", finished.parent),
    ]
    for args in commands:
        proc = _with_closed_pipe(*args)
        assert (proc.returncode, proc.stderr) == (141, b""), (args, proc.returncode, proc.stderr.decode())
    # As a user types it.
    piped = subprocess.run(
        [
            "bash",
            "-c",
            (
                f"'{_script()}' trial '{finished}' {trial_id} --json | head -1; "
                f"'{_script()}' trials '{finished}' | head -1"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert piped.stdout.splitlines()[0] == "{"


# ---- bad rows stored by an older version -----------------------------------------------------

BAD_ROWS = [
    "UPDATE trials SET final_metric_json = '}{' WHERE seq = 0",
    "UPDATE trials SET parameters_json = 'not json', stderr_tail = x'ff00' WHERE seq = 1",
    "UPDATE trials SET status = 'BOGUS', gpu_indices_json = '{' WHERE seq = 2",
    "UPDATE environments SET info_json = 'garbage', status = 'WANDERING'",
    "UPDATE experiment SET config_json = '[1, 2'",
    "UPDATE events SET at = 'then'",
]


def test_every_reading_command_shows_bad_rows_as_unreadable(finished: Path, tmp_path: Path) -> None:
    exp = _copy(finished, tmp_path / "work" / "exp")
    with sqlite3.connect(exp / Store.FILENAME) as db:
        ids = [r[0] for r in db.execute("SELECT id FROM trials ORDER BY seq")]
        for sql in BAD_ROWS:
            db.execute(sql)
    status = ok_json("status", exp)
    assert status["trials"] == {"SUCCEEDED": 2, "UNREADABLE": 1}
    assert "config_json: unreadable" in status["unreadable"][0]
    trials = ok_json("trials", exp)
    assert trials[0]["final_metric_value"] is None and "final_metric_json: unreadable" in trials[0]["unreadable"][0]
    assert trials[1]["parameters"] is None and trials[2]["status"] is None
    for trial_id in ids:
        detail = ok_json("trial", exp, trial_id)
        assert detail["id"] == trial_id and all(h["at"] is None for h in detail["history"])
        assert "unreadable" in ok("trial", exp, trial_id)
    envs = ok_json("envs", exp)
    assert all(e["status"] is None and e["gpus"] == [] and e["unreadable"] for e in envs)
    for command in ("status", "trials", "envs"):
        assert "unreadable" in ok(command, exp), command
    assert ok_json("list", "--dir", exp.parent)[0]["unreadable"]
    assert "unreadable: config_json" in ok("list", "--dir", exp.parent)
    ok("logs", exp, ids[0])
    assert ok("trials", exp, "--status", "unreadable").count(ids[2]) == 1
    # clean and resume cannot go on from an unreadable config: each says so in one line.
    clean = tk("clean", exp)
    assert clean.returncode == 2 and len(clean.stderr.strip().splitlines()) == 1, clean.stderr
    assert "stored config is unreadable" in clean.stderr and "pass it with --config" in clean.stderr
    resume = tk("resume", exp, "--quiet")
    assert resume.returncode == 1 and "Traceback" not in resume.stderr, resume.stderr
    assert resume.stderr.strip().splitlines() == [
        f"trialkeeper: cannot resume: the stored config of {exp.resolve()} is unreadable; pass the config file"
    ]


# ---- waiting reasons and connected agents ------------------------------------------------------


def _reading(exp: Path) -> tuple[Any, Any]:
    """What the CLI shows of the trials and environments, as JSON: the snapshots' fields (a
    trial's ``failure_summary``, said only by the CLI and the dashboard, is left out)."""
    trials = ok_json("trials", exp)
    for t in trials:
        assert t.pop("failure_summary") == "" or t["status"] == "FAILED", t
    return trials, ok_json("envs", exp)


def test_live_and_finished_experiments_show_the_same_snapshots(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", GATED_TRIAL)
    config = build_config(tmp_path, trialConcurrency=1, trialEnv={"GATE": str(tmp_path / "gate")})
    exp = tmp_path / "exp"

    async def body() -> None:
        async with Coordinator(config, experiment_dir=exp) as c:
            first = await c.submit({"x": 1, "wait": 1})
            second = await c.submit({"x": 2})
            assert c.store is not None
            live = ReadModel(c.store)

            def held() -> bool:
                a, b = live.trial(first.id), live.trial(second.id)
                return bool(
                    a and b and a.status and a.status.value == "RUNNING" and b.waiting_reason == CONCURRENCY_REASON
                )

            await async_wait_until(held, WAIT_S, message="the second trial never waited on the first")
            assert c.trial(second.id).waiting_reason == CONCURRENCY_REASON  # the live API says the same
            trials, envs = await asyncio.to_thread(_reading, exp)
            assert trials == to_json(live.trials()) and envs == to_json(live.environments())
            assert trials[1]["waiting_reason"] == CONCURRENCY_REASON and trials[0]["waiting_reason"] == ""
            (env,) = envs
            assert env["connected"] and env["running_trials"] == [first.id]
            table = await asyncio.to_thread(ok, "envs", exp)
            assert " connected " in table and "not connected" not in table
            assert CONCURRENCY_REASON in await asyncio.to_thread(ok, "trials", exp)

            # A cancel is stored before the call returns (nothing has run on the loop since):
            # the trial is being stopped, its environment says which.
            await c.cancel(first.id)
            assert live.trial(first.id).stopping  # type: ignore[union-attr]
            assert live.environments()[0].stopping_trials == (first.id,)
            await c.wait_all(WAIT_S)
    run_async(body)

    trials, envs = _reading(exp)
    with ReadModel.open(exp) as model:
        assert trials == to_json(model.trials()) and envs == to_json(model.environments())
    assert [t["status"] for t in trials] == ["USER_CANCELED", "SUCCEEDED"]
    assert not any(t["stopping"] or t["waiting_reason"] for t in trials)
    assert [e["connected"] for e in envs] == [False] and "not connected" in ok("envs", exp)


# A coordinator embedded in a process of its own, with one trial held running and one waiting
# on it, until it is killed.
EMBEDDED = """
import asyncio, sys
from pathlib import Path
from trialkeeper.coordinator import Coordinator
from trialkeeper.coordinator.config.experiment import parse_config

async def main():
    root = Path(sys.argv[1])
    config = parse_config({
        "trialCommand": "python3 trial.py", "trialConcurrency": 1, "trialCodeDirectory": str(root),
        "trialEnv": {"GATE": str(root / "gate")}, "trainingService": {"platform": "local"},
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 20, "trialLostTimeout": 40},
    }, root)
    c = Coordinator(config, experiment_dir=root / "exp")
    await c.start()
    await c.submit({"x": 1, "wait": 1})
    await c.submit({"x": 2})
    await asyncio.Event().wait()  # until the test kills this process

asyncio.run(main())
"""


def _kill_leftovers(root: Path) -> None:
    left = _leftovers(root)
    for p in left:
        p.kill()
    psutil.wait_procs(left, timeout=COMMAND_TIMEOUT_S)


def test_a_crashed_experiment_shows_what_it_showed_live(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", GATED_TRIAL)
    embedded = write_script(tmp_path, "embedded.py", EMBEDDED)
    exp = tmp_path / "exp"
    coordinator = subprocess.Popen(
        [sys.executable, str(embedded), str(tmp_path)], cwd=tmp_path,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        def waiting() -> tuple[Any, Any] | None:
            if not (exp / Store.FILENAME).exists():
                return None
            trials, envs = _reading(exp)
            shown = [(t["status"], t["waiting_reason"]) for t in trials]
            if shown == [("RUNNING", ""), ("WAITING", CONCURRENCY_REASON)] and envs and envs[0]["connected"]:
                return trials, envs
            return None

        live = wait_until(waiting, WAIT_S, interval=0.2, message="never one trial running and one waiting")
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(COMMAND_TIMEOUT_S)
        # What the dead coordinator left running (its agent, the held trial) goes too; the
        # store stays as the crash left it.
        _kill_leftovers(tmp_path)
        assert _reading(exp) == live
        assert CONCURRENCY_REASON in ok("trials", exp)
        assert " connected " in ok("envs", exp) and "not connected" not in ok("envs", exp)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait(COMMAND_TIMEOUT_S)
        _kill_leftovers(tmp_path)
