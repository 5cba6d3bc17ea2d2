"""`trialkeeper update`, `submit` and `rerun` without a running experiment: the engine takes
new limits at once (virtual time), the control server refuses what is malformed naming the
field and what is valid, and the commands refuse bad values before asking anyone."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from test_engine import ready_sim
from trialkeeper.coordinator.cli.app import main
from trialkeeper.coordinator.cli.control import ControlServer
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.states import TrialStatus


def test_a_higher_concurrency_places_the_waiting_trials_at_once() -> None:
    sim = ready_sim(trial_concurrency=1, environment_count=1, trial_slots=3)
    for t in ("a", "b", "c"):
        sim.submit(t)
    assert list(sim.starts()) == ["a"]
    assert sim.status("b") is sim.status("c") is TrialStatus.WAITING

    sim.feed(ev.UpdateRequested(dataclasses.replace(sim.engine.policy, trial_concurrency=3)))
    assert sorted(sim.starts()) == ["b", "c"]
    assert sim.engine.book.policy is sim.engine.fleet.policy is sim.engine.supply.policy is sim.engine.policy


def test_a_lower_concurrency_lets_running_trials_finish_and_starts_no_more() -> None:
    sim = ready_sim(trial_concurrency=2, environment_count=1, trial_slots=3)
    for t in ("a", "b", "c"):
        sim.submit(t)
    assert sorted(sim.starts()) == ["a", "b"]
    sim.feed(ev.UpdateRequested(dataclasses.replace(sim.engine.policy, trial_concurrency=1)))
    env_id = sim.engine.trials["a"].env_id
    assert env_id is not None
    sim.run(env_id, "a")
    sim.end(env_id, "a", ev.Outcome.SUCCEEDED)
    sim.feed(ev.Ticked())
    assert sim.starts() == {}, "b still runs: one is the new limit"
    assert sim.status("c") is TrialStatus.WAITING


def test_more_environments_are_asked_for_when_the_concurrency_grows() -> None:
    sim = ready_sim(trial_concurrency=1, environment_count=1, trial_slots=1)
    assert sim.take(ev.StartEnvironment) == []
    policy = sim.engine.policy
    wider = dataclasses.replace(policy, trial_concurrency=3, platforms=(
        dataclasses.replace(policy.platforms[0], environment_count=3),
    ))
    sim.feed(ev.UpdateRequested(wider))
    assert len(sim.take(ev.StartEnvironment)) == 2


def _answer(tmp_path: Path, request: dict[str, object]) -> dict[str, object]:
    server = ControlServer(None, tmp_path)  # refusals are decided before the coordinator is asked
    return asyncio.run(server.answer(json.dumps(request).encode()))


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"op": "update"}, (
            "limits: an object with one or more of trialConcurrency, maxTrialNumber, maxExperimentDuration is needed"
        )),
        ({"op": "update", "limits": {}}, "limits: an object with one or more of"),
        ({"op": "update", "limits": {"trialConcurrency": 0}},
         "trialConcurrency: 0 is not valid: an integer >= 1 is needed; nothing was changed"),
        ({"op": "update", "limits": {"trialConcurrency": 2.5}}, "trialConcurrency: 2.5 is not valid"),
        ({"op": "update", "limits": {"maxTrialNumber": True}}, "maxTrialNumber: True is not valid"),
        ({"op": "update", "limits": {"maxExperimentDuration": -1}},
         "maxExperimentDuration: -1 is not valid: a number of seconds > 0 is needed"),
        ({"op": "update", "limits": {"maxExperimentDuration": "1h"}}, "maxExperimentDuration: '1h' is not valid"),
        ({"op": "update", "limits": {"trialGpuNumber": 2, "trialConcurrency": 2}},
         "'trialGpuNumber' cannot be updated (only trialConcurrency, maxTrialNumber, maxExperimentDuration)"),
        ({"op": "submit", "parameters": [1, 2]}, "parameters: a JSON object of parameter names to values is needed"),
        ({"op": "rerun"}, "trials: a list of 1 to 10000 trial ids, or failed: true, is needed"),
        ({"op": "rerun", "trials": [7]}, "trials: a list of 1 to 10000 trial ids, or failed: true, is needed"),
    ],
)
def test_malformed_control_requests_say_what_is_wrong(
    tmp_path: Path, request_: dict[str, object], error: str
) -> None:
    answer = _answer(tmp_path, request_)
    assert answer["ok"] is False
    assert str(answer["error"]).startswith(error), answer


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["update", "EXP", "--concurrency", "0"], "'0' is not valid for trialConcurrency: an integer >= 1 is needed"),
        (["update", "EXP", "--max-trials", "many"], "'many' is not valid for maxTrialNumber: an integer >= 1"),
        (["update", "EXP", "--max-duration", "0"], "'0' is not valid for maxExperimentDuration: a number of seconds"),
        (["submit", "EXP"], "the following arguments are required: --params"),
    ],
)
def test_bad_values_are_refused_before_the_experiment_is_asked(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    assert said in capsys.readouterr().err


def test_an_experiment_that_does_not_exist_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nowhere")
    for argv in (["update", missing, "--concurrency", "2"], ["submit", missing, "--params", "{}"],
                 ["rerun", missing, "--failed"], ["view", missing]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err == (
            f"trialkeeper: no experiment {missing!r}: neither a directory holding one nor a known experiment id "
            "(`trialkeeper list` shows them)"
        ), argv


def test_submit_wants_a_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "EXP", "--params", "[1]"]) == 2  # a wrong argument, as argparse's own
    assert capsys.readouterr().err.strip() == (
        "trialkeeper: --params: a JSON object of parameter names to values is needed, got [1]"
    )
    assert main(["submit", "EXP", "--params", "{x"]) == 2
    assert capsys.readouterr().err.startswith("trialkeeper: --params: not JSON: ")
    assert main(["rerun", "EXP"]) == 2
    assert capsys.readouterr().err.strip() == "trialkeeper: name the trials to run again, or give --failed (not both)"
