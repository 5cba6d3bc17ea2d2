"""Replay in virtual time: the recorded trial a configuration is drawn from, the seconds each
result took, and searches that stop, pause and continue trials through the real engine."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.engine.rows import MetricRow
from trialkeeper.coordinator.replay.curves import Curves, Recorded, ReplayError, recorded_trials
from trialkeeper.coordinator.replay.driver import replay

SPACE = {"lr": {"_type": "loguniform", "_value": [1e-4, 1.0]}, "opt": {"_type": "choice", "_value": ["a", "b"]}}


def rec(i: int, params: dict[str, Any], values: tuple[float, ...], status: str = "SUCCEEDED",
        step_s: float = 1.0) -> Recorded:
    final = values[-1] if status == "SUCCEEDED" and values else None
    return Recorded(f"t{i}", i, params, status, values, (step_s,) * len(values), final, 0.0)


def config(tmp_path: Path, **data: Any) -> Any:
    base = {"searchSpace": SPACE, "trialCommand": "python trial.py", "trialConcurrency": 1,
            "trainingService": {"platform": "local"}}
    return parse_config({**base, **data}, tmp_path)


def test_a_configuration_is_drawn_from_its_own_trial_else_the_nearest_complete_one_or_none() -> None:
    curves = Curves([
        rec(0, {"lr": 1e-3, "opt": "a"}, (0.1, 0.2), status="EARLY_STOPPED"),
        rec(1, {"lr": 1e-3, "opt": "a"}, (0.1, 0.2, 0.3)),
        rec(2, {"lr": 0.5, "opt": "a"}, (0.5, 0.6)),
        rec(3, {"lr": 2e-3, "opt": "b"}, (0.4,)),
        rec(4, {"lr": 1.1e-3, "opt": "b"}, (0.4,), status="FAILED"),  # incomplete: never drawn for another
    ])
    assert curves.draw({"opt": "a", "lr": 1e-3}, "nearest") == (curves.trials[1], True)  # the whole one
    # The rates span a factor of 500: compared by their logarithms, 1.5e-3 is nearer 1e-3 than 0.5 is.
    assert curves.draw({"lr": 1.5e-3, "opt": "a"}, "nearest") == (curves.trials[1], False)
    assert curves.draw({"lr": 0.2, "opt": "a"}, "nearest")[0] is curves.trials[2]
    assert curves.draw({"lr": 1.2e-3, "opt": "b"}, "nearest")[0] is curves.trials[3]  # same optimizer first
    assert curves.draw({"lr": 1.2e-3, "opt": "b"}, "skip") == (None, False)
    assert curves.draw({"lr": 1.1e-3, "opt": "b"}, "skip") == (curves.trials[4], True)
    assert curves.best() == 0.6
    with pytest.raises(ReplayError, match="no trial"):
        Curves([])


def test_each_results_seconds_are_those_it_trained_a_wait_while_paused_counting_as_a_typical_step() -> None:
    rows = [{"id": "a", "seq": 0, "status": "SUCCEEDED", "parameters_json": '{"x": 1}', "final_metric": 0.9,
             "started_at": 100.0, "ended_at": 190.5, "reason": ""}]
    at = [102.0, 104.0, 106.0, 186.0, 188.0, 190.0]  # paused 78 s between the third and the fourth
    metrics = [MetricRow("a", i, "intermediate", 0.1 * i, "", t) for i, t in enumerate(at)]
    metrics.append(MetricRow("a", 0, "final", 0.9, "", 190.4))
    (r,) = recorded_trials(rows, metrics)
    assert r.seconds == (2.0, 2.0, 2.0, 2.0, 2.0, 2.0) and r.values == tuple(0.1 * i for i in range(6))
    assert r.final == 0.9 and r.final_seconds == pytest.approx(0.5) and r.complete


# Pauses each trial at its second result; once a second trial is paused, continues the first.
RUNG = """
from trialkeeper.coordinator.search.assessors import Assessor, Verdict

class Rung(Assessor):
    def __init__(self):
        self.paused = []

    def decide(self, trial_id, history):
        return Verdict.PAUSE if len(history) == 2 and trial_id not in self.paused else Verdict.CONTINUE

    def trial_paused(self, trial_id):
        self.paused.append(trial_id)
        if len(self.paused) == 2:
            self.request_continue(self.paused[0])
