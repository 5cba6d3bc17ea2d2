"""`trialkeeper trials`: a page at a time, counted and paged in the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.store.store import Store


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    store = Store.in_dir(tmp_path / "exp")
    store.create_experiment("exp1", "demo", {"trialCommand": "python trial.py"})
    with store.transaction():
        for seq in range(30):
            store.insert_trial({
                "id": f"t{seq:02d}", "seq": seq, "status": "FAILED" if seq % 3 == 0 else "SUCCEEDED",
                "parameters_json": json.dumps({"x": seq}), "command": "python trial.py", "gpu_number": 0,
                "submitted_at": 1000.0 + seq,
            })
        store.insert_trial({"id": "odd", "seq": 30, "status": "LOST_IN_SPACE", "parameters_json": "{}",
                            "command": "python trial.py", "gpu_number": 0, "submitted_at": 2000.0})
    store.close()
    return tmp_path / "exp"


def _ids(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[str], str]:
    assert cli.main(["trials", *argv, "--json"]) == 0
    out = capsys.readouterr()
    return [t["id"] for t in json.loads(out.out)], out.err


def test_a_page_of_one_status_in_submission_order(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    failed = [f"t{s:02d}" for s in range(0, 30, 3)]
    assert _ids(capsys, str(exp), "--status", "failed", "--limit", "4")[0] == failed[:4]
    assert _ids(capsys, str(exp), "--status", "FAILED", "--limit", "4", "--offset", "8")[0] == failed[8:]
    assert _ids(capsys, str(exp), "--status", "FAILED", "--limit", "0")[0] == failed
    assert _ids(capsys, str(exp), "--status", "FAILED", "--offset", "10")[0] == []


def test_the_default_page_and_every_trial(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    everything = [f"t{s:02d}" for s in range(30)] + ["odd"]
    assert _ids(capsys, str(exp))[0] == everything  # fewer than a page
    assert _ids(capsys, str(exp), "--limit", "0")[0] == everything
    assert _ids(capsys, str(exp), "--status", "UNREADABLE")[0] == ["odd"]


def test_pages_longer_than_the_read_models_are_read_in_several(exp: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from trialkeeper.coordinator.cli import views as cli_views

    monkeypatch.setattr(cli_views, "MAX_PAGE", 7)
    assert _ids(capsys, str(exp), "--limit", "20", "--offset", "3")[0] == [f"t{s:02d}" for s in range(3, 23)]
    assert len(_ids(capsys, str(exp), "--limit", "0")[0]) == 31


def test_the_table_says_how_many_more_there_are(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trials", str(exp), "--status", "SUCCEEDED", "--limit", "5"]) == 0
    out = capsys.readouterr()
    assert "t01" in out.out and "t07" in out.out and "t08" not in out.out
    assert "trials 1-5 of 20; --offset 5 for the next ones" in out.err
    assert cli.main(["trials", str(exp), "--status", "FAILED", "--limit", "10"]) == 0
    assert capsys.readouterr().err == ""  # all shown


@pytest.mark.parametrize(("argv", "says"), [
    (["--status", "BROKEN"], "--status: 'BROKEN' is not one of WAITING, RUNNING"),
    (["--limit", "-1"], "--limit and --offset take a whole number of 0 or more"),
    (["--offset", "-5"], "--limit and --offset take a whole number of 0 or more"),
])
def test_a_bad_argument_is_named(exp: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    assert cli.main(["trials", str(exp), *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_trials_view_lists_only_the_log_files_it_has(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trial", str(exp), "t00"]) == 0
    out = capsys.readouterr().out
    assert "logs: none: it never ran" in out and ".log" not in out
    trial_dir = exp / "trials" / "t01"
    trial_dir.mkdir(parents=True)
    (trial_dir / "stdout.log").write_text("epoch 1\n")
    assert cli.main(["trial", str(exp), "t01"]) == 0
    assert f"logs: {trial_dir / 'stdout.log'}\n" in capsys.readouterr().out
