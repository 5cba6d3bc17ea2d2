"""The dashboard over a large experiment: how long each JSON answer takes.

Builds a store of 100,000 trials (3 intermediate results each) and 1,000 environments with
2 GPUs sampled 20 times each, serves it with `trialkeeper ui`, and times every request the
pages make (the median of 5, with min and max, and the median time to the first byte),
through real HTTP. A copy of it beside it makes a directory of two such experiments, served
by `trialkeeper ui --dir` (the experiments home: its list, a comparison of the two, an
experiment's page under /x/NAME/).

    python scripts/bench/dashboard.py [--trials 100000] [--envs 1000]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from trialkeeper.coordinator.store.store import GpuSampleRow, MetricRow, Store

REPEATS = 5


def build(exp: Path, trials: int, envs: int) -> float:
    began = time.perf_counter()
    rng = random.Random(0)
    store = Store.in_dir(exp)
    space = {"lr": {"_type": "loguniform", "_value": [1e-4, 1]}, "layers": {"_type": "randint", "_value": [1, 9]},
             "opt": {"_type": "choice", "_value": ["sgd", "adam"]}}
    store.create_experiment(
        "bench", "dashboard", {"maxTrialNumber": trials, "tuner": {"name": "random"}, "searchSpace": space}
    )
    with store.transaction():
        for e in range(envs):
            store.insert_env(f"env-{e}", "remote", "BUSY")
        for seq in range(trials):
            draw = rng.random()  # 90% succeeded, 5% stopped early (by their last intermediate result), 5% failed
            ok = draw < 0.9
            start = 1_700_000_000.0 + seq
            row = {
                "id": f"t{seq:06d}", "seq": seq,
                "status": "SUCCEEDED" if ok else "EARLY_STOPPED" if draw < 0.95 else "FAILED",
                "parameters_json": json.dumps({"lr": rng.uniform(1e-4, 1), "layers": rng.randint(1, 8),
                                               "opt": rng.choice(["sgd", "adam"])}),
                "command": "python3 train.py", "gpu_number": 1, "environment_id": f"env-{seq % envs}",
                "submitted_at": start, "started_at": start, "ended_at": start + rng.uniform(1, 100),
                "final_metric": rng.random() if ok else None,
            }
            store.insert_trial({**row, "ran_s": row["ended_at"] - start})  # one attempt each
    gpus = [{"index": i, "uuid": f"GPU-{i}", "name": "H100", "memory_total_bytes": 80 * 2**30} for i in range(2)]
    with store.transaction():
        for e in range(envs):
            store.update_env(
                f"env-{e}",
                hostname=f"host-{e}",
                info_json=json.dumps({"gpus": [dict(g, uuid=f"GPU-{e}-{g['index']}") for g in gpus]}),
            )
    store.add_metrics(
        [
            MetricRow(f"t{s:06d}", i, "intermediate", i / 3, json.dumps(i / 3), 1.0)
            for s in range(trials)
            for i in range(3)
        ]
    )
    store.add_gpu_samples([
        GpuSampleRow(1_700_000_000.0 + k, f"env-{e}", f"GPU-{e}-{g}", 50.0, 2**34, 80 * 2**30, (f"t{e:06d}",))
        for k in range(20) for e in range(envs) for g in range(2)
    ])
    store.set_experiment_status("RUNNING")
    store.close()
    return time.perf_counter() - began


def timed(url: str) -> tuple[float, float, float, float, int]:
    """(median, min, max) of the whole answer's time, the median time to its first byte, its size."""
    times, firsts, size = [], [], 0
    for _ in range(REPEATS):
        began = time.perf_counter()
        with urllib.request.urlopen(url, timeout=120) as r:
            first = r.read(1)
            firsts.append(time.perf_counter() - began)
            size = len(first) + len(r.read())
        times.append(time.perf_counter() - began)
    return statistics.median(times), min(times), max(times), statistics.median(firsts), size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100_000)
    p.add_argument("--envs", type=int, default=1_000)
    args = p.parse_args()
    tk = (
        str(Path(sys.executable).parent / "trialkeeper")
        if (Path(sys.executable).parent / "trialkeeper").exists()
        else shutil.which("trialkeeper")
    )
    with tempfile.TemporaryDirectory() as tmp:
        exp = Path(tmp) / "exp"
        took = build(exp, args.trials, args.envs)
        print(f"store of {args.trials} trials and {args.envs} environments built in {took:.1f} s")
        shutil.copytree(exp, Path(tmp) / "exp2")  # the experiments home compares two
        ui = subprocess.Popen([str(tk), "ui", str(exp), "--address", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
        home = subprocess.Popen(
            [str(tk), "ui", "--dir", tmp, "--address", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert ui.stdout is not None and home.stdout is not None
            url = ui.stdout.readline().removeprefix("dashboard: ").strip().rstrip("/")
            home_url = home.stdout.readline().removeprefix("dashboard: ").strip().rstrip("/")
            print(f"{'request':55} {'median':>8} {'min':>8} {'max':>8} {'first B':>8} {'bytes':>9}")
            for path in (
                "/api/experiment", "/api/trials?limit=200", "/api/trials?sort=metric&order=desc&limit=200",
                "/api/trials?sort=param:lr&limit=200&offset=50000", "/api/trials?status=FAILED&q=adam&limit=200",
                "/api/trials/t050000", "/api/compare", "/api/environments", "/api/environments?offset=900",
                "/api/environments/env-7/gpus", "/metrics",
                "/api/compare?ids=t000010,t050000,t099999", "/api/importance",
                "/api/trials/export?format=csv&status=FAILED&q=adam", "/api/trials/export?format=csv",
                "/api/trials/export?format=json",
                "/api/context", "home: /api/home", "home: /api/home/compare?keys=exp,exp2",
                "home: /x/exp2/api/experiment",
            ):
                at = home_url + path.removeprefix("home: ") if path.startswith("home: ") else url + path
                median, low, high, first, size = timed(at)
                print(f"{path:55} {median * 1000:7.0f}ms {low * 1000:7.0f}ms {high * 1000:7.0f}ms"
                      f" {first * 1000:7.0f}ms {size:9d}")
        finally:
            for served in (ui, home):
                served.terminate()
                served.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
