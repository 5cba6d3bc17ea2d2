from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trialkeeper.coordinator.config.experiment import ConfigError, parse_config
from trialkeeper.coordinator.search.space import (
    TYPES,
    SearchSpaceError,
    grid,
    grid_size,
    is_discrete,
    sample,
    validate_search_space,
)

N = 2000


def draws(spec: dict[str, Any], seed: int = 0, n: int = N) -> list[Any]:
    rng = random.Random(seed)
    return [sample({"p": spec}, rng)["p"] for _ in range(n)]


def issues_of(space: object) -> list[tuple[str, str]]:
    with pytest.raises(SearchSpaceError) as info:
        validate_search_space(space)
    return info.value.issues


def param(kind: str, *value: Any) -> dict[str, Any]:
    return {"_type": kind, "_value": list(value)}


# -- sampling ---------------------------------------------------------------------------


def test_choice_picks_every_item_and_copies_it() -> None:
    items = [1, "two", 3.5, [4, 4], None]
    values = draws(param("choice", *items))
    assert all(v in items for v in values)
    assert {json.dumps(v) for v in values} == {json.dumps(i) for i in items}
    list_draw = next(v for v in values if isinstance(v, list))
    list_draw.append(5)  # a sampled list must not alias the search space
    assert items[3] == [4, 4]


def test_randint_is_an_int_in_the_half_open_range() -> None:
    values = draws(param("randint", -2, 3))
    assert all(type(v) is int for v in values)
    assert set(values) == {-2, -1, 0, 1, 2}


@pytest.mark.parametrize("kind", ["uniform", "loguniform"])
def test_continuous_bounded_types_stay_in_bounds(kind: str) -> None:
    values = draws(param(kind, 1, 100))
    assert all(type(v) is float and 1 <= v <= 100 for v in values)


def test_loguniform_is_uniform_on_a_log_scale() -> None:
    values = draws(param("loguniform", 0.001, 1000))
    below_one = sum(v < 1 for v in values) / len(values)
    assert 0.45 < below_one < 0.55  # 1 is the geometric midpoint


@pytest.mark.parametrize("kind", ["normal", "lognormal"])
def test_normal_types_follow_mu_and_sigma(kind: str) -> None:
    values = draws(param(kind, 1.0, 0.5))
    logs = [math.log(v) for v in values] if kind == "lognormal" else values
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert all(type(v) is float for v in values)
    assert abs(mean - 1.0) < 0.05 and abs(sd - 0.5) < 0.05
    if kind == "lognormal":
        assert all(v > 0 for v in values)


def test_quniform_with_int_arguments_gives_reachable_ints() -> None:
    values = draws(param("quniform", 2, 10, 3))
    assert all(type(v) is int for v in values)
    # round(x / 3) * 3 for x in [2, 10] is 3, 6 or 9; 2 and 10 are never reached.
    assert set(values) == {3, 6, 9}


def test_quniform_clips_to_the_bounds_and_drops_float_noise() -> None:
    values = draws(param("quniform", 0.04, 1, 0.1))
    assert all(type(v) is float and 0.04 <= v <= 1 for v in values)
    assert set(values) == {0.04, *(round(0.1 * k, 1) for k in range(1, 11))}
    assert 0.3 in values and 0.30000000000000004 not in values


def test_qloguniform_quantizes_within_bounds() -> None:
    values = draws(param("qloguniform", 1, 1000, 10))
    assert all(type(v) is int and 1 <= v <= 1000 for v in values)
    assert all(v == 1 or v % 10 == 0 for v in values)
    assert sum(v < 100 for v in values) > len(values) / 2  # log scale favours small values


@pytest.mark.parametrize("kind", ["qnormal", "qlognormal"])
def test_quantized_normals_are_multiples_of_q(kind: str) -> None:
    assert all(type(v) is int and v % 2 == 0 for v in draws(param(kind, 3, 1, 2)))
    assert all(type(v) is float and round(v / 0.5) * 0.5 == v for v in draws(param(kind, 1, 1, 0.5)))
    if kind == "qlognormal":
        assert all(v >= 0 for v in draws(param(kind, 3, 1, 2)))


def test_nested_choice_yields_name_and_nested_parameters() -> None:
    space = {
        "optimizer": param(
            "choice",
            {"_name": "sgd", "momentum": param("uniform", 0, 0.99)},
            {"_name": "adam", "beta1": param("choice", 0.9, 0.95), "eps": param("loguniform", 1e-8, 1e-6)},
            "none",
        )
    }
    rng = random.Random(3)
    shapes = set()
    for _ in range(300):
        opt = sample(space, rng)["optimizer"]
        if isinstance(opt, dict):
            shapes.add((opt["_name"], tuple(sorted(opt))))
        else:
            shapes.add((opt, ()))
    assert shapes == {
        ("sgd", ("_name", "momentum")),
        ("adam", ("_name", "beta1", "eps")),
        ("none", ()),
    }


