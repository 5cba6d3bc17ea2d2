"""The multi-node benchmarks run and print their figures (no figure is compared with a target
here: timings on a shared test machine say nothing; see docs/benchmarks.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_gang_pass_benchmark_places_gangs_and_one_node_trials() -> None:
    out = _run(str(BENCH / "gangpass.py"), "--runs", "1")
    gangs = re.search(r"gang pass: (\d+) waiting gangs .*: (\d+) placed", out)
    ones = re.search(r"one-node pass: 10,000 waiting, 1,000 environments: (\d+) placed", out)
    assert gangs and ones, out
    assert int(gangs.group(1)) > 5000 and 0 < int(gangs.group(2)) <= 500  # at most the 500 free environments
    assert int(ones.group(1)) == 500


def test_the_start_benchmark_times_every_ranks_first_line() -> None:
    out = _run(str(BENCH / "multinode_start.py"), "--rounds", "1")
    for nodes in (2, 4):
        assert re.search(rf"{nodes}-node trial: submit -> every rank's first line \d+ ms; "
                         rf"{nodes} one-node trials, the slowest \d+ ms; ratio [\d.]+", out), out
