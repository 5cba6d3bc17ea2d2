"""Hostile configs: whatever a user (or a tuner embedding us) hands to the parser, the
only exception that comes out is ConfigError, with at least one located issue.

``test_config.py`` fuzzes the shape of the config with the search-space checks switched
off. These fuzz what it leaves: search spaces through the real search-space checks, every
registered platform, values YAML cannot produce but Python callers can (NaN, huge ints,
bytes, sets, cycles, deep nesting, non-string keys), and raw bytes as a config file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trialkeeper.coordinator.config.experiment import (
    TRAINING_SERVICES,
    ConfigError,
    ExperimentConfig,
    load_config,
    parse_config,
)
from trialkeeper.coordinator.search.space import TYPES

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ODD_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([10**400, -(10**400), 2**63, -(2**63) - 1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
    | st.text(alphabet=st.characters(blacklist_categories=()), max_size=8)  # surrogates, NULs
    | st.binary(max_size=8)
    | st.sampled_from(["", " ", "\x00", "1e999", "-0", "NaN", "inf", "0x10", "1h", "-1s", "9" * 40])
    | st.sampled_from(["127.0.0.1:0", "[::1]:65536", ":", "host:port", "a" * 300, "~", "/", "..", "0,1,1"])
    | st.builds(Path, st.sampled_from(["/", ".", "/nonexistent", "\x00"]))
    | st.builds(object)
)
ODD_KEYS = (
    st.text(max_size=12)
    | st.integers()
    | st.none()
    | st.booleans()
    | st.tuples(st.integers())
    | st.sampled_from(["platform", "_type", "_value", "_name", "tls", "machineList", "host", "user"])
)
ODD_DATA = st.recursive(
    ODD_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.frozensets(st.integers(), max_size=3)
        | st.dictionaries(ODD_KEYS, inner, max_size=5)
    ),
    max_leaves=30,
)

PARAM_SPECS = st.fixed_dictionaries(
    {"_type": st.sampled_from(TYPES) | st.text(max_size=6)},
    optional={
        "_value": st.lists(
            st.floats(allow_nan=True) | st.integers(min_value=-(10**30), max_value=10**30) | ODD_DATA,
            max_size=4,
        )
        | st.lists(
            st.fixed_dictionaries({"_name": st.text(max_size=4)}, optional={"p": st.deferred(lambda: PARAM_SPECS)}),
            max_size=3,
        )
        | ODD_DATA,
        "_extra": ODD_DATA,
    },
)
SEARCH_SPACES = st.dictionaries(st.text(max_size=6) | st.integers(), PARAM_SPECS | ODD_DATA, max_size=4) | ODD_DATA


def _base(tmp_path: Path, **over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "trialCommand": "python3 trial.py",
        "trialConcurrency": 1,
        "trainingService": {"platform": "local"},
        "trialCodeDirectory": str(tmp_path),
        "experimentWorkingDirectory": str(tmp_path / "exp"),
    }
    data.update(over)
    return data


def _parse_only_config_error(data: object, base: Path) -> ExperimentConfig | None:
    try:
        return parse_config(data, base)
    except ConfigError as e:
        assert e.issues, "a ConfigError names at least one issue"
        assert str(e)
        return None


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(space=SEARCH_SPACES)
def test_fuzzed_search_spaces_through_the_real_checks(base: Path, space: object) -> None:
    cfg = _parse_only_config_error(_base(base, searchSpace=space), base)
    if cfg is not None:
        assert isinstance(cfg.search_space, dict)


@FUZZ
@given(
    platform=st.sampled_from(sorted(TRAINING_SERVICES)) | ODD_SCALARS,
    fields=st.dictionaries(ODD_KEYS, ODD_DATA, max_size=6),
)
def test_fuzzed_training_services_of_every_platform(base: Path, platform: object, fields: dict[Any, Any]) -> None:
    _parse_only_config_error(_base(base, trainingService={**fields, "platform": platform}), base)


MACHINE = st.fixed_dictionaries(
    {"host": ODD_SCALARS | st.just("gpu-box-1"), "user": ODD_SCALARS | st.just("me")},
    optional={"port": ODD_SCALARS, "password": ODD_SCALARS, "sshKeyFile": ODD_SCALARS, "gpuIndices": ODD_DATA},
)


@FUZZ
@given(machines=st.lists(MACHINE, max_size=3) | ODD_DATA, extra=st.dictionaries(ODD_KEYS, ODD_DATA, max_size=3))
def test_fuzzed_remote_machine_lists(base: Path, machines: object, extra: dict[Any, Any]) -> None:
    ts = {**extra, "platform": "remote", "machineList": machines}
    _parse_only_config_error(_base(base, trainingService=ts), base)


@FUZZ
@given(section=st.dictionaries(st.sampled_from(["tls", "address", "advertiseAddress", "heartbeatInterval",
                                                "agentLostTimeout", "trialLostTimeout", "reconnectWindow"]) | ODD_KEYS,
                               ODD_SCALARS, max_size=4))
def test_fuzzed_coordinator_section(base: Path, section: dict[Any, Any]) -> None:
    cfg = _parse_only_config_error(_base(base, coordinator=section), base)
    if cfg is not None:
        assert isinstance(cfg.coordinator.tls, bool)
        assert math.isfinite(cfg.coordinator.heartbeat_interval) and cfg.coordinator.heartbeat_interval > 0


@FUZZ
@given(data=ODD_DATA | st.dictionaries(ODD_KEYS, ODD_DATA, max_size=8))
def test_python_values_yaml_cannot_produce(base: Path, data: object) -> None:
    _parse_only_config_error(data, base)
    if isinstance(data, dict):
        _parse_only_config_error({**_base(base), **data}, base)


def test_cycles_and_deep_nesting(base: Path) -> None:
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    looped: list[Any] = []
    looped.append(looped)
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    for value in (cyclic, looped, deep):
        for data in (
            value,
            _base(base, searchSpace=value),
            _base(base, trialEnv=value),
            _base(base, tuner={"classArgs": value}),
        ):
            _parse_only_config_error(data, base)


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode), suffix=st.sampled_from([".yml", ".json"]))
def test_raw_bytes_as_a_config_file(base: Path, raw: bytes, suffix: str) -> None:
    file = base / f"config{suffix}"
    file.write_bytes(raw)
    try:
        load_config(file)
    except ConfigError as e:
        assert e.issues
