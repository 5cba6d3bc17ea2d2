"""Multi-fidelity search on curves whose best configurations start slow: trialkeeper's ASHA
(pausing and continuing), asynchronous Hyperband (its brackets set or adaptive), TPE + ASHA and PBT against Ray Tune's
OptunaSearch + ASHA, TuneBOHB + HyperBandForBOHB and PBT, on the same workload.

    python scripts/bench/mfbench.py [--family crossing|plateau|power] [--seeds 5] [--trials 40]
        [--concurrency 2] [--epoch-s 0.04] [--methods asha,hyperband,...] [--ray-python PATH] [--json OUT]
        [--ray-wall-from RAY.json] [--draw K] [--draws N]

The objective is slowcurves.py (families of curves, ``--family``, one objective per seed; the
best configurations learn slowest), EPOCHS epochs of ``--epoch-s`` seconds of sleep each (about 1 s a trial, so
the machine's CPU stays free). Every method gets ``--trials`` configurations (PBT: a
population of POPULATION), ``--concurrency`` at a time, one method after the other, each in a
process of its own; Ray Tune runs in its own virtualenv (peers.py; ``peer_ray_mf.py``).

Figures per method and seed: wall time (from before the coordinator or ``ray.init`` starts
to the end), and two measures of how close it came, each as the time it first came within
2 %, 1 % and 0.5 % and where it stood at Ray Tune's OptunaSearch + ASHA wall time of the
same seed. With ``--ray-wall-from``, each trialkeeper method runs for that wall time instead of
``--trials``, and the summary counts the target's two parts over its runs (every seed, and
every draw of ``--draws``): within 0.5 % at Ray Tune's wall time, and within 1 % by half of it.

- **regret**, the measure the targets are judged by: what the search's pick is worth (the
  configuration that reported the best score so far, at the epoch it reported it, without
  the noise per epoch) against the best the seed's curves reach without noise
  (``optimum(noise=False)``);
- **gap**, the best score reported against the best known score (``optimum``: the best noisy
  epoch of a wide sample refined locally, or what a method reported, when better). That
  reference sits on the luckiest noise of thousands of near-optimal evaluations, 0.9-2.0 %
  above what the best configuration is worth, so a gap under about 1 % measures the luck of
  a draw as much as the search.

The last line of stdout is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import run_json_child
from peer_ray_mf import picks
from peers import DEFAULT_CACHE, venv_python
from searchbench import reach, run_config
from slowcurves import EPOCHS, FAMILIES, SPACE, _world, curve

POPULATION = 8
ASHA = {"min_resource": 1, "max_resource": EPOCHS, "reduction_factor": 3}
# The settings docs/search.md recommends for slow starters: a first rung at a third of the
# training, halving (eta 2), and every bracket, the last one training its share to the end.
SLOW_STARTERS = {"min_resource": EPOCHS / 3, "max_resource": EPOCHS, "reduction_factor": 2, "brackets": 3}
TK_METHODS = ("asha", "hyperband", "tpe+asha", "tpe+hyperband", "tpe+adaptive", "tpe+slow-adaptive", "tpe", "pbt",
              "bo", "bo-scores", "bo+slow-adaptive")
RAY_METHODS = ("ray-optuna+asha", "ray-bohb", "ray-pbt")
WITHIN = (0.02, 0.01, 0.005)
TIMED = " (Ray's wall time)"  # a method given Ray Tune's OptunaSearch + ASHA wall time of the seed


def optimum(seed: int, family: str = FAMILIES[0], samples: int = 10_000, noise: bool = True) -> float:
    """The best score known for the seed, any epoch: the best of ``samples`` random
    configurations and of each architecture's best rate and momentum at each width, each
    of the best 20 then refined by 200 small random steps. ``noise=False``: the same on the
    curves without their noise per epoch (what the best configuration is worth)."""
    rng = random.Random(seed)
    found: list[tuple[float, dict[str, Any]]] = []
    for arch, w in _world(seed).items():
        for width in (64, 128, 256, 512):
            p = {"lr": 10 ** w["lr"], "momentum": w["momentum"], "width": width, "arch": arch}
            found.append((max(curve(p, seed, family, noise)), p))
    for _ in range(samples):
        p = {"lr": 10 ** rng.uniform(-4, 0), "momentum": rng.uniform(0, 0.99), "width": rng.choice([64, 128, 256, 512]),
             "arch": rng.choice(["mlp", "cnn", "res"])}
        found.append((max(curve(p, seed, family, noise)), p))
    found.sort(key=lambda f: -f[0])
    best = found[0][0]
    for score, p in found[:20]:
        for _ in range(200):
            q = {**p, "lr": min(1.0, max(1e-4, p["lr"] * 10 ** rng.gauss(0, 0.1))),
                 "momentum": min(0.99, max(0.0, p["momentum"] + rng.gauss(0, 0.03)))}
            s = max(curve(q, seed, family, noise))
            if s > score:
                score, p = s, q
        best = max(best, score)
    return best


def _search(method: str, seed: int) -> dict[str, Any]:
    asha = {"name": "asha", "classArgs": dict(ASHA)}
    tpe = {"name": "optuna", "classArgs": {"sampler": "TPE", "seed": seed}}
    told = {"name": "optuna", "classArgs": {"sampler": "TPE", "seed": seed, "tell_paused": True}}
    bo = {"name": "optuna", "classArgs": {"sampler": "bo", "seed": seed}}
    return {
        "asha": {"tuner": {"name": "random", "classArgs": {"seed": seed}}, "assessor": asha},
        "hyperband": {"tuner": {"name": "random", "classArgs": {"seed": seed}},
                      "assessor": {"name": "asha", "classArgs": {**ASHA, "brackets": 3}}},
        "tpe+asha": {"tuner": tpe, "assessor": asha},
        "tpe+hyperband": {"tuner": tpe, "assessor": {"name": "asha", "classArgs": dict(SLOW_STARTERS)}},
        # Brackets that learn which one pays, with TPE told of paused trials: ASHA's defaults, and
        # the slow-starter settings.
        "tpe+adaptive": {"tuner": told, "assessor": {"name": "asha", "classArgs": {**ASHA, "brackets": "adaptive"}}},
        "tpe+slow-adaptive": {"tuner": told,
                              "assessor": {"name": "asha", "classArgs": {**SLOW_STARTERS, "brackets": "adaptive"}}},
        "tpe": {"tuner": tpe},  # no early stopping: every configuration trains to the end
        # The Gaussian-process sampler (sampler: bo), alone (and from the final scores only: no
        # proposal from the learning curves), and with the slow-starter brackets.
        "bo": {"tuner": bo},
        "bo-scores": {"tuner": {**bo, "classArgs": {**bo["classArgs"], "sampler_args": {"curve_every": 0}}}},
        "bo+slow-adaptive": {"tuner": bo, "assessor": {"name": "asha",
                                                       "classArgs": {**SLOW_STARTERS, "brackets": "adaptive"}}},
        "pbt": {"tuner": {"name": "pbt", "classArgs": {"population_size": POPULATION, "perturbation_interval": 3,
                                                       "seed": seed}}},
    }[method]


def search_seed(seed: int, draw: int) -> int:
    """The search's seed on a workload seed's ``draw``-th run (0: the seed itself); mfsim.py's
    runs seed their samplers alike, so that a draw here is the same draw there."""
    return seed + 1000 * draw


def run_trialkeeper(method: str, seed: int, trials: int, concurrency: int, epoch_s: float,
                    duration: float | None = None, family: str = FAMILIES[0], draw: int = 0) -> dict[str, Any]:
    """One method on one seed: ``trials`` configurations, or, with ``duration``, as many as
    that many seconds allow (maxExperimentDuration, no maxTrialNumber); ``draw`` seeds the
    search anew (0: the seed itself), as mfsim.py's runs do."""
    with tempfile.TemporaryDirectory() as work:
        trace = Path(work) / "trace.jsonl"  # each report with what it is worth (slowcurve_trial.py)
        search = _search(method, search_seed(seed, draw))
        # A search that never pauses a trial has no use for its checkpoints: its trials save
        # none, as Ray Tune's OptunaSearch + ASHA trials (peer_ray_mf.py).
        saves = "each" if "assessor" in search or method == "pbt" else "none"
        data: dict[str, Any] = {
            "trialCommand": f"{sys.executable} {HERE / 'slowcurve_trial.py'} {seed} {epoch_s} {family} {trace} {saves}",
            "trialCodeDirectory": str(HERE), "trialConcurrency": concurrency, "maxTrialNumber": trials,
            "searchSpace": SPACE, "trainingService": {"platform": "local"}, "experimentWorkingDirectory": work,
            # Each trial forked from a template that has imported what it needs (warm starts).
            "trialPreload": ["trialkeeper.agent.trial", "random", "hashlib", "json"],
            **search,
        }
        if duration is not None:
            del data["maxTrialNumber"]
            data["maxExperimentDuration"] = f"{duration:.0f}s"
        name = method if duration is None else f"{method}{TIMED}"
        t0 = time.time()  # run_config's own start follows at once; the picks are measured from here
        ran = run_config(data, Path(work))
        reports = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
        ran["picks"] = picks(sorted((r["t"] - t0, r["score"], r["worth"]) for r in reports))
        return {"method": name, "seed": seed, "family": family, "draw": draw, **ran}


