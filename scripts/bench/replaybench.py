"""Replay at scale: `trialkeeper replay` against an experiment of 10,000 recorded trials.

Builds, once per size (kept under the bench cache), an experiment store as a random search
over slowcurves.py's space would have left it: N trials, each with its curve's first
``--epochs`` results one (recorded) second apart, run ``--concurrency`` at a time. Then
times `trialkeeper replay` (the CLI's own code, in this process, its JSON output thrown
away: reading the store, drawing the curves, the search and the engine in virtual time) for
each search in SEARCHES, the median of ``--repeats``, in wall time and in this process's CPU
time (what a shared machine's load does not stretch). Prints one JSON object.

    python scripts/bench/replaybench.py [--trials 10000] [--epochs 10] [--repeats 3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from slowcurves import SPACE, curve  # beside this script

SEED = 0
# Each replayed search: the config keys that replace the recorded experiment's.
SEARCHES: dict[str, dict[str, Any]] = {
    "own search (random, seed 0)": {},
    "random, seed 1 (every trial the nearest)": {"tuner": {"name": "random", "classArgs": {"seed": 1}}},
    "random, seed 1 + median stop": {"tuner": {"name": "random", "classArgs": {"seed": 1}},
                                     "assessor": {"name": "median", "classArgs": {"start_step": 3}}},
}


def build(exp: Path, trials: int, epochs: int, concurrency: int) -> float:
    from trialkeeper.coordinator.config.experiment import config_to_dict, parse_config
    from trialkeeper.coordinator.engine.rows import MetricRun
    from trialkeeper.coordinator.search.tuners import RandomTuner
    from trialkeeper.coordinator.store.store import Store

    began = time.perf_counter()
    exp.mkdir(parents=True)
    config = parse_config({
        "searchSpace": SPACE, "trialCommand": "python train.py", "trialConcurrency": concurrency,
        "maxTrialNumber": trials, "tuner": {"name": "random", "classArgs": {"seed": SEED}},
        "trainingService": {"platform": "local"},
    }, exp)
    tuner = RandomTuner(SPACE, seed=SEED)
    store = Store.in_dir(exp)
    store.create_experiment("replaybench", "replay at scale", config_to_dict(config, redact=True))
    slots = [0.0] * concurrency
    runs: list[MetricRun] = []
    with store.transaction():
        for seq in range(trials):
            params = tuner.generate_parameters(seq)
            values = curve(params, SEED)[:epochs]
            slot = min(range(concurrency), key=lambda s: slots[s])
            start = 1_700_000_000.0 + slots[slot]
            slots[slot] += epochs + 0.1
            tid = f"t{seq:06d}"
            store.insert_trial({
                "id": tid, "seq": seq, "status": "SUCCEEDED", "parameters_json": json.dumps(params),
                "command": "python train.py", "gpu_number": 0, "environment_id": f"env-{slot}",
                "submitted_at": start, "started_at": start, "ended_at": start + epochs + 0.1, "ran_s": epochs + 0.1,
                "final_metric": values[-1], "reason": "",
            })
            runs.append(MetricRun(tid, "intermediate", 0, values, None, [start + 1 + i for i in range(epochs)]))
            runs.append(MetricRun(tid, "final", 0, (values[-1],), None, (start + epochs + 0.05,)))
        store.add_runs(runs)
    store.set_experiment_status("DONE", "", ended=True)
    store.close()
    return time.perf_counter() - began


def time_replay(exp: Path, other: dict[str, Any], work: Path) -> tuple[float, float, dict[str, Any]]:
    from trialkeeper.coordinator.cli.app import main

    argv = ["replay", str(exp), "--json"]
    if other:
        file = work / f"other-{abs(hash(json.dumps(other, sort_keys=True)))}.json"
        file.write_text(json.dumps(other))
        argv += ["--config", str(file)]
    out = io.StringIO()
    began, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    took, cpu = time.perf_counter() - began, time.process_time() - cpu
    if code != 0:
        raise SystemExit(f"replay {argv} exited {code}")
    return took, cpu, json.loads(out.getvalue())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10_000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "trialkeeper-bench" / "replay")
    args = p.parse_args()
    exp = args.cache / f"exp-{args.trials}x{args.epochs}c{args.concurrency}"
    built = None
    if not (exp / "trialkeeper.db").is_file():
        built = build(exp, args.trials, args.epochs, args.concurrency)
    figures: dict[str, Any] = {"trials": args.trials, "epochs": args.epochs, "concurrency": args.concurrency,
                               "build_s": built, "searches": {}}
    for name, other in SEARCHES.items():
        times, cpus, outcome = [], [], {}
        for _ in range(args.repeats):
            took, cpu, outcome = time_replay(exp, other, args.cache)
            times.append(took)
            cpus.append(cpu)
        figures["searches"][name] = {
            "median_s": statistics.median(times), "runs_s": times, "median_cpu_s": statistics.median(cpus),
            "replayed_trials": len(outcome["trials"]),
            "replay_only_s": outcome["wall_seconds"], "nearest": outcome["nearest"],
            "decisions": len(outcome["decisions"]), "virtual_s": outcome["virtual_seconds"], "gap": outcome["gap"],
        }
        print(f"{name}: {statistics.median(times):.2f} s ({statistics.median(cpus):.2f} s of CPU)", file=sys.stderr)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
