"""Helpers shared by the benchmark stages: statistics, child processes with deadlines,
sampling a process's CPU and memory."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable


def summary(values: Sequence[float]) -> dict[str, float] | None:
    """min / median / max of a list of repeats (None when empty)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (nearest rank on a sorted copy)."""
    vals = sorted(values)
    if not vals:
        return None
    k = max(0, min(len(vals) - 1, round(p / 100.0 * (len(vals) - 1))))
    return vals[k]


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a child started with start_new_session=True and everything in its group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
    except psutil.Error:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def run_json_child(
    argv: list[str], timeout_s: float, env: dict[str, str] | None = None, sample: bool = False
) -> dict[str, Any]:
    """Run a child that prints one JSON object as its last stdout line; kill it (and its
    process group) past ``timeout_s``. Returns the object, or {"error": ...}. With
    ``sample``, the child's peak RSS is added as ``peak_rss_mib``."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env, cwd=str(HERE)
    )
    sampler = Sampler(proc.pid).start() if sample else None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return {"error": f"did not finish in {timeout_s:.0f} s", "stderr_tail": err.decode(errors="replace")[-800:]}
    finally:
        # A stage that ended cleanly has left nothing; one that died may have.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if sampler is not None:
        sampler.stop()
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}", "stderr_tail": err.decode(errors="replace")[-1500:]}
    try:
        result = json.loads(lines[-1])
        if sampler is not None and isinstance(result, dict):
            result["peak_rss_mib"] = sampler.peak_rss / 2**20
        return result
    except ValueError:
        return {
            "error": "no JSON result",
            "stdout_tail": "\n".join(lines[-5:]),
            "stderr_tail": err.decode(errors="replace")[-800:],
        }


class Sampler:
    """Samples one process's RSS (and CPU time) in a thread; ``peak_rss`` and ``cpu_s``."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.proc = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_rss = 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._cpu0 = self._cpu()

    def _cpu(self) -> float:
        try:
            t = self.proc.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def rss(self) -> int:
        try:
            return self.proc.memory_info().rss
        except psutil.Error:
            return 0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            r = self.rss()
            self.samples.append((time.monotonic(), r))
            self.peak_rss = max(self.peak_rss, r)

    def start(self) -> Sampler:
        self._cpu0 = self._cpu()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    @property
    def cpu_s(self) -> float:
        return self._cpu() - self._cpu0


def mib(n: float) -> float:
    return n / (1024 * 1024)


def read_times(path: Path) -> dict[str, tuple[float, float]]:
    """What trials appended to a times file: id -> (first line, last line), as epoch seconds."""
    out: dict[str, tuple[float, float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                out[parts[0]] = (float(parts[1]), float(parts[2]))
    return out