def best_at(curve_: list[list[float]], t: float) -> float | None:
    seen = [s for at, s in curve_ if at <= t]
    return max(seen) if seen else None


def worth_at(picks_: list[list[float]], t: float) -> float | None:
    """What the pick at ``t`` is worth (None: nothing reported yet)."""
    seen = [p[2] for p in picks_ if p[0] <= t]
    return seen[-1] if seen else None


def worth_reach(picks_: list[list[float]], target: float) -> float | None:
    """When the pick was first worth ``target`` or more (None: never)."""
    return next((p[0] for p in picks_ if p[2] >= target - 1e-12), None)


def summarize(runs: list[dict[str, Any]], optima: dict[int, float], clean: dict[int, float],
              ray_wall: dict[int, float] | None = None) -> dict[str, Any]:
    """Per method, each run's figures by gap (against ``optima``) and by regret (against
    ``clean``, the noiseless optima; runs recorded before picks were kept have none), at Ray
    Tune's OptunaSearch + ASHA wall time of the seed: its run's among ``runs``, or else
    ``ray_wall``'s (the seed's wall time in an earlier output)."""
    walls = dict(ray_wall or {})
    walls.update({r["seed"]: r["wall_s"] for r in runs if r["method"] == "ray-optuna+asha" and r.get("curve")})
    table: dict[str, Any] = {}
    for r in runs:  # the best known: what any method found too
        if r.get("curve"):
            optima[r["seed"]] = max(optima[r["seed"]], r["curve"][-1][1])
        if r.get("picks") and r["seed"] in clean:
            clean[r["seed"]] = max(clean[r["seed"]], *(p[2] for p in r["picks"]))
    for method in (*TK_METHODS, *(m + TIMED for m in TK_METHODS), *RAY_METHODS):
        rows = []
        for r in sorted((r for r in runs if r["method"] == method and r.get("curve")), key=lambda r: r["seed"]):
            opt, wall, picked = optima[r["seed"]], walls.get(r["seed"]), r.get("picks") or []
            at_ray = best_at(r["curve"], wall) if wall else None
            row = {
                "seed": r["seed"], "draw": r.get("draw", 0), "ray_wall_s": wall, "wall_s": r["wall_s"],
                "final_gap": 1 - r["curve"][-1][1] / opt,
                "reach_s": {f"{w:g}": reach(r["curve"], opt * (1 - w)) for w in WITHIN},
                "gap_at_ray_wall": None if at_ray is None else 1 - at_ray / opt,
                "early_stopped": r.get("early_stopped"), "trials": r.get("trials"),
            }
            if picked and r["seed"] in clean:
                best = clean[r["seed"]]
                worth = worth_at(picked, wall) if wall else None
                row.update({"final_regret": 1 - picked[-1][2] / best,
                            "regret_reach_s": {f"{w:g}": worth_reach(picked, best * (1 - w)) for w in WITHIN},
                            "regret_at_ray_wall": None if worth is None else 1 - worth / best})
            rows.append(row)
        if rows:
            table[method] = rows
    return table


