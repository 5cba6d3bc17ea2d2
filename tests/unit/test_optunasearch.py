"""Optuna's samplers and pruners behind trialkeeper's interfaces, with the real optuna."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from search_sim import Sim
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import make_search as _search
from trialkeeper.coordinator.search.algorithms import create_assessor, create_tuner
from trialkeeper.coordinator.search.asha import Asha
from trialkeeper.coordinator.search.optunasearch import (
    OptunaTuner,
    create_optuna_mirror,
    flatten,
    optuna_space_issues,
)
from trialkeeper.coordinator.search.search import (
    IntermediateStored,
    Search,
    TrialContinued,
    TrialEnded,
    TrialPaused,
    TrialSubmitted,
)
from trialkeeper.coordinator.search.space import SearchSpaceError, validate_search_space
from trialkeeper.coordinator.search.tuners import PastTrial, TunerError

SPACE: dict[str, Any] = {
    "lr": {"_type": "loguniform", "_value": [1e-4, 1e-1]},
    "dropout": {"_type": "uniform", "_value": [0.0, 0.5]},
    "layers": {"_type": "randint", "_value": [1, 4]},
    "units": {"_type": "quniform", "_value": [32, 256, 32]},
    "momentum": {"_type": "quniform", "_value": [0.0, 0.9, 0.3]},
    "opt": {"_type": "choice", "_value": [
        "adam",
        {"_name": "sgd", "nesterov": {"_type": "choice", "_value": [True, False]},
         "wd": {"_type": "loguniform", "_value": [1e-6, 1e-3]}},
    ]},
    "shape": {"_type": "choice", "_value": [[1, 2], [3, 4]]},
}


def check_in_space(p: dict[str, Any]) -> None:
    assert 1e-4 <= p["lr"] <= 1e-1 and 0 <= p["dropout"] <= 0.5
    assert p["layers"] in (1, 2, 3) and isinstance(p["layers"], int)
    assert p["units"] in range(32, 257, 32) and isinstance(p["units"], int)
    assert p["momentum"] in (0.0, 0.3, 0.6, 0.9)
    assert p["shape"] in ([1, 2], [3, 4])
    if p["opt"] == "adam":
        return
    assert p["opt"]["_name"] == "sgd" and set(p["opt"]) == {"_name", "nesterov", "wd"}
    assert 1e-6 <= p["opt"]["wd"] <= 1e-3


@pytest.mark.parametrize("sampler", ["TPE", "CMA-ES", "NSGA-II", "QMC", "random"])
def test_each_sampler_proposes_points_of_the_space_in_nni_form(sampler: str) -> None:
    tuner = create_tuner("optuna", None, {"sampler": sampler, "seed": 3}, SPACE)
    search = Search(tuner)
    for pid in range(12):
        p = search.propose(pid)
        assert p is not None
        check_in_space(p)
        validate_search_space(SPACE)
        search.handle(TrialSubmitted(f"t{pid}", pid, p))
        search.handle(TrialEnded(f"t{pid}", TrialStatus.SUCCEEDED, p["dropout"]))
    assert search.failure == ""
    trials = tuner.study.trials  # type: ignore[attr-defined]
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 12
    # Nested choice: the option's parameters exist only when it is chosen.
    for t in trials:
        assert ("opt/sgd/wd" in t.params) == (t.params["opt"] == "sgd")


def same_params(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal, floats up to the noise NNI's tidy quantized values leave."""
    return a.keys() == b.keys() and all(
        a[k] == pytest.approx(b[k]) if isinstance(a[k], float) else a[k] == b[k] for k in a
    )


