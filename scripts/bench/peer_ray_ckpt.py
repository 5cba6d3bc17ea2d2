"""The checkpoint benchmark's workload under Ray Tune, its trial workers killed at random.
Runs in an interpreter with ray[tune]; prints one JSON line.

    RAY_PY peer_ray_ckpt.py --trials 16 --epochs 10 --epoch-s 0.3 --lifetime-s 9 --seed 1 [--no-ckpt]

N trials of E epochs, 2 at a time (max_concurrent_trials, one CPU each), each epoch reported
with ``tune.report(..., checkpoint=tune.Checkpoint.from_directory(...))`` and continued with
``tune.get_checkpoint()`` (Ray Tune's names for train.report / train.get_checkpoint in its
function API), ``FailureConfig(max_failures=...)`` retrying a trial whose worker died,
``reuse_actors=True`` (Ray's faster way to run many short trials). A thread of the driver
kills -9 the worker process of a running trial (the pid its run wrote into the events file:
the trial actor's process, ``ray::ImplicitFunc``) at the times of the same Poisson process as
trialkeeper's environments (ckpt_chaos.Killer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ckpt_chaos import Killer, summarise


def trainable(config: dict) -> None:
    import json
    import tempfile
    from pathlib import Path

    from ckpt_chaos import note, work
    from ray import tune

    key, events, use_ckpt = config["key"], config["events"], config["ckpt"]
    start = 0
    if use_ckpt and (ckpt := tune.get_checkpoint()) is not None:
        with ckpt.as_directory() as d:
            start = json.loads((Path(d) / "state.json").read_text())["epoch"] + 1
    note(events, "run", key, start - 1)
    blob = b"\0" * config["blob"]
    for epoch in range(start, config["epochs"]):
        note(events, "start", key, epoch)
        work(config["epoch_s"], config["work"])
        note(events, "done", key, epoch)
        if use_ckpt:
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "state.json").write_text(json.dumps({"epoch": epoch}))
                if blob:
                    (Path(d) / "blob.bin").write_bytes(blob)
                tune.report({"epoch": epoch}, checkpoint=tune.Checkpoint.from_directory(d))
        else:
            tune.report({"epoch": epoch})
    note(events, "end", key, config["epochs"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--epoch-s", type=float, default=0.3)
    p.add_argument("--work", choices=("sleep", "cpu"), default="sleep")
    p.add_argument("--blob", type=int, default=0)
    p.add_argument("--width", type=int, default=2)
    p.add_argument("--lifetime-s", type=float, default=0.0, help="mean lifetime of a worker (0: no kills)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-ckpt", action="store_true")
    p.add_argument("--max-failures", type=int, default=1000)
    a = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # The workers import ckpt_chaos from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    import ray
    from ray import tune

    out: dict = {"system": "ray", "ray": ray.__version__, "ckpt": not a.no_ckpt, "width": a.width}
    t = time.perf_counter()
    # A cluster of its own, whatever one runs on this machine (ray.init would join that one).
    ray.init(address="local", num_cpus=a.width, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    out["init_s"] = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="tk-ckptbench-ray-") as d:
        events = Path(d) / "events"
        config = {"epochs": a.epochs, "epoch_s": a.epoch_s, "work": a.work, "blob": a.blob, "ckpt": not a.no_ckpt,
                  "events": str(events)}
        tuner = tune.Tuner(
            trainable,
            param_space={**config, "key": tune.grid_search([f"t{i}" for i in range(a.trials)])},
            tune_config=tune.TuneConfig(max_concurrent_trials=a.width, reuse_actors=True),
            run_config=tune.RunConfig(
                storage_path=str(Path(d) / "storage"), name="ckpt", verbose=0,
                failure_config=tune.FailureConfig(max_failures=a.max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
            ),
        )
        killer = None
        if a.lifetime_s > 0:
            killer = Killer(events, a.lifetime_s, a.width, a.seed, host_of=lambda pid: pid, tree=False)
            killer.start()
        t = time.perf_counter()
        try:
            results = tuner.fit()
        finally:
            if killer is not None:
                killer.stop()
        out["wall_s"] = time.perf_counter() - t
        out["succeeded"] = sum(1 for r in results if r.error is None)
        kills = killer.kills if killer else []
        out["misses"] = killer.misses if killer else 0
        out.update(summarise(events, kills, a.trials, a.epochs))
    ray.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
