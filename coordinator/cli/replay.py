"""``trialkeeper replay EXP [--config other.yml]``: another search run against the learning
curves an experiment recorded, in virtual time (``replay/``), and what it would have found
and when."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..store.reads import holds_experiment
from .views import experiment_path

_WITHIN = (0.02, 0.01, 0.005)


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "replay", help="replay another search against an experiment's recorded learning curves",
        description="Run a search (another tuner, assessor or advisor, trialConcurrency, maxTrialNumber, "
        "maxExperimentDuration) against the learning curves the experiment recorded, in virtual time, through "
        "the same decision core and search code as a real run, and print what it would have found and when. "
        "A configuration the experiment never ran follows the curve of the nearest one it ran (--unseen "
        "nearest) or is not run (--unseen skip). Without --config, the experiment's own search is replayed.",
    )
    p.add_argument("experiment", metavar="EXP", help="an experiment directory, or an experiment id")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="a config file whose keys replace the experiment's (a key set to null removes it)")
    p.add_argument("--unseen", choices=("nearest", "skip"), default="nearest",
                   help="a configuration the experiment never ran: follow the nearest recorded one (default), "
                   "or skip it (it fails at once)")
    p.add_argument("--decisions", action="store_true", help="print every stop, pause and continue")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=cmd_replay)


def replay_config(stored: dict[str, Any], other: dict[str, Any] | None, base_dir: Path) -> Any:
    """The config to replay: the experiment's, with ``other``'s top-level keys in place of
    its own (null: removed). An advisor takes the place of the tuner and the assessor, and
    either of them the advisor's. The training service and code directory are not used:
    they are set to ones that parse anywhere."""
    from ..config.experiment import parse_config
    from ..config.rules import to_camel

    data = dict(stored)
    if other:
        given = {to_camel(str(k)): v for k, v in other.items()}
        if given.get("advisor") is not None:
            data.pop("tuner", None)
            data.pop("assessor", None)
        if given.get("tuner") is not None or given.get("assessor") is not None:
            data.pop("advisor", None)
        if "searchSpaceFile" in given:
            data.pop("searchSpace", None)
        data.update(given)
        data = {k: v for k, v in data.items() if v is not None}
    data["trainingService"] = {"platform": "local"}
    data["trialCodeDirectory"] = "."
    for key in ("experimentWorkingDirectory", "optunaStorage", "optunaStudyName"):
        data.pop(key, None)
    return parse_config(data, base_dir)


def cmd_replay(args: argparse.Namespace) -> int:
    from ..config.experiment import ConfigError, read_config_data
    from ..replay.curves import ReplayError, read_experiment
    from ..replay.driver import replay
    from ..search.space import SearchSpaceError
    from ..search.tuners import TunerError

    directory = experiment_path(args.experiment)
    if not holds_experiment(directory):
        print(f"trialkeeper: {args.experiment} is no experiment directory or id", file=sys.stderr)
        return 2
    try:
        stored, recorded = read_experiment(directory)
        other, base = None, directory
        if args.config is not None:
            file, other = read_config_data(args.config)
            if not isinstance(other, dict):
                raise ReplayError(f"{args.config}: a config is a mapping of keys, got {type(other).__name__}")
            base = file.parent
        config = replay_config(stored, other, base)
        outcome = replay(config, recorded, unseen=args.unseen)
    except (ConfigError, ReplayError, TunerError, SearchSpaceError) as e:
        print(f"trialkeeper: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_as_json(outcome, len(recorded)), indent=1))
    else:
        _print(outcome, len(recorded), args.decisions)
    return 0


def _as_json(r: Any, recorded: int) -> dict[str, Any]:
    best = r.best
    return {
        "recorded_trials": recorded, "reason": r.reason, "virtual_seconds": r.virtual_seconds,
        "wall_seconds": r.wall_seconds, "optimum": r.optimum, "maximize": r.maximize,
        "best": None if best is None else {"value": best[1], "at": best[0], "trial": best[2]},
        "gap": r.gap(), "reached": {f"{w:g}": r.reached(w) for w in _WITHIN},
        "nearest": r.nearest, "skipped": r.skipped,
        "improvements": [list(i) for i in r.improvements],
        "decisions": [vars(d) for d in r.decisions],
        "trials": [vars(t) for t in r.trials],
    }


def _seconds(s: float | None) -> str:
    if s is None:
        return "never"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def _print(r: Any, recorded: int, decisions: bool) -> None:
    from collections import Counter

    out = sys.stdout.write
    out(f"replayed {len(r.trials)} trials against {recorded} recorded ones in {r.wall_seconds:.2f} s; "
        f"{_seconds(r.virtual_seconds)} of virtual time: {r.reason}\n")
    best = r.best
    if best is None:
        out("no result was reported\n")
    else:
        t = next((x for x in r.trials if x.trial_id == best[2]), None)
        params = json.dumps(t.parameters, sort_keys=True) if t is not None else ""
        gap = r.gap()
        gap_text = "" if gap is None else f"; the recorded optimum is {r.optimum:g} ({gap * 100:.2f} % from it)"
        out(f"best: {best[1]:g} at {_seconds(best[0])} (trial {best[2]} {params}){gap_text}\n")
        if r.optimum is not None:
            out("within " + ", ".join(f"{w * 100:g} % at {_seconds(r.reached(w))}" for w in _WITHIN)
                + " of the optimum\n")
    counts = Counter(t.status for t in r.trials)
    out("trials: " + ", ".join(f"{n} {s}" for s, n in counts.most_common())
        + f"; {r.nearest} followed the nearest recorded configuration, {r.skipped} skipped\n")
    kinds = Counter(d.kind for d in r.decisions)
    out(f"decisions: {kinds['stop']} stops, {kinds['pause']} pauses, {kinds['continue']} continues\n")
    if decisions:
        for d in r.decisions:
            out(f"  {_seconds(d.at):>10}  {d.trial_id}  {d.kind:<8} after {d.step} results  {d.reason}\n")
