"""The multi-fidelity benchmark's workload under Ray Tune (mfbench.py), in the peer's own
virtualenv: OptunaSearch + ASHA, TuneBOHB + HyperBandForBOHB, or PBT, on slowcurves.py's
curves with the same epochs, sleep, configurations and concurrency. Prints one JSON line.

    <cache>/peers/ray/bin/python peer_ray_mf.py --method ray-optuna+asha --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slowcurves import EPOCHS, FAMILIES, curve  # beside this script


def heard_callback(tune: Any) -> Any:
    """A Ray Tune callback that keeps every result as the driver hears it (the CSV loggers
    are off): ``results``, (the trial's ``wall`` clock, its ``score``, its id) each, and
    ``worths``, the ``worth`` it reported with them (None where it reported none)."""

    class Heard(tune.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.results: list[tuple[float, float, str]] = []
            self.worths: list[float | None] = []

        def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: dict[str, Any], **info: Any) -> None:
            self.results.append((result["wall"], result["score"], trial.trial_id))
            self.worths.append(result.get("worth"))

    return Heard()


def picks(reports: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """(seconds, score, worth) reports, in time order -> the search's pick over time: the
    report with the best score so far, one point per new pick, with what its configuration
    is worth at that epoch without the noise."""
    out: list[tuple[float, float, float]] = []
    for t, score, worth in reports:
        if not out or score > out[-1][1]:
            out.append((round(t, 3), score, worth))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", required=True, choices=("ray-optuna+asha", "ray-bohb", "ray-pbt"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=FAMILIES, default=FAMILIES[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--epoch-s", type=float, default=0.04)
    p.add_argument("--population", type=int, default=8)
    a = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    t0 = time.time()
    import ray
    from ray import tune

    seed, family, epoch_s, checkpoints = a.seed, a.family, a.epoch_s, a.method != "ray-optuna+asha"

    def trainable(config: dict[str, Any]) -> None:
        start = 0
        ckpt = tune.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                start = json.loads((Path(d) / "state.json").read_text())["epoch"]
        params = {"lr": float(config["lr"]), "momentum": float(config["momentum"]), "width": int(config["width"]),
                  "arch": str(config["arch"])}  # (BOHB's are numpy's numbers)
        values, worth = curve(params, seed, family), curve(params, seed, family, noise=False)
        for epoch in range(start, EPOCHS):
            time.sleep(epoch_s)
            metrics = {"score": values[epoch], "wall": time.time(), "epoch": epoch + 1, "worth": worth[epoch]}
            if checkpoints:
                with tempfile.TemporaryDirectory() as d:
                    (Path(d) / "state.json").write_text(json.dumps({"epoch": epoch + 1}))
                    tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
            else:
                tune.report(metrics)

    heard = heard_callback(tune)
    space = {"lr": tune.loguniform(1e-4, 1.0), "momentum": tune.uniform(0.0, 0.99),
             "width": tune.choice([64, 128, 256, 512]), "arch": tune.choice(["mlp", "cnn", "res"])}
    samples = a.trials
    if a.method == "ray-optuna+asha":
        from ray.tune.schedulers import ASHAScheduler
        from ray.tune.search.optuna import OptunaSearch

        search: Any = OptunaSearch(seed=seed)
        scheduler: Any = ASHAScheduler(time_attr="training_iteration", max_t=EPOCHS, grace_period=1,
                                       reduction_factor=3)
    elif a.method == "ray-bohb":
        from ray.tune.schedulers import HyperBandForBOHB
        from ray.tune.search.bohb import TuneBOHB

        search = TuneBOHB(seed=seed)
        scheduler = HyperBandForBOHB(time_attr="training_iteration", max_t=EPOCHS, reduction_factor=3)
    else:
        from ray.tune.schedulers import PopulationBasedTraining
        from ray.tune.search.basic_variant import BasicVariantGenerator

        search = BasicVariantGenerator(random_state=seed)
        scheduler = PopulationBasedTraining(
            time_attr="training_iteration", perturbation_interval=3,
            hyperparam_mutations={"lr": tune.loguniform(1e-4, 1.0), "momentum": tune.uniform(0.0, 0.99),
                                  "width": [64, 128, 256, 512], "arch": ["mlp", "cnn", "res"]},
        )
        samples = a.population
    ray.init(num_cpus=a.concurrency, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            trainable, param_space=space,
            tune_config=tune.TuneConfig(metric="score", mode="max", num_samples=samples,
                                        max_concurrent_trials=a.concurrency, search_alg=search, scheduler=scheduler),
            run_config=tune.RunConfig(storage_path=storage, name="slowcurves", verbose=0, callbacks=[heard],
                                      stop={"training_iteration": EPOCHS}),
        )
        results = tuner.fit()
        wall = time.time() - t0
    ray.shutdown()
    points = sorted((w - t0, s) for w, s, _ in heard.results)
    best: list[tuple[float, float]] = []
    for t, s in points:
        if not best or s > best[-1][1]:
            best.append((round(t, 3), s))
    reports = sorted((w - t0, s, worth) for (w, s, _), worth in zip(heard.results, heard.worths))
    per_trial: dict[str, int] = {}
    for _, _, trial_id in heard.results:
        per_trial[trial_id] = per_trial.get(trial_id, 0) + 1
    print(json.dumps({"method": a.method, "seed": seed, "family": family, "ok": True, "wall_s": wall, "curve": best,
                      "picks": picks(reports),
                      "trials": len(results), "early_stopped": sum(1 for n in per_trial.values() if n < EPOCHS),
                      "ray": ray.__version__}), flush=True)


if __name__ == "__main__":
    main()
