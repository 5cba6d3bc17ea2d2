"""The trivial-trial workload under NNI (local training service). Runs in the peer's own
virtualenv; prints one JSON line.

    <cache>/peers/nni/bin/python peer_nni.py --n 40 --width 2
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TRIAL = """
import nni
x = float(nni.get_next_parameter()["x"])
for i in range(3):
    nni.report_intermediate_result(x + i)
nni.report_final_result(x * 10.0)
"""


def grid_experiment(code: Path, workdir: Path, n: int, width: int) -> Any:
    """NNI's local training service running ``code/trial.py`` over x = 0..n-1, ``width`` at a time."""
    from nni.experiment import Experiment

    exp = Experiment("local")
    exp.config.trial_command = f"{sys.executable} trial.py"
    exp.config.trial_code_directory = str(code)
    exp.config.experiment_working_directory = str(workdir)
    exp.config.search_space = {"x": {"_type": "choice", "_value": list(range(n))}}
    exp.config.tuner.name = "GridSearch"
    exp.config.max_trial_number = n
    exp.config.trial_concurrency = width
    return exp


def wait_for_trials(exp: Any, n: int, timeout: float, interval: float = 0.2) -> int:
    """Poll NNI's experiment until ``n`` trials ended or ``timeout`` passed; how many ended."""
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        done = sum(
            1 for j in exp.list_trial_jobs() if j.status in ("SUCCEEDED", "FAILED", "USER_CANCELED", "SYS_CANCELED")
        )
        if done >= n:
            break
        time.sleep(interval)
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(exp: Any) -> None:
    """``exp.start`` on a free port, letting NNI's manager take up to 60 s to answer.

    NNI's launcher gives its manager 3 s to answer /check-status, then fails the start
    (``launcher._check_rest_server``, retry=3); a cold start on a fresh machine can take
    longer. The wait still counts in the start time the caller measures."""
    from nni.experiment import launcher

    check = launcher._check_rest_server
    launcher._check_rest_server = lambda port, retry=3, url_prefix=None: check(port, 60, url_prefix)
    try:
        exp.start(free_port())
    finally:
        launcher._check_rest_server = check


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--width", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args()
    import nni

    out: dict = {"n": a.n, "width": a.width, "nni": nni.__version__}
    with tempfile.TemporaryDirectory() as d:
        code = Path(d) / "code"
        code.mkdir()
        (code / "trial.py").write_text(TRIAL)
        exp = grid_experiment(code, Path(d) / "exp", a.n, a.width)
        t0 = time.perf_counter()
        start(exp)
        out["start_s"] = time.perf_counter() - t0
        try:
            done = wait_for_trials(exp, a.n, a.timeout)
            out["wall_s"] = time.perf_counter() - t0 - out["start_s"]
            out["ok"] = sum(1 for j in exp.list_trial_jobs() if j.status == "SUCCEEDED")
            out["completed"] = done
        finally:
            exp.stop()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