"""


def test_a_paused_trial_continues_from_its_checkpoint_along_its_curve_in_virtual_time(tmp_path: Path) -> None:
    (tmp_path / "replay_rung.py").write_text(RUNG)  # a name no other test loads
    recorded = [rec(0, {"lr": 1e-3, "opt": "a"}, (0.1, 0.2, 0.3, 0.4)), rec(1, {"lr": 1e-2, "opt": "a"}, (0.5, 0.6))]
    cfg = config(tmp_path, tuner={"name": "grid"}, searchSpace={
        "lr": {"_type": "choice", "_value": [1e-3, 1.1e-2]}, "opt": {"_type": "choice", "_value": ["a"]},
    }, assessor={"className": "replay_rung.Rung", "codeDirectory": str(tmp_path)})
    r = replay(cfg, recorded)
    assert r.reason == "the tuner has nothing more to propose"
    # r000000 pauses after its second result (2 s); r000001, drawn from the nearest recorded
    # configuration (t1), pauses at its second (4 s) and r000000 continues from its checkpoint:
    # its third and fourth results at 5 and 6 s. Nothing continues r000001: given up at the end.
    assert [(d.at, d.trial_id, d.kind, d.step) for d in r.decisions] == [
        (2.0, "r000000", "pause", 2), (4.0, "r000001", "pause", 2), (4.0, "r000000", "continue", 2),
    ]
    first, second = r.trials
    assert (first.status, first.drawn_from, first.exact, first.results) == ("SUCCEEDED", "t0", True, 4)
    assert first.final == 0.4
    assert (second.status, second.drawn_from, second.exact, second.results) == ("EARLY_STOPPED", "t1", False, 2)
    assert second.reason == "paused by the search, which ended without continuing it"
    assert r.nearest == 1 and r.virtual_seconds == 6.0
    assert r.improvements == [(1.0, 0.1, "r000000"), (2.0, 0.2, "r000000"), (3.0, 0.5, "r000001"),
                              (4.0, 0.6, "r000001")]
    assert r.optimum == pytest.approx(0.6) and r.reached(0.0) == 4.0 and r.gap() == 0.0


def test_max_experiment_duration_ends_the_replay_at_that_virtual_time(tmp_path: Path) -> None:
    recorded = [rec(i, {"lr": 10 ** -(1 + i % 3), "opt": "ab"[i % 2]}, tuple(0.01 * k * (i % 7) for k in range(10)))
                for i in range(30)]
    cfg = config(tmp_path, tuner={"name": "random", "classArgs": {"seed": 1}}, maxExperimentDuration="25s",
                 trialConcurrency=2)
    r = replay(cfg, recorded)
    assert r.reason == "maxExperimentDuration (25 s) reached" and r.virtual_seconds == 25.0
    assert all(at <= 25.0 for at, _, _ in r.improvements)
    assert sum(t.status == "SUCCEEDED" for t in r.trials) == 4  # two slots, 10 s each, over 25 s
    assert not math.isnan(r.wall_seconds)
    with pytest.raises(ReplayError, match="unseen must be one of nearest, skip"):
        replay(cfg, recorded, unseen="closest")


def test_asha_judges_the_first_trial_at_its_rung_as_soon_as_the_engine_says_it_saved_a_checkpoint(
    tmp_path: Path,
) -> None:
    recorded = [rec(i, {"lr": lr, "opt": "a"}, tuple(q * k for k in range(1, 5)))
                for i, (lr, q) in enumerate([(1e-3, 0.1), (1e-2, 0.3), (1e-1, 0.2)])]
    cfg = config(tmp_path, tuner={"name": "grid"}, searchSpace={
        "lr": {"_type": "choice", "_value": [1e-3, 1e-2, 1e-1]}, "opt": {"_type": "choice", "_value": ["a"]},
    }, assessor={"name": "asha", "classArgs": {"min_resource": 1, "max_resource": 4, "reduction_factor": 2}})
    r = replay(cfg, recorded)
    # r000000 reaches rung 1 with its first result (1 s), before anyone is known to save
    # checkpoints; its save right after is published by the engine, and ASHA judges it then,
    # at its rung: it waits there (alone, nothing to promote), paused after 1 result, not 2.
    assert (r.decisions[0].at, r.decisions[0].trial_id, r.decisions[0].kind, r.decisions[0].step) == (
        1.0, "r000000", "pause", 1)
    assert "waits at rung 1" in r.decisions[0].reason
    # Every other pause is judged at a result that reached a rung (1, 2 or 4 results).
    assert all(d.step in (1, 2, 4) for d in r.decisions if d.kind == "pause"), r.decisions