def test_flatten_is_what_suggest_set() -> None:
    tuner = create_tuner("optuna", None, {"seed": 1}, SPACE)
    for pid in range(8):
        p = tuner.generate_parameters(pid)
        assert same_params(flatten(SPACE, p), tuner.trial(pid).params)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"_type": "normal", "_value": [0, 1]}, "normal cannot be given to Optuna: Optuna's distributions are bounded"),
        ({"_type": "qloguniform", "_value": [1, 100, 1]}, "Optuna has no quantized log-uniform"),
        ({"_type": "quniform", "_value": [1, 10, 4]}, "make low and high multiples of q"),
        (
            {"_type": "choice", "_value": [{"_name": "a", "s": {"_type": "lognormal", "_value": [0, 1]}}]},
            "lognormal cannot",
        ),
    ],
)
def test_types_optuna_cannot_express_are_refused_with_the_reason(spec: dict[str, Any], reason: str) -> None:
    issues = optuna_space_issues({"p": spec})
    assert len(issues) == 1 and reason in issues[0][1]
    with pytest.raises(SearchSpaceError) as info:
        create_tuner("optuna", None, {}, {"p": spec})
    assert reason in str(info.value) and "search_space.p" in str(info.value)


def test_bad_optuna_class_args_are_named() -> None:
    with pytest.raises(TunerError, match="unknown Optuna sampler 'sobol'; valid: bo, cmaes, gp, nsga2"):
        create_tuner("optuna", None, {"sampler": "sobol"}, SPACE)
    with pytest.raises(TunerError, match="unexpected classArgs 'pruner' for tuner 'optuna'"):
        create_tuner("optuna", None, {"pruner": "median"}, SPACE)
    with pytest.raises(TunerError, match=r"classArgs.sampler_args for TPESampler: unknown 'n_startup'; valid: .*"
                                         r"\bn_startup_trials\b"):
        create_tuner("optuna", None, {"sampler_args": {"n_startup": 3}}, SPACE)
    with pytest.raises(TunerError, match=r"sampler_args for GaussianProcessSampler: unknown 'refine', 'start'; valid: "
                                         r"seed, n_startup_trials, candidates, max_points, local, refine_from, "
                                         r"curve_every$"):
        create_tuner("optuna", None, {"sampler": "bo", "sampler_args": {"start": 3, "refine": 30}}, SPACE)


def feed(search: Search, tid: str, pid: int, curve: list[float]) -> TrialStatus:
    p = search.propose(pid)
    assert p is not None
    search.handle(TrialSubmitted(tid, pid, p))
    for v in curve:
        if search.handle(IntermediateStored(tid, v)):
            search.handle(TrialEnded(tid, TrialStatus.EARLY_STOPPED, None))
            return TrialStatus.EARLY_STOPPED
    search.handle(TrialEnded(tid, TrialStatus.SUCCEEDED, curve[-1]))
    return TrialStatus.SUCCEEDED


@pytest.mark.parametrize("tuner_name", ["optuna", "random"])
@pytest.mark.parametrize("pruner", ["median", "percentile", "successive halving", "hyperband", "wilcoxon"])
def test_pruners_stop_a_bad_curve_and_keep_good_ones(tuner_name: str, pruner: str) -> None:
    tuner = create_tuner(tuner_name, None, {"seed": 0}, SPACE)
    args: dict[str, Any] = {
        "median": {"pruner_args": {"n_startup_trials": 2, "n_warmup_steps": 1}},
        "percentile": {"pruner_args": {"percentile": 50.0, "n_startup_trials": 2, "n_warmup_steps": 1}},
        "successive halving": {"pruner_args": {"min_resource": 1, "reduction_factor": 2}},
        "hyperband": {"pruner_args": {"min_resource": 1, "max_resource": 8, "reduction_factor": 2}},
        "wilcoxon": {"pruner_args": {"p_threshold": 0.1, "n_startup_steps": 1}},
    }[pruner]
    search = Search(tuner, create_assessor("optuna", None, {"pruner": pruner, **args}, tuner=tuner))
    good = [0.5 + 0.05 * i for i in range(8)]
    for i in range(8):
        assert feed(search, f"g{i}", i, good) is TrialStatus.SUCCEEDED
    bad = [0.01 * i for i in range(8)]
    ends = [feed(search, f"bad{i}", 8 + i, bad) for i in range(4)]
    # Hyperband puts each trial in one of its brackets, and judges it against that bracket.
    stopped = [e is TrialStatus.EARLY_STOPPED for e in ends]
    assert any(stopped) if pruner == "hyperband" else all(stopped)
    assert search.failure == ""


