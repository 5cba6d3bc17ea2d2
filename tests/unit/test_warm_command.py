"""Which trial commands the warm template runs, and how: the rest start cold."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trialkeeper.agent.warm import interpreter_variables, warm_command


def _env() -> dict[str, str]:
    return {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


def test_a_script_runs_warm_with_the_path_a_cold_start_gives(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("")
    got = warm_command(["python", "sub/train.py", "--lr", "0.1"], str(tmp_path), _env(), sys.executable)
    assert got is not None
    assert got.argv == ["sub/train.py", "--lr", "0.1"] and got.module == ""
    assert got.path0 == str((tmp_path / "sub").resolve())
    assert got.executable == os.path.join(os.path.dirname(sys.executable), "python")


def test_a_module_runs_warm_with_the_working_directory_first(tmp_path: Path) -> None:
    got = warm_command([sys.executable, "-m", "pkg.train", "x"], str(tmp_path), _env(), sys.executable)
    assert got is not None and got.module == "pkg.train" and got.argv == [sys.executable, "x"]
    assert got.path0 == str(tmp_path)


def test_what_is_not_a_plain_python_start_runs_cold(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    cwd, env = str(tmp_path), _env()
    for argv in (
        ["/bin/sh", "-c", "python t.py"],  # not Python
        ["python"],  # no script
        ["python", "-u", "t.py"],  # interpreter options are read at its start
        ["python", "-m"],
        ["python", "missing.py"],  # a cold start reports it
        ["/usr/bin/env", "python", "t.py"],
    ):
        assert warm_command(argv, cwd, env, sys.executable) is None, argv
    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").symlink_to(sys.executable)
    # The same interpreter file in another directory is another environment (a venv).
    assert warm_command([str(other / "python"), "t.py"], cwd, env, sys.executable) is None


def test_only_interpreter_start_up_variables_must_match() -> None:
    assert interpreter_variables({"PYTHONPATH": "/x", "PATH": "/bin", "HOME": "/h"}) == {"PYTHONPATH": "/x"}
