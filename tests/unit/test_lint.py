"""The tree keeps the rules it configures: ruff (pinned in the dev extra) finds nothing,
the line length of pyproject.toml included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_line_length_is_checked() -> None:
    """A line past the configured length is found: the check is on, not only configured."""
    long_line = "x = " + "1 + " * 40 + "1\n"
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "--stdin-filename", "probe.py", "-"],
        cwd=REPO, input=long_line, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 1 and "E501" in done.stdout, done.stdout + done.stderr