def test_storage_holds_the_study_and_a_resume_goes_on_from_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = {"sampler": "TPE", "sampler_args": {"n_startup_trials": 3}, "seed": 5, "storage": url}
    first = create_tuner("optuna", None, args, SPACE, experiment_id="e1")
    search = Search(first)
    history = []
    for pid in range(5):
        p = search.propose(pid)
        assert p is not None
        search.handle(TrialSubmitted(f"t{pid}", pid, p))
        search.handle(IntermediateStored(f"t{pid}", p["dropout"] / 2))
        if pid < 4:
            search.handle(TrialEnded(f"t{pid}", TrialStatus.SUCCEEDED, p["dropout"]))
        history.append(PastTrial(f"t{pid}", pid, p, (p["dropout"] / 2,), p["dropout"] if pid < 4 else None,
                                 TrialStatus.SUCCEEDED if pid < 4 else None))
    study = optuna.load_study(study_name="trialkeeper-e1", storage=url)  # what optuna-dashboard reads
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4 + ["RUNNING"]
    assert study.best_value == max(h.final for h in history if h.final is not None)
    assert study.trials[0].intermediate_values == {0: history[0].parameters["dropout"] / 2}

    # A new coordinator: the tuner is rebuilt, hears the history, the running trial ends.
    resumed_tuner = create_tuner("optuna", None, args, SPACE, experiment_id="e1")
    resumed = Search(resumed_tuner)
    resumed.resume(history)
    resumed.handle(TrialEnded("t4", TrialStatus.SUCCEEDED, 0.42))
    p = resumed.propose(5)
    assert p is not None
    study = optuna.load_study(study_name="trialkeeper-e1", storage=url)
    assert len(study.trials) == 6 and study.trials[4].value == 0.42 and study.trials[5].number == 5


def test_an_in_memory_study_is_rebuilt_from_the_history_on_resume() -> None:
    args = {"seed": 2}
    history = [
        PastTrial(f"t{i}", i, p, (0.1 * i,), 0.1 * i, TrialStatus.SUCCEEDED)
        for i, p in enumerate(create_tuner("optuna", None, args, SPACE).generate_parameters(i) for i in range(4))
    ]
    tuner = create_tuner("optuna", None, args, SPACE)
    Search(tuner).resume(history)
    trials = tuner.study.trials  # type: ignore[attr-defined]
    assert [t.value for t in trials] == [0.0, 0.1, 0.2, pytest.approx(0.3)]
    assert all(same_params(flatten(SPACE, h.parameters), t.params) for h, t in zip(history, trials))


def test_the_gp_sampler_works_or_names_what_to_install() -> None:
    import importlib.util

    missing = [m for m in ("torch", "scipy") if importlib.util.find_spec(m) is None]
    if missing:
        with pytest.raises(
            TunerError,
            match=(
                f"Optuna's GPSampler needs the package '{missing[0]}', which is not installed: "
                f"pip install {missing[0]}"
            ),
        ):
            create_tuner("optuna", None, {"sampler": "GP"}, SPACE)
    else:
        tuner = create_tuner("optuna", None, {"sampler": "GP", "seed": 0}, SPACE)
        check_in_space(tuner.generate_parameters(0))