def test_samples_are_reproducible_from_the_seed_and_json_serialisable() -> None:
    space = {kind: param(kind, *args) for kind, args in {
        "randint": (0, 100), "uniform": (0, 1), "quniform": (0, 10, 0.5),
        "loguniform": (1e-3, 1), "qloguniform": (1, 100, 1), "normal": (0, 1),
        "qnormal": (0, 10, 1), "lognormal": (0, 1), "qlognormal": (1, 1, 0.1),
    }.items()}
    space["choice"] = param("choice", "a", {"_name": "b", "x": param("randint", 0, 5)})
    assert set(space) == set(TYPES)
    first = [sample(space, random.Random(42)) for _ in range(3)]
    again = [sample(space, random.Random(42)) for _ in range(3)]
    other = [sample(space, random.Random(43)) for _ in range(3)]
    assert first == again != other
    assert json.loads(json.dumps(first)) == first


@given(
    low=st.floats(-1e6, 1e6, allow_nan=False),
    width=st.floats(1e-3, 1e6),
    q=st.floats(1e-3, 1e4),
    seed=st.integers(0, 2**32),
)
def test_samples_always_respect_the_bounds(low: float, width: float, q: float, seed: int) -> None:
    high = low + width
    log_low = abs(low) + 1e-3
    space = {
        "u": param("uniform", low, high),
        "qu": param("quniform", low, high, q),
        "lu": param("loguniform", log_low, log_low + width),
        "qlu": param("qloguniform", log_low, log_low + width, q),
        "ri": param("randint", math.floor(low), math.floor(low) + 1 + int(width)),
    }
    validate_search_space(space)
    point = sample(space, random.Random(seed))
    assert low <= point["u"] <= high and low <= point["qu"] <= high
    assert log_low <= point["lu"] <= log_low + width
    assert log_low <= point["qlu"] <= log_low + width
    assert math.floor(low) <= point["ri"] <= math.floor(low) + int(width)


# -- grid -------------------------------------------------------------------------------


def test_grid_is_the_cartesian_product_first_parameter_slowest() -> None:
    space = {"a": param("choice", "x", "y"), "b": param("randint", 0, 3)}
    assert list(grid(space)) == [
        {"a": "x", "b": 0}, {"a": "x", "b": 1}, {"a": "x", "b": 2},
        {"a": "y", "b": 0}, {"a": "y", "b": 1}, {"a": "y", "b": 2},
    ]
    assert grid_size(space) == 6


def test_grid_expands_nested_choices() -> None:
    space = {
        "opt": param(
            "choice",
            {"_name": "sgd", "m": param("choice", 0.0, 0.9), "n": param("randint", 0, 2)},
            {"_name": "adam"},
            "none",
        ),
        "bs": param("choice", 16, 32),
    }
    points = list(grid(space))
    assert len(points) == grid_size(space) == (4 + 1 + 1) * 2
    assert {"opt": {"_name": "sgd", "m": 0.9, "n": 1}, "bs": 32} in points
    assert {"opt": {"_name": "adam"}, "bs": 16} in points
    assert {"opt": "none", "bs": 32} in points
    assert len({json.dumps(p, sort_keys=True) for p in points}) == len(points)


def test_grid_of_quantized_types_is_what_sampling_can_reach() -> None:
    assert [p["q"] for p in grid({"q": param("quniform", 0, 1, 0.25)})] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [p["q"] for p in grid({"q": param("quniform", 2, 10, 3)})] == [3, 6, 9]
    assert [p["q"] for p in grid({"q": param("quniform", 0.04, 0.37, 0.1)})] == [0.04, 0.1, 0.2, 0.3, 0.37]
    assert [p["q"] for p in grid({"q": param("qloguniform", 1, 50, 10)})] == [1, 10, 20, 30, 40, 50]
    for spec in (param("quniform", 0.04, 0.37, 0.1), param("qloguniform", 1, 50, 10)):
        assert set(draws(spec)) == {p["q"] for p in grid({"q": spec})}


@given(
    low=st.floats(-100, 100, allow_nan=False),
    width=st.floats(1e-3, 100),
    q=st.floats(0.05, 50),
)
def test_grid_size_counts_the_quantized_grid(low: float, width: float, q: float) -> None:
    space = {"q": param("quniform", low, low + width, q)}
    values = [p["q"] for p in grid(space)]
    assert grid_size(space) == len(values) == len(set(values))
    assert values == sorted(values) and low <= values[0] and values[-1] <= low + width


