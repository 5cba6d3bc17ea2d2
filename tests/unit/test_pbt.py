"""Population-based training in the decision core, in virtual time: a population of simulated
trials (a state that grows each epoch by what its learning rate gives, checkpointed every
epoch) driven through the real search by the instructions it returns. Exploit (a bottom
trial paused and continued from a top trial's checkpoint), explore (the donor's parameters
perturbed or resampled within the space), a trial lost and continued elsewhere, a resume,
several objectives, and the config's errors."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from search_sim import Sim
from trialkeeper.coordinator.config.objectives import parse
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.algorithms import create_tuner
from trialkeeper.coordinator.search.pbt import PopulationBasedTraining, explore
from trialkeeper.coordinator.search.search import (
    ContinueTrial,
    IntermediateStored,
    PauseTrial,
    Search,
    TrialContinued,
    TrialPaused,
    TrialSubmitted,
)
from trialkeeper.coordinator.search.tuners import PastTrial, TunerError

SPACE = {
    "lr": {"_type": "loguniform", "_value": [1e-4, 1.0]},
    "batch": {"_type": "choice", "_value": [16, 32, 64, 128]},
    "layers": {"_type": "randint", "_value": [1, 9]},
}
EPOCHS = 24


def gain(p: dict[str, Any]) -> float:
    """What an epoch adds: best near lr = 0.01."""
    return math.exp(-((math.log10(p["lr"]) + 2) ** 2))


def pbt(**args: Any) -> PopulationBasedTraining:
    tuner = create_tuner("pbt", None, {"population_size": 8, "perturbation_interval": 4, "seed": 3, **args}, SPACE)
    assert isinstance(tuner, PopulationBasedTraining)
    return tuner


def population(tuner: PopulationBasedTraining, size: int) -> Sim:
    """The population trained together, an epoch a tick; each epoch adds gain(parameters)."""
    return Sim(Search(tuner), lambda p, _: gain(p), epochs=EPOCHS, concurrency=size, cumulative=True)


def drawn(size: int, **args: Any) -> dict[str, dict[str, Any]]:
    """The parameters the tuner draws for the population (it is seeded)."""
    tuner = pbt(population_size=size, **args)
    return {f"t{i}": tuner.generate_parameters(i) for i in range(size)}


def test_exploit_copies_a_top_trials_checkpoint_into_a_bottom_one_and_continues_it() -> None:
    tuner = pbt()
    sim = population(tuner, 8)
    originals = drawn(8)
    sim.run(until=lambda s: bool(s.events("continued")))
    first = sim.events("paused")
    assert first and all(epoch == 4 for _, _, _, epoch in first)  # ranked at 4 results, paused at that save
    assert len(first) <= 2  # the bottom quarter of 8
    for taker, donor in tuner.exploits:
        # Ranked below the donor, one epoch ahead at most: its parameters gain less.
        assert gain(originals[f"t{taker}"]) < gain(originals[f"t{donor}"])
    for _, _, tid, _ in first:
        t = sim.trials[tid]
        donor = sim.trials[t.took_from[0]]
        # The donor's newest checkpoint when the taker was paused (the donor may have saved since).
        assert t.checkpoint is not None and donor.checkpoint is not None and t.checkpoint <= donor.checkpoint
        assert t.saved == {t.checkpoint: donor.saved[t.checkpoint]}
        assert t.parameters != originals[tid] and t.status == "waiting"
    sim.run()
    assert all(t.end is TrialStatus.SUCCEEDED for t in sim.trials.values())
    takers = {tid for tid, t in sim.trials.items() if t.took_from}
    assert takers and len(tuner.exploits) >= len(takers)
    # Each taker ends above what its own first parameters would have reached alone.
    assert all(sim.trials[tid].state > gain(originals[tid]) * EPOCHS for tid in takers)


def test_the_population_ends_better_than_the_same_trials_without_exploits() -> None:
    sim = population(pbt(population_size=10, seed=5), 10)
    originals = drawn(10, seed=5)
    sim.run()
    alone = sorted(gain(p) * EPOCHS for p in originals.values())
    together = sorted(t.state for t in sim.trials.values())
    assert sum(together) > sum(alone) and together[0] > alone[0]
    assert max(together) >= max(alone) * 0.99


def test_a_trial_lost_after_an_exploit_continues_elsewhere_from_the_state_it_took() -> None:
    tuner = pbt()
    sim = Sim(Search(tuner), lambda p, _: gain(p), epochs=EPOCHS, concurrency=8, cumulative=True, checkpoint_every=2)
    sim.run(until=lambda s: bool(s.events("continued")))
    tid = sim.events("continued")[0][2]
    t = sim.trials[tid]
    took = t.checkpoint
    assert took is not None
    sim.run(until=lambda s: t.epoch == took + 1)  # one epoch on, before its own next save
    sim.lose_environment(tid)
    donor = sim.trials[t.took_from[0]]
    assert (t.epoch, t.state) == (took, donor.saved[took])
    sim.run()
    assert t.end is TrialStatus.SUCCEEDED and t.epoch == EPOCHS
    assert [e for e in sim.events("result", tid) if e[3] == took + 1][1:]  # that epoch reported again


def test_explore_perturbs_each_parameter_within_the_space_or_resamples_it() -> None:
    rng = random.Random(1)
    donor = {"lr": 0.01, "batch": 32, "layers": 4}
    seen_lr, seen_batch, seen_layers = set(), set(), set()
    for _ in range(300):
        p = explore(donor, SPACE, list(SPACE), rng, 0.25, (1.2, 0.8))
        assert 1e-4 <= p["lr"] <= 1.0 and p["batch"] in (16, 32, 64, 128) and 1 <= p["layers"] <= 8
        seen_lr.add(round(p["lr"], 6))
        seen_batch.add(p["batch"])
        seen_layers.add(p["layers"])
    assert {0.012, 0.008} <= seen_lr and len(seen_lr) > 10  # perturbed by the factors, and resampled
    assert {16, 64} <= seen_batch  # a neighbouring option, or another drawn
    assert {5, 3} <= seen_layers  # round(4 * 1.2), round(4 * 0.8)
    only_lr = explore(donor, SPACE, ["lr"], rng, 0.0, (2.0,))
    assert only_lr == {**donor, "lr": 0.02}
    at_bound = explore({"lr": 0.9, "batch": 128, "layers": 8}, SPACE, list(SPACE), random.Random(2), 0.0, (2.0,))
    assert at_bound["lr"] == 1.0 and at_bound["layers"] == 8


def test_a_trial_lost_and_continued_elsewhere_is_one_curve_and_is_not_ranked_twice() -> None:
    tuner = pbt(population_size=4, perturbation_interval=3)
    search = Search(tuner)
    for pid in range(4):
        proposal = search.propose_trial(pid)
        assert proposal is not None
        search.handle(TrialSubmitted(f"t{pid}", pid, proposal.parameters))
    curves = {"t0": [5.0, 6, 7], "t1": [4.0, 5, 6], "t2": [3.0, 4, 5], "t3": [1.0, 1.5]}
    orders = []
    for i in range(3):
        for tid, curve in curves.items():
            if i < len(curve):
                orders += search.handle(IntermediateStored(tid, curve[i], i))
    assert orders == []  # t3 has not reached 3 results: the others are not at the bottom
    # t3 is lost after its 2nd result and continues elsewhere from its checkpoint at index 1: it reports
    # index 1 again, then goes on; its curve is one, ranked once it has 3 results.
    assert search.handle(IntermediateStored("t3", 1.2, 1)) == []
    orders = search.handle(IntermediateStored("t3", 1.4, 2))
    assert [type(o).__name__ for o in orders] == ["PauseTrial"] and orders[0].trial_id == "t3"
    orders = search.handle(TrialPaused("t3"))
    assert len(orders) == 1 and isinstance(orders[0], ContinueTrial) and orders[0].checkpoint_from == "t0"
    assert search.handle(TrialContinued("t3", orders[0].parameters)) == []
    assert tuner.exploits == [(3, 0)]
    # Continued from t0's checkpoint at index 2: its results go on from index 3 (t0's); the next ranking
    # comes perturbation_interval results after the continue, not at once.
    assert search.handle(IntermediateStored("t3", 7.5, 3)) == []
    assert search.handle(IntermediateStored("t3", 8.0, 4)) == []


def test_a_resumed_population_goes_on_with_its_stored_trials_and_parameters() -> None:
    tuner = pbt(population_size=3, perturbation_interval=2)
    search = Search(tuner)
    history = [
        PastTrial("t0", 0, {"lr": 0.01, "batch": 32, "layers": 2}, (3.0, 4.0), None, None),
        PastTrial("t1", 1, {"lr": 0.5, "batch": 16, "layers": 1}, (1.0, 1.1), None, None),
        PastTrial("t2", 2, {"lr": 0.1, "batch": 64, "layers": 5}, (2.0, 2.5, 3.0), 3.0, TrialStatus.SUCCEEDED),
    ]
    search.resume(history)
    assert search.propose_trial(3) is None  # the population is complete
    assert search.handle(IntermediateStored("t0", 4.5, 2)) == []
    assert search.handle(IntermediateStored("t1", 1.2, 2)) == []  # 2 results since its last ranking: not yet
    orders = search.handle(IntermediateStored("t1", 1.3, 3))
    assert [type(o).__name__ for o in orders] == ["PauseTrial"]
    continued = search.handle(TrialPaused("t1"))
    assert isinstance(continued[0], ContinueTrial) and continued[0].checkpoint_from == "t0"  # t2 has ended
    assert continued[0].parameters is not None and set(continued[0].parameters) == {"lr", "batch", "layers"}


def test_with_several_objectives_trials_rank_by_the_declared_ranking() -> None:
    tuner = pbt(population_size=4, perturbation_interval=2, quantile_fraction=0.25)
    # Ranked by a weighted sum: latency counts against; a trial breaking the memory bound ranks last.
    tuner.use_objectives(parse({"optimize": {"acc": "maximize", "latency": "minimize"},
                                "constraints": {"memory": {"max": 10}},
                                "rank": {"weights": {"acc": 1.0, "latency": -1.0}}}))
    search = Search(tuner)
    for pid in range(4):
        proposal = search.propose_trial(pid)
        assert proposal is not None
        search.handle(TrialSubmitted(f"t{pid}", pid, proposal.parameters))
    results = {"t0": {"acc": 0.9, "latency": 0.1, "memory": 1}, "t1": {"acc": 0.99, "latency": 0.5, "memory": 1},
               "t2": {"acc": 0.95, "latency": 0.1, "memory": 50}, "t3": {"acc": 0.7, "latency": 0.0, "memory": 1}}
    orders: list[Any] = []
    for i in range(2):
        for tid, r in results.items():
            orders += search.handle(IntermediateStored(tid, r["acc"], i, result=r))
    # Best: t0 (0.8); t3 (0.7), t1 (0.49); t2 breaks its constraint: last, and it takes t0's state.
    assert [o.trial_id for o in orders if isinstance(o, PauseTrial)] == ["t2"]
    continued = search.handle(TrialPaused("t2"))
    assert [(o.trial_id, o.checkpoint_from) for o in continued] == [("t2", "t0")]


@pytest.mark.parametrize(("args", "says"), [
    ({"population_size": 1}, "population_size must be an integer >= 2, got 1"),
    ({"perturbation_interval": 0}, "perturbation_interval must be an integer >= 1"),
    ({"quantile_fraction": 0.7}, "quantile_fraction must be a number in (0, 0.5]"),
    ({"resample_probability": 2}, "resample_probability must be a number in [0, 1]"),
    ({"perturbation_factors": [1.2, -1]}, "perturbation_factors must be a list of numbers > 0"),
    ({"mutations": ["momentum"]}, "mutations must list parameters of the search space (lr, batch, layers)"),
    ({"populaton_size": 4}, "did you mean 'population_size'"),
])
def test_bad_class_args_are_named_with_what_is_valid(args: dict[str, Any], says: str) -> None:
    with pytest.raises(TunerError, match=None) as e:
        create_tuner("pbt", None, args, SPACE)
    assert says in str(e.value)


def test_nnis_pbt_keeps_its_name() -> None:
    from trialkeeper.coordinator.search.nnialgos import is_pbt

    assert not is_pbt("pbt") and is_pbt("PBT") and is_pbt("PBTTuner")
