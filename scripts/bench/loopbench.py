"""The experiment loop as an experiment grows: trials per second, early and late.

    python scripts/bench/loopbench.py [--trials 2000] [--concurrency 4] [--windows 4] [--progress]

Runs one experiment, as ``trialkeeper run`` does (``run_experiment``): the random tuner,
trivial_trial.py (three intermediate results and a final one), a local agent running
``--concurrency`` trials at a time, until ``--trials`` have ended. Every trial's end is
timed as the coordinator hears it. Printed: the trials per second in each of ``--windows``
equal shares of the trials, in order, and the ratio of the last to the first: a loop whose
work per event grows with the number of trials slows down as the experiment goes on
(ratio well below 1); one whose work does not keeps its pace (about 1). Also the
coordinator process's CPU seconds per trial. ``--progress`` also asks for the live progress
every half second, as ``trialkeeper run`` does for its table. The last line of stdout is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from stages import PY, TRIVIAL, make_config, workdir
from trialkeeper.coordinator.experiment import run_experiment


async def _run(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    config = make_config(
        d,
        trialCommand=f"{PY} {TRIVIAL}",
        trialConcurrency=a.concurrency,
        maxTrialNumber=a.trials,
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}},
        tuner={"name": "random", "classArgs": {"seed": 0}},
    )
    ends: list[float] = []

    def on_start(c: Any) -> None:
        c.on_status(lambda e: ends.append(time.monotonic()) if e.trial.status.terminal else None)

    me = psutil.Process()
    cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
    lines = [0]

    def on_progress(p: Any) -> None:
        lines[0] += 1

    result = await run_experiment(config, experiment_dir=d / "exp", on_start=on_start,
                                  on_progress=on_progress if a.progress else None, progress_interval_s=0.5)
    wall, cpu = time.monotonic() - t0, sum(me.cpu_times()[:2]) - cpu0
    if not result.ok or len(ends) != a.trials:
        raise SystemExit(f"the experiment did not end well: {result.reason!r}, {len(ends)} of {a.trials} trials ended")
    size = a.trials // a.windows
    rates = []
    for w in range(a.windows):
        chunk = ends[w * size : (w + 1) * size]
        rates.append((len(chunk) - 1) / (chunk[-1] - chunk[0]))
    return {"trials": a.trials, "concurrency": a.concurrency, "progress_lines": lines[0], "wall_s": wall,
            "coordinator_cpu_s": cpu,
            "coordinator_cpu_ms_per_trial": 1000 * cpu / a.trials, "trials_per_s_by_window": rates,
            "last_over_first": rates[-1] / rates[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--progress", action="store_true", help="ask for the live progress every 0.5 s")
    a = ap.parse_args()
    if a.trials < 2 * a.windows or a.windows < 2:
        ap.error("--windows must be at least 2, and --trials at least twice --windows")
    with workdir() as d:
        out = asyncio.run(_run(a, d))
    rates = " ".join(f"{r:.1f}" for r in out["trials_per_s_by_window"])
    print(f"{out['trials']} trials, {out['concurrency']} at a time: {out['wall_s']:.1f} s; trials/s by "
          f"window: {rates} (last/first {out['last_over_first']:.2f}); coordinator CPU "
          f"{out['coordinator_cpu_ms_per_trial']:.1f} ms per trial")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
