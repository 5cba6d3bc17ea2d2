"""The experiment-loop benchmark runs end to end at a tiny size (figures are its job)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


@pytest.mark.slow
def test_loopbench_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "loopbench.py"), "--trials", "24", "--concurrency", "2", "--windows", "2",
         "--progress"],
        check=False, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["trials"] == 24 and out["concurrency"] == 2
    rates = out["trials_per_s_by_window"]
    assert len(rates) == 2 and all(r > 0 for r in rates)
    assert out["last_over_first"] == pytest.approx(rates[1] / rates[0])
    assert out["coordinator_cpu_ms_per_trial"] > 0 and out["wall_s"] > 0
    assert out["progress_lines"] >= 1  # the last, at the end, at least