def test_grid_is_lazy() -> None:
    space = {"a": param("randint", 0, 10**12), "b": param("randint", 0, 10**12)}
    assert grid_size(space) == 10**24
    assert next(grid(space)) == {"a": 0, "b": 0}


def test_empty_space_has_one_empty_point() -> None:
    assert list(grid({})) == [{}] and grid_size({}) == 1
    assert sample({}, random.Random(0)) == {}


@pytest.mark.parametrize(
    ("kind", "args", "word"),
    [
        ("uniform", (0, 1), "continuous"),
        ("loguniform", (1, 2), "continuous"),
        ("normal", (0, 1), "continuous"),
        ("lognormal", (0, 1), "continuous"),
        ("qnormal", (0, 1, 1), "unbounded"),
        ("qlognormal", (0, 1, 1), "unbounded"),
    ],
)
def test_grid_refuses_non_discrete_types(kind: str, args: tuple[float, ...], word: str) -> None:
    space = {"ok": param("choice", 1, 2), "lr": param(kind, *args)}
    assert not is_discrete(space)
    for call in (grid, grid_size):
        with pytest.raises(SearchSpaceError) as info:
            call(space)  # raises at once, not on the first next()
        [(path, message)] = info.value.issues
        assert path == "lr"
        assert kind in message and word in message
        assert "grid search needs discrete values" in message and "quniform or choice" in message


def test_grid_names_every_non_discrete_parameter_even_nested() -> None:
    space = {
        "lr": param("loguniform", 1e-4, 1),
        "opt": param("choice", "adam", {"_name": "sgd", "momentum": param("uniform", 0, 1)}),
    }
    with pytest.raises(SearchSpaceError) as info:
        grid(space)
    assert [path for path, _ in info.value.issues] == ["lr", "opt._value[1].momentum"]
    assert "opt._value[1].momentum: uniform is continuous" in str(info.value)


def test_grid_validates_first() -> None:
    with pytest.raises(SearchSpaceError) as info:
        grid({"a": param("randint", 3, 1)})
    assert info.value.issues[0][0] == "a._value"


# -- validation -------------------------------------------------------------------------


def test_a_valid_space_of_every_type_passes() -> None:
    validate_search_space({
        "c": param("choice", 1, "a", [1, 2], None, {"_name": "n", "x": param("randint", 0, 2)}),
        "ri": param("randint", 0, 1), "u": param("uniform", -1, 1.5),
        "qu": param("quniform", 0, 1, 0.1), "lu": param("loguniform", 1e-5, 1),
        "qlu": param("qloguniform", 1, 10, 1), "n": param("normal", -3, 0.1),
        "qn": param("qnormal", 0, 1, 1), "ln": param("lognormal", 0, 1),
        "qln": param("qlognormal", 0, 1, 1),
    })


