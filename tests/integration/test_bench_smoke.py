"""The benchmark suite's smoke variant: every stage runs at tiny sizes and yields figures.

Correctness only: no figure is compared with a target here (timings on a shared test
machine say nothing); the suite itself is scripts/bench/run.py, see docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "run.py"


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_every_benchmark_stage_runs_and_produces_figures(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(RUN), "--smoke", "--json", str(out), "--markdown", str(tmp_path / "table.md")],
        capture_output=True,
        text=True,
        timeout=160,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    results = data["results"]
    for k in (1, 2):
        runs = results[f"overhead_k{k}"]
        assert all("error" not in r for r in runs["floor"] + runs["trialkeeper"]), runs
        assert all(r["succeeded"] == r["n"] for r in runs["trialkeeper"])
    assert all(r["stored"] == r["expected"] for r in results["ingest"]["trialkeeper"])
    assert all("error" not in e for e in results["ingest"]["edge"])
    assert "error" not in results["footprint"]
    assert all(r["status"] == "FAILED" for r in results["failure_local"])
    scale = results["scale"]["5"]
    assert "connect_s" in scale and scale["heartbeat_windows"], scale
    assert scale["burst"]["running"] == scale["burst"]["target"], scale["burst"]
    assert all("error" not in s for s in results["sched"].values())
    figures = [row["figure"] for row in data["table"]]
    for prefix in (
        "1. wall",
        "2. submit",
        "2. trial end",
        "3. metric ingest",
        "4. N=5",
        "4. scheduler alone",
        "5. idle agent",
        "6. kill -9",
    ):
        assert any(f.startswith(prefix) for f in figures), (prefix, figures)
    assert (tmp_path / "table.md").read_text().startswith("| figure")
