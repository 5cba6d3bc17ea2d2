from __future__ import annotations

import json
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from trialkeeper.coordinator.search.algorithms import create_tuner
from trialkeeper.coordinator.search.space import SearchSpaceError, grid, grid_size
from trialkeeper.coordinator.search.tuners import (
    BUILTIN_TUNERS,
    GridTuner,
    NoMoreTrials,
    RandomTuner,
    Tuner,
    TunerError,
)

DISCRETE = {
    "bs": {"_type": "choice", "_value": [16, 32, 64]},
    "opt": {"_type": "choice", "_value": [
        "adam",
        {"_name": "sgd", "momentum": {"_type": "quniform", "_value": [0, 0.9, 0.3]}},
    ]},
}  # 3 * (1 + 4) = 15 points
CONTINUOUS = {
    "lr": {"_type": "loguniform", "_value": [1e-4, 1]},
    "bs": {"_type": "choice", "_value": [16, 32]},
}


def key(parameters: dict[str, Any]) -> str:
    return json.dumps(parameters, sort_keys=True)


def drain(tuner: Tuner, limit: int = 100_000) -> list[dict[str, Any]]:
    out = []
    for i in range(limit):
        try:
            out.append(tuner.generate_parameters(i))
        except NoMoreTrials:
            return out
    raise AssertionError(f"{type(tuner).__name__} never ran out")


# -- RandomTuner ------------------------------------------------------------------------


def test_random_tuner_proposes_every_discrete_point_once_then_stops() -> None:
    tuner = RandomTuner(DISCRETE, seed=1)
    points = drain(tuner)
    assert len(points) == grid_size(DISCRETE) == 15
    assert {key(p) for p in points} == {key(p) for p in grid(DISCRETE)}
    with pytest.raises(NoMoreTrials, match="all 15 points"):
        tuner.generate_parameters(99)


def test_random_tuner_exhausts_a_large_space_without_repeats() -> None:
    # Near the end nearly every draw is a repeat; the tuner must still finish quickly.
    space = {"n": {"_type": "randint", "_value": [0, 1000]}}
    points = drain(RandomTuner(space, seed=5))
    assert sorted(p["n"] for p in points) == list(range(1000))


def test_random_tuner_on_an_empty_space_proposes_one_empty_point() -> None:
    assert drain(RandomTuner({}, seed=0)) == [{}]


def test_random_tuner_is_reproducible_from_its_seed() -> None:
    def run(seed: int) -> list[dict[str, Any]]:
        tuner = RandomTuner(CONTINUOUS, seed=seed)
        return [tuner.generate_parameters(i) for i in range(20)]

    assert run(7) == run(7) != run(8)
    assert drain(RandomTuner(DISCRETE, seed=7)) == drain(RandomTuner(DISCRETE, seed=7))


def test_random_tuner_never_runs_out_on_a_continuous_space() -> None:
    tuner = RandomTuner(CONTINUOUS, seed=0)
    points = [tuner.generate_parameters(i) for i in range(500)]
    assert all(1e-4 <= p["lr"] <= 1 and p["bs"] in (16, 32) for p in points)


def test_default_result_callbacks_do_nothing() -> None:
    tuner = RandomTuner(CONTINUOUS, seed=0)
    parameters = tuner.generate_parameters(0)
    assert tuner.receive_trial_result(0, parameters, 0.5) is None
    assert tuner.trial_end(0, True) is None


# -- GridTuner --------------------------------------------------------------------------


def test_grid_tuner_walks_the_grid_then_stops() -> None:
    tuner = GridTuner(DISCRETE)
    assert drain(tuner) == list(grid(DISCRETE))
    with pytest.raises(NoMoreTrials, match="all 15 points"):
        tuner.generate_parameters(99)


def test_grid_tuner_refuses_a_continuous_space_at_once() -> None:
    with pytest.raises(SearchSpaceError) as info:
        GridTuner(CONTINUOUS)
    assert info.value.issues[0][0] == "lr"