def target(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    """The target's two parts counted over a method's runs, by regret: within 0.5 % at Ray
    Tune's wall time, and within 1 % by half of it (None: no run has both a pick and Ray
    Tune's wall time)."""
    rows = [r for r in rows if r.get("ray_wall_s") and "regret_reach_s" in r]
    if not rows:
        return None
    at_wall = [r["regret_at_ray_wall"] for r in rows]
    by_half = [(r["regret_reach_s"]["0.01"], r["ray_wall_s"] / 2) for r in rows]
    return {"runs": len(rows),
            "within_05_at_ray_wall": sum(x is not None and x <= 0.005 for x in at_wall),
            "within_1_by_half_ray_wall": sum(t is not None and t <= half for t, half in by_half)}


def report(table: dict[str, Any]) -> None:
    """Per method on stderr: the median wall time, each run's regret and gap at Ray Tune's wall
    time, and the target's two parts counted."""
    for method, rows in table.items():
        walls = statistics.median(r["wall_s"] for r in rows)

        def pcts(key: str, rows: list[dict[str, Any]] = rows) -> str:
            return ", ".join("—" if r.get(key) is None else f"{r[key] * 100:.2f} %" for r in rows)

        print(f"{method:16} wall median {walls:5.1f} s; at Ray ASHA's wall: regret {pcts('regret_at_ray_wall')}; "
              f"gap {pcts('gap_at_ray_wall')}", file=sys.stderr)
        counted = target(rows)
        if counted:
            print(f"{method:16} target, by regret, of {counted['runs']} runs: within 0.5 % at Ray's wall time in "
                  f"{counted['within_05_at_ray_wall']}, within 1 % by half of it in "
                  f"{counted['within_1_by_half_ray_wall']}", file=sys.stderr)


def markdown(table: dict[str, Any]) -> str:
    """The summary as a Markdown table: per method, each seed's time to 2 %, 1 % and 0.5 %
    (— never) and where it stood at Ray Tune's OptunaSearch + ASHA wall time, by regret
    (where the run kept its picks) and by gap."""
    def cells(rows: list[dict[str, Any]], figure: Any) -> str:
        return ", ".join(figure(r) for r in rows)

    def secs(t: float | None) -> str:
        return "—" if t is None else f"{t:.0f}"

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x * 100:.2f}"

    def label(r: dict[str, Any]) -> str:  # the seed, and its draw after the first
        return f"{r['seed']} (draw {r['draw']})" if r.get("draw") else str(r["seed"])

    lines = [("| method | seeds | regret: time to 2 % (s) | to 1 % (s) | to 0.5 % (s) | at Ray's wall time (%) "
              "| gap: time to 2 % (s) | to 1 % (s) | to 0.5 % (s) | at Ray's wall time (%) |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, rows in table.items():
        by_regret = [cells(rows, lambda r, w=w: secs(r["regret_reach_s"][f"{w:g}"]) if "regret_reach_s" in r else "?")
                     for w in WITHIN] + [cells(rows, lambda r: pct(r.get("regret_at_ray_wall")))]
        by_gap = [cells(rows, lambda r, w=w: secs(r["reach_s"][f"{w:g}"])) for w in WITHIN] + [
            cells(rows, lambda r: pct(r["gap_at_ray_wall"]))]
        lines.append(f"| {method} | {cells(rows, label)} | " + " | ".join(by_regret + by_gap) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", choices=TK_METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--family", choices=FAMILIES, default=FAMILIES[0], help="slowcurves.py's family of curves")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--epoch-s", type=float, default=0.04)
    ap.add_argument("--draw", type=int, default=0,
                    help="seed trialkeeper's searches anew: the K-th draw (0: the seed; as mfsim.py's --first-draw)")
    ap.add_argument("--draws", type=int, default=1,
                    help="run each trialkeeper method on N draws per seed, from --draw on")
    ap.add_argument("--methods", default=",".join((*TK_METHODS, *RAY_METHODS)))
    ap.add_argument("--ray-python", default=str(venv_python(DEFAULT_CACHE, "ray")))
    ap.add_argument("--json", type=Path, default=Path("mf-bench.json"))
    ap.add_argument("--duration", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--ray-wall-from", type=Path, metavar="JSON",
                    help="give each trialkeeper method, instead of --trials, the wall time Ray Tune's OptunaSearch + "
                    "ASHA took on the same seed in this earlier output")
    ap.add_argument("--summarize", type=Path, nargs="+", metavar="JSON",
                    help="only summarize the runs of these earlier outputs (of --family) together")
    ap.add_argument("--markdown", action="store_true", help="with --summarize: the table in Markdown on stderr")
    a = ap.parse_args()
    if a.draw < 0:
        ap.error(f"--draw must be 0 or more, got {a.draw}")
    if a.draws < 1:
        ap.error(f"--draws must be 1 or more, got {a.draws}")
    ray_wall: dict[int, float] = {}
    if a.ray_wall_from:
        ray_wall = {r["seed"]: r["wall_s"] for r in json.loads(a.ray_wall_from.read_text())["runs"]
                    if r["method"] == "ray-optuna+asha" and r.get("wall_s")
                    and r.get("family", FAMILIES[0]) == a.family}  # (outputs before families were "crossing")
    if a.summarize:
        runs, optima, clean = [], {}, {}
        for f in a.summarize:
            d = json.loads(f.read_text())
            if d.get("family", FAMILIES[0]) != a.family:
                ap.error(f"--summarize: {f} holds the family {d.get('family', FAMILIES[0])!r}, "
                         f"not --family {a.family!r}")
            runs += d["runs"]
            optima.update({int(k): v for k, v in d["optima"].items()})
            clean.update({int(k): v for k, v in d.get("clean_optima", {}).items()})
        # (outputs from before the regret was kept have no noiseless optima: work them out)
        clean.update({seed: optimum(seed, a.family, noise=False) for seed in optima if seed not in clean})
        table = summarize(runs, optima, clean, ray_wall)
        report(table)
        if a.markdown:
            print(markdown(table), file=sys.stderr)
        print(json.dumps({"family": a.family, "optima": optima, "clean_optima": clean, "summary": table,
                          "target": {m: target(rows) for m, rows in table.items()}}))
        return 0
    if a.one:
        print(json.dumps(run_trialkeeper(a.one, a.seed, a.trials, a.concurrency, a.epoch_s, a.duration, a.family,
                                         a.draw)), flush=True)
        return 0
    runs: list[dict[str, Any]] = []
    optima = {seed: optimum(seed, a.family) for seed in range(a.seeds)}
    clean = {seed: optimum(seed, a.family, noise=False) for seed in range(a.seeds)}
    # Ray Tune's runs do not draw anew: they run once per seed, trialkeeper's once per draw.
    plan = [(seed, draw, method) for seed in range(a.seeds) for draw in range(a.draw, a.draw + a.draws)
            for method in a.methods.split(",") if method not in RAY_METHODS or draw == a.draw]
    for seed, draw, method in plan:
        if method in RAY_METHODS:
            argv = [a.ray_python, str(HERE / "peer_ray_mf.py"), "--method", method, "--seed", str(seed),
                    "--trials", str(a.trials), "--concurrency", str(a.concurrency), "--epoch-s", str(a.epoch_s),
                    "--population", str(POPULATION), "--family", a.family]
        else:
            argv = [sys.executable, __file__, "--one", method, "--seed", str(seed), "--trials", str(a.trials),
                    "--concurrency", str(a.concurrency), "--epoch-s", str(a.epoch_s), "--family", a.family,
                    "--draw", str(draw)]
            if a.ray_wall_from:
                if seed not in ray_wall:
                    continue
                argv += ["--duration", str(ray_wall[seed])]
        r = run_json_child(argv, timeout_s=900)
        runs.append({"method": method, "seed": seed, "family": a.family, **r})  # (a timed run names itself)
        best = r["curve"][-1][1] if r.get("curve") else math.nan
        worth = r["picks"][-1][2] if r.get("picks") else math.nan
        drawn = f" draw {draw}" if draw and method not in RAY_METHODS else ""
        print(f"{a.family} seed {seed}{drawn} {method:16} wall {r.get('wall_s', 0):6.1f} s best {best:.4f} "
              f"of {optima[seed]:.4f}, its pick worth {worth:.4f} of {clean[seed]:.4f} stopped "
              f"{r.get('early_stopped')} {str(r.get('error', ''))[-300:]}", file=sys.stderr, flush=True)
        a.json.write_text(json.dumps({"family": a.family, "optima": optima, "clean_optima": clean, "runs": runs},
                                     indent=1))
    table = summarize(runs, optima, clean, ray_wall)
    counted = {m: target(rows) for m, rows in table.items()}
    a.json.write_text(json.dumps({"family": a.family, "optima": optima, "clean_optima": clean, "runs": runs,
                                  "summary": table, "target": counted}, indent=1))
    report(table)
    print(json.dumps({"family": a.family, "optima": optima, "clean_optima": clean, "summary": table,
                      "target": counted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
