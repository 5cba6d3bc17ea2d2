"""An experiment's store at scale: 1,000,000 trials and 10,000,000 metrics.

Builds the store once through the store's own API (big transactions, executemany) and
keeps it under the bench cache, so a rerun only reads. Then times, each the median of a
few repeats: `trialkeeper status`, the first page of `trialkeeper trials --status FAILED`
(the CLI's own code, in this process, output thrown away, and once as a fresh process),
and the dashboard's trial pages through real HTTP against `trialkeeper ui`. Prints one
JSON object; reports the store's size per trial and per metric.

    python scripts/bench/storebench.py [--trials 1000000] [--metrics-per-trial 10] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from trialkeeper.coordinator import cli
from trialkeeper.coordinator.engine.rows import MetricRun
from trialkeeper.coordinator.store.store import MetricRow, Store

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import summary  # beside this script

STATUSES = ("SUCCEEDED",) * 17 + ("FAILED",) * 2 + ("EARLY_STOPPED",)  # 10 % failed
CHUNK = 50_000  # trials per batch of metric rows


def build(exp: Path, trials: int, per_trial: int, shape: str) -> dict[str, Any]:
    """The store, written in large transactions; returns build time and table sizes."""
    began = time.perf_counter()
    rng = random.Random(0)
    store = Store.in_dir(exp)
    store.create_experiment("bench", "store at scale", {"maxTrialNumber": trials, "tuner": {"name": "random"}})
    for e in range(100):
        store.insert_env(f"env-{e}", "remote", "IDLE")
    with store.transaction():
        for seq in range(trials):
            status = STATUSES[seq % len(STATUSES)] if seq < trials - 20 else "RUNNING"
            start = 1_700_000_000.0 + seq
            row = {
                "id": f"t{seq:07d}", "seq": seq, "status": status,
                "parameters_json": json.dumps({"lr": rng.uniform(1e-4, 1), "layers": rng.randint(1, 8),
                                               "opt": rng.choice(["sgd", "adam"])}),
                "command": "python3 train.py", "gpu_number": 1, "environment_id": f"env-{seq % 100}",
                "submitted_at": start, "started_at": start,
                "ended_at": None if status == "RUNNING" else start + rng.uniform(1, 100),
                "final_metric": rng.random() if status == "SUCCEEDED" else None,
                "exit_code": 1 if status == "FAILED" else None,
                "reason": "exit code 1" if status == "FAILED" else "",
            }
            store.insert_trial({**row, "ran_s": row["ended_at"] - start if row["ended_at"] else 0.0})
            store.record("trial", f"t{seq:07d}", "WAITING", "RUNNING", "placed")
            if status != "RUNNING":
                store.record("trial", f"t{seq:07d}", "RUNNING", status, "ended")
    trials_at = time.perf_counter()
    store.close()  # a checkpoint, so the file's size is the trials' alone
    trials_bytes = _size(exp)
    store = Store.in_dir(exp)
    for first in range(0, trials, CHUNK):
        rows = []
        for seq in range(first, min(trials, first + CHUNK)):
            tid = f"t{seq:07d}"
            for i in range(per_trial):
                v = (seq % 997) / 997 + i / per_trial
                rows.append(
                    MetricRow(
                        tid,
                        i,
                        "final" if i == per_trial - 1 else "intermediate",
                        v,
                        json.dumps(v),
                        1_700_000_000.0 + seq + i,
                    )
                )
        if shape == "rows":
            # As versions before runs wrote them: a row per metric, in `metrics`.
            with store.transaction():
                store._db.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?)", rows)
                store._db.execute("UPDATE meta SET value = value + ? WHERE key = 'metric_count'", (len(rows),))
        else:
            # Each metric a run of its own: what a trial reporting once an epoch leaves (one
            # reporting in a tight loop leaves one row for hundreds of them).
            with store.transaction():
                store.add_runs(
                    [MetricRun(r.trial_id, r.kind, r.index, (r.value,), None, (r.reported_at,)) for r in rows]
                )
    store.close()
    return {
        "build_s": time.perf_counter() - began, "trials_build_s": trials_at - began,
        "trials_bytes": trials_bytes, "metrics_bytes": _size(exp) - trials_bytes,
    }


def _size(exp: Path) -> int:
    return sum(p.stat().st_size for p in exp.iterdir() if p.name.startswith(Store.FILENAME))


def cached_store(cache: Path, trials: int, per_trial: int, shape: str, log: Any) -> tuple[Path, dict[str, Any]]:
    """The built store under ``cache`` (built there first when missing)."""
    exp = cache / f"store-{trials}x{per_trial}{'' if shape == 'rows' else '-' + shape}"
    done = exp / "built.json"
    if not done.exists():
        shutil.rmtree(exp, ignore_errors=True)
        exp.mkdir(parents=True)
        log(f"building a store of {trials} trials and {trials * per_trial} metrics in {exp}")
        done.write_text(json.dumps(build(exp, trials, per_trial, shape)))
    return exp, json.loads(done.read_text())


def in_process(argv: list[str]) -> float:
    """One CLI command run by the CLI's own code in this process; its output discarded."""
    began = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = cli.main(argv)
    took = time.perf_counter() - began
    if rc != 0:
        raise RuntimeError(f"trialkeeper {' '.join(argv)} exited {rc}: {out.getvalue()[-500:]}")
    return took


