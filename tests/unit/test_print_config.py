"""`trialkeeper run CONFIG --print-config` checks what `run` would refuse at start: the tuner,
the assessor and the advisor are made as `run` makes them, every problem said at once with
where it is, and nothing is kept."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from trialkeeper.coordinator.cli.app import main

BASE = {
    "trialCommand": "python3 t.py",
    "trialConcurrency": 1,
    "maxTrialNumber": 2,
    "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
    "trainingService": {"platform": "local"},
}


def _check(tmp_path: Path, capsys: pytest.CaptureFixture[str], **sections: object) -> tuple[int, list[str]]:
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump({**BASE, **sections}))
    code = main(["run", str(path), "--print-config"])
    out = capsys.readouterr()
    assert yaml.safe_load(out.out)["trialCommand"] == "python3 t.py"  # printed all the same
    return code, out.err.splitlines()


def test_a_tuner_and_an_assessor_run_would_refuse_are_both_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _check(tmp_path, capsys, tuner={"name": "randm"}, assessor={"name": "medain"})
    assert code == 2
    assert err[0] == f"trialkeeper: invalid config {tmp_path / 'config.yml'}:"
    assert err[1].startswith("  tuner: unknown tuner 'randm'; did you mean 'random'?")
    assert err[2].startswith("  assessor: unknown assessor 'medain'; did you mean 'median'?")
    assert len(err) == 3

    code, err = _check(tmp_path, capsys, tuner={"name": "random", "classArgs": {"optimize_mode": "max"}},
                       assessor={"name": "asha", "classArgs": {"brackets": "adaptve"}})
    assert code == 2
    assert err[1:] == ["  tuner: optimize_mode must be 'maximize' or 'minimize', got 'max'",
                       "  assessor: assessor 'asha' needs classArgs max_resource"]

    code, err = _check(tmp_path, capsys, tuner={"name": "random", "classArgs": {"sede": 3}})
    assert code == 2 and len(err) == 1
    config = tmp_path / "config.yml"
    assert err[0].startswith(f"trialkeeper: invalid config {config}: tuner: unexpected classArgs 'sede'")


def test_a_valid_search_passes_and_leaves_nothing_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    study = tmp_path / "study.db"
    code, err = _check(tmp_path, capsys,
                       tuner={"name": "optuna", "classArgs": {"sampler": "TPE", "storage": f"sqlite:///{study}"}},
                       assessor={"name": "asha", "classArgs": {"max_resource": 9}})
    assert (code, err) == (0, [])
    assert not study.exists(), "checking the config made the Optuna study"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yml"]


def test_an_algorithm_whose_package_is_not_installed_here_is_a_note_of_its_own_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _check(tmp_path, capsys, tuner={"name": "random"}, assessor={"name": "Medianstop"})
    assert code == 0  # the config may be meant for a machine that has NNI
    if importlib.util.find_spec("nni") is None:
        assert len(err) == 1 and err[0].startswith(
            "trialkeeper: note: assessor not checked here: assessor 'Medianstop' is one of NNI's algorithms, "
            "and NNI is not installed"), err
    else:
        assert err == []


def test_an_attached_run_says_every_section_it_refuses_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump({**BASE, "tuner": {"name": "random", "classArgs": {"sede": 3}},
                                    "assessor": {"name": "asha", "classArgs": {"max_resource": 9, "nope": 1}}}))
    code = main(["run", str(path), "--quiet", "--experiment-dir", str(tmp_path / "exp")])
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    assert err[0] == f"trialkeeper: invalid config {path}:", err
    assert err[1].startswith("  tuner: unexpected classArgs 'sede'"), err
    assert err[2].startswith("  assessor: unexpected classArgs 'nope'"), err
    assert not (tmp_path / "exp").exists(), "a run refused at start keeps no directory"
