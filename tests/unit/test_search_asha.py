"""ASHA and asynchronous Hyperband, built in, in virtual time: promotions, pauses and
continues from checkpoints, the stopping form for trials that do not checkpoint, a promoted
trial lost with its environment, and a resume of the whole experiment mid-rung."""

from __future__ import annotations

from typing import Any

import pytest
from search_sim import Sim
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.algorithms import create_assessor, create_tuner
from trialkeeper.coordinator.search.asha import Asha, bracket_rungs
from trialkeeper.coordinator.search.assessors import AssessorError, Verdict
from trialkeeper.coordinator.search.search import IntermediateStored, PauseTrial, Search, StopTrial, TrialSubmitted
from trialkeeper.coordinator.search.tuners import NoMoreTrials, PastTrial, Tuner


class Listed(Tuner):
    """Proposes the given qualities in order, then nothing more."""

    def __init__(self, search_space: dict[str, Any], qualities: list[float]) -> None:
        super().__init__(search_space)
        self.qualities = qualities

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        if parameter_id >= len(self.qualities):
            raise NoMoreTrials("all proposed")
        return {"q": self.qualities[parameter_id]}


def flat(parameters: dict[str, Any], epoch: int) -> float:
    """A curve that ranks the same at every epoch: the quality times a rising factor."""
    return parameters["q"] * epoch / (epoch + 1)


def search(qualities: list[float], **args: Any) -> Search:
    return Search(Listed({}, qualities), create_assessor("asha", None, {"max_resource": 9, **args}))


def test_rungs_and_config_errors_name_the_field() -> None:
    assert bracket_rungs(1, 9, 3, 0) == [1, 3]
    assert bracket_rungs(1, 27, 3, 1) == [3, 9]
    assert bracket_rungs(2, 100, 2, 0) == [2, 4, 8, 16, 32, 64]
    for args, message in [
        ({}, "needs classArgs max_resource"),
        ({"max_resource": 0}, "classArgs.max_resource must be a number > 0"),
        ({"max_resource": 9, "min_resource": 9}, "max_resource (9) must be larger than min_resource (9)"),
        ({"max_resource": 9, "reduction_factor": 1}, "classArgs.reduction_factor must be an integer >= 2"),
        ({"max_resource": 9, "brackets": 4}, "classArgs.brackets must be an integer from 1 to 3"),
        ({"max_resource": 9, "optimize_mode": "max"}, "classArgs.optimize_mode must be 'maximize' or 'minimize'"),
        ({"max_resource": 9, "resource": ""}, "classArgs.resource must be 'epoch'"),
        ({"max_resource": 9, "eta": 3}, "unexpected classArgs 'eta'"),
    ]:
        with pytest.raises(AssessorError, match=message.replace("(", r"\(").replace(")", r"\)")):
            create_assessor("asha", None, args)


def test_a_trial_below_the_top_third_of_its_rung_is_paused_and_continued_once_the_rung_makes_it_promotable() -> None:
    # Arrival order at rung 1: 0.5 and 0.4 wait (fewer than eta reached it); 0.3 makes a
    # third, so 0.5 (the best) goes on; three more make six, so 0.4 is the second promoted.
    sim = Sim(search([0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02]), flat, epochs=9).run()
    paused = {e[2] for e in sim.events("paused")}
    assert {"t0", "t1"} <= paused
    # The first two reached rung 1 before any checkpoint was known: judged one result later.
    assert sim.events("paused", "t1")[0][3] == 2
    assert sim.events("paused", "t3")[0][3] == 1  # later ones at their rung, at its checkpoint
    t1_continued = sim.events("continued", "t1")
    assert t1_continued and t1_continued[0][3] == 2  # from its checkpoint
    assert t1_continued[0][0] >= sim.events("submitted", "t5")[0][0]  # once the sixth reached the rung
    # Promoted trials train on from their checkpoints: no epoch is trained twice.
    assert all(t.trained == len(t.curve) for t in sim.trials.values())
    assert sim.ended(TrialStatus.SUCCEEDED) == {"t0"}  # the one promoted from rung 3 (3 reached it)
    assert sim.trials["t0"].curve[-1] == flat({"q": 0.5}, 9)
    # Nine reached rung 1, three rung 3 (the top third each time); the rest were stopped at the end.
    assert sum(1 for t in sim.trials.values() if len(t.curve) >= 3) == 3
    assert sim.ended(TrialStatus.EARLY_STOPPED) == {f"t{i}" for i in range(1, 9)}
    assert not sim.events("stopped")  # nothing was killed at a rung while others could still come


