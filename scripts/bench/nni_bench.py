"""An unmodified NNI trial under trialkeeper and under NNI's own local training service.

    python nni_bench.py trialkeeper --nni-python PY [--n 40 --width 2 --starts 5]
    PY nni_bench.py nni [--n 40 --width 2]         # run by NNI's own interpreter

Each prints one JSON line. The trial (`NNI_TRIAL`) does what NNI's examples do, with NNI's
API only: `import nni`, get the parameters, report three intermediate results and a final
one. It appends "<trial id> <time of its first line after import nni> <time at exit>" to
$BENCH_TIMES (NNI passes it on too), which is where both sides' start is read from.

Start: trialkeeper, a trial submitted to an idle, warm agent until its first line after
`import nni` (one at a time, `--starts` times, each beside a floor run); NNI, the
`startTime` NNI records for each trial until that line. Floor: `Popen` of the trial until
the same line (what `import nni` costs). Wall: `n` trials, `width` at a time, from the first
submit (NNI: `Experiment.start` returning) to the last trial ended. Floor: the same trials run
by hand (NNI's standalone mode) by a plain pool of `width`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import read_times
from peer_nni import grid_experiment, start, wait_for_trials

NNI_TRIAL = """
import nni
import os, time
_t0 = time.time()
params = nni.get_next_parameter()
x = float(params["x"])
for i in range(3):
    nni.report_intermediate_result(x + i)
nni.report_final_result(x * 10.0)
_fd = os.open(os.environ["BENCH_TIMES"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(_fd, f"{nni.get_trial_id()} {_t0:.6f} {time.time():.6f}\\n".encode())
os.close(_fd)
"""


def _standalone(python: str, code: Path, times: Path) -> None:
    """The trial run by hand: NNI's standalone mode (no NNI_PLATFORM), x = 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNI_")} | {"BENCH_TIMES": str(times)}
    subprocess.run(
        [python, "-c", NNI_TRIAL.replace('params["x"]', "params.get('x', 1)")],
        cwd=code,
        env=env,
        check=True,
        timeout=60,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _floor(python: str, code: Path, times: Path, repeats: int) -> list[float]:
    """Popen of the trial until its first line after import nni."""
    out = []
    for _ in range(repeats):
        times.unlink(missing_ok=True)
        t = time.time()
        _standalone(python, code, times)
        out.append(next(iter(read_times(times).values()))[0] - t)
    return out


def _floor_wall(python: str, code: Path, times: Path, n: int, width: int) -> float:
    """``n`` runs of the trial by a plain pool of ``width`` threads, each waiting on a Popen."""
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(width) as pool:
        list(pool.map(lambda _: _standalone(python, code, times), range(n)))
    return time.perf_counter() - t


async def _trialkeeper(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    from trialkeeper.coordinator.config.experiment import parse_config
    from trialkeeper.coordinator.core import Coordinator
    from trialkeeper.coordinator.engine.states import TrialStatus

    code = d / "code"
    code.mkdir()
    (code / "trial.py").write_text(NNI_TRIAL)
    times = d / "times"
    # An NNI-style config, as `trialkeeper run` would read it.
    config = parse_config(
        {
            "trialCommand": f"{a.nni_python} trial.py",
            "trialCodeDirectory": str(code),
            "trialConcurrency": a.width,
            "experimentWorkingDirectory": str(d / "experiments"),
            "trialEnv": {"BENCH_TIMES": str(times)},
            "trainingService": {"platform": "local", "reuseMode": True},
        },
        d,
    )
    # The floors are taken in turn with the figures: this machine's load drifts over a run.
    out: dict[str, Any] = {"n": a.n, "width": a.width, "floor_start_s": [],
                           "floor_wall_s": [_floor_wall(a.nni_python, code, d / "floor", a.n, a.width)]}
    async with Coordinator(config, experiment_dir=d / "exp") as c:
        # Warm: the agents are up, and the interpreter's files are in the page cache.
        warm = await c.submit({"x": -1})
        assert (await warm.wait(120)).status is TrialStatus.SUCCEEDED
        starts = []
        for i in range(a.starts):
            out["floor_start_s"] += _floor(a.nni_python, code, d / "floor", 1)
            times.unlink(missing_ok=True)
            t = time.time()
            h = await c.submit({"x": i})
            info = await h.wait(120)
            assert info.status is TrialStatus.SUCCEEDED, info.reason
            starts.append(read_times(times)[h.id][0] - t)
        out["start_s"] = starts
        times.unlink(missing_ok=True)
        t = time.perf_counter()
        handles = [await c.submit({"x": i}) for i in range(a.n)]
        infos = [await h.wait(600) for h in handles]
        out["wall_s"] = time.perf_counter() - t
        out["ok"] = sum(1 for i in infos if i.status is TrialStatus.SUCCEEDED)
        assert c.store is not None
        out["metrics_stored"] = sum(len(c.store.metrics(h.id)) for h in handles)
    out["floor_wall_s"].append(_floor_wall(a.nni_python, code, d / "floor", a.n, a.width))
    return out


def _nni(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    import nni

    code = d / "code"
    code.mkdir()
    (code / "trial.py").write_text(NNI_TRIAL)
    times = d / "times"
    # The floor is taken half before and half after the run: this machine's load changes.
    out: dict[str, Any] = {"n": a.n, "width": a.width, "nni": nni.__version__,
                           "floor_start_s": _floor(sys.executable, code, d / "floor", (a.starts + 1) // 2)}
    os.environ["BENCH_TIMES"] = str(times)  # NNI's trials inherit the manager's environment
    exp = grid_experiment(code, d / "exp", a.n, a.width)
    t0 = time.perf_counter()
    start(exp)
    out["manager_start_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    try:
        wait_for_trials(exp, a.n, a.timeout, interval=0.05)
        out["wall_s"] = time.perf_counter() - t
        jobs = exp.list_trial_jobs()
        out["ok"] = sum(1 for j in jobs if j.status == "SUCCEEDED")
        seen = read_times(times)
        out["start_s"] = [
            seen[j.trialJobId][0] - j.startTime / 1000 for j in jobs if j.trialJobId in seen and j.startTime
        ]
    finally:
        exp.stop()
    out["floor_start_s"] += _floor(sys.executable, code, d / "floor", a.starts // 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=["trialkeeper", "nni"])
    p.add_argument("--nni-python", default=os.environ.get("TRIALKEEPER_NNI_PYTHON", ""))
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--width", type=int, default=2)
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tk-bench-nni-") as d:
        if a.side == "nni":
            result = _nni(a, Path(d))
        else:
            if not a.nni_python:
                sys.exit("--nni-python (or TRIALKEEPER_NNI_PYTHON) must name an interpreter with nni installed")
            result = asyncio.run(_trialkeeper(a, Path(d)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
