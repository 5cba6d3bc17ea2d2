"""NNI's tuners and assessors by name, under NNI's real package: the coordinator runs in
the interpreter $TRIALKEEPER_NNI_PYTHON names (nni 3.0 and trialkeeper installed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import optuna
import pytest
from conftest import write_script
from nni_python import nni_python
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.algorithms import create_tuner
from trialkeeper.coordinator.search.tuners import TunerError
from trialkeeper.coordinator.store.store import Store

HERE = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("nni") / "report.json"
    proc = subprocess.run([nni_python(), str(HERE / "nni_search_check.py"), str(out)],
                          check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def in_space(p: dict[str, Any]) -> bool:
    return 0 <= p["x"] <= 1 and p["k"] in (1, 2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TPE", "tpe", "Random", "Evolution", "MetisTuner", "GP", "PBT"])
def test_nni_tuners_by_name_and_alias_propose_points_of_the_space(report: dict[str, Any], name: str) -> None:
    seen = report["tuners"][name]
    assert seen["failure"] == "" and len(seen["points"]) == 8
    assert all(in_space(p) for p in seen["points"]), seen["points"]


@pytest.mark.slow
def test_nni_grid_search_proposes_every_point_once_then_ends(report: dict[str, Any]) -> None:
    seen = report["tuners"]["GridSearch"]
    assert len({json.dumps(p, sort_keys=True) for p in seen["points"]}) == 8 and seen["failure"] == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "install"),
    [("Anneal", "pip install hyperopt"), ("SMAC", "pip install 'nni[SMAC]'"), ("DNGO", "pip install 'nni[DNGO]'"),
     ("PPO", "pip install 'nni[PPOTuner]'"), ("NetworkMorphism", "pip install torch")],
)
def test_a_tuner_whose_package_is_missing_says_what_to_install(report: dict[str, Any], name: str, install: str) -> None:
    seen = report["tuners"][name]
    if "error" in seen:
        assert "which is not installed: " + install in seen["error"]
    else:  # the package is there after all: then the tuner must work
        assert seen["failure"] == "" and all(in_space(p) for p in seen["points"])


@pytest.mark.slow
def test_nni_errors_are_one_clear_line(report: dict[str, Any]) -> None:
    errors = report["errors"]
    if "BOHB" in errors:  # its extra packages are not installed: the error says which command installs them
        assert (
            errors["BOHB"].startswith("advisor 'BOHB' needs the package")
            and "pip install 'nni[BOHB]'" in errors["BOHB"]
        )
    assert errors["Hyperband"].startswith("invalid classArgs for advisor 'Hyperband': ") and "R" in errors["Hyperband"]
    assert errors["nosuch"].startswith("unknown tuner 'nosuch'") and "TPE" in errors["nosuch"]
    assert "'max' is not a valid OptimizeMode" in errors["TPE"]
    assert errors["Medianstop"].startswith("invalid classArgs for assessor 'Medianstop': optimize_mode")
    assert "refused the search space" in report["tuners"]["RegularizedEvolution"]["error"]


@pytest.mark.slow
def test_a_users_own_nni_tuner_by_class_name(report: dict[str, Any]) -> None:
    assert report["user_tuner"] == [{"x": 9}, {"x": 8}, {"x": 7}]


@pytest.mark.slow
def test_nni_assessors_by_name_stop_a_bad_curve(report: dict[str, Any]) -> None:
    median = report["assessors"]["Medianstop"]
    assert median["stopped_at"] == [None, None, None, 0] and median["kept"]
    curve = report["assessors"]["curvefitting"]
    assert curve["failure"] == "" and curve["kept"] and curve["stopped_at"][0] is None
    assert curve["stopped_at"][3] is not None  # the flat curve far below the others


@pytest.mark.slow
def test_resumed_nni_tuners_go_on_from_the_history(report: dict[str, Any]) -> None:
    grid = report["grid_resume"]
    assert [p["x"] for p in grid["first"]] == [0, 1, 2, 3]
    # 4 was running at the resume and ended after it: neither it nor the first four again.
    assert [p["x"] for p in grid["after"]] == [5, 6, 7, 8, 9]
    tpe = report["tpe_resume"]
    # Told 40 results peaking at 0.8, TPE proposes near it at once; a fresh one starts at random.
    near = sum(abs(x - 0.8) < 0.1 for x in tpe["resumed"])
    assert near >= 8 and near > sum(abs(x - 0.8) < 0.1 for x in tpe["fresh"])


def run_cli(
    python: Path, tmp_path: Path, config: dict[str, Any], output: list[str] | None = None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """`trialkeeper run` in the NNI interpreter; the stored trials (in order) and metrics.
    ``output`` receives what it printed (stdout, then stderr)."""
    (tmp_path / "config.yml").write_text(json.dumps({
        "trialCommand": f"{python} trial.py", "trialCodeDirectory": str(tmp_path),
        "trainingService": {"platform": "local"}, **config,
    }))
    exp = tmp_path / "exp"
    proc = subprocess.run(
        [
            python,
            "-m",
            "trialkeeper.coordinator.cli",
            "run",
            str(tmp_path / "config.yml"),
            "--experiment-dir",
            str(exp),
            "--quiet",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if output is not None:
        output += [proc.stdout, proc.stderr]
    store = Store.in_dir(exp, readonly=True)
    try:
        return sorted(store.trials(), key=lambda t: t["seq"]), store.metrics()
    finally:
        store.close()


# Ten results of x, each after a step's work (0.15 s), then x as final.
CURVE = """
import time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
for step in range(10):
    time.sleep(0.15)
    trial.report_intermediate_result(p["x"])