def test_a_mirror_copies_a_builtin_tuners_trials_into_a_study_and_resumes_without_duplicates(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'mirror.db'}"
    search = Search(
        create_tuner("random", None, {"seed": 1}, SPACE), mirror=create_optuna_mirror(url, "m", SPACE, "minimize")
    )
    history = []
    for pid in range(4):
        p = search.propose(pid)
        assert p is not None
        search.handle(TrialSubmitted(f"t{pid}", pid, p))
        search.handle(IntermediateStored(f"t{pid}", 0.5))
        if pid < 3:
            search.handle(TrialEnded(f"t{pid}", TrialStatus.SUCCEEDED, p["dropout"]))
        history.append(PastTrial(f"t{pid}", pid, p, (0.5,), p["dropout"] if pid < 3 else None,
                                 TrialStatus.SUCCEEDED if pid < 3 else None))
    study = optuna.load_study(study_name="m", storage=url)
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3 + ["RUNNING"]
    assert all(same_params(flatten(SPACE, h.parameters), t.params) for h, t in zip(history, study.trials))
    assert study.best_value == min(h.final for h in history if h.final is not None)

    # After a resume the study is taken as it is: the running trial ends, a new one joins.
    resumed = Search(
        create_tuner("random", None, {"seed": 1}, SPACE), mirror=create_optuna_mirror(url, "m", SPACE, "minimize")
    )
    resumed.resume(history)
    resumed.handle(TrialEnded("t3", TrialStatus.EARLY_STOPPED, None))
    p = resumed.propose(4)
    assert p is not None
    resumed.handle(TrialSubmitted("t4", 4, p))
    study = optuna.load_study(study_name="m", storage=url)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3 + ["PRUNED", "RUNNING"]
    assert study.trials[3].intermediate_values == {0: 0.5}


def test_a_mirror_that_fails_is_dropped_and_the_search_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'gone.db'}"
    mirror = create_optuna_mirror(url, "m", SPACE, "maximize")
    search = Search(create_tuner("random", None, {"seed": 1}, SPACE), mirror=mirror)
    optuna.delete_study(study_name="m", storage=url)  # someone deletes the study under it
    p = search.propose(0)
    assert p is not None
    search.handle(TrialSubmitted("t0", 0, p))
    assert search.mirror is None and search.failure == "" and search.propose(1) is not None
    assert "the Optuna study mirroring the experiment raised in adopt" in caplog.text


def test_a_mirror_names_its_field_for_a_space_optuna_cannot_hold() -> None:
    with pytest.raises(SearchSpaceError, match=r"optunaStorage: search_space.n: normal cannot be given to Optuna"):
        create_optuna_mirror("sqlite://", "m", {"n": {"_type": "normal", "_value": [0, 1]}}, "maximize")
    with pytest.raises(TunerError, match=r"optunaStorage: NNI's Batch tuner"):
        create_optuna_mirror("sqlite://", "m", {"c": {"_type": "choice", "_value": [{"a": 1}]}}, "maximize", batch=True)


@pytest.mark.parametrize(
    "tuner", [{"name": "optuna", "classArgs": {"seed": 1}}, {"name": "random", "classArgs": {"seed": 1}}]
)
def test_optuna_storage_is_an_optuna_tuners_own_study_and_a_mirror_for_any_other(
    tmp_path: Path, tuner: dict[str, Any]
) -> None:
    url = f"sqlite:///{tmp_path / 'exp.db'}"
    config = parse_config(
        {
            "trialCommand": "python t.py",
            "trialConcurrency": 1,
            "trainingService": {"platform": "local"},
            "searchSpace": SPACE,
            "tuner": tuner,
            "optunaStorage": url,
        },
        tmp_path,
    )
    search = _search(config, "e7")
    # One study either way, named after the experiment: never a second copy of the trials.
    assert (search.mirror is None) == (tuner["name"] == "optuna")
    p = search.propose(0)
    assert p is not None
    search.handle(TrialSubmitted("t0", 0, p))
    search.handle(TrialEnded("t0", TrialStatus.SUCCEEDED, 0.7))
    study = optuna.load_study(study_name="trialkeeper-e7", storage=url)
    assert [t.value for t in study.trials] == [0.7]


def test_a_storage_that_cannot_be_opened_is_named_without_its_password() -> None:
    with pytest.raises(TunerError) as e:
        create_tuner("optuna", None, {"storage": "mysql://ann:hunter2@127.0.0.1:9/db"}, SPACE)
    assert "classArgs.storage 'mysql://ann:***@127.0.0.1:9/db': cannot open the study" in str(e.value)
    assert "hunter2" not in str(e.value)


