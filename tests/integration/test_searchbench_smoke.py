"""The search-quality benchmark runs end to end at a tiny size (figures are its job)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "searchbench.py"


@pytest.mark.slow
def test_searchbench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "search.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--seeds",
            "1",
            "--trials",
            "3",
            "--methods",
            "random,tpe+sha",
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])["summary"]
    assert [row["method"] for row in summary] == ["random", "tpe+sha"]
    for row in summary:
        assert row["seeds"] == 1 and 0.1 < row["best"][0] <= 1.0 and row["wall_s"][0] > 0
    runs = json.loads(out.read_text())["runs"]
    assert all(r["ok"] and r["trials"] == 3 for r in runs)