def test_a_slow_starter_paused_at_the_first_rung_is_continued_later_and_wins_where_stopping_loses_it() -> None:
    def curve(p: dict[str, Any], epoch: int) -> float:
        return p["q"] * (epoch / 9) ** (0.6 if p["q"] == 1.0 else 0.2)  # q 1.0 starts slow, ends best

    # The slow one reaches rung 1 third, behind two fast ones: not in the top third then.
    qualities = [0.6, 0.55, 1.0, *[0.3 - i / 100 for i in range(15)]]
    paused = Sim(search(qualities), curve, epochs=9, concurrency=1).run()
    assert paused.events("paused", "t2")[0][3] == 1 and paused.events("continued", "t2")
    best = max(paused.trials.values(), key=lambda t: t.curve[-1])
    assert best.id == "t2" and best.end is TrialStatus.SUCCEEDED
    stopping = Sim(search(qualities), curve, epochs=9, concurrency=1, checkpoints=False).run()
    assert stopping.trials["t2"].end is TrialStatus.EARLY_STOPPED and len(stopping.trials["t2"].curve) == 1
    assert "t2" not in stopping.ended(TrialStatus.SUCCEEDED)


def test_trials_that_save_no_checkpoint_are_stopped_at_a_rung_instead_of_paused() -> None:
    sim = Sim(search([0.5, 0.4, 0.6, 0.2, 0.1, 0.7]), flat, epochs=9, checkpoints=False).run()
    assert not sim.events("paused") and not sim.events("continued")
    # The first one to reach rung 1 is its best so far: it goes on. The second is worse
    # than the first (the best ceil(2/3) = 1 go on): stopped one result after its rung,
    # once it is known that it saved no checkpoint; the others, known by then, at it.
    assert sim.trials["t0"].end is TrialStatus.SUCCEEDED or len(sim.trials["t0"].curve) > 3
    assert sim.trials["t1"].end is TrialStatus.EARLY_STOPPED and len(sim.trials["t1"].curve) == 2
    assert sim.trials["t3"].end is TrialStatus.EARLY_STOPPED and len(sim.trials["t3"].curve) == 1
    assert sim.trials["t5"].end is TrialStatus.SUCCEEDED  # the best: never stopped


def test_a_trial_reaching_its_rung_before_any_checkpoint_is_judged_once_it_has_saved_one() -> None:
    s = search([0.5, 0.4, 0.3])
    for i in range(2):
        s.propose_trial(i)
        s.handle(TrialSubmitted(f"t{i}", i, {"q": 0.5 - i / 10}))
    assert s.handle(IntermediateStored("t0", 0.5, 0, False)) == []  # nobody saved one yet: it waits
    assert s.handle(IntermediateStored("t1", 0.4, 0, False)) == []
    # t0 saved its checkpoint after that result: at the next one it is judged at rung 1, paused.
    assert s.handle(IntermediateStored("t0", 0.6, 1, True)) == [
        PauseTrial("t0", "paused by the assessor after 2 intermediate results")
    ]
    # t1 did not, although t0 did: trials checkpoint or not alike, but its own silence decides.
    assert s.handle(IntermediateStored("t1", 0.45, 1, False)) == [
        StopTrial("t1", "stopped early by the assessor after 2 intermediate results")
    ]


def test_a_save_heard_before_the_next_result_judges_the_first_trials_at_their_rung() -> None:
    sim = Sim(search([0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02]), flat, epochs=9, hears_checkpoints=True).run()
    assert sim.events("paused", "t0")[0][3] == 1 and sim.events("paused", "t1")[0][3] == 1  # not one result late
    assert all(e[3] in (1, 3) for e in sim.events("paused"))
    assert all(t.trained == len(t.curve) for t in sim.trials.values())
    assert sim.ended(TrialStatus.SUCCEEDED) == {"t0"}