def test_every_error_is_reported_with_its_path() -> None:
    space = {
        "lr": param("unifrom", 0, 1),
        "decay": param("loguniform", 0, 1),
        "dropout": param("uniform", 0.5, 0.1),
        "units": param("randint", 1.5, 4),
        "step": param("quniform", 0, 1),
        "noise": {"_type": "normal", "_value": [0, -1], "_vlaue": 3},
        "act": param("choice"),
        "optimizer": param(
            "choice",
            {"_name": "sgd", "momentum": param("uniform", 1, 0)},
            {"_name": "sgd"},
            {"lr": param("uniform", 0, 1)},
        ),
        "bare": 0.1,
        "nothing": {},
    }
    issues = issues_of(space)
    by_path: dict[str, list[str]] = {}
    for path, message in issues:
        by_path.setdefault(path, []).append(message)
    assert by_path == {
        "lr._type": [
            ("unknown _type 'unifrom'; did you mean 'uniform'? valid: choice, randint, uniform, "
            "quniform, loguniform, qloguniform, normal, qnormal, lognormal, qlognormal")
        ],
        "decay._value": ["loguniform needs low > 0 (it samples on a log scale), got low=0"],
        "dropout._value": ["uniform needs low < high, got [0.5, 0.1]"],
        "units._value": ["randint needs 2 integers [lower, upper) with lower < upper, got [1.5, 4]"],
        "step._value": ["quniform needs 3 numbers [low, high, q] with low < high and q > 0, got [0, 1]"],
        "noise._vlaue": ["unexpected key; a parameter has only _type and _value"],
        "noise._value": ["normal needs sigma > 0, got sigma=-1"],
        "act._value": ["choice needs a non-empty list of options"],
        "optimizer._value[0].momentum._value": ["uniform needs low < high, got [1, 0]"],
        "optimizer._value[1]._name": ["duplicate _name 'sgd' in this choice"],
        "optimizer._value[2]": [(
            "a dict option is a nested space and needs a '_name' key (a choice of whole parameter sets "
            "is the format of NNI's Batch tuner: give tuner: {name: Batch} to use it)"
        )],
        "bare": ['a parameter is {"_type": ..., "_value": [...]}, got float'],
        "nothing._type": ["missing; valid: " + ", ".join(TYPES)],
        "nothing._value": ["missing; it is a list whose meaning depends on _type"],
    }
    message = str(SearchSpaceError(issues))
    assert message.startswith(f"search space has {len(issues)} problem(s):")
    assert "\n  decay._value: loguniform needs low > 0" in message


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (param("uniform", 0, "1"), "uniform needs 2 numbers [low, high] with low < high"),
        (param("uniform", 0, float("inf")), "uniform needs 2 numbers"),
        (param("randint", True, 3), "randint needs 2 integers"),
        (param("qloguniform", -1, 10, 1), "qloguniform needs low > 0"),
        (param("qloguniform", 1, 10, 0), "qloguniform needs q > 0, got q=0"),
        (param("lognormal", 0, 0), "lognormal needs sigma > 0"),
        (param("qnormal", 0, 1), "qnormal needs 3 numbers [mu, sigma, q] with sigma > 0 and q > 0"),
        ({"_type": "choice", "_value": "abc"}, "must be a list, got str"),
        ({"_type": "choice"}, "missing; it is a list"),
        ({"_type": 3, "_value": [1]}, "unknown _type 3; valid: choice, randint"),
    ],
)
def test_validation_messages_say_what_is_valid(spec: dict[str, Any], expected: str) -> None:
    [(path, message)] = issues_of({"p": spec})
    assert path in ("p._type", "p._value")
    assert expected in message


def test_a_space_must_be_an_object() -> None:
    [(path, message)] = issues_of([param("uniform", 0, 1)])
    assert path == "<root>" and "JSON object" in message and "got list" in message


def test_the_quickstart_example_space_is_valid() -> None:
    path = Path(__file__).parents[2] / "examples" / "quickstart" / "search_space.json"
    space = json.loads(path.read_text())
    validate_search_space(space)
    assert set(sample(space, random.Random(0))) == {"lr", "batch_size", "epochs", "l2"}


BATCH_SPACE = {
    "combine_params": {"_type": "choice", "_value": [{"lr": 0.1, "opt": "adam"}, {"lr": 0.01, "opt": "sgd"}]}
}


def test_nnis_batch_format_is_accepted_for_the_batch_tuner_only() -> None:
    validate_search_space(BATCH_SPACE, batch=True)
    with pytest.raises(SearchSpaceError, match=r"give tuner: \{name: Batch\}"):
        validate_search_space(BATCH_SPACE)


@pytest.mark.parametrize(
    ("space", "where"),
    [
        ({**BATCH_SPACE, "x": {"_type": "uniform", "_value": [0, 1]}}, "<root>"),
        ({"combine_params": {"_type": "uniform", "_value": [0, 1]}}, "combine_params"),
        ({"combine_params": {"_type": "choice", "_value": [{"lr": 0.1}, 3]}}, "combine_params._value[1]"),
    ],
)
def test_a_batch_space_of_another_shape_says_what_batch_takes(space: dict[str, Any], where: str) -> None:
    with pytest.raises(SearchSpaceError) as e:
        validate_search_space(space, batch=True)
    assert [path for path, _ in e.value.issues] == [where]
    assert 'NNI\'s Batch tuner takes one parameter, {"combine_params": {"_type": "choice"' in str(e.value)


@pytest.mark.parametrize(("tuner", "ok"), [({"name": "Batch"}, True), ({"name": "batch_tuner"}, True),
                                           ({"className": "nni.algorithms.hpo.batch_tuner.BatchTuner"}, True),
                                           ({"name": "grid"}, False)])
def test_a_config_with_the_batch_format_loads_when_its_tuner_is_batch(tuner: dict[str, Any], ok: bool) -> None:
    data = {"trialCommand": "python t.py", "trialConcurrency": 1, "trainingService": {"platform": "local"},
            "searchSpace": BATCH_SPACE, "tuner": tuner}
    if ok:
        assert parse_config(data, '.').search_space == BATCH_SPACE
    else:
        with pytest.raises(ConfigError, match=r"searchSpace.combine_params._value\[0\].*give tuner: \{name: Batch\}"):
            parse_config(data, '.')
