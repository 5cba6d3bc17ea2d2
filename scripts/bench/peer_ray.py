"""The trivial-trial workload under Ray Tune (function API, local ray.init). Runs in the
peer's own virtualenv; prints one JSON line.

    <cache>/peers/ray/bin/python peer_ray.py --n 40 --width 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--width", type=int, default=2)
    a = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    t_import = time.perf_counter()
    import ray
    from ray import tune

    def trainable(config: dict) -> None:
        x = float(config["x"])
        for i in range(3):
            tune.report({"score": x + i})
        tune.report({"score": x * 10.0})

    out: dict = {"n": a.n, "width": a.width, "ray": ray.__version__}
    t0 = time.perf_counter()
    ray.init(num_cpus=a.width, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    out["init_s"] = time.perf_counter() - t0
    out["import_s"] = t0 - t_import
    with tempfile.TemporaryDirectory() as storage:
        for label, reuse in (("new_worker_per_trial", False), ("reuse_actors", True)):
            tuner = tune.Tuner(
                trainable,
                param_space={"x": tune.grid_search(list(range(a.n)))},
                tune_config=tune.TuneConfig(max_concurrent_trials=a.width, reuse_actors=reuse),
                run_config=tune.RunConfig(storage_path=storage, name=label, verbose=0),
            )
            t = time.perf_counter()
            results = tuner.fit()
            out[f"{label}_wall_s"] = time.perf_counter() - t
            out[f"{label}_ok"] = sum(1 for r in results if r.error is None)
    ray.shutdown()
    out["wall_s"] = out["new_worker_per_trial_wall_s"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