# -- base class arguments ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [RandomTuner, GridTuner])
def test_tuners_check_their_common_arguments(cls: type[Tuner]) -> None:
    with pytest.raises(TunerError, match="optimize_mode must be 'maximize' or 'minimize', got 'max'"):
        cls(DISCRETE, optimize_mode="max")
    with pytest.raises(TunerError, match="seed must be an integer"):
        cls(DISCRETE, seed="7")  # type: ignore[arg-type]
    with pytest.raises(SearchSpaceError):
        cls({"x": {"_type": "randint", "_value": [2, 1]}})
    tuner = cls(DISCRETE, optimize_mode="minimize", seed=3)
    assert (tuner.optimize_mode, tuner.seed, tuner.search_space) == ("minimize", 3, DISCRETE)


# -- create_tuner: built-ins ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"),
    [("random", RandomTuner), ("Random", RandomTuner), ("grid", GridTuner),
     ("GridSearch", GridTuner), ("grid_search", GridTuner)],
)
def test_create_tuner_finds_builtins_case_insensitively(name: str, cls: type[Tuner]) -> None:
    tuner = create_tuner(name, None, {"optimize_mode": "minimize", "seed": 1}, DISCRETE)
    assert type(tuner) is cls and tuner.optimize_mode == "minimize"
    assert create_tuner(name, None, None, DISCRETE).optimize_mode == "maximize"


def test_builtin_registry() -> None:
    assert BUILTIN_TUNERS == {"random": RandomTuner, "grid": GridTuner}


@pytest.mark.parametrize(
    ("name", "class_name", "class_args", "message"),
    [
        ("randm", None, {}, "unknown tuner 'randm'; did you mean 'random'? built-in tuners: random, grid, pbt"),
        ("nosuch", None, {}, "unknown tuner 'nosuch'; built-in tuners: random, grid, pbt; optuna"),
        (
            None,
            None,
            {},
            "a tuner needs either name (built-in: random, grid, pbt; optuna; NNI's names) or className, got neither",
        ),
        ("random", "x:Y", {}, "got both"),
        (
            "random",
            None,
            {"optimise_mode": "maximize"},
            (
                "unexpected classArgs 'optimise_mode' (did you mean 'optimize_mode'?) for tuner 'random'; "
                "accepted: optimize_mode, seed"
            ),
        ),
        ("grid", None, {"foo": 1, "bar": 2}, "unexpected classArgs 'foo', 'bar' for tuner 'grid'"),
        ("random", None, {"optimize_mode": "max"}, "optimize_mode must be 'maximize' or 'minimize'"),
        ("random", None, ["seed"], "classArgs of tuner 'random' must be a mapping"),
    ],
)
def test_create_tuner_errors_are_one_clear_line(
    name: str | None, class_name: str | None, class_args: Any, message: str
) -> None:
    with pytest.raises(TunerError) as info:
        create_tuner(name, class_name, class_args, DISCRETE)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_create_tuner_validates_the_search_space_first() -> None:
    with pytest.raises(SearchSpaceError) as info:
        create_tuner("no-such-tuner", None, {}, {"lr": {"_type": "unifrom", "_value": [0, 1]}})
    assert info.value.issues[0][0] == "lr._type"


# -- create_tuner: third-party tuners ---------------------------------------------------

