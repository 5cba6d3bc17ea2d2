"""The checkpoint benchmark runs end to end at a tiny size and yields its figures.

Correctness only: no timing is compared with a target here; the benchmark itself is
scripts/bench/ckptbench.py, see docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
RAY_VENV = Path.home() / ".cache" / "trialkeeper-bench" / "peers" / "ray" / "bin" / "python"


def _ray_python() -> str:
    for python in (str(RAY_VENV), sys.executable):
        if Path(python).exists():
            probe = subprocess.run([python, "-c", "import ray.tune"], capture_output=True, timeout=120, check=False)
            if probe.returncode == 0:
                return python
    return ""


def _chaos_ran(run: dict) -> None:
    assert "error" not in run, run
    assert run["succeeded"] == run["trials"] == run["trials_finished"], run
    assert run["epochs_computed"] >= run["epochs_needed"], run
    # A trial whose run was killed ran again (one killed as it ended may not have needed to).
    assert len(run["kill_to_next_run_s"]) <= run["losses"], run


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoint_benchmark_runs_and_produces_figures(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "ckptbench.py"), "--smoke", "--ray-python", "", "--json", str(out),
         "--markdown", str(tmp_path / "table.md")],
        capture_output=True, text=True, timeout=220, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = data["results"]["chaos"]["runs"]
    assert {(r["ckpt"], r["kills"]) for r in runs} == {(True, False), (True, True), (False, True)}
    for run in runs:
        _chaos_ran(run)
        assert run["system"] == "trialkeeper"
        if not run["kills"]:
            assert run["losses"] == 0 and run["epochs_computed"] == run["epochs_needed"]
    transfer = data["results"]["transfer"]
    [upload], [tcp], [grpc], local = transfer["upload"], transfer["tcp"], transfer["grpc"], transfer["local"]
    assert upload["way"] == "upload" and local["way"] == "shared", (upload, local)
    assert len(tcp["tcp_s"]) == len(tcp["sha256_s"]) == len(grpc["grpc_s"]) == transfer["repeats"], (tcp, grpc)
    # Each save is timed or refused with its reason (refusals are reported, not hidden).
    assert sum(map(len, upload["saves"].values())) + len(upload["refused"]) == transfer["repeats"]
    assert all(reason for reason in upload["refused"] + local["refused"])
    figures = [row[0] for row in data["table"]]
    for prefix in (
        "1. trialkeeper, no kills",
        "1. trialkeeper, checkpoint per epoch: compute lost per loss",
        "1. trialkeeper, no checkpoints: epochs computed / needed",
        "2. save_checkpoint of 2 MiB, uploaded",
        "2. floor: 2 MiB over loopback TCP",
        "2. floor: 2 MiB as 1 MiB messages of a bare gRPC stream",
        "2. upload / TCP floor",
        "2. save_checkpoint of 1 KiB on the shared",
    ):
        assert any(f.startswith(prefix) for f in figures), (prefix, figures)
    assert (tmp_path / "table.md").read_text().startswith("| figure")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_tune_side_of_the_checkpoint_benchmark_loses_workers_and_finishes() -> None:
    python = _ray_python()
    if not python:
        pytest.skip("no interpreter with ray[tune] (python scripts/bench/peers.py installs one)")
    proc = subprocess.run(
        [python, str(BENCH / "peer_ray_ckpt.py"), "--trials", "3", "--epochs", "4", "--epoch-s", "0.2",
         "--lifetime-s", "0.8", "--seed", "1"],
        capture_output=True, text=True, timeout=220, check=False, cwd=BENCH,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    _chaos_ran(run)
    assert run["system"] == "ray" and run["ckpt"] is True
    assert run["losses"] + run["misses"] > 0, run  # the kills ran (whether they found a run is chance)
