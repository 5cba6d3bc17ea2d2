"""Run by test_nni_search.py in an interpreter with NNI's real package: builds NNI's
algorithms by name through trialkeeper and drives them with the search core. Prints one
JSON object with what it saw into the file its argument names (NNI logs on stdout)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.algorithms import create_assessor, create_tuner
from trialkeeper.coordinator.search.search import (
    IntermediateStored,
    Search,
    TrialEnded,
    TrialSubmitted,
)
from trialkeeper.coordinator.search.tuners import PastTrial, Tuner, TunerError

warnings.filterwarnings("ignore")
MIXED = {"x": {"_type": "uniform", "_value": [0, 1]}, "k": {"_type": "choice", "_value": [1, 2, 3]}}
CHOICES = {"x": {"_type": "choice", "_value": [0.1, 0.3, 0.5, 0.7, 0.9]}, "k": {"_type": "choice", "_value": [1, 2]}}
TUNERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "TPE": ({"optimize_mode": "maximize", "seed": 1}, MIXED),
    "tpe": ({"optimize_mode": "maximize"}, MIXED),
    "Random": ({"seed": 2}, MIXED),
    "Anneal": ({"optimize_mode": "maximize"}, MIXED),
    "Evolution": ({"optimize_mode": "maximize", "population_size": 4}, MIXED),
    "GridSearch": ({}, CHOICES),
    "MetisTuner": ({"optimize_mode": "maximize"}, MIXED),
    "GP": ({"optimize_mode": "maximize"}, MIXED),
    "PBT": ({"optimize_mode": "maximize", "population_size": 4, "all_checkpoint_dir": tempfile.mkdtemp()}, MIXED),
    "RegularizedEvolution": ({"optimize_mode": "maximize", "population_size": 4, "sample_size": 2}, CHOICES),
    "SMAC": ({"optimize_mode": "maximize"}, MIXED),
    "DNGO": ({"optimize_mode": "maximize"}, MIXED),
    "PPO": ({"optimize_mode": "maximize"}, MIXED),
    "NetworkMorphism": ({"optimize_mode": "maximize"}, MIXED),
}

BATCH_SETS = [{"x": 0.2, "opt": "adam"}, {"x": 0.4, "opt": "sgd"}, {"x": 0.9, "opt": "adam"}]

USER_TUNER = '''
from nni.tuner import Tuner

class Countdown(Tuner):
    def __init__(self, start):
        self.n = start
    def update_search_space(self, space):
        self.space = space
    def generate_parameters(self, parameter_id, **kwargs):
        self.n -= 1
        return {"x": self.n}
    def receive_trial_result(self, parameter_id, parameters, value, **kwargs):
        pass
'''

# A user's own PBT: NNI's, under another class name.
USER_PBT = '''
from nni.algorithms.hpo.pbt_tuner import PBTTuner

class Generations(PBTTuner):
    pass
'''


def drive(search: Search, n: int, offset: int = 0) -> list[dict[str, Any]]:
    out = []
    for i in range(offset, offset + n):
        p = search.propose(i)
        if p is None:
            break
        out.append(p)
        search.handle(TrialSubmitted(f"t{i}", i, p))
        search.handle(IntermediateStored(f"t{i}", 0.5))
        search.handle(TrialEnded(f"t{i}", TrialStatus.SUCCEEDED, float(p.get("x", 0.5))))
    return out


def main() -> None:
    report: dict[str, Any] = {"tuners": {}, "assessors": {}}
    for name, (args, space) in TUNERS.items():
        try:
            search = Search(create_tuner(name, None, args, space))
        except TunerError as e:
            report["tuners"][name] = {"error": str(e)}
            continue
        points = drive(search, 8)
        report["tuners"][name] = {"points": points, "failure": search.failure, "exhausted": search.exhausted}
    for name, args in {"BOHB": {"optimize_mode": "maximize"}, "nosuch": {}, "TPE": {"optimize_mode": "max"},
                       "Hyperband": {"optimize_mode": "maximize", "R": "many"}}.items():
        try:
            create_tuner(name, None, args, MIXED)
        except TunerError as e:
            report["errors"] = report.get("errors", {}) | {name: str(e)}

    # A user's own NNI tuner, by className and codeDirectory.
    code = Path(tempfile.mkdtemp())
    (code / "my_nni_tuner.py").write_text(USER_TUNER)
    user = Search(create_tuner(None, "my_nni_tuner.Countdown", {"start": 10}, {}, str(code)))
    report["user_tuner"] = drive(user, 3)

    # Assessors by name: a curve below the median of completed ones is stopped.
    for name, args in {
        "Medianstop": {"optimize_mode": "maximize"},
        "curvefitting": {"epoch_num": 10, "start_step": 3},
    }.items():
        search = Search(create_tuner("random", None, {"seed": 0}, MIXED), create_assessor(name, None, args))
        verdicts = []
        for i, curve in enumerate([[0.5 + 0.03 * k for k in range(10)]] * 3 + [[0.01 * k for k in range(10)]]):
            p = search.propose(i)
            search.handle(TrialSubmitted(f"t{i}", i, p))
            stopped_at = None
            for k, v in enumerate(curve):
                if search.handle(IntermediateStored(f"t{i}", v)):
                    stopped_at = k
                    break
            search.handle(
                TrialEnded(
                    f"t{i}",
                    TrialStatus.EARLY_STOPPED if stopped_at is not None else TrialStatus.SUCCEEDED,
                    None if stopped_at is not None else curve[-1],
                )
            )
            verdicts.append(stopped_at)
        report["assessors"][name] = {
            "stopped_at": verdicts,
            "failure": search.failure,
            "kept": search.assessor is not None,
        }
    try:
        create_assessor("Medianstop", None, {"optimize_mode": "best"})
    except TunerError as e:
        report["errors"]["Medianstop"] = str(e)

    # Resume: GridSearch hears the points already run and proposes only the others; TPE,
    # past its random start-up, proposes near the best of the history it was told.
    grid_space = {"x": {"_type": "choice", "_value": list(range(10))}}
    first = drive(Search(create_tuner("GridSearch", None, {}, grid_space)), 4)
    resumed = Search(create_tuner("GridSearch", None, {}, grid_space))
    resumed.resume([PastTrial(f"t{i}", i, p, (), float(p["x"]), TrialStatus.SUCCEEDED) for i, p in enumerate(first)]
                   + [PastTrial("t4", 4, {"x": first[-1]["x"] + 1}, (), None, None)])
    resumed.handle(TrialEnded("t4", TrialStatus.SUCCEEDED, 1.0))
    report["grid_resume"] = {"first": first, "after": drive(resumed, 20, offset=5)}
    space = {"x": {"_type": "uniform", "_value": [0, 1]}}
    history = [
        PastTrial(f"t{i}", i, {"x": i / 40}, (), -((i / 40 - 0.8) ** 2), TrialStatus.SUCCEEDED) for i in range(40)
    ]
    tpe = Search(create_tuner("TPE", None, {"optimize_mode": "maximize", "seed": 3}, space))
    tpe.resume(history)
    fresh = Search(create_tuner("TPE", None, {"optimize_mode": "maximize", "seed": 3}, space))
    report["tpe_resume"] = {
        "resumed": [p["x"] for p in drive(tpe, 10, 40)],
        "fresh": [p["x"] for p in drive(fresh, 10)],
    }
    report["hyperband"] = hyperband()
    report["pbt_defaults"] = pbt_with_its_defaults()
    report["pbt_sources"] = pbt_sources(lambda args: create_tuner("PBT", None, args, MIXED))
    (code / "my_population.py").write_text(USER_PBT)
    report["pbt_subclass"] = pbt_sources(
        lambda args: create_tuner(None, "my_population.Generations", args, MIXED, str(code)))
    # BOHB, min_budget 1, max_budget 9, eta 3: 9 configurations for 1, the best 3 for 3, the best for 9.
    bohb = {"optimize_mode": "maximize", "min_budget": 1, "max_budget": 9, "eta": 3}
    report["bohb"] = rounds(create_tuner("BOHB", None, bohb, MIXED), 13)
    # NNI's Batch tuner, in its own search-space format: the parameter sets, in order, then exhausted.
    batch = Search(create_tuner("Batch", None, {}, {"combine_params": {"_type": "choice", "_value": BATCH_SETS}}))
    report["batch"] = {"points": drive(batch, 5), "exhausted": batch.exhausted, "failure": batch.failure}
    Path(sys.argv[1]).write_text(json.dumps(report))


def hyperband() -> dict[str, Any]:
    """Hyperband (serial: one bracket at a time) with R=9, eta=3: its first bracket runs 9
    configurations for budget 1, then the best 3 for budget 3, then the best for 9. Each
    promoted trial names the trial of the round before that ran its configuration."""
    return rounds(
        create_tuner("hyperband", None, {"optimize_mode": "maximize", "R": 9, "eta": 3, "exec_mode": "serial"}, MIXED),
        13,
    )


def rounds(advisor: Any, n: int) -> dict[str, Any]:
    """``n`` trials of an advisor, each ended (scored by x) when the advisor waits for its round."""
    search = Search(advisor)
    running: list[tuple[str, dict[str, Any]]] = []
    proposed, sources, waits = [], [], 0
    for i in range(n):
        p = search.propose_trial(i)
        while p is None and running:  # it waits for the round: end the oldest trial
            waits += 1
            tid, params = running.pop(0)
            for step in range(int(params["TRIAL_BUDGET"])):
                search.handle(IntermediateStored(tid, params["x"] * (step + 1) / 9, step))
            search.handle(TrialEnded(tid, TrialStatus.SUCCEEDED, params["x"]))
            p = search.propose_trial(i)
        assert p is not None, search.failure
        proposed.append(p.parameters)
        sources.append(p.checkpoint_from)
        running.append((f"t{i}", p.parameters))
        search.handle(TrialSubmitted(f"t{i}", i, p.parameters, p.checkpoint_from))
    return {"proposed": proposed, "sources": sources, "waits": waits, "failure": search.failure}


def pbt_with_its_defaults() -> dict[str, Any]:
    """NNI's PBT named without all_checkpoint_dir, built as an experiment builds it: with
    NNI_CHECKPOINT_DIRECTORY set to the experiment's directory for it, only while it is built."""
    from trialkeeper.coordinator.config.experiment import parse_config
    from trialkeeper.coordinator.experiment import make_search as _search

    exp = Path(tempfile.mkdtemp()) / "exp"
    config = parse_config({
        "trialCommand": "python3 trial.py", "trialConcurrency": 2, "searchSpace": MIXED,
        "trainingService": {"platform": "local"},
        "tuner": {"name": "PBT", "classArgs": {"optimize_mode": "maximize", "population_size": 4}},
    }, exp.parent)
    search = _search(config, "e1", exp)
    points = drive(search, 8)
    return {
        "points": points, "failure": search.failure, "directory": str(exp / "nni-checkpoints"),
        "made": (exp / "nni-checkpoints").is_dir(), "left_set": os.environ.get("NNI_CHECKPOINT_DIRECTORY"),
    }


