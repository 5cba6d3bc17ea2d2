"""What Optuna's TPE learns from trials the ASHA assessor pauses, in virtual time.

    python scripts/bench/mfsim.py [--families crossing,plateau,power] [--seeds 5] [--budget 540]
        [--concurrency 2] [--assessor slow|asha]

Each family of slowcurves.py and each seed runs twice with the real search (``Search``), the
real Optuna tuner (TPE, seeded) and the real ``Asha`` assessor, driven by the experiment loop's
real pass in virtual time (tests/search_sim.py: an epoch a tick, a pause at the next
checkpoint, a continue ahead of new trials): ``told``
is the tuner with ``tell_paused: true`` (a paused trial is told to its study PRUNED with its
intermediate values), ``running`` the tuner as it is by default, which leaves a paused trial
RUNNING (TPE learns only from ended trials). Both stop after ``--budget``
epochs trained in all. Printed per family and seed: the gap of the best score reported to
the best known score of the seed (mfbench's ``optimum``), in %, for each; then the mean per
family. ``--families faithful`` adds a control that does not start slow (the crossing
family's final scores, ranked alike at every epoch: early results are faithful).
``--assessor slow`` is docs/search.md's setting for slow starters (min_resource EPOCHS/3,
reduction_factor 2, 3 brackets), ``asha`` the plain one (min 1, reduction_factor 3).
The last line of stdout is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))

import optuna
from mfbench import ASHA, SLOW_STARTERS, optimum
from search_sim import Sim
from slowcurves import EPOCHS, FAMILIES, SPACE, curve
from trialkeeper.coordinator.search.asha import Asha
from trialkeeper.coordinator.search.optunasearch import OptunaTuner
from trialkeeper.coordinator.search.search import Search

CONTROL = "faithful"  # not slow starters: the crossing family's final scores, ranked alike at every epoch


def scores(params: dict[str, Any], seed: int, family: str) -> list[float]:
    if family != CONTROL:
        return curve(params, seed, family)
    final = curve(params, seed, "crossing")[-1]
    return [final * (1 - 0.5 * math.exp(-e / 4)) for e in range(1, EPOCHS + 1)]


def run(family: str, seed: int, budget: int, concurrency: int, assessor: dict[str, Any], told: bool) -> float:
    """The best score reported once ``budget`` epochs were trained."""
    tuner = OptunaTuner(SPACE, sampler="TPE", seed=seed, study_name=f"mfsim-{family}-{seed}", tell_paused=told)
    curves: dict[str, list[float]] = {}

    def score(params: dict[str, Any], epoch: int) -> float:
        key = json.dumps(params, sort_keys=True)
        if key not in curves:
            curves[key] = scores(params, seed, family)
        return curves[key][epoch - 1]

    sim = Sim(Search(tuner, Asha(**assessor)), score, epochs=EPOCHS, concurrency=concurrency)
    sim.run(until=lambda s: sum(t.trained for t in s.trials.values()) >= budget, ticks=budget + 10)
    return max(v for t in sim.trials.values() for v in t.curve)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budget", type=int, default=540, help="epochs trained in all (540: 20 full trials)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--assessor", choices=("slow", "asha"), default="slow")
    args = ap.parse_args()
    families = args.families.split(",")
    unknown = sorted(set(families) - {*FAMILIES, CONTROL})
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)}; valid: {', '.join((*FAMILIES, CONTROL))}")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    assessor = dict(SLOW_STARTERS if args.assessor == "slow" else ASHA)
    out: dict[str, Any] = {"budget": args.budget, "assessor": assessor, "families": {}}
    print(f"budget {args.budget} epochs, concurrency {args.concurrency}, asha {assessor}; gap to the optimum, %")
    for family in families:
        rows = []
        for seed in range(args.seeds):
            best = optimum(seed, family if family != CONTROL else "crossing", samples=3000)
            scores = {told: run(family, seed, args.budget, args.concurrency, assessor, told) for told in (False, True)}
            best = max(best, *scores.values())
            running, told_gap = (round(100 * (1 - scores[k] / best), 2) for k in (False, True))
            rows.append({"seed": seed, "running": running, "told": told_gap})
            print(f"{family:9} seed {seed}: paused RUNNING {running:6.2f}   paused told PRUNED {told_gap:6.2f}",
                  flush=True)
        means = {k: round(statistics.mean(r[k] for r in rows), 2) for k in ("running", "told")}
        print(f"{family:9} mean:   paused RUNNING {means['running']:6.2f}   paused told PRUNED {means['told']:6.2f}")
        out["families"][family] = {"seeds": rows, "mean": means}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