CUSTOM = '''
from trialkeeper.coordinator.search.tuners import Tuner

class CountingTuner(Tuner):
    def __init__(self, search_space, *, start, optimize_mode="maximize"):
        super().__init__(search_space, optimize_mode=optimize_mode)
        if start < 0:
            raise ValueError("start must be >= 0")
        self.next = start
        self.results = []

    def generate_parameters(self, parameter_id):
        self.next += 1
        return {"n": self.next}

    def receive_trial_result(self, parameter_id, parameters, value):
        self.results.append((parameter_id, value))

class Half(Tuner):
    pass

class NotATuner:
    def __init__(self, search_space):
        pass
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Writes a module into tmp_path under a fresh name; returns the name."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # create_tuner extends sys.path
    names: list[str] = []

    def write(source: str) -> str:
        name = f"tk_plugin_{uuid.uuid4().hex}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("sep", [":", "."])
def test_create_tuner_loads_a_third_party_tuner_by_class_name(
    plugin: Callable[[str], str], tmp_path: Path, sep: str
) -> None:
    module = plugin(CUSTOM)
    tuner = create_tuner(None, f"{module}{sep}CountingTuner", {"start": 10}, {}, str(tmp_path))
    assert type(tuner).__name__ == "CountingTuner" and isinstance(tuner, Tuner)
    assert [tuner.generate_parameters(i) for i in range(2)] == [{"n": 11}, {"n": 12}]
    tuner.receive_trial_result(0, {"n": 11}, 0.9)
    assert tuner.results == [(0, 0.9)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("source", "class_name", "class_args", "message"),
    [
        (CUSTOM, "{m}:Missing", {}, "module '{m}' has no 'Missing'"),
        (CUSTOM, "{m}:NotATuner", {}, ("tuner '{m}:NotATuner' is not a subclass of "
                                       "trialkeeper.coordinator.search.tuners.Tuner")),
        (CUSTOM, "{m}:Half", {}, "tuner '{m}:Half' does not implement generate_parameters"),
        (CUSTOM, "{m}:CountingTuner", {}, "tuner '{m}:CountingTuner' needs classArgs start"),
        (CUSTOM, "{m}:CountingTuner", {"start": 1, "seed": 2},
         "unexpected classArgs 'seed' for tuner '{m}:CountingTuner'; accepted: start, optimize_mode"),
        (CUSTOM, "{m}:CountingTuner", {"start": -1},
         "tuner '{m}:CountingTuner' failed to start: ValueError: start must be >= 0"),
        ("def broken(:\n", "{m}:T", {}, "cannot import module '{m}' of tuner '{m}:T': SyntaxError"),
        ("raise RuntimeError('no GPU\\nhere')\n", "{m}:T", {},
         "cannot import module '{m}' of tuner '{m}:T': RuntimeError: no GPU here"),
        (CUSTOM, "CountingTuner", {}, "className 'CountingTuner' must look like 'package.module:ClassName'"),
    ],
)
def test_create_tuner_explains_third_party_failures(
    plugin: Callable[[str], str], tmp_path: Path,
    source: str, class_name: str, class_args: dict[str, Any], message: str,
) -> None:
    module = plugin(source)
    with pytest.raises(TunerError) as info:
        create_tuner(None, class_name.format(m=module), class_args, {}, str(tmp_path))
    assert message.format(m=module) in str(info.value)
    assert "\n" not in str(info.value)


def test_create_tuner_reports_a_missing_module() -> None:
    with pytest.raises(TunerError, match="cannot import module 'no_such_pkg.tuners' .*ModuleNotFoundError"):
        create_tuner(None, "no_such_pkg.tuners:Mine", {}, {})


def test_a_class_name_imports_the_module_of_its_own_code_directory_over_one_of_that_name_imported_before(
    tmp_path: Path,
) -> None:
    # Two experiments in one process, each with its own tuner.py: each gets its own.
    name = f"tuner_{uuid.uuid4().hex[:8]}"
    for label in ("first", "second"):
        (tmp_path / label).mkdir()
        (tmp_path / label / f"{name}.py").write_text(textwrap.dedent(f"""
            from trialkeeper.coordinator.search.tuners import Tuner

            class Mine(Tuner):
                label = {label!r}

                def generate_parameters(self, parameter_id):
                    return {{"which": self.label}}
        """))
    try:
        for label in ("first", "second", "first"):
            tuner = create_tuner(None, f"{name}:Mine", {}, {}, str(tmp_path / label))
            assert tuner.generate_parameters(0) == {"which": label}
    finally:
        sys.modules.pop(name, None)
        for label in ("first", "second"):
            if str(tmp_path / label) in sys.path:
                sys.path.remove(str(tmp_path / label))
