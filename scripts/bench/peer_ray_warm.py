"""The warm-start trial (numpy + scikit-learn) under Ray Tune, one trial at a time, with and
without ``reuse_actors``. Runs in an interpreter with ray[tune] and scikit-learn; prints one
JSON line.

    RAY_PY peer_ray_warm.py --starts 10

Ray gives no submit time per trial: the figure is the gap from one trial's last line to the
next trial's first line after its imports, one trial at a time (what a queued trial waits
to start), the first trial left out (it starts the worker).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--starts", type=int, default=10)
    a = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    import ray
    from ray import tune

    def trainable(config: dict) -> None:
        import numpy  # noqa: F401
        import sklearn.svm  # noqa: F401

        first = time.time()
        tune.report({"score": float(config["x"]), "first": first, "last": time.time()})

    out: dict = {"ray": ray.__version__, "starts": a.starts}
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        for label, reuse in (("new_worker_per_trial", False), ("reuse_actors", True)):
            tuner = tune.Tuner(
                trainable,
                param_space={"x": tune.grid_search(list(range(a.starts + 1)))},
                tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=reuse),
                run_config=tune.RunConfig(storage_path=storage, name=label, verbose=0),
            )
            results = tuner.fit()
            spans = sorted((r.metrics["first"], r.metrics["last"]) for r in results if r.error is None)
            gaps = [nxt[0] - prev[1] for prev, nxt in itertools.pairwise(spans)]
            out[f"{label}_gap_s"] = {
                "min": min(gaps),
                "median": statistics.median(gaps),
                "max": max(gaps),
                "n": len(gaps),
            }
    ray.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
