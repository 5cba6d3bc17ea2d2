"""Multi-fidelity search methods on slowcurves.py's families, in virtual time.

    python scripts/bench/mfsim.py [--families crossing,plateau,power] [--seeds 5] [--runs 1]
        [--methods slow,adaptive,...] [--budget 540 | --ray-wall-from JSON...] [--concurrency 2]

Each family of slowcurves.py, each seed and each method (``METHODS``: a tuner and an
assessor, the same settings on every family and seed) runs with the real search
(``Search``), the real tuner (Optuna's TPE, seeded, or random) and the real ``Asha``
assessor, driven by the experiment loop's real pass in virtual time (tests/search_sim.py:
an epoch a tick, a pause at the next checkpoint, a continue ahead of new trials), until
the budget of epochs is trained in all. The budget is ``--budget``, or per seed what
``--concurrency`` slots train in Ray Tune's OptunaSearch + ASHA wall time of the seed and
family (``--ray-wall-from``, mfbench.py outputs; a seed it has no run of gets the median
of the others') on a quiet machine: ``--epoch-s`` a
result plus ``--turnover-s`` per trial (mfbench's trial: 27 epochs of 0.04 s).

Printed per family, seed and method, two figures:

- ``gap``: the gap of the best score reported to the best known score of the seed
  (mfbench's ``optimum``: the best noisy epoch of a refined configuration), in %, the
  figure of the timed benchmark;
- ``regret``: the regret of the search's pick (the configuration that reported the best
  score, at the epoch it reported it), by what it is worth without the noise per epoch
  against the best noiseless score of the seed, in % (mfbench's regret).

Then per method the mean of each over the seeds, and the seeds within 0.5 % and 1 %.
``--runs N`` runs each method N times per seed, the sampler seeded anew each time (the
objective stays the seed's; ``--first-draw K`` starts at the K-th seeding), and counts every
run: one run per seed shows one draw of the search's luck, which on these budgets moves a
seed's regret by several points.
``--families faithful`` adds a control that does not start slow (the crossing family's
final scores, ranked alike at every epoch). The last line of stdout is JSON.
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
from mfbench import ASHA, SLOW_STARTERS, optimum, search_seed
from search_sim import Sim
from slowcurves import EPOCHS, FAMILIES, SPACE, curve
from trialkeeper.coordinator.search.algorithms import create_tuner
from trialkeeper.coordinator.search.asha import Asha
from trialkeeper.coordinator.search.search import Search

CONTROL = "faithful"  # not slow starters: the crossing family's final scores, ranked alike at every epoch
TPE: dict[str, Any] = {"sampler": "TPE"}
TOLD: dict[str, Any] = {"sampler": "TPE", "tell_paused": True}
BO: dict[str, Any] = {"sampler": "bo"}  # the Gaussian-process sampler
# name -> (the optuna tuner's classArgs, or None for random; the asha assessor's classArgs, or None for none)
METHODS: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]] = {
    "tpe": (TPE, None),
    "tpe+asha": (TPE, ASHA),
    "tpe+asha+told": (TOLD, ASHA),
    "slow": (TPE, SLOW_STARTERS),
    "slow+told": (TOLD, SLOW_STARTERS),
    "adaptive": (TPE, {**ASHA, "brackets": "adaptive"}),
    "adaptive+told": (TOLD, {**ASHA, "brackets": "adaptive"}),
    "slow-adaptive": (TPE, {**SLOW_STARTERS, "brackets": "adaptive"}),
    "slow-adaptive+told": (TOLD, {**SLOW_STARTERS, "brackets": "adaptive"}),
    "hyperband4": (TPE, {**ASHA, "brackets": 4}),
    "bo": (BO, None),
    "bo-global": ({**BO, "sampler_args": {"local": 0}}, None),  # never refining around its best
    "bo-scores": ({**BO, "sampler_args": {"curve_every": 0}}, None),  # never proposing from the curves
    "bo+slow-adaptive": (BO, {**SLOW_STARTERS, "brackets": "adaptive"}),
}


def scores(params: dict[str, Any], seed: int, family: str, noise: bool = True) -> list[float]:
    if family != CONTROL:
        return curve(params, seed, family, noise)
    final = curve(params, seed, "crossing", noise)[-1]
    return [final * (1 - 0.5 * math.exp(-e / 4)) for e in range(1, EPOCHS + 1)]


def run(method: str, family: str, seed: int, budget: int, concurrency: int,
        draw: int = 0) -> tuple[float, dict[str, Any], int]:
    """The best score reported once ``budget`` epochs were trained, the configuration that
    reported it and at which epoch (0-based); ``draw`` seeds the sampler anew (0: the seed)."""
    tuner_args, assessor = METHODS[method]
    sampler_seed = search_seed(seed, draw)
    if tuner_args is None:
        tuner = create_tuner("random", None, {"seed": sampler_seed}, SPACE)
    else:
        args = {**tuner_args, "seed": sampler_seed, "study_name": f"mfsim-{family}-{seed}-{draw}"}
        tuner = create_tuner("optuna", None, args, SPACE)
    curves: dict[str, list[float]] = {}

    def score(params: dict[str, Any], epoch: int) -> float:
        key = json.dumps(params, sort_keys=True)
        if key not in curves:
            curves[key] = scores(params, seed, family)
        return curves[key][epoch - 1]

    sim = Sim(Search(tuner, Asha(**assessor) if assessor else None), score, epochs=EPOCHS, concurrency=concurrency)
    sim.run(until=lambda s: s.loop.trained >= budget, ticks=budget + 10)
    best = max((v, t.id, e) for t in sim.trials.values() for e, v in enumerate(t.curve))
    return best[0], sim.trials[best[1]].parameters, best[2]


def budgets(args: argparse.Namespace, family: str) -> dict[int, int]:
    if not args.ray_wall_from:
        return {seed: args.budget for seed in range(args.seeds)}
    walls: dict[int, float] = {}
    base = family if family != CONTROL else "crossing"
    for f in args.ray_wall_from:
        d = json.loads(Path(f).read_text())
        for r in d["runs"]:
            of = r.get("family", d.get("family") or FAMILIES[0])  # (outputs before families were "crossing")
            if r["method"] == "ray-optuna+asha" and r.get("wall_s") and of == base:
                walls[r["seed"]] = r["wall_s"]
    per_epoch = args.epoch_s + args.turnover_s / EPOCHS
    # A seed Ray Tune did not run on gets the median of the others' times.
    wall = {seed: walls.get(seed, statistics.median(walls.values())) for seed in range(args.seeds)}
    return {seed: int(args.concurrency * wall[seed] / per_epoch) for seed in range(args.seeds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1, help="runs of each method per seed, the sampler seeded anew each")
    ap.add_argument("--methods", default="slow,adaptive,slow-adaptive+told")
    ap.add_argument("--first-draw", type=int, default=0,
                    help="the first run's sampler draw: runs K.. K+N-1 (fresh draws beside an earlier batch)")
    ap.add_argument("--budget", type=int, default=540, help="epochs trained in all (540: 20 full trials)")
    ap.add_argument("--ray-wall-from", nargs="+", metavar="JSON",
                    help="budget per seed: what the slots train in Ray Tune's OptunaSearch + ASHA wall time there")
    ap.add_argument("--epoch-s", type=float, default=0.04)
    ap.add_argument("--turnover-s", type=float, default=0.15, help="a trial's start and end, on a quiet machine")
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()
    families, methods = args.families.split(","), args.methods.split(",")
    unknown = sorted(set(families) - {*FAMILIES, CONTROL})
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)}; valid: {', '.join((*FAMILIES, CONTROL))}")
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    if args.first_draw < 0:
        ap.error(f"--first-draw must be 0 or more, got {args.first_draw}")
    if set(methods) - set(METHODS):
        ap.error(f"--methods: unknown {', '.join(sorted(set(methods) - set(METHODS)))}; valid: {', '.join(METHODS)}")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    out: dict[str, Any] = {"methods": {m: METHODS[m] for m in methods}, "families": {}}
    print(f"concurrency {args.concurrency}; gap to the best known score / regret of the pick, noiseless, %")
    for family in families:
        base = family if family != CONTROL else "crossing"
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for seed, budget in budgets(args, family).items():
            best = optimum(seed, base, samples=3000)
            clean = optimum(seed, base, samples=3000, noise=False)
            draws = range(args.first_draw, args.first_draw + args.runs)
            found = {(m, k): run(m, family, seed, budget, args.concurrency, k) for m in methods for k in draws}
            best = max(best, *(f[0] for f in found.values()))
            for (m, k), (score, params, epoch) in found.items():
                worth = scores(params, seed, family, noise=False)[epoch]
                row = {"seed": seed, "run": k, "budget": budget, "gap": round(100 * (1 - score / best), 2),
                       "regret": round(100 * (1 - worth / max(clean, worth)), 2)}
                rows[m].append(row)
                print(f"{family:9} seed {seed} run {k} budget {budget:6d} {m:20} gap {row['gap']:6.2f}  regret "
                      f"{row['regret']:6.2f}", flush=True)
        out["families"][family] = {}
        for m, rs in rows.items():
            if not rs:
                continue
            summary = {k: round(statistics.mean(r[k] for r in rs), 2) for k in ("gap", "regret")}
            summary.update({f"{k} within {w}": sum(r[k] <= w for r in rs) for k in ("gap", "regret") for w in (0.5, 1)})
            print(f"{family:9} {m:20} mean gap {summary['gap']:6.2f} (within 0.5/1 %: {summary['gap within 0.5']}/"
                  f"{summary['gap within 1']} of {len(rs)} runs)  mean regret {summary['regret']:6.2f} "
                  "(within 0.5/1 %: "
                  f"{summary['regret within 0.5']}/{summary['regret within 1']})", flush=True)
            out["families"][family][m] = {"seeds": rs, "mean": summary}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
