"""The largest-messages benchmark runs end to end once (its figures are its job, not this test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trialkeeper.protos import limits

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


@pytest.mark.slow
def test_limitsbench_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "limitsbench.py"), "--repeats", "1", "--timeout", "30"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    # One full batch and two one-metric ones, every metric stored.
    assert figures["repeats"] == 1 and figures["stored"] == figures["expected"] == limits.MAX_METRICS_PER_BATCH + 2
    # The batch fills all but a little of the largest message allowed; the heartbeat lists every process
    # it may, each with a trial id at its longest.
    size = figures["bytes"]
    assert limits.MAX_MESSAGE_BYTES - 256 * 1024 < size["metrics"] < limits.MAX_MESSAGE_BYTES, size
    assert size["heartbeat"] > limits.MAX_GPUS * limits.MAX_PROCESSES_PER_GPU * limits.MAX_ID_CHARS, size
    for kind in ("metrics", "heartbeat", "floor"):
        wall = figures[kind]["wall_s"]
        assert set(wall) == {"min", "median", "max", "n", "p90"} and wall["n"] == 1, wall
        assert 0 < wall["min"] <= wall["median"] <= wall["p90"] <= wall["max"], wall
        assert figures[kind]["cpu_s"]["n"] == 1 and len(figures[kind]["runs_wall_s"]) == 1
    assert len(figures["load_before"]) == len(figures["load_after"]) == 3