def test_hyperband_shares_trials_among_brackets_each_with_its_own_rungs() -> None:
    asha = Asha(max_resource=27, reduction_factor=3, brackets=3)
    assert [[r.resource for r in rungs] for rungs in asha.rungs] == [[1, 3, 9], [3, 9], [9]]
    s = Search(Listed({}, [0.1 * (i % 7) + 0.05 for i in range(30)]), asha)
    sim = Sim(s, flat, epochs=27, concurrency=3).run()
    shares = [sum(1 for t in asha._trials.values() if t.bracket == b) for b in range(3)]
    assert shares == [18, 8, 4]  # Hyperband's eta**s / (s + 1): 27/4, 9/3, 3/2, as 9 : 4 : 2
    brackets = {trial_id: t.bracket for trial_id, t in asha._trials.items()}
    # Each pause is at a rung of the trial's bracket (for the first three, which reached one
    # before any checkpoint was known, one result later), and every bracket pauses some.
    rungs = [[1, 3, 9], [3, 9], [9]]
    for _, _, trial_id, epoch in sim.events("paused"):
        b = brackets[trial_id]
        assert epoch in rungs[b] or (epoch - 1 in rungs[b] and sim.trials[trial_id].parameter_id < 3)
    assert {brackets[e[2]] for e in sim.events("paused")} == {0, 1, 2}
    assert all(t.trained == len(t.curve) for t in sim.trials.values())
    assert len(sim.ended(TrialStatus.SUCCEEDED)) >= 2  # each bracket promotes to the end


def test_a_promoted_trial_lost_with_its_environment_goes_on_from_its_checkpoint_without_being_judged_again() -> None:
    qualities = [0.5, 0.4, *[0.3 - i / 100 for i in range(13)]]
    sim = Sim(search(qualities), flat, epochs=9, checkpoint_every=2)
    sim.run(until=lambda s: "t0" in s.trials and len(s.trials["t0"].curve) == 5 and s.trials["t0"].status == "running")
    pauses = len(sim.events("paused", "t0"))
    sim.lose_environment("t0")  # its last checkpoint is at epoch 4: epoch 5 is trained again, elsewhere
    assert sim.trials["t0"].epoch == 4
    sim.run()
    t0 = sim.trials["t0"]
    assert t0.end is TrialStatus.SUCCEEDED and len(t0.curve) == 9 and t0.trained == 10
    assert len(sim.events("paused", "t0")) == pauses  # promoted: not paused again after the loss
    assert max(sim.trials.values(), key=lambda t: t.curve[-1]).id == "t0"


def test_a_waiting_trial_the_user_continues_passes_its_rung() -> None:
    sim = Sim(search([0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02]), flat, epochs=9)
    sim.run(until=lambda s: "t4" in s.trials and s.trials["t4"].status == "paused")
    sim.continue_trial(sim.trials["t4"])  # trialkeeper continue: not the search's doing
    sim.run()
    t4 = sim.trials["t4"]
    assert len(t4.curve) >= 3 and [e[3] for e in sim.events("paused", "t4")][1:] in ([], [3])


def test_once_no_new_configuration_comes_the_final_rungs_promote_their_best_third_rounded_up() -> None:
    # Five configurations: rung 1 promotes floor(5/3) = 1, which then waits alone at rung 3.
    # With nothing more to come, rung 3 is final: its best ceil(1/3) = 1 trains to the end.
    sim = Sim(search([0.5, 0.4, 0.3, 0.2, 0.1]), flat, epochs=9).run()
    assert sim.ended(TrialStatus.SUCCEEDED) == {"t0"}
    assert sim.events("paused", "t0")[-1][3] == 3 and sim.events("continued", "t0")[-1][3] == 3
    # Then rung 1's best ceil(5/3) = 2 went on (0.4 too), and waited at rung 3 behind 0.5.
    assert len(sim.trials["t1"].curve) == 3 and sim.trials["t1"].end is TrialStatus.EARLY_STOPPED
    assert all(len(sim.trials[f"t{i}"].curve) <= 2 for i in range(2, 5))


