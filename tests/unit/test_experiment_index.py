"""The index of this machine's experiments: `trialkeeper list` finds every experiment that
still exists, wherever it was made, as `nnictl experiment list` does; concurrent writers
lose nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.store import index
from trialkeeper.coordinator.store.store import Store

WRITERS = 4
RECORDS_EACH = 15
WRITERS_TIMEOUT_S = 120


def _experiment(directory: Path, exp_id: str) -> Path:
    store = Store.in_dir(directory)
    store.create_experiment(exp_id, f"name-{exp_id}", {"trialCommand": "python trial.py"})
    store.close()
    return directory


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRIALKEEPER_HOME", str(tmp_path / "tkhome"))
    return tmp_path


def test_the_index_is_under_trialkeeper_home(tmp_path: Path) -> None:
    assert index.default_index({"TRIALKEEPER_HOME": str(tmp_path)}) == tmp_path / "experiments.json"
    assert index.default_index({}) == Path("~/.trialkeeper/experiments.json").expanduser()


def test_recorded_experiments_are_listed_until_their_directory_goes(tmp_path: Path) -> None:
    file = tmp_path / "tk" / "experiments.json"
    a = _experiment(tmp_path / "a", "expA")
    b = _experiment(tmp_path / "b", "expB")
    index.record("expA", a, file)
    index.record("expB", b, file)
    index.record("expA", a, file)  # recorded again: still one entry
    assert [(e.experiment_id, e.directory) for e in index.entries(file)] == [
        ("expB", b),
        ("expA", a),
    ]
    shutil.rmtree(b)
    assert [e.experiment_id for e in index.entries(file)] == ["expA"]
    assert index.forget_gone(file) == 1
    assert [row["id"] for row in json.loads(file.read_text())["experiments"]] == ["expA"]


def test_a_damaged_index_lists_nothing_and_is_rewritten(tmp_path: Path) -> None:
    file = tmp_path / "experiments.json"
    file.write_text('{"experiments": [{"id": ')
    assert index.entries(file) == []
    index.record("expA", _experiment(tmp_path / "a", "expA"), file)
    assert [e.experiment_id for e in index.entries(file)] == ["expA"]


WRITER = """
import sys
from pathlib import Path
from trialkeeper.coordinator.store import index
file, root, who, n = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
for i in range(n):
    index.record(f"{who}-{i}", root / f"{who}-{i}", file)
"""


def test_concurrent_writers_lose_no_entry(tmp_path: Path) -> None:
    file = tmp_path / "tk" / "experiments.json"
    for w in range(WRITERS):
        for i in range(RECORDS_EACH):
            _experiment(tmp_path / f"w{w}-{i}", f"w{w}-{i}")
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(file), str(tmp_path), f"w{w}", str(RECORDS_EACH)]
        )
        for w in range(WRITERS)
    ]
    assert [p.wait(timeout=WRITERS_TIMEOUT_S) for p in writers] == [0] * WRITERS
    ids = sorted(e.experiment_id for e in index.entries(file))
    assert ids == sorted(f"w{w}-{i}" for w in range(WRITERS) for i in range(RECORDS_EACH))
    assert not list(file.parent.glob(".experiments-*"))  # no temporary file left behind


def test_list_finds_experiments_made_anywhere(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _experiment(home / "home" / "trialkeeper-experiments" / "d1", "inDefault")
    elsewhere = _experiment(home / "elsewhere" / "mine", "madeElsewhere")
    index.record("madeElsewhere", elsewhere)
    assert cli.main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted((e["id"], e["directory"]) for e in listed)[1] == ("madeElsewhere", str(elsewhere))
    assert cli.main(["list"]) == 0
    assert "directory" in capsys.readouterr().out  # the table says where each one is
    assert (
        cli.main(["list", "--dir", str(home / "home" / "trialkeeper-experiments"), "--json"]) == 0
    )
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == ["inDefault"]

    shutil.rmtree(elsewhere)
    assert cli.main(["list", "--json"]) == 0
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == ["inDefault"]
    assert json.loads(index.default_index().read_text())["experiments"] == []
