"""The checkpoint benchmark's workload and chaos, shared by trialkeeper's trials and Ray
Tune's workers (standard library only: it runs in both systems' interpreters).

- ``work``: one epoch, a fixed sleep or a fixed CPU cost (CPU time of the calling thread);
- ``note``: a run of a trial appends what it does to an events file, one line each:
  ``<kind> <trial key> <pid> <epoch> <time>``, kind being ``run`` (a run began, epoch = the
  step it continues from, -1 on a fresh start), ``start``/``done`` (an epoch computed; a
  ``done`` is written before the checkpoint is saved), ``end`` (all epochs done);
- ``Killer``: a Poisson process of kills (kill -9) aimed at the runs alive at that moment;
- ``summarise``: what the events and kills say was computed, lost and recomputed.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def work(seconds: float, kind: str) -> None:
    """One epoch: ``sleep`` waits, ``cpu`` spins until this thread has used ``seconds`` of CPU."""
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for _ in range(2000):
            x += 1


def note(path: str, kind: str, key: str, epoch: int = -1) -> None:
    """Append one event line (one write on an O_APPEND file: whole even with many writers)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{kind} {key} {os.getpid()} {epoch} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


@dataclass
class Run:
    """One run of a trial: a process that began it (fresh or continued) until it ended or died."""

    key: str
    pid: int
    resumed: int
    began: float
    starts: dict[int, float] = field(default_factory=dict)
    dones: dict[int, float] = field(default_factory=dict)
    ended: bool = False


def read_runs(path: Path) -> dict[int, Run]:
    runs: dict[int, Run] = {}
    if not path.exists():
        return runs
    older = 0
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 5:
            continue
        kind, key, pid_s, epoch_s, t_s = parts
        pid, epoch, t = int(pid_s), int(epoch_s), float(t_s)
        if kind == "run" or pid not in runs:
            # Ray may run a continued trial in the same worker process: a new "run" line
            # starts a new run; the old one is kept under a key of its own.
            if pid in runs:
                older -= 1
                runs[older] = runs.pop(pid)
            runs[pid] = Run(key, pid, epoch if kind == "run" else -1, t)
        r = runs[pid]
        if kind == "start":
            r.starts[epoch] = t
        elif kind == "done":
            r.dones[epoch] = t
        elif kind == "end":
            r.ended = True
    return runs


def alive(pid: int) -> bool:
    """The process runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = parent_of(int(name))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def ancestor_below(pid: int, top: int) -> int | None:
    """The ancestor of ``pid`` (or ``pid`` itself) whose parent is ``top``."""
    seen = 0
    while pid > 1 and seen < 64:
        ppid = parent_of(pid)
        if ppid == top:
            return pid
        if ppid is None:
            return None
        pid, seen = ppid, seen + 1
    return None


class Killer(threading.Thread):
    """Kills at the times of a Poisson process: each of ``slots`` environments lives an
    exponential time of mean ``mean_lifetime_s``, so kills come at the rate slots / mean.
    Each kill picks one of the slots (at random, seeded); when a run is alive in it, it
    kill -9s that run's host (``host_of(pid)``: the process that stands for the environment),
    with ``tree`` everything below the host as well; else the kill is a miss. So each
    running trial dies at the rate 1 / mean, however many others run."""

    def __init__(self, events: Path, mean_lifetime_s: float, slots: int, seed: int,
                 host_of: Callable[[int], int | None], tree: bool) -> None:
        super().__init__(daemon=True)
        self.events, self.slots, self.rate = events, slots, slots / mean_lifetime_s
        self.rng = random.Random(seed)
        self.host_of, self.tree = host_of, tree
        self.kills: list[dict[str, Any]] = []
        self.misses = 0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)

    def run(self) -> None:
        due = time.monotonic() + self.rng.expovariate(self.rate)
        while not self._stop_event.wait(max(0.0, due - time.monotonic())):
            due += self.rng.expovariate(self.rate)
            live = sorted((r.pid, r.key) for r in read_runs(self.events).values() if not r.ended and alive(r.pid))
            # The environment that dies is one of the slots: a slot with no run alive in it
            # (its trial not started yet, or none left) loses nothing.
            slot = self.rng.randrange(self.slots)
            if slot >= len(live):
                self.misses += 1
                continue
            pid, key = live[slot]
            host = self.host_of(pid)
            if host is None:
                self.misses += 1
                continue
            below = descendants(host) if self.tree else []
            t = time.time()
            for victim in (host, *below):
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.kills.append({"t": t, "key": key, "pid": pid, "host": host, "also": len(below)})


def summarise(events: Path, kills: list[dict[str, Any]], trials: int, epochs: int) -> dict[str, Any]:
    """Epochs computed against epochs needed, the compute each loss cost (epochs done again,
    plus the part of the epoch under way when it died), and how long a killed trial took to
    run again (kill -> its next run's first line)."""
    runs = list(read_runs(events).values())
    needed = trials * epochs
    done = sum(len(r.dones) for r in runs)
    durations = [r.dones[e] - r.starts[e] for r in runs for e in r.dones if e in r.starts]
    epoch_wall = statistics.median(durations) if durations else 0.0
    partial = 0.0
    back: list[float] = []
    for k in kills:
        # The run the kill hit: the last one in that process begun before it.
        hit = [x for x in runs if x.pid == k["pid"] and x.began <= k["t"]]
        r = max(hit, key=lambda x: x.began) if hit else None
        if r is not None:
            open_epochs = [t for e, t in r.starts.items() if e not in r.dones and t <= k["t"]]
            if open_epochs and epoch_wall > 0:
                partial += min(1.0, (k["t"] - max(open_epochs)) / epoch_wall)
        later = [x.began for x in runs if x.key == k["key"] and x.began > k["t"]]
        if later:
            back.append(min(later) - k["t"])
    finished = {r.key for r in runs if r.ended}
    recomputed = done - needed
    lost = recomputed + partial
    return {
        "trials": trials, "epochs": epochs, "epochs_needed": needed, "epochs_computed": done,
        "epochs_recomputed": recomputed, "partial_epochs_lost": partial, "losses": len(kills),
        "runs": len(runs), "trials_finished": len(finished), "epoch_wall_s": epoch_wall,
        "computed_over_needed": done / needed if needed else None,
        "lost_epochs_per_loss": lost / len(kills) if kills else None,
        "kill_to_next_run_s": back,
    }
