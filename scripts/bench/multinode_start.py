"""How long a multi-node trial takes to start on warm agents, against one-node trials.

    python scripts/bench/multinode_start.py [--rounds 10]

Four local agents, registered and idle (warm). Each round, in turn:
- a 2-node trial, and 2 one-node trials submitted together;
- a 4-node trial, and 4 one-node trials submitted together.
The figure of a multi-node trial is submit -> every rank's first line (the last of its ranks'
first lines), the baseline's the slowest of the one-node trials' submit -> first line in the
same round. The first line is the trial's own ``time.time()`` printed as it starts, read
from its log. Medians over the rounds, and their ratio (target: at most 1.2).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trialkeeper.coordinator.config import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus

FIRST_LINE = "import time\nprint(f'first {time.time()!r}', flush=True)\n"


def _first_line(exp: Path, trial_id: str, rank: int) -> float:
    log = exp / "trials" / trial_id / (f"rank{rank}" if rank else "") / "stdout.log"
    line = next(ln for ln in log.read_text().splitlines() if ln.startswith("first "))
    return float(line.split()[1])


async def _round(c: Coordinator, exp: Path, nodes: int) -> tuple[float, float]:
    submitted = time.time()
    gang = await c.submit({}, nodes=nodes)
    info = await gang.wait(60)
    assert info.status is TrialStatus.SUCCEEDED, info.reason
    gang_s = max(_first_line(exp, gang.id, r) for r in range(nodes)) - submitted
    submitted = time.time()
    singles = [await c.submit({}) for _ in range(nodes)]
    for s in singles:
        assert (await s.wait(60)).status is TrialStatus.SUCCEEDED
    single_s = max(_first_line(exp, s.id, 0) for s in singles) - submitted
    return gang_s, single_s


async def _main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tk-mnbench-") as tmp:
        d = Path(tmp)
        (d / "trial.py").write_text(FIRST_LINE)
        config = parse_config({
            "trialCommand": f"{sys.executable} trial.py", "trialConcurrency": 4, "trialCodeDirectory": str(d),
            "experimentWorkingDirectory": str(d / "experiments"),
            "trainingService": {"platform": "local", "environmentCount": 4},
        }, d)
        exp = d / "exp"
        async with Coordinator(config, experiment_dir=exp) as c:
            warm = [await c.submit({}) for _ in range(4)]  # every agent up and warm
            for w in warm:
                await w.wait(120)
            for nodes in (2, 4):
                figures = [await _round(c, exp, nodes) for _ in range(rounds)]
                gang = statistics.median(f[0] for f in figures)
                single = statistics.median(f[1] for f in figures)
                print(f"{nodes}-node trial: submit -> every rank's first line {gang * 1000:.0f} ms; "
                      f"{nodes} one-node trials, the slowest {single * 1000:.0f} ms; ratio {gang / single:.2f} "
                      f"(median of {rounds})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    asyncio.run(_main(ap.parse_args().rounds))


if __name__ == "__main__":
    main()