def test_a_mirror_keeps_parameters_outside_the_space_as_user_attributes() -> None:
    mirror = create_optuna_mirror("sqlite://", "m", SPACE, "maximize")
    p = create_tuner("random", None, {"seed": 3}, SPACE).generate_parameters(0)
    mirror.adopt(0, {**p, "TRIAL_BUDGET": 9})  # Hyperband and BOHB add the budget they chose
    (trial,) = mirror.study.trials
    assert trial.user_attrs["TRIAL_BUDGET"] == 9 and "TRIAL_BUDGET" not in trial.params
    assert same_params(flatten(SPACE, p), trial.params)


# ---- paused trials: what TPE learns from them ------------------------------------------------------

ONE: dict[str, Any] = {"x": {"_type": "uniform", "_value": [0.0, 1.0]}}


def near(x: float, best: float = 0.9) -> float:
    return 1.0 - abs(x - best)


def start_and_pause(search: Search, tid: str, pid: int, results: int = 2, best: float = 0.9) -> dict[str, Any]:
    p = search.propose(pid)
    assert p is not None
    search.handle(TrialSubmitted(tid, pid, p))
    for step in range(results):
        search.handle(IntermediateStored(tid, near(p["x"], best) * (step + 1) / results))
    search.handle(TrialPaused(tid, "waits at a rung"))
    return p


def test_a_paused_trial_is_told_pruned_with_what_it_reached_and_tpe_learns_from_it() -> None:
    told = create_tuner("optuna", None, {"sampler": "TPE", "seed": 0, "tell_paused": True}, ONE)
    assert isinstance(told, OptunaTuner)
    search = Search(told)
    params = [start_and_pause(search, f"t{pid}", pid) for pid in range(20)]
    # What TPE reads of its study: the COMPLETE and PRUNED trials, a PRUNED one ranked by its last step's value.
    seen = told.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert [t.state for t in seen] == [TrialState.PRUNED] * 20
    assert [t.intermediate_values for t in seen] == [{0: near(p["x"]) / 2, 1: near(p["x"])} for p in params]
    assert [t.params["x"] for t in seen] == [p["x"] for p in params]

    def proposed_after_pauses(tell_paused: bool, best: float) -> float:
        """The mean of what TPE proposes after 20 trials paused with curves that peak at ``best``."""
        search = Search(create_tuner("optuna", None, {"seed": 0, "tell_paused": tell_paused}, ONE))
        for pid in range(20):
            start_and_pause(search, f"t{pid}", pid, best=best)
        xs = [p["x"] for p in (search.propose(pid) for pid in range(20, 50)) if p is not None]
        return sum(xs) / len(xs)

    # Told: TPE proposes towards where the paused trials did best.
    assert proposed_after_pauses(True, 0.9) > proposed_after_pauses(True, 0.1) + 0.2
    # tell_paused: false (the default) leaves them RUNNING: TPE learns nothing from them.
    assert proposed_after_pauses(False, 0.9) == proposed_after_pauses(False, 0.1)
    with pytest.raises(TunerError, match="classArgs.tell_paused must be true or false, got 'no'"):
        create_tuner("optuna", None, {"tell_paused": "no"}, ONE)


def test_a_continued_trial_goes_on_in_a_fresh_record_and_ends_there() -> None:
    tuner = create_tuner("optuna", None, {"sampler": "TPE", "seed": 1, "tell_paused": True}, ONE)
    assert isinstance(tuner, OptunaTuner)
    search = Search(tuner)
    p = start_and_pause(search, "t0", 0)
    given_up = start_and_pause(search, "t1", 1, results=1)
    search.handle(TrialContinued("t0"))
    search.handle(IntermediateStored("t0", 0.95))
    search.handle(TrialEnded("t0", TrialStatus.SUCCEEDED, 0.97))
    search.handle(TrialEnded("t1", TrialStatus.EARLY_STOPPED, None))  # paused, never continued
    trials = tuner.study.get_trials()
    assert [(t.number, t.state) for t in trials] == [(0, TrialState.PRUNED), (1, TrialState.PRUNED),
                                                     (2, TrialState.COMPLETE)]
    frozen, stopped, ended = trials
    assert frozen.intermediate_values == {0: near(p["x"]) / 2, 1: near(p["x"])} and frozen.params == p
    assert frozen.value == near(p["x"])
    assert stopped.intermediate_values == {0: near(given_up["x"])}
    assert ended.params == p and ended.value == 0.97
    assert ended.intermediate_values == {**frozen.intermediate_values, 2: 0.95}
    assert ended.user_attrs == {"trialkeeper_parameter_id": 0, "trialkeeper_continues": 0}
    assert tuner.trial(0) is None and tuner.trial(1) is None


