"""Search quality per wall time: how soon each way of searching finds a good model.

    python scripts/bench/searchbench.py [--seeds 3] [--trials 30] [--concurrency 2]
        [--nni-python PATH] [--json OUT]

The objective is digits_trial.py (an MLP trained epoch by epoch on scikit-learn's digits,
validation accuracy after every epoch). Every method gets the same trial budget and
concurrency, on this machine, one after the other, for each seed:

- ``random``: trialkeeper's random tuner;
- ``tpe``: trialkeeper with Optuna's TPE sampler;
- ``tpe+sha``: the same with Optuna's successive-halving pruner as assessor (SHA_ARGS);
- ``nni-tpe+median``: trialkeeper with NNI's TPE and Medianstop (in an interpreter with NNI);
- ``ray-optuna+asha``: Ray Tune with its OptunaSearch and ASHA scheduler.

Wall time counts from before the coordinator (or ``ray.init``) starts to the end of the
run; the best score at a moment is the best validation accuracy any trial had reported
by then. Each method runs in a process of its own; the last line of stdout is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import run_json_child
from peer_ray_mf import heard_callback

# Optuna's defaults (min_resource "auto", reduction factor 4) stop trials before the epochs
# that separate good configurations on this objective; see docs/benchmarks.md.
SHA_ARGS = {"min_resource": 3, "reduction_factor": 3}
METHODS = ("random", "tpe", "tpe+sha", "nni-tpe+median", "ray-optuna+asha")


def _curve(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(seconds, score) points -> the running best, one point per improvement."""
    out: list[tuple[float, float]] = []
    for t, score in sorted(points):
        if not out or score > out[-1][1]:
            out.append((round(t, 3), score))
    return out


def run_trialkeeper(method: str, seed: int, trials: int, concurrency: int) -> dict[str, Any]:
    from digits_trial import SPACE

    tuner: dict[str, Any] = {
        "random": {"name": "random", "classArgs": {"seed": seed}},
        "tpe": {"name": "optuna", "classArgs": {"sampler": "TPE", "seed": seed}},
        "tpe+sha": {"name": "optuna", "classArgs": {"sampler": "TPE", "seed": seed}},
        "nni-tpe+median": {"name": "TPE", "classArgs": {"optimize_mode": "maximize", "seed": seed}},
    }[method]
    assessor = {
        "tpe+sha": {"name": "optuna", "classArgs": {"pruner": "successive_halving", "pruner_args": SHA_ARGS}},
        "nni-tpe+median": {"name": "Medianstop", "classArgs": {"optimize_mode": "maximize", "start_step": 3}},
    }.get(method)
    with tempfile.TemporaryDirectory() as work:
        data: dict[str, Any] = {
            "trialCommand": f"{sys.executable} {HERE / 'digits_trial.py'}", "trialCodeDirectory": work,
            "trialConcurrency": concurrency, "maxTrialNumber": trials, "searchSpace": SPACE, "tuner": tuner,
            "trainingService": {"platform": "local"}, "experimentWorkingDirectory": work,
        }
        if assessor:
            data["assessor"] = assessor
        return {"method": method, "seed": seed, **run_config(data, Path(work))}


