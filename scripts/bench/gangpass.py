"""The gang scheduler's pass beside the one-node pass: 10,000 waiting trials of mixed sizes
(1, 2, 4 and 8 nodes) on 1,000 environments, half of them busy, against 10,000 one-node
trials on the same fleet. Prints one line per pass (the median of --runs).

Usage: python scripts/bench/gangpass.py [--runs 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from trialkeeper.coordinator.engine.gangs import place_gangs
from trialkeeper.coordinator.engine.scheduler import EnvCapacity, place_waiting
from trialkeeper.coordinator.engine.waiting import Demand, WaitingTrials


def fleet() -> dict[str, EnvCapacity]:
    return {f"e{i}": EnvCapacity(f"e{i}", 1, holders={f"busy{i}"} if i % 2 else set(), platform="p")
            for i in range(1000)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    runs = ap.parse_args().runs
    rng = random.Random(1)
    sizes = [rng.choice((1, 1, 2, 4, 8)) for _ in range(10_000)]
    gangs = [(i, Demand(f"t{i}", nodes=n, platforms=("p",))) for i, n in enumerate(sizes) if n > 1]
    gang_s, one_s = [], []
    for _ in range(runs):
        envs = fleet()
        t = time.perf_counter()
        placed = place_gangs(gangs, envs).placements
        gang_s.append(time.perf_counter() - t)
        queue = WaitingTrials()
        for i in range(10_000):
            queue.append(Demand(f"s{i}", platforms=("p",)))
        envs = fleet()
        t = time.perf_counter()
        ones = place_waiting(queue, envs).placements
        one_s.append(time.perf_counter() - t)
    print(f"gang pass: {len(gangs)} waiting gangs of 2-8 nodes (of 10,000 trials), 1,000 environments: "
          f"{len(placed)} placed, {statistics.median(gang_s) * 1000:.0f} ms")
    print(f"one-node pass: 10,000 waiting, 1,000 environments: {len(ones)} placed, "
          f"{statistics.median(one_s) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