def test_a_trial_paused_at_a_resume_keeps_its_pruned_record_and_goes_on_when_continued(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = {"sampler": "TPE", "seed": 3, "storage": url, "tell_paused": True}
    search = Search(create_tuner("optuna", None, args, ONE, experiment_id="e1"))
    p = start_and_pause(search, "t0", 0)
    history = [PastTrial("t0", 0, p, (near(p["x"]) / 2, near(p["x"])), None, None, paused=True)]

    resumed = create_tuner("optuna", None, args, ONE, experiment_id="e1")
    again = Search(resumed)
    again.resume(history)
    assert [t.state for t in resumed.study.get_trials()] == [TrialState.PRUNED]  # nothing told twice
    again.handle(TrialContinued("t0"))
    again.handle(IntermediateStored("t0", 0.9))
    again.handle(TrialEnded("t0", TrialStatus.SUCCEEDED, 0.91))
    study = optuna.load_study(study_name="trialkeeper-e1", storage=url)
    # Optuna gives a PRUNED trial its last intermediate value as its value.
    pruned, ended = study.trials
    assert (pruned.state, pruned.value, ended.state, ended.value) == (
        TrialState.PRUNED, near(p["x"]), TrialState.COMPLETE, 0.91)
    assert study.trials[1].intermediate_values == {0: near(p["x"]) / 2, 1: near(p["x"]), 2: 0.9}

    # Without storage, the study is rebuilt from the history: the paused trial as PRUNED.
    memory = create_tuner("optuna", None, {"sampler": "TPE", "seed": 3, "tell_paused": True}, ONE)
    Search(memory).resume(history)
    (rebuilt,) = memory.study.get_trials()  # type: ignore[attr-defined]
    assert rebuilt.state == TrialState.PRUNED and rebuilt.intermediate_values == {0: near(p["x"]) / 2, 1: near(p["x"])}


def test_with_the_asha_assessor_every_pause_leaves_a_pruned_record_and_every_end_one_record() -> None:
    tuner = create_tuner("optuna", None, {"sampler": "TPE", "seed": 4, "tell_paused": True}, ONE)
    assert isinstance(tuner, OptunaTuner)
    sim = Sim(Search(tuner, Asha(max_resource=9, reduction_factor=3)), lambda p, e: near(p["x"]) * e / 9,
              epochs=9, concurrency=2, max_trials=24).run()
    records = tuner.study.get_trials()
    by_pid: dict[int, list[Any]] = {}
    for t in records:
        by_pid.setdefault(t.user_attrs["trialkeeper_parameter_id"], []).append(t)
    assert sim.events("paused") and sim.events("continued")
    for t in sim.trials.values():
        pauses = len(sim.events("paused", t.id))
        kept = by_pid[t.parameter_id]
        # A PRUNED record per pause, each continued one a fresh record; the last says how it ended.
        assert len(kept) == 1 + len(sim.events("continued", t.id)) and len(kept) >= pauses
        assert all(r.state == TrialState.PRUNED for r in kept[:-1])
        last = kept[-1]
        if t.end is TrialStatus.SUCCEEDED:
            assert last.state == TrialState.COMPLETE and last.value == t.curve[-1]
        else:
            assert last.state == TrialState.PRUNED, (t.id, t.end, last.state)
        assert max(last.intermediate_values) == len(t.curve) - 1
    assert not tuner.study.get_trials(states=(TrialState.RUNNING,))