@pytest.mark.parametrize("resource", [{}, {"min_resource": 100, "max_resource": 900, "resource": "step"}])
def test_a_stopped_experiment_resumed_mid_rung_keeps_waiting_trials_paused_and_promotes_them_later(
    resource: dict[str, Any],
) -> None:
    qualities = [0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02]
    sim = Sim(search(qualities, **resource), flat, epochs=9)
    # t0 and t1 wait at rung 1; t2 arrives and t0 goes on; stop the experiment then.
    sim.run(until=lambda s: "t3" in s.trials and len(s.trials["t3"].curve) >= 1)
    assert sim.trials["t1"].status == "paused"
    history = sim.stop_experiment()
    assert {t.trial_id for t in history if t.paused} >= {"t1", "t0", "t3"}
    resumed = search(qualities, **resource)
    sim.resume(resumed, history)
    assert resumed.holds("t1")  # waits at rung 1: not continued by the resume
    assert not resumed.holds("t0")  # promoted: continued first
    assert sim.trials["t0"].status == "waiting" and sim.trials["t1"].status == "paused"
    assert sim.submitted == len(history)  # the resumed loop counts the trials the store holds
    sim.run()
    assert sim.events("continued", "t1")  # promoted once six reached rung 1
    assert all(t.trained == len(t.curve) for t in sim.trials.values())  # nothing trained twice
    assert sim.ended(TrialStatus.SUCCEEDED) == {"t0"}
    assert sum(1 for t in sim.trials.values() if len(t.curve) >= 3) == 3


@pytest.mark.parametrize(
    ("name", "args"), [("random", {"seed": 1}), ("optuna", {"sampler": "TPE", "seed": 1}), ("grid", {})]
)
def test_any_tuner_proposes_the_configurations_asha_judges(name: str, args: dict[str, Any]) -> None:
    space = {"q": {"_type": "quniform", "_value": [0.05, 1, 0.05]}}
    s = Search(create_tuner(name, None, args, space), create_assessor("asha", None, {"max_resource": 9}))
    sim = Sim(s, flat, epochs=9, max_trials=15, concurrency=3).run()
    assert len(sim.trials) == 15 and s.failure == ""
    assert sim.outcome is not None and sim.outcome.reason == "maxTrialNumber (15) reached"  # the pass ended it
    assert sim.events("paused")
    # The grid proposes ever better ones: each goes on at once, and those before it wait.
    assert sim.events("continued") or name == "grid"
    assert all(t.trained == len(t.curve) for t in sim.trials.values())  # continued, never trained again
    # What trained to the end is the best of what reached the last rung.
    finished = sim.ended(TrialStatus.SUCCEEDED)
    at_top = [t for t in sim.trials.values() if len(t.curve) >= 3]
    assert finished and max(at_top, key=lambda t: t.curve[2]).id in finished


def test_a_result_key_as_the_resource() -> None:
    # Each result carries "step": 100 per epoch; rungs at 100 and 300 steps, that is epochs 1 and 3.
    s = search([0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02], min_resource=100, max_resource=900,
               resource="step")
    sim = Sim(s, flat, epochs=9).run()
    assert {e[3] for e in sim.events("paused") if sim.trials[e[2]].parameter_id >= 2} <= {1, 3}
    assert sim.ended(TrialStatus.SUCCEEDED) == {"t0"}
    assert sum(1 for t in sim.trials.values() if len(t.curve) >= 3) == 3


class Promoting(Tuner):
    """Two configurations at budget 1, then the better one again at budget 3 (a promotion)."""

    budget_parameter = "TRIAL_BUDGET"

    def __init__(self, search_space: dict[str, Any]) -> None:
        super().__init__(search_space)
        self.plan = [({"x": 1, "TRIAL_BUDGET": 1}, None), ({"x": 2, "TRIAL_BUDGET": 1}, None),
                     ({"x": 2, "TRIAL_BUDGET": 3}, 1), ({"x": 3, "TRIAL_BUDGET": 1}, None)]
        self.told_no_more = 0

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        if self.told_no_more and self.plan[parameter_id][1] is None:
            raise NoMoreTrials("only promotions now")
        return self.plan[parameter_id][0]

    def configuration_of(self, parameter_id: int) -> int | None:
        return self.plan[parameter_id][1]

    def only_promotions(self) -> bool:
        self.told_no_more += 1
        return True