trial.report_final_result(p["x"])
"""

# CURVE for one trial at a time under NNI's Medianstop (start_step 1, maximize): it stops a trial whose
# best result is below the median ((n - 1) // 2-th of n, sorted) of the completed trials' running
# averages at that step, and each trial's results are all x, so a trial knows from the x of those that
# completed (listed in `done`) whether it will be stopped. One that will is held until it is (600 steps,
# 90 s at most); the others can never be stopped: ten results, then x as final.
MEDIAN_CURVE = """
import os, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
done = {done!r}
completed = sorted(float(v) for v in open(done).read().split()) if os.path.exists(done) else []
hopeless = bool(completed) and p["x"] < completed[(len(completed) - 1) // 2]
for step in range(600 if hopeless else 10):
    time.sleep(0.15)
    trial.report_intermediate_result(p["x"])
with open(done, "a") as f:
    f.write(repr(p["x"]) + "\\n")
trial.report_final_result(p["x"])
"""


@pytest.mark.slow
def test_trialkeeper_run_with_nni_tpe_and_medianstop(tmp_path: Path) -> None:
    python = nni_python()
    write_script(tmp_path, "trial.py", MEDIAN_CURVE.format(done=str(tmp_path / "completed.txt")))
    output: list[str] = []
    trials, metrics = run_cli(python, tmp_path, {
        "trialConcurrency": 1, "maxTrialNumber": 8, "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "TPE", "classArgs": {"optimize_mode": "maximize", "seed": 7}},
        "assessor": {"name": "Medianstop", "classArgs": {"optimize_mode": "maximize", "start_step": 1}},
        "optunaStorage": f"sqlite:///{tmp_path / 'mirror.db'}", "optunaStudyName": "nni-tpe",
    }, output)
    # NNI's TPE logs "Using random seed 7" at INFO: not printed over the live view, nor at
    # the default --log-level WARNING.
    assert not any("Using random seed" in text for text in output), output
    statuses = [TrialStatus(t["status"]) for t in trials]
    assert len(trials) == 8 and set(statuses) == {TrialStatus.SUCCEEDED, TrialStatus.EARLY_STOPPED}, statuses
    for t in trials:
        n = sum(1 for m in metrics if m.trial_id == t["id"] and m.kind == "intermediate")
        assert n == 10 if t["status"] == "SUCCEEDED" else 1 <= n < 600, (t["status"], n)
    # The experiment is mirrored into an Optuna study whatever the tuner: NNI's TPE here.
    study = optuna.load_study(study_name="nni-tpe", storage=f"sqlite:///{tmp_path / 'mirror.db'}")
    expected = {"SUCCEEDED": "COMPLETE", "EARLY_STOPPED": "PRUNED"}
    assert [ot.state.name for ot in study.trials] == [expected[t["status"]] for t in trials]
    for t, ot in zip(trials, study.trials):
        assert ot.params == json.loads(t["parameters_json"])
        assert len(ot.intermediate_values) == sum(
            1 for m in metrics if m.trial_id == t["id"] and m.kind == "intermediate"
        )
    assert study.best_value == max(t["final_metric"] for t in trials if t["status"] == "SUCCEEDED")


@pytest.mark.slow
def test_nnis_tpe_proposes_for_the_built_in_asha_which_pauses_and_continues_checkpointing_trials(
    tmp_path: Path,
) -> None:
    from test_search_paused_trials import TRIAL

    write_script(tmp_path, "trial.py", TRIAL.format(log=str(tmp_path / "runs.log"), epochs=9, first=9, pause=0.05))
    trials, metrics = run_cli(nni_python(), tmp_path, {
        "trialConcurrency": 2, "maxTrialNumber": 9, "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "TPE", "classArgs": {"optimize_mode": "maximize", "seed": 7}},
        "assessor": {"name": "asha", "classArgs": {"max_resource": 9, "reduction_factor": 3}},
    })
    assert len(trials) == 9
    assert {t["status"] for t in trials} == {"SUCCEEDED", "EARLY_STOPPED"}, [(t["status"], t["reason"]) for t in trials]
    starts: dict[str, list[int]] = {}
    for line in (tmp_path / "runs.log").read_text().splitlines():
        trial_id, start = line.split()
        starts.setdefault(trial_id, []).append(int(start))
    assert any(len(runs) > 1 for runs in starts.values()), starts  # paused at a rung, continued from there
    for t in trials:  # each epoch's result once: no epoch trained again
        indexes = [m.index for m in metrics if m.trial_id == t["id"] and m.kind == "intermediate"]
        assert indexes == list(range(len(indexes))), (t["id"], indexes, starts)


@pytest.mark.slow
def test_a_resource_budget_ends_a_search_of_nnis_tuner_and_assessor(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", CURVE)
    trials, metrics = run_cli(nni_python(), tmp_path, {
        "trialConcurrency": 2, "maxTrialResource": 25, "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "TPE", "classArgs": {"optimize_mode": "maximize", "seed": 7}},
        "assessor": {"name": "Medianstop", "classArgs": {"optimize_mode": "maximize", "start_step": 1}},
    })
    # The search ends once 25 are stored: past them, only what the two trials then running report (ten each
    # at most, one of them has reported at least one already).
    assert 25 <= sum(1 for m in metrics if m.kind == "intermediate") <= 25 + 9 + 10
    assert len(trials) >= 3  # ten results a trial at most: the budget took several configurations


@pytest.mark.skipif(
    importlib.util.find_spec("nni") is not None,
    reason="checks the error shown without NNI, and nni is installed in this interpreter; runs in one without it",
)
def test_without_nni_its_names_say_what_to_install() -> None:
    with pytest.raises(
        TunerError,
        match=r"tuner 'TPE' is one of NNI's algorithms, and NNI is not installed .*pip install 'trialkeeper\[nni\]'",
    ):
        create_tuner("TPE", None, {}, {"x": {"_type": "uniform", "_value": [0, 1]}})


@pytest.mark.slow
def test_hyperband_as_an_advisor_promotes_the_best_to_larger_budgets(report: dict[str, Any]) -> None:
    hb = report["hyperband"]
    assert hb["failure"] == ""
    budgets = [p["TRIAL_BUDGET"] for p in hb["proposed"]]
    assert budgets == [1] * 9 + [3] * 3 + [9]
    first = [{k: v for k, v in p.items() if k != "TRIAL_BUDGET"} for p in hb["proposed"][:9]]
    promoted = [{k: v for k, v in p.items() if k != "TRIAL_BUDGET"} for p in hb["proposed"][9:12]]
    # The 3 promoted are the 3 best of the first 9 (their score is x).
    assert sorted(p["x"] for p in promoted) == sorted(p["x"] for p in first)[-3:]
    assert hb["proposed"][12]["x"] == max(p["x"] for p in promoted)


@pytest.mark.slow
@pytest.mark.parametrize("advisor", ["hyperband", "bohb"])
def test_an_advisor_continues_a_promoted_configuration_from_the_trial_that_ran_it_before(
    report: dict[str, Any], advisor: str
) -> None:
    seen = report[advisor]
    assert seen["failure"] == ""
    proposed, sources = seen["proposed"], seen["sources"]
    assert [p["TRIAL_BUDGET"] for p in proposed] == [1] * 9 + [3] * 3 + [9]
    assert sources[:9] == [None] * 9  # new configurations start afresh

    def config(p: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in p.items() if k != "TRIAL_BUDGET"}

    for i in range(9, 13):
        source = sources[i]
        assert source is not None, (i, sources)
        before = int(source.removeprefix("t"))
        # The same configuration, from the round just before (budget 1 -> 3 -> 9).
        assert config(proposed[before]) == config(proposed[i])
        assert proposed[before]["TRIAL_BUDGET"] * 3 == proposed[i]["TRIAL_BUDGET"]
    assert int(sources[12].removeprefix("t")) in (9, 10, 11)


@pytest.mark.slow
def test_nnis_pbt_starts_with_its_defaults_keeping_checkpoints_in_the_experiment(report: dict[str, Any]) -> None:
    pbt = report["pbt_defaults"]
    assert pbt["failure"] == "" and len(pbt["points"]) == 8 and pbt["made"]
    assert all(in_space(p) for p in pbt["points"]), pbt["points"]
    for p in pbt["points"]:
        assert p["save_checkpoint_dir"].startswith(pbt["directory"] + "/"), p
    assert pbt["left_set"] is None  # set only while the tuner was built


BUDGETED = """
from trialkeeper.agent import trial

p = trial.get_next_parameter()
for step in range(int(p["TRIAL_BUDGET"])):
    trial.report_intermediate_result(p["x"])
trial.report_final_result(p["x"])
"""


def run_advisor(
    tmp_path: Path, trials: int, advisor: dict[str, Any], **more: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """`trialkeeper run` of BUDGETED with ``advisor``, 2 at a time: trials, their parameters, metrics."""
    write_script(tmp_path, "trial.py", BUDGETED)
    stored, metrics = run_cli(nni_python(), tmp_path, {
        "trialConcurrency": 2, "maxTrialNumber": trials, "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "advisor": advisor, **more,
    })
    return stored, [json.loads(t["parameters_json"]) for t in stored], metrics


@pytest.mark.slow
def test_trialkeeper_run_with_nni_hyperband_as_advisor(tmp_path: Path) -> None:
    # maxTrialNumber counts configurations: the promoted one is no new configuration.
    trials, params, _ = run_advisor(tmp_path, 3, {"name": "Hyperband", "classArgs": {
        "optimize_mode": "maximize", "R": 3, "eta": 3, "exec_mode": "serial"}})
    assert [p["TRIAL_BUDGET"] for p in params] == [1, 1, 1, 3]
    assert params[3]["x"] == max(p["x"] for p in params[:3])  # the best of the round, promoted
    assert {t["status"] for t in trials} == {"SUCCEEDED"}


# Trains TRIAL_BUDGET epochs, saving a checkpoint after each; a trial continued from one
# goes on from its epoch. Each run appends "<trial> <first epoch> <budget>" to runs.log.
CHECKPOINTED = """
import json, os
from trialkeeper.agent import trial

p = trial.get_next_parameter()
here = os.environ["TRIALKEEPER_CHECKPOINT_DIR"]
start = trial.checkpoint_step() or 0
if start:
    with open(os.path.join(here, "state.json")) as f:
        state = json.load(f)
    assert state == {{"epoch": start, "x": p["x"]}}, state
with open({log!r}, "a") as f:
    f.write(f"{{trial.get_trial_id()}} {{start}} {{p['TRIAL_BUDGET']}}\\n")
for epoch in range(start, int(p["TRIAL_BUDGET"])):
    trial.report_intermediate_result(p["x"])
    with open(os.path.join(here, "state.json"), "w") as f:
        json.dump({{"epoch": epoch + 1, "x": p["x"]}}, f)
    trial.save_checkpoint(epoch + 1)
trial.report_final_result(p["x"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("advisor", [
    {"name": "Hyperband", "classArgs": {"optimize_mode": "maximize", "R": 3, "eta": 3, "exec_mode": "serial"}},
    {"name": "BOHB", "classArgs": {"optimize_mode": "maximize", "min_budget": 1, "max_budget": 3, "eta": 3}},
], ids=["Hyperband", "BOHB"])
def test_an_advisor_continues_a_promoted_trial_from_the_checkpoint_of_its_previous_round(
    tmp_path: Path, advisor: dict[str, Any]
) -> None:
    write_script(tmp_path, "trial.py", CHECKPOINTED.format(log=str(tmp_path / "runs.log")))
    # Three configurations (maxTrialNumber counts them), the best promoted from budget 1 to 3.
    trials, _ = run_cli(nni_python(), tmp_path, {
        "trialConcurrency": 2, "maxTrialNumber": 3, "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "advisor": advisor,
    })
    assert {t["status"] for t in trials} == {"SUCCEEDED"}, [(t["status"], t["reason"]) for t in trials]
    params = [json.loads(t["parameters_json"]) for t in trials]
    assert [p["TRIAL_BUDGET"] for p in params] == [1, 1, 1, 3]
    best = max(range(3), key=lambda i: params[i]["x"])
    assert params[3]["x"] == params[best]["x"]
    runs = {}
    for line in (tmp_path / "runs.log").read_text().splitlines():
        trial_id, start, budget = line.split()
        runs[trial_id] = (int(start), int(budget))
    # The promoted trial went on from the epoch its configuration had trained at budget 1:
    # two epochs more, not three.
    assert [runs[t["id"]] for t in trials] == [(0, 1), (0, 1), (0, 1), (1, 3)], runs


@pytest.mark.slow
def test_max_trial_number_counts_configurations_and_cuts_a_bracket_short_as_an_incomplete_one(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", CHECKPOINTED.format(log=str(tmp_path / "runs.log")))
    # R=9, eta=3: the first bracket draws 9 configurations for budget 1. Five of them run; the
    # bracket goes on with those five: the best floor(5/3) = 1 is promoted to budget 3, from
    # its checkpoint, and nothing new starts.
    trials, _ = run_cli(nni_python(), tmp_path, {
        "trialConcurrency": 2, "maxTrialNumber": 5, "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "advisor": {"name": "Hyperband", "classArgs": {"optimize_mode": "maximize", "R": 9, "eta": 3}},
    })
    assert {t["status"] for t in trials} == {"SUCCEEDED"}, [(t["status"], t["reason"]) for t in trials]
    params = [json.loads(t["parameters_json"]) for t in trials]
    assert [p["TRIAL_BUDGET"] for p in params] == [1, 1, 1, 1, 1, 3]
    assert params[5]["x"] == max(p["x"] for p in params[:5])
    runs = {}
    for line in (tmp_path / "runs.log").read_text().splitlines():
        trial_id, start, budget = line.split()
        runs[trial_id] = (int(start), int(budget))
    assert runs[trials[5]["id"]] == (1, 3), runs  # two epochs more, from its checkpoint


@pytest.mark.parametrize("tuner", ["pbt_sources", "pbt_subclass"])
def test_nnis_pbt_starts_each_trial_from_the_checkpoint_its_load_checkpoint_dir_names(
    report: dict[str, Any], tuner: str
) -> None:
    """NNI's PBT by name, and a user's subclass of it under another name (className): known
    by its class, it gets the same default names and each trial the checkpoint it loads."""
    pbt = report[tuner]
    assert pbt["failure"] == "" and len(pbt["trials"]) == 12
    saver = {t["parameters"]["save_checkpoint_dir"]: t["id"] for t in pbt["trials"]}
    for n, t in enumerate(pbt["trials"]):
        p = t["parameters"]
        assert p["save_checkpoint_dir"].startswith("nni-checkpoints/"), p  # names only, no directory given
        if n < 4:
            assert t["source"] is None and p["load_checkpoint_dir"] == p["save_checkpoint_dir"], t
        else:  # its own model of the generation before, or a better member's
            assert t["source"] == saver[p["load_checkpoint_dir"]] != t["id"], t
    assert any(t["parameters"]["load_checkpoint_dir"].split("/")[1] != t["parameters"]["save_checkpoint_dir"].split(
        "/")[1] for t in pbt["trials"][4:]), "no member exploited another's checkpoint"


# NNI's PBT trial: goes on from the model in load_checkpoint_dir (if any), saves one step more
# in save_checkpoint_dir, and scores x plus the steps the model had.
PBT_TRIAL = """
import json, os
from trialkeeper.agent import trial

p = trial.get_next_parameter()
model = os.path.join(p["load_checkpoint_dir"], "model.json")
steps = 0
if os.path.isfile(model):
    with open(model) as f:
        steps = json.load(f)["steps"]
os.makedirs(p["save_checkpoint_dir"], exist_ok=True)
with open(os.path.join(p["save_checkpoint_dir"], "model.json"), "w") as f:
    json.dump({"steps": steps + 1}, f)
trial.report_final_result(p["x"] + steps)
"""


@pytest.mark.slow
def test_trialkeeper_run_with_nnis_pbt_and_its_defaults_runs_generation_after_generation(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", PBT_TRIAL)
    trials, _ = run_cli(nni_python(), tmp_path, {
        "trialConcurrency": 2, "maxTrialNumber": 6, "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "PBT", "classArgs": {"optimize_mode": "maximize", "population_size": 2}},
    })
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 6, [(t["status"], t["reason"]) for t in trials]
    params = [json.loads(t["parameters_json"]) for t in trials]
    home = str(tmp_path / "exp" / "nni-checkpoints") + "/"
    assert all(p["save_checkpoint_dir"].startswith(home) for p in params), params
    # Each generation goes on from the models the one before saved (its own, or a better one's).
    for generation, pair in enumerate((trials[0:2], trials[2:4], trials[4:6])):
        for t, p in zip(pair, params[2 * generation: 2 * generation + 2]):
            assert t["final_metric"] == pytest.approx(p["x"] + generation), (generation, p, t["final_metric"])


@pytest.mark.slow
def test_trialkeeper_resume_goes_on_with_nnis_grid_search_where_it_was(tmp_path: Path) -> None:
    python = nni_python()
    write_script(tmp_path, "trial.py", BUDGETED.replace('int(p["TRIAL_BUDGET"])', "2"))
    base = {
        "trialConcurrency": 2, "searchSpace": {"x": {"_type": "choice", "_value": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}},
        "tuner": {"className": "nni.algorithms.hpo.gridsearch_tuner.GridSearchTuner"},
        "assessor": {"name": "Medianstop", "classArgs": {"optimize_mode": "maximize"}},
    }
    first, _ = run_cli(python, tmp_path, {**base, "maxTrialNumber": 3})
    assert len(first) == 3
    (tmp_path / "more.yml").write_text(json.dumps({
        "trialCommand": f"{python} trial.py", "trialCodeDirectory": str(tmp_path),
        "trainingService": {"platform": "local"}, **base, "maxTrialNumber": 6,
    }))
    proc = subprocess.run(
        [
            python,
            "-m",
            "trialkeeper.coordinator.cli",
            "resume",
            str(tmp_path / "exp"),
            "--config",
            str(tmp_path / "more.yml"),
            "--quiet",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    store = Store.in_dir(tmp_path / "exp", readonly=True)
    try:
        xs = [json.loads(t["parameters_json"])["x"] for t in sorted(store.trials(), key=lambda t: t["seq"])]
    finally:
        store.close()
    # The resumed grid search was told the first three points: it proposes the other three.
    assert xs[:3] == [json.loads(t["parameters_json"])["x"] for t in first]
    assert sorted(xs) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]


@pytest.mark.slow
def test_nnis_batch_tuner_takes_its_own_search_space_format(report: dict[str, Any]) -> None:
    batch = report["batch"]
    assert batch["failure"] == "" and batch["exhausted"]
    assert batch["points"] == [{"x": 0.2, "opt": "adam"}, {"x": 0.4, "opt": "sgd"}, {"x": 0.9, "opt": "adam"}]


@pytest.mark.slow
def test_anneal_proposes_points_of_the_space_with_hyperopt_installed(report: dict[str, Any]) -> None:
    # The interpreters CI builds carry hyperopt, so Anneal must work there, not only name its package.
    seen = report["tuners"]["Anneal"]
    assert "error" not in seen, seen["error"]
    assert seen["failure"] == "" and len(seen["points"]) == 8 and all(in_space(p) for p in seen["points"])


@pytest.mark.slow
def test_trialkeeper_run_with_nni_bohb_as_advisor(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bohb.db'}"
    trials, params, metrics = run_advisor(
        tmp_path,
        5,  # configurations: six trials, one of them a promotion
        {"name": "BOHB", "classArgs": {"optimize_mode": "maximize", "min_budget": 1, "max_budget": 3, "eta": 3}},
        optunaStorage=url,
        optunaStudyName="bohb",
    )
    assert len(trials) == 6 and {t["status"] for t in trials} == {"SUCCEEDED"}
    # Its first bracket runs 3 configurations for budget 1 and the best of them for 3; the
    # next bracket starts at budget 3.
    assert [p["TRIAL_BUDGET"] for p in params] == [1, 1, 1, 3, 3, 3]
    assert params[3]["x"] == max(p["x"] for p in params[:3])
    # Mirrored into an Optuna study, the budget each trial had as a user attribute.
    study = optuna.load_study(study_name="bohb", storage=url)
    assert [(ot.params["x"], ot.user_attrs["TRIAL_BUDGET"], ot.state.name) for ot in study.trials] == [
        (p["x"], p["TRIAL_BUDGET"], "COMPLETE") for p in params]
    for t, p in zip(trials, params):  # each trial ran the budget BOHB gave it
        assert sum(1 for m in metrics if m.trial_id == t["id"] and m.kind == "intermediate") == int(p["TRIAL_BUDGET"])
