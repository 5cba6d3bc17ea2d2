"""Warm trial starts: submit -> the first line of a trial's own code after its imports,
cold and forked from a template that preloaded them (``trialPreload``).

    python warmbench.py --trial sklearn [--starts 10]
    NNI_PY warmbench.py --trial nni [--starts 10]      # an interpreter with nni and trialkeeper

Prints one JSON line. One local agent, one trial at a time on an idle agent; the first
trial of each side is a warm-up (the agent started, the template built) and is not counted.
Floor: ``Popen`` of the same trial until the same line (interpreter start and the imports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus

TRIALS = {
    "sklearn": ("import numpy\nimport sklearn\nimport sklearn.svm\n", ["numpy", "sklearn", "sklearn.svm"]),
    "nni": ("import nni\n", ["nni"]),
}
# The trial's own first line after its imports: when it ran, appended to $BENCH_TIMES.
FIRST_LINE = 'import os, time\nopen(os.environ["BENCH_TIMES"], "a").write(f"{time.time()}\\n")\n'


def _times(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


async def _starts(d: Path, preload: list[str], starts: int) -> list[float]:
    times = d / f"times-{bool(preload)}.txt"
    config = parse_config({
        "trialCommand": f"{sys.executable} trial.py", "trialConcurrency": 1,
        "trainingService": {"platform": "local"}, "trialCodeDirectory": str(d),
        "experimentWorkingDirectory": str(d / "experiments"), "trialPreload": preload,
        "trialEnv": {"BENCH_TIMES": str(times)},
    }, d)
    found = []
    async with Coordinator(config, experiment_dir=d / f"exp-{bool(preload)}") as c:
        for i in range(starts + 1):
            before = len(_times(times))
            submitted = time.time()
            info = await (await c.submit({"i": i})).wait(120.0)
            if info.status is not TrialStatus.SUCCEEDED:
                raise RuntimeError(f"trial failed: {info.reason} {info.stderr_tail}")
            seen = _times(times)
            if len(seen) != before + 1:
                raise RuntimeError("the trial did not write its start time")
            if i:  # the first one starts the agent (and builds the template)
                found.append(seen[-1] - submitted)
    return found


def _floor(d: Path, starts: int) -> list[float]:
    times = d / "times-floor.txt"
    env = {**os.environ, "BENCH_TIMES": str(times)}
    found = []
    for _ in range(starts):
        t = time.time()
        subprocess.run([sys.executable, str(d / "trial.py")], env=env, check=True, timeout=120)
        found.append(_times(times)[-1] - t)
    return found


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trial", choices=sorted(TRIALS), default="sklearn")
    ap.add_argument("--starts", type=int, default=10)
    a = ap.parse_args()
    imports, preload = TRIALS[a.trial]
    with tempfile.TemporaryDirectory(prefix="tk-warm-") as tmp:
        d = Path(tmp)
        (d / "trial.py").write_text(imports + FIRST_LINE)
        floor = _floor(d, a.starts)
        cold = asyncio.run(_starts(d, [], a.starts))
        warm = asyncio.run(_starts(d, preload, a.starts))
    result: dict[str, Any] = {
        "trial": a.trial, "preload": preload, "python": sys.executable,
        "floor_s": summary(floor), "cold_s": summary(cold), "warm_s": summary(warm),
        "cold_over_warm": statistics.median(cold) / statistics.median(warm),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