def test_max_trial_number_counts_configurations_and_the_tuner_goes_on_with_promotions() -> None:
    s = Search(Promoting({}))
    for pid in range(2):
        proposal = s.propose_trial(pid)
        assert proposal is not None and not proposal.promotes
        s.handle(TrialSubmitted(f"t{pid}", pid, proposal.parameters))
    assert s.configurations == 2
    assert s.no_more_configurations() and s.no_more_configurations()  # a limit of 2: asked once
    assert s.tuner.told_no_more == 1  # type: ignore[attr-defined]
    promoted = s.propose_trial(2)
    assert promoted is not None and promoted.promotes and promoted.parameters["TRIAL_BUDGET"] == 3
    s.handle(TrialSubmitted("t2", 2, promoted.parameters))
    assert s.configurations == 2  # the promotion is no new configuration
    assert s.propose_trial(3) is None and s.exhausted
    # After a resume, trials that differ only in their budget ran one configuration.
    resumed = Search(Promoting({}))
    resumed.resume([PastTrial(f"t{i}", i, p, (), 1.0, TrialStatus.SUCCEEDED) for i, (p, _) in enumerate(
        Promoting({}).plan[:3])])
    assert resumed.configurations == 2


def _shares(curve: Any, qualities: list[float]) -> tuple[Asha, list[int]]:
    asha = Asha(max_resource=9, reduction_factor=3, brackets="adaptive")
    Sim(Search(Listed({}, qualities), asha), curve, epochs=9, concurrency=2).run()
    return asha, [sum(1 for t in asha._trials.values() if t.bracket == b) for b in range(len(asha.rungs))]


def misleading(parameters: dict[str, Any], epoch: int) -> float:
    """The configurations that end best look worst until their last epoch."""
    q = parameters["q"]
    return q if epoch == 9 else (1 - q) * epoch / 10


def test_adaptive_brackets_give_the_bracket_without_rungs_more_configurations_where_early_results_mislead() -> None:
    qualities = [((i * 37) % 101) / 101 for i in range(90)]
    asha, shares = _shares(misleading, qualities)
    assert [[r.resource for r in rungs] for rungs in asha.rungs] == [[1, 3], [3], []]  # every bracket
    # Hyperband would give the bracket without rungs 2 of every 11 (9/3 : 3/2 : 1 = 6 : 3 : 2);
    # its finishers are the best, the others' are the worst, so it gets most of what follows.
    assert shares[2] > 0.45 * len(qualities), shares
    hits = sorted(asha.pay.finals, reverse=True)[:10]
    assert all(b == 2 for _, b in hits), hits
    # Where early results rank as the final ones, every bracket's finishers are among the best
    # about as often, and the shares stay near Hyperband's.
    _, faithful = _shares(flat, qualities)
    assert faithful[2] < 0.3 * len(qualities) and faithful[0] > faithful[1] > 0, faithful


def test_adaptive_brackets_are_rebuilt_with_what_each_bracket_paid_after_a_resume() -> None:
    qualities = [((i * 37) % 101) / 101 for i in range(40)]
    asha = Asha(max_resource=9, reduction_factor=3, brackets="adaptive")
    sim = Sim(Search(Listed({}, qualities), asha), misleading, epochs=9, concurrency=2)
    sim.run(until=lambda s: len(asha.pay.finals) >= 8)
    before = sorted(asha.pay.finals)
    history = sim.stop_experiment()
    resumed = Asha(max_resource=9, reduction_factor=3, brackets="adaptive")
    sim.resume(Search(Listed({}, qualities), resumed), history)
    assert sorted(s for s, _ in resumed.pay.finals) == sorted(s for s, _ in before)
    sim.run()
    assert {t.end for t in sim.trials.values()} <= {TrialStatus.SUCCEEDED, TrialStatus.EARLY_STOPPED}
    assert sum(1 for t in resumed._trials.values() if t.bracket == 2) > sum(
        1 for t in resumed._trials.values() if t.bracket == 1)


def test_adaptive_brackets_refuse_another_word_by_name() -> None:
    with pytest.raises(AssessorError, match=r"classArgs.brackets must be an integer from 1 to 3 .* or 'adaptive'"):
        create_assessor("asha", None, {"max_resource": 9, "brackets": "auto"})
    assert len(create_assessor("asha", None, {"max_resource": 27, "brackets": "adaptive"}).rungs) == 4


def test_a_result_that_jumps_past_max_resource_counts_for_its_bracket_and_stops_the_trial() -> None:
    asha = Asha(max_resource=9, resource="step", brackets="adaptive", optimize_mode="minimize")
    asha.trial_started("t0", 0, {})
    asha.result_reported("t0", {"default": 0.25, "step": 12})
    assert asha.decide("t0", [0.25]) is Verdict.STOP
    assert asha.pay.finals == [(-0.25, asha._trials["t0"].bracket)]  # smaller is better: ranked by its negative