def run_config(data: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run the experiment config ``data`` (its directory under ``work``): whether it ended
    well, its wall time, its running best score over time, its trials and those stopped."""
    from trialkeeper.coordinator.config.experiment import parse_config
    from trialkeeper.coordinator.experiment import run_experiment
    from trialkeeper.coordinator.store.store import Store

    config = parse_config(data, work)
    t0 = time.time()
    result = asyncio.run(run_experiment(config))
    wall = time.time() - t0
    store = Store.in_dir(result.experiment_dir, readonly=True)
    try:
        points = [(m.reported_at - t0, m.value) for m in store.metrics()]
    finally:
        store.close()
    statuses = [t.status.value for t in result.trials]
    return {"ok": result.ok, "reason": result.reason, "wall_s": wall, "curve": _curve(points),
            "trials": len(statuses), "early_stopped": statuses.count("EARLY_STOPPED")}


def run_ray(seed: int, trials: int, concurrency: int) -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    t0 = time.time()
    import ray
    from digits_trial import EPOCHS, train
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    def trainable(config: dict[str, Any]) -> None:
        train(config, lambda _epoch, acc: tune.report({"score": acc, "wall": time.time()}))

    heard = heard_callback(tune)
    space = {
        "hidden": tune.quniform(16, 256, 16), "alpha": tune.loguniform(1e-6, 1e-1), "lr": tune.loguniform(1e-5, 1e-1),
        "batch_size": tune.choice([32, 64, 128, 256]), "activation": tune.choice(["relu", "tanh", "logistic"]),
    }
    ray.init(num_cpus=concurrency, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            trainable, param_space=space,
            tune_config=tune.TuneConfig(
                metric="score", mode="max", num_samples=trials, max_concurrent_trials=concurrency,
                search_alg=OptunaSearch(seed=seed), scheduler=ASHAScheduler(max_t=EPOCHS, grace_period=1),
            ),
            run_config=tune.RunConfig(storage_path=storage, name="digits", verbose=0, callbacks=[heard]),
        )
        results = tuner.fit()
        wall = time.time() - t0
    ray.shutdown()
    points = [(w - t0, s) for w, s, _ in heard.results]
    per_trial: dict[str, int] = {}
    for _, _, trial_id in heard.results:
        per_trial[trial_id] = per_trial.get(trial_id, 0) + 1
    stopped = sum(1 for n in per_trial.values() if n < EPOCHS)
    return {"method": "ray-optuna+asha", "seed": seed, "ok": True, "wall_s": wall, "curve": _curve(points),
            "trials": len(results), "early_stopped": stopped, "ray": ray.__version__}


def reach(curve: list[list[float]], target: float) -> float | None:
    """When the curve first reached ``target`` (None: never)."""
    return next((t for t, s in curve if s >= target - 1e-12), None)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method over seeds: final best, wall time, and when it reached Ray Tune's final best."""
    ray = {r["seed"]: r for r in runs if r["method"] == "ray-optuna+asha" and r.get("curve")}
    rows = []
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method and r.get("curve")]
        if not mine:
            continue
        fractions = []
        for r in mine:
            peer = ray.get(r["seed"])
            if peer:
                t = reach(r["curve"], peer["curve"][-1][1])
                fractions.append(None if t is None else t / peer["wall_s"])
        reached = [f for f in fractions if f is not None]
        rows.append({
            "method": method, "seeds": len(mine),
            "best": [r["curve"][-1][1] for r in mine], "wall_s": [r["wall_s"] for r in mine],
            "early_stopped": [r["early_stopped"] for r in mine],
            "to_ray_best_over_ray_wall": fractions,
            "median_to_ray_best": statistics.median(reached) if len(reached) == len(fractions) and reached else None,
        })
    return rows


def profiled(path: Path, run: Any) -> dict[str, Any]:
    """``run()`` under cProfile: its result plus the coordinator's CPU seconds (this process;
    the trials are processes of their own), with the top functions printed to stderr."""
    import cProfile
    import pstats

    cpu0 = time.process_time()
    profile = cProfile.Profile()
    out: dict[str, Any] = profile.runcall(run)
    out["coordinator_cpu_s"] = time.process_time() - cpu0
    profile.dump_stats(path)
    stats = pstats.Stats(str(path), stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(15)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--nni-python", default=os.environ.get("TRIALKEEPER_NNI_PYTHON", ""))
    ap.add_argument("--json", type=Path, default=Path("search-bench.json"))
    ap.add_argument(
        "--profile",
        type=Path,
        help="with --one (a trialkeeper method): profile the coordinator's process, "
        "print where its CPU time goes and write the pstats file here",
    )
    a = ap.parse_args()
    if a.one:
        if a.one == "ray-optuna+asha":
            out = run_ray(a.seed, a.trials, a.concurrency)
        elif a.profile:
            out = profiled(a.profile, lambda: run_trialkeeper(a.one, a.seed, a.trials, a.concurrency))
        else:
            out = run_trialkeeper(a.one, a.seed, a.trials, a.concurrency)
        print(json.dumps(out), flush=True)
        return 0
    runs = []
    for seed in range(a.seeds):
        for method in a.methods.split(","):
            python = a.nni_python if method.startswith("nni") else sys.executable
            if not python:
                runs.append({"method": method, "seed": seed, "error": "no interpreter with NNI: pass --nni-python"})
                continue
            argv = [
                python,
                __file__,
                "--one",
                method,
                "--seed",
                str(seed),
                "--trials",
                str(a.trials),
                "--concurrency",
                str(a.concurrency),
            ]
            r = run_json_child(argv, timeout_s=1800)
            runs.append({"method": method, "seed": seed, **r})
            r = runs[-1]
            best = r["curve"][-1][1] if r.get("curve") else None
            print(
                f"seed {seed} {method:16} wall {r.get('wall_s', 0):6.1f} s best {best} "
                f"stopped {r.get('early_stopped')} {r.get('error', '')[-300:]}",
                file=sys.stderr,
                flush=True,
            )
    table = summarize(runs)
    a.json.write_text(
        json.dumps({"trials": a.trials, "concurrency": a.concurrency, "runs": runs, "summary": table}, indent=1)
    )
    for row in table:
        to_ray = ", ".join("never" if f is None else f"{f:.2f}" for f in row["to_ray_best_over_ray_wall"])
        print(
            f"{row['method']:16} best {', '.join(f'{b:.4f}' for b in row['best'])}; "
            f"wall {', '.join(f'{w:.0f}' for w in row['wall_s'])} s; "
            f"stopped {row['early_stopped']}; reached Ray's best at {to_ray} of Ray's wall time",
            file=sys.stderr,
        )
    print(json.dumps({"trials": a.trials, "concurrency": a.concurrency, "seeds": a.seeds, "summary": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