def pbt_sources(build: Callable[[dict[str, Any]], Tuner]) -> dict[str, Any]:
    """NNI's PBT, as ``build`` makes it with no checkpoint directory given anywhere (as the
    embedding API builds it), a population of 4 for three generations, each trial ended (scored
    by x) when PBT waits for its generation: the trial each one starts from the checkpoint of."""
    os.environ.pop("NNI_CHECKPOINT_DIRECTORY", None)
    try:
        search = Search(build({"optimize_mode": "maximize", "population_size": 4}))
    except TunerError as e:
        return {"trials": [], "failure": str(e)}
    trials: list[dict[str, Any]] = []
    running: list[tuple[str, dict[str, Any]]] = []
    while len(trials) < 12:
        i = len(trials)
        p = search.propose_trial(i)
        if p is None:
            assert running, search.failure
            tid, params = running.pop(0)
            search.handle(TrialEnded(tid, TrialStatus.SUCCEEDED, float(params["x"])))
            continue
        trials.append({"id": f"t{i}", "parameters": p.parameters, "source": p.checkpoint_from})
        running.append((f"t{i}", p.parameters))
        search.handle(TrialSubmitted(f"t{i}", i, p.parameters, p.checkpoint_from))
    return {"trials": trials, "failure": search.failure}


if __name__ == "__main__":
    main()
