"""The multi-fidelity and replay benchmarks run end to end at a tiny size (figures are their job)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


@pytest.mark.slow
def test_mfbench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "mf.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "mfbench.py"), "--seeds", "1", "--trials", "4", "--epoch-s", "0.01",
         "--methods", "asha,pbt,bo+slow-adaptive", "--family", "plateau", "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["family"] == "plateau" and 0.5 < last["optima"]["0"] <= 1.0
    # The noiseless optimum sits below the best noisy epoch, which carries the luckiest noise.
    assert 0.5 < last["clean_optima"]["0"] < last["optima"]["0"]
    summary = last["summary"]
    assert sorted(summary) == ["asha", "bo+slow-adaptive", "pbt"]
    for rows in summary.values():
        (row,) = rows
        assert row["wall_s"] > 0 and 0 <= row["final_gap"] < 1 and row["gap_at_ray_wall"] is None
        # Every reported epoch was traced with its worth: the pick's regret is known.
        assert 0 <= row["final_regret"] < 1 and row["regret_at_ray_wall"] is None
        assert set(row["regret_reach_s"]) == {"0.02", "0.01", "0.005"}


@pytest.mark.slow
def test_replaybench_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "replaybench.py"), "--trials", "60", "--repeats", "1", "--cache", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["trials"] == 60 and figures["build_s"] > 0
    own = figures["searches"]["own search (random, seed 0)"]
    assert own["replayed_trials"] == 60 and own["nearest"] == 0 and own["gap"] == 0.0
    assert figures["searches"]["random, seed 1 (every trial the nearest)"]["nearest"] == 60


def test_slowcurves_families_start_slow() -> None:
    """Each family's eventual best configuration stays out of the early top tenth (what the
    benchmark's figures rest on), and an unknown family is refused by name."""
    code = (
        "import json, slowcurves as s\n"
        "print(json.dumps({f: s.crossing(0, n=200, family=f) for f in s.FAMILIES}))\n"
        "try:\n"
        "    s.curve({'lr': 0.01, 'momentum': 0.9, 'width': 64, 'arch': 'mlp'}, 0, 'linear')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=BENCH, check=False, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats_line, error = proc.stdout.strip().splitlines()
    stats = json.loads(stats_line)
    assert sorted(stats) == ["crossing", "plateau", "power"]
    for family, s in stats.items():
        assert s["best_outside_top_tenth_until_epoch"] >= 6, (family, s)
        assert s["spearman_e3"] < 0.7, (family, s)
    assert "linear" in error and "plateau" in error


@pytest.mark.parametrize(("script", "flag"), [("mfbench.py", "--draw"), ("mfsim.py", "--first-draw")])
def test_a_negative_draw_is_refused_by_name(script: str, flag: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / script), flag, "-1"], check=False, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and f"{flag} must be 0 or more, got -1" in proc.stderr, proc.stderr[-2000:]


def test_no_draws_is_refused_by_name() -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "mfbench.py"), "--draws", "0"], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--draws must be 1 or more, got 0" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_mfbench_counts_the_target_over_every_draw_at_ray_tunes_wall_time(tmp_path: Path) -> None:
    """--draws runs a method on several draws per seed, each for Ray Tune's wall time of its
    seed (--ray-wall-from), and the summary counts the target's two parts over all of them."""
    ray = tmp_path / "ray.json"
    ray.write_text(json.dumps({"family": "power", "runs": [
        {"method": "ray-optuna+asha", "seed": 0, "family": "power", "wall_s": 4.0},
        {"method": "ray-optuna+asha", "seed": 0, "family": "plateau", "wall_s": 99.0}]}))
    out = tmp_path / "mf.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "mfbench.py"), "--seeds", "1", "--epoch-s", "0.01", "--methods", "bo",
         "--family", "power", "--draw", "1", "--draws", "2", "--ray-wall-from", str(ray), "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = last["summary"]["bo (Ray's wall time)"]
    assert [(r["seed"], r["draw"], r["ray_wall_s"]) for r in rows] == [(0, 1, 4.0), (0, 2, 4.0)]
    assert all(r["regret_at_ray_wall"] is not None for r in rows)
    within = sum(r["regret_at_ray_wall"] <= 0.005 for r in rows)
    by_half = sum(r["regret_reach_s"]["0.01"] is not None and r["regret_reach_s"]["0.01"] <= 2.0 for r in rows)
    assert last["target"]["bo (Ray's wall time)"] == {"runs": 2, "within_05_at_ray_wall": within,
                                                     "within_1_by_half_ray_wall": by_half}
    assert "target, by regret, of 2 runs" in proc.stderr
    assert json.loads(out.read_text())["target"] == last["target"]
    # The saved output summarizes to the same count, the Ray Tune wall time given again.
    again = subprocess.run(
        [sys.executable, str(BENCH / "mfbench.py"), "--family", "power", "--summarize", str(out),
         "--ray-wall-from", str(ray)], check=False, capture_output=True, text=True, timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["target"] == last["target"]


def test_both_benchmarks_seed_a_draw_alike() -> None:
    """mfsim.py's virtual runs and mfbench.py's timed ones seed the search of a draw alike,
    so that a draw counted in one is the same draw in the other."""
    code = (
        "import mfbench, mfsim\n"
        "print(mfbench.search_seed(3, 0), mfbench.search_seed(3, 2), mfsim.search_seed is mfbench.search_seed)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=BENCH, check=False, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["3", "2003", "True"]
