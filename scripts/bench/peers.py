"""The same trivial-trial workload under Ray Tune and NNI, each in its own virtualenv.

``setup()`` creates ``<cache>/ray`` and ``<cache>/nni`` with pip (bounded time; a marker
file makes it idempotent); ``run_peer()`` runs one workload in that virtualenv and returns
its figures, or a line saying why it could not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import kill_group, run_json_child

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = Path(os.environ.get("TRIALKEEPER_BENCH_CACHE", Path.home() / ".cache" / "trialkeeper-bench"))

PEERS = {
    # name: pip requirements
    # OptunaSearch and TuneBOHB (mfbench.py's Ray Tune side) need optuna, hpbandster and ConfigSpace.
    "ray": ["ray[tune]==2.60.0", "optuna==4.9.0", "hpbandster==0.7.4", "ConfigSpace==1.2.2"],
    "nni": ["nni==3.0", "setuptools<70"],
}


def venv_python(cache: Path, name: str) -> Path:
    return cache / "peers" / name / "bin" / "python"


def setup(cache: Path = DEFAULT_CACHE, timeout_s: float = 420.0, log=print) -> dict[str, str]:
    """Install each peer into its own virtualenv. Returns {name: "" or why it failed}."""
    status: dict[str, str] = {}
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for name, reqs in PEERS.items():
        venv = cache / "peers" / name
        marker = venv / ".installed"
        if marker.exists():
            status[name] = ""
            continue
        venv.parent.mkdir(parents=True, exist_ok=True)
        logf = cache / "peers" / f"{name}-install.log"
        script = (
            f"set -e; rm -rf '{venv}'; '{sys.executable}' -m venv '{venv}'; "
            f"'{venv}/bin/python' -m pip install -q --disable-pip-version-check "
            + " ".join(f"'{r}'" for r in reqs)
            + f" && touch '{marker}'"
        )
        log(f"peers: installing {name} ({' '.join(reqs)}) into {venv}; log {logf}")
        with open(logf, "wb") as out:
            procs[name] = (
                subprocess.Popen(["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT, start_new_session=True),
                logf,
            )
    deadline = time.monotonic() + timeout_s
    for name, (proc, logf) in procs.items():
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            status[name] = f"pip install did not finish in {timeout_s:.0f} s"
            continue
        if proc.returncode != 0:
            tail = logf.read_text(errors="replace").strip().splitlines()[-3:]
            status[name] = f"pip install failed ({proc.returncode}): {' | '.join(tail)}"
        else:
            status[name] = ""
    return status


def run_peer(name: str, n: int, width: int, cache: Path = DEFAULT_CACHE, timeout_s: float = 300.0) -> dict:
    """One run of ``n`` trivial trials, ``width`` at a time, under peer ``name``."""
    py = venv_python(cache, name)
    if not py.exists():
        return {"error": f"{name} is not installed under {py.parent.parent}"}
    script = HERE / f"peer_{name}.py"
    return run_json_child([str(py), str(script), "--n", str(n), "--width", str(width)], timeout_s)


if __name__ == "__main__":
    print(json.dumps(setup(), indent=1))