def repeat(fn: Any, repeats: int) -> dict[str, float] | None:
    return summary([fn() for _ in range(repeats)])


def fresh_process(tk: list[str], argv: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run([*tk, *argv], check=True, stdout=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - began


def http(url: str) -> float:
    began = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as r:
        r.read()
    return time.perf_counter() - began


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1_000_000)
    ap.add_argument("--metrics-per-trial", type=int, default=10)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "TRIALKEEPER_BENCH_CACHE", Path.home() / ".cache" / "trialkeeper-bench")))
    ap.add_argument("--repeats", type=int, default=5, help="times each figure is taken (median, min, max)")
    ap.add_argument("--shape", choices=("runs", "rows"), default="runs",
                    help="metrics as this version stores them (runs), or a row each as versions before it did (rows)")
    a = ap.parse_args()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    exp, built = cached_store(a.cache, a.trials, a.metrics_per_trial, a.shape, log)
    # Opened for writing once, as a coordinator resuming it would: a store built by an older
    # version gets what the schema added since (its indexes) here, and this is timed.
    began = time.perf_counter()
    Store.in_dir(exp).close()
    R: dict[str, Any] = {"trials": a.trials, "metrics": a.trials * a.metrics_per_trial, "shape": a.shape,
                         "open_for_writing_s": time.perf_counter() - began}
    R.update(built)
    R["bytes"] = _size(exp)
    # A trial's row, its indexes' entries and its two status events; a metric's row.
    R["bytes_per_trial"] = (R["bytes"] - built["metrics_bytes"]) / a.trials
    R["bytes_per_metric"] = built["metrics_bytes"] / (a.trials * a.metrics_per_trial)
    # The CLI's module rather than the `trialkeeper` script: the same code, and it follows
    # PYTHONPATH, so one checkout can be timed against another.
    tk = [sys.executable, "-m", "trialkeeper.coordinator.cli"]
    failed_page = ["trials", str(exp), "--status", "FAILED"]
    log("timing the CLI")
    R["cli"] = {
        "status": repeat(lambda: in_process(["status", str(exp)]), a.repeats),
        "trials --status FAILED": repeat(lambda: in_process(failed_page), a.repeats),
        "status, fresh process": repeat(lambda: fresh_process(tk, ["status", str(exp)]), a.repeats),
        "trials --status FAILED, fresh process": repeat(lambda: fresh_process(tk, failed_page), a.repeats),
    }
    log("timing the dashboard's JSON")
    ui = subprocess.Popen([*tk, "ui", str(exp), "--address", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        assert ui.stdout is not None
        url = ui.stdout.readline().removeprefix("dashboard: ").strip().rstrip("/")
        R["ui"] = {path: repeat(lambda path=path: http(url + path), a.repeats) for path in (
            "/api/experiment", "/api/trials?status=FAILED&sort=metric", "/api/trials?sort=metric&order=desc",
            f"/api/trials/t{a.trials // 2:07d}",
        )}
    finally:
        ui.terminate()
        ui.wait(30)
    print(json.dumps(R))
    return 0


if __name__ == "__main__":
    sys.exit(main())
