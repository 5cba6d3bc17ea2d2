from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trialkeeper.coordinator.config.experiment import (
    TRAINING_SERVICES,
    ConfigError,
    ConfigIssue,
    CoordinatorSettings,
    ExperimentConfig,
    TrainingServiceConfig,
    TunerConfig,
    config_to_dict,
    load_config,
    parse_config,
    parse_duration,
    register_training_service,
    split_address,
)
from trialkeeper.coordinator.services.local_config import LocalConfig

SEARCHSPACE = "trialkeeper.coordinator.search.space"


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclass(frozen=True, kw_only=True)
class FakeRemoteConfig(TrainingServiceConfig):
    PLATFORM: ClassVar[str] = "fakeremote"
    host: str
    password: str | None = None
    ssh_key_file: str | None = None
    api_token: str | None = None
    mode: Mode = Mode.FAST
    shell: Literal["bash", "sh"] = "bash"


@pytest.fixture
def fake_remote() -> Iterator[type[FakeRemoteConfig]]:
    register_training_service(FakeRemoteConfig)
    yield FakeRemoteConfig
    TRAINING_SERVICES.pop("fakeremote")


@pytest.fixture
def no_searchspace() -> Iterator[None]:
    """Hide the search-space validator so these tests check this module alone."""
    with mock.patch.dict(sys.modules, {SEARCHSPACE: None}):
        yield


def minimal(**extra: Any) -> dict[str, Any]:
    return {
        "trialCommand": "python train.py",
        "trialConcurrency": 2,
        "trainingService": {"platform": "local"},
        **extra,
    }


def errors(data: object, base_dir: Path) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, base_dir)
    return {issue.path: issue.message for issue in info.value.issues}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- valid configs ---------------------------------------------------------------------


def test_minimal_config_from_yaml_gets_defaults(tmp_path: Path) -> None:
    file = write(
        tmp_path / "exp" / "config.yml",
        "trialCommand: python train.py\ntrialConcurrency: 2\ntrainingService:\n  platform: local\n",
    )
    cfg = load_config(file)
    assert cfg.trial_command == "python train.py"
    assert cfg.trial_concurrency == 2
    assert cfg.training_service == LocalConfig()
    assert cfg.training_service.platform == "local"
    assert cfg.search_space == {}
    assert cfg.trial_code_directory == tmp_path / "exp"
    assert cfg.tuner.name == "random" and cfg.tuner.class_name is None
    assert cfg.coordinator == CoordinatorSettings()
    assert cfg.experiment_working_directory == Path.home() / "trialkeeper-experiments"
    assert cfg.max_trial_retries == 0 and cfg.trial_env == {}


FULL_CAMEL = {
    "experimentName": "mnist",
    "trialCommand": "python train.py",
    "trialConcurrency": 4,
    "trialGpuNumber": 1,
    "maxTrialNumber": 20,
    "maxExperimentDuration": "1h",
    "maxTrialDuration": 90,
    "maxTrialRetries": 2,
    "searchSpace": {"lr": {"_type": "loguniform", "_value": [0.0001, 0.1]}},
    "trialCodeDirectory": "code",
    "experimentWorkingDirectory": "runs",
    "trialEnv": {"OMP_NUM_THREADS": "1"},
    "tuner": {"className": "my_tuners:Best", "classArgs": {"optimizeMode": "max"}},
    "trainingService": {
        "platform": "local",
        "reuseMode": True,
        "environmentCount": 2,
        "trialsPerEnvironment": 2,
        "useActiveGpu": True,
        "maxTrialNumberPerGpu": 2,
        "gpuIndices": [0, 1],
        "simulatedGpus": 2,
    },
    "coordinator": {
        "address": "0.0.0.0:50051",
        "advertiseAddress": "head.example.com:50051",
        "heartbeatInterval": "2s",
        "agentLostTimeout": 10,
        "reconnectWindow": "2m",
    },
}


def snake_keys(data: Any) -> Any:
    """The config with its own keys in snake_case (user data such as classArgs untouched)."""
    if not isinstance(data, dict):
        return data
    return {
        re.sub(r"[A-Z]", lambda m: "_" + m[0].lower(), key): (
            value if key in {"searchSpace", "trialEnv", "classArgs"} else snake_keys(value)
        )
        for key, value in data.items()
    }


def test_camel_and_snake_case_parse_identically(tmp_path: Path, no_searchspace: None) -> None:
    (tmp_path / "code").mkdir()
    camel = parse_config(FULL_CAMEL, tmp_path)
    snake_data = snake_keys(FULL_CAMEL)
    assert "trial_concurrency" in snake_data and "use_active_gpu" in snake_data["training_service"]
    assert parse_config(snake_data, tmp_path) == camel
    assert camel.max_experiment_duration == 3600.0
    assert camel.max_trial_duration == 90.0
    assert camel.coordinator.reconnect_window == 120.0
    assert camel.trial_code_directory == tmp_path / "code"
    assert camel.experiment_working_directory == tmp_path / "runs"
    assert camel.tuner.name is None and camel.tuner.class_args == {"optimizeMode": "max"}


def test_mixed_spelling_is_fine_but_the_same_key_twice_is_not(tmp_path: Path) -> None:
    cfg = parse_config(
        {"trial_command": "x", "trialConcurrency": 1, "training_service": {"platform": "local"}},
        tmp_path,
    )
    assert cfg.trial_concurrency == 1
    found = errors(minimal(trial_concurrency=3), tmp_path)
    assert found == {"trial_concurrency": "the same key as 'trialConcurrency'; give it once"}


def test_null_means_default(tmp_path: Path) -> None:
    cfg = parse_config(minimal(trialEnv=None, tuner=None, maxTrialNumber=None), tmp_path)
    assert cfg.trial_env == {} and cfg.tuner.name == "random" and cfg.max_trial_number is None


# --- errors ------------------------------------------------------------------------------


def test_every_error_is_reported_at_once_with_its_path(tmp_path: Path) -> None:
    data = {
        "trialConcurrency": "two",
        "maxTrialNumber": 0,
        "maxTrialDuration": "forever",
        "trialGpuNumber": -1,
        "trainingService": {"platform": "local", "environmentCount": -1, "gpuIndices": [0, "a"]},
        "coordinator": {"address": "localhost", "heartbeatInterval": 0},
        "tuner": {"name": "tpe", "className": "pkg:Tuner"},
    }
    found = errors(data, tmp_path)
    assert found == {
        "trialCommand": "required key is missing (a non-empty string)",
        "trialConcurrency": "expected a positive integer, got 'two'",
        "maxTrialNumber": "expected a positive integer, got 0",
        "maxTrialDuration": (
            "expected a duration (a number of seconds or a string like "
            "'90s', '30m', '1.5h', '2d'), got 'forever'"
        ),
        "trialGpuNumber": "expected a non-negative integer, got -1",
        "trainingService.environmentCount": "expected a non-negative integer, got -1",
        "trainingService.gpuIndices[1]": "expected an integer, got 'a'",
        "coordinator.address": "expected host:port with a port 0-65535, got 'localhost'",
        "coordinator.heartbeatInterval": (
            "expected a positive duration (a number of seconds or a string like "
            "'90s', '30m', '1.5h', '2d'), got 0"
        ),
        "tuner.className": "give either name or className, not both",
    }


def test_local_environment_count_0_is_an_experiment_of_agents_started_by_hand_in_reuse_mode(tmp_path: Path) -> None:
    base = {"trialCommand": "python trial.py", "trialConcurrency": 2}
    config = parse_config({**base, "trainingService": {"platform": "local", "environmentCount": 0}}, tmp_path)
    assert config.training_service.effective_environment_count(2) == 0
    assert errors({**base, "trainingService": {"platform": "local", "environmentCount": 0, "reuseMode": False}},
                  tmp_path) == {"trainingService.environmentCount": (
        "0 (agents started by hand only) needs reuseMode: true, as agents started by hand join only in "
        "reuse mode; give 1 or more, or set reuseMode: true")}


def test_config_error_lists_issues_one_per_line() -> None:
    error = ConfigError([ConfigIssue("a.b", "bad"), ConfigIssue("c", "worse")])
    assert str(error) == "a.b: bad\nc: worse"
    assert isinstance(error, ValueError)


def test_missing_keys_are_named_in_the_users_style(tmp_path: Path) -> None:
    found = errors({"trial_command": "x", "trial_code_directory": "."}, tmp_path)
    assert set(found) == {"trial_concurrency", "training_service"}
    assert "one of: local" in found["training_service"]


def test_unknown_key_did_you_mean(tmp_path: Path) -> None:
    found = errors(minimal(trialConcurency=3, max_trail_number=3), tmp_path)
    assert found == {
        "trialConcurency": "unknown key; did you mean 'trialConcurrency'?",
        "max_trail_number": "unknown key; did you mean 'max_trial_number'?",
    }


def test_unknown_key_without_a_close_match_lists_the_valid_ones(tmp_path: Path) -> None:
    found = errors(minimal(coordinator={"zzz": 1}), tmp_path)
    assert found == {
        "coordinator.zzz": (
            "unknown key; valid keys are: address, advertiseAddress, heartbeatInterval, "
            "agentLostTimeout, trialLostTimeout, reconnectWindow, maxHeartbeatsPerSecond, tls, checkpointPort"
        )
    }


def test_nested_unknown_key_in_training_service(tmp_path: Path) -> None:
    found = errors(
        minimal(trainingService={"platform": "local", "enviromentCount": 2, "gpu_indexes": "0"}),
        tmp_path,
    )
    assert found == {
        "trainingService.enviromentCount": "unknown key; did you mean 'environmentCount'?",
        "trainingService.gpu_indexes": "unknown key; did you mean 'gpu_indices'?",
    }


def test_unknown_or_missing_platform(tmp_path: Path) -> None:
    valid = ", ".join(TRAINING_SERVICES)  # every registered platform, built-in or not
    found = errors(minimal(trainingService={"platform": "locl"}), tmp_path)
    assert found == {
        "trainingService.platform": f"unknown platform 'locl'; did you mean 'local'? valid: {valid}"
    }
    found = errors(minimal(trainingService={"platform": "abacus"}), tmp_path)
    assert found == {"trainingService.platform": f"unknown platform 'abacus'; valid: {valid}"}
    found = errors(minimal(trainingService={"useActiveGpu": True}), tmp_path)
    assert found == {"trainingService.platform": f"required key is missing (one of: {valid})"}
    found = errors(minimal(trainingService="local"), tmp_path)
    assert found == {
        "trainingService": (
            f"expected a mapping with 'platform' (one of: {valid}), or a list of such mappings, got 'local'"
        )
    }


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("trialConcurrency", True, "expected a positive integer, got true"),
        ("trialConcurrency", 2.0, "expected a positive integer, got 2.0"),
        ("trialGpuNumber", False, "expected a non-negative integer, got false"),
        ("maxTrialDuration", True, "expected a duration"),
    ],
)
def test_a_bool_is_not_an_int(tmp_path: Path, key: str, value: object, message: str) -> None:
    assert errors(minimal(**{key: value}), tmp_path)[key].startswith(message)


@pytest.mark.parametrize("value", [1, 0, "yes", "true", "on"])
def test_only_true_and_false_are_bools(tmp_path: Path, value: object) -> None:
    found = errors(minimal(trainingService={"platform": "local", "useActiveGpu": value}), tmp_path)
    assert found == {"trainingService.useActiveGpu": f"expected true or false, got {value!r}"}


def test_yaml_yes_stays_a_string(tmp_path: Path) -> None:
    file = write(
        tmp_path / "c.yml",
        "trialCommand: x\ntrialConcurrency: 1\n"
        "trainingService: {platform: local, useActiveGpu: yes, reuseMode: false}\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert [str(i) for i in info.value.issues] == [
        "trainingService.useActiveGpu: expected true or false, got 'yes'"
    ]


def test_strings_are_not_guessed_from_numbers(tmp_path: Path) -> None:
    found = errors(minimal(trialEnv={"CUDA_VISIBLE_DEVICES": 0}), tmp_path)
    assert found == {
        "trialEnv.CUDA_VISIBLE_DEVICES": (
            "expected a string, got 0 (quote it in YAML to make it a string)"
        )
    }


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert errors([1, 2], tmp_path) == {"": "expected a mapping, got [1, 2]"}
    assert errors(minimal(trialEnv={1: "x"}), tmp_path) == {
        "trialEnv.1": "keys must be strings, got 1"
    }


# --- durations, addresses, GPUs --------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (90, 90.0),
        (1.5, 1.5),
        ("90", 90.0),
        ("90s", 90.0),
        ("30m", 1800.0),
        ("1.5h", 5400.0),
        ("2d", 172800.0),
        (" 10 min ", 600.0),
        ("1e3", 1000.0),
        ("0", 0.0),
    ],
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value", [True, -1, "-5s", "5 fortnights", "h", "", None, [1], math.inf, math.nan, "1e999s"]
)
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="expected a duration .* got"):
        parse_duration(value)


def test_duration_fields(tmp_path: Path) -> None:
    cfg = parse_config(
        minimal(maxExperimentDuration="2d", coordinator={"heartbeatInterval": "500e-3s"}), tmp_path
    )
    assert cfg.max_experiment_duration == 172800.0
    assert cfg.coordinator.heartbeat_interval == 0.5
    found = errors(minimal(coordinator={"heartbeatInterval": "10s"}), tmp_path)
    assert found == {
        "coordinator.agentLostTimeout": "must be longer than heartbeatInterval (10s), got 5s"
    }


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("localhost:50051", ("localhost", 50051)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::]:0", ("::", 0)),
        ("head-node.example.com:65535", ("head-node.example.com", 65535)),
    ],
)
def test_split_address(address: str, expected: tuple[str, int]) -> None:
    assert split_address(address) == expected


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("localhost", "expected host:port"),
        ("localhost:65536", "expected host:port with a port 0-65535"),
        ("::1:80", "write an IPv6 host in brackets"),
        ("[::zz]:80", "invalid IPv6 address"),
        ("300.1.1.1:80", "invalid IPv4 address"),
        ("bad host:80", "invalid host name"),
        (":80", "invalid host name"),
    ],
)
def test_split_address_rejects(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_address(address)


def test_advertised_address_needs_a_real_port(tmp_path: Path) -> None:
    found = errors(minimal(coordinator={"advertiseAddress": "head:0"}), tmp_path)
    assert found == {
        "coordinator.advertiseAddress": "expected host:port with a port 1-65535, got 'head:0'"
    }


@pytest.mark.parametrize(
    ("value", "indices"), [("0,1,3", [0, 1, 3]), (" 2 , 0 ", [2, 0]), (1, [1]), ([0, 2], [0, 2])]
)
def test_gpu_indices_forms(tmp_path: Path, value: object, indices: list[int]) -> None:
    cfg = parse_config(
        minimal(trainingService={"platform": "local", "gpuIndices": value}), tmp_path
    )
    assert isinstance(cfg.training_service, LocalConfig)
    assert cfg.training_service.gpu_indices == indices


@pytest.mark.parametrize("value", ["0,0", "0,a", "", [-1], [1, 1], True])
def test_gpu_indices_rejects(tmp_path: Path, value: object) -> None:
    found = errors(minimal(trainingService={"platform": "local", "gpuIndices": value}), tmp_path)
    assert found["trainingService.gpuIndices"].startswith(
        "expected a list of distinct non-negative GPU indices, or a comma string like '0,1,3', got"
    )


def test_effective_environment_count() -> None:
    assert LocalConfig().effective_environment_count(4) == 4
    assert LocalConfig(trials_per_environment=3).effective_environment_count(7) == 3
    assert LocalConfig(trials_per_environment=3).effective_environment_count(6) == 2
    assert LocalConfig(environment_count=5).effective_environment_count(2) == 5
    no_reuse = LocalConfig(reuse_mode=False, environment_count=1, trials_per_environment=4)
    assert no_reuse.effective_environment_count(3) == 3


# --- files and directories -------------------------------------------------------------


def test_search_space_file_is_relative_to_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_searchspace: None
) -> None:
    space = {"lr": {"_type": "choice", "_value": [0.1, 0.01]}}
    write(tmp_path / "exp" / "spaces" / "space.json", json.dumps(space))
    write(tmp_path / "exp" / "space.yml", "lr: {_type: choice, _value: [0.1, 0.01]}\n")
    config = write(
        tmp_path / "exp" / "config.yml",
        "trialCommand: x\ntrialConcurrency: 1\ntrainingService: {platform: local}\n"
        "searchSpaceFile: spaces/space.json\n",
    )
    monkeypatch.chdir(tmp_path)  # not the config's directory
    cfg = load_config(Path("exp/config.yml"))
    assert cfg.search_space == space
    assert cfg.search_space_file == tmp_path / "exp" / "spaces" / "space.json"
    config.write_text(config.read_text().replace("spaces/space.json", "space.yml"))
    assert load_config(config).search_space == space


def test_search_space_file_errors_name_the_file(tmp_path: Path) -> None:
    found = errors(minimal(searchSpaceFile="nope.json"), tmp_path)
    assert found == {"searchSpaceFile": f"{tmp_path / 'nope.json'}: does not exist"}
    write(tmp_path / "list.yml", "- 1\n- 2\n")
    found = errors(minimal(searchSpaceFile="list.yml"), tmp_path)
    assert found == {"searchSpaceFile": f"{tmp_path / 'list.yml'}: expected a mapping, got [1, 2]"}
    write(tmp_path / "broken.json", '{"lr": ')
    found = errors(minimal(searchSpaceFile="broken.json"), tmp_path)
    assert found["searchSpaceFile"].startswith(f"{tmp_path / 'broken.json'}:1:8: invalid JSON")
    found = errors(minimal(searchSpaceFile="."), tmp_path)
    assert found == {"searchSpaceFile": f"{tmp_path}: is not a file"}


def test_search_space_and_file_are_exclusive(tmp_path: Path) -> None:
    write(tmp_path / "space.json", "{}")
    found = errors(minimal(searchSpace={}, searchSpaceFile="space.json"), tmp_path)
    assert found == {"searchSpaceFile": "give either searchSpace or searchSpaceFile, not both"}
    found = errors(minimal(search_space={}, search_space_file="space.json"), tmp_path)
    assert found == {"search_space_file": "give either search_space or search_space_file, not both"}


def test_search_space_issues_are_folded_in(tmp_path: Path) -> None:
    class SearchSpaceError(ValueError):
        def __init__(self, issues: list[tuple[Any, str]]) -> None:
            super().__init__("bad space")
            self.issues = issues

    def validate_search_space(space: object) -> None:
        raise SearchSpaceError(
            [
                ("lr._type", "unknown _type 'foo'"),
                ("<root>", "too small"),
                (("opt", "_value", 1), "bad option"),
            ]
        )

    fake = types.ModuleType(SEARCHSPACE)
    fake.SearchSpaceError = SearchSpaceError  # type: ignore[attr-defined]
    fake.validate_search_space = validate_search_space  # type: ignore[attr-defined]
    with mock.patch.dict(sys.modules, {SEARCHSPACE: fake}):
        found = errors(minimal(searchSpace={"lr": {}}, trialGpuNumber=-1), tmp_path)
    assert found == {
        "searchSpace.lr._type": "unknown _type 'foo'",
        "searchSpace": "too small",
        "searchSpace.opt._value[1]": "bad option",
        "trialGpuNumber": "expected a non-negative integer, got -1",
    }


def test_search_space_must_be_plain_data(tmp_path: Path) -> None:
    found = errors(minimal(searchSpace={"lr": {1, 2}}), tmp_path)
    assert found == {
        "searchSpace.lr": (
            "expected plain data (mappings, lists, strings, numbers, booleans), got a set"
        )
    }


def test_code_directory_must_exist(tmp_path: Path) -> None:
    found = errors(minimal(trialCodeDirectory="missing"), tmp_path)
    assert found == {"trialCodeDirectory": f"{tmp_path / 'missing'} does not exist"}
    write(tmp_path / "file.py", "")
    found = errors(minimal(trial_code_directory="file.py"), tmp_path)
    assert found == {"trial_code_directory": f"{tmp_path / 'file.py'} is not a directory"}
    found = errors(minimal(tuner={"className": "a.B", "codeDirectory": "gone"}), tmp_path)
    assert found == {"tuner.codeDirectory": f"not an existing directory: {tmp_path / 'gone'}"}


def test_tuner_class_name_replaces_the_default_name(tmp_path: Path) -> None:
    cfg = parse_config(minimal(tuner={"className": "pkg.tuners:MyTuner"}), tmp_path)
    assert cfg.tuner.name is None and cfg.tuner.class_name == "pkg.tuners:MyTuner"
    found = errors(minimal(tuner={"className": "not an import path"}), tmp_path)
    assert found["tuner.className"].startswith("expected an import path like")


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    file = write(tmp_path / "c.yml", "trialCommand: x\ntrialConcurrency: [1\nfoo: bar\n")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    (issue,) = info.value.issues
    assert issue.path.startswith(f"{file}:")
    line, column = map(int, issue.path.rsplit(":", 2)[1:])
    assert line == 3 and column >= 1
    assert issue.message.startswith("invalid YAML:")


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yml")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(write(tmp_path / "empty.yml", "# nothing\n"))
    with pytest.raises(
        ConfigError, match=r"c\.yml:2:1: invalid YAML: duplicate key 'trialCommand'"
    ):
        load_config(write(tmp_path / "c.yml", "trialCommand: a\ntrialCommand: b\n"))


# --- storing the config ----------------------------------------------------------------


def test_config_to_dict_round_trips(tmp_path: Path, no_searchspace: None) -> None:
    (tmp_path / "code").mkdir()
    write(tmp_path / "space.json", '{"x": {"_type": "choice", "_value": [1, 2]}}')
    cfg = parse_config(
        {**FULL_CAMEL, "searchSpace": None, "searchSpaceFile": "space.json"}, tmp_path
    )
    stored = json.loads(json.dumps(config_to_dict(cfg)))
    assert stored["trainingService"]["platform"] == "local"
    assert stored["trainingService"]["gpuIndices"] == [0, 1]
    assert stored["trialCodeDirectory"] == str(tmp_path / "code")
    assert stored["searchSpace"] == {"x": {"_type": "choice", "_value": [1, 2]}}
    assert "searchSpaceFile" not in stored
    assert stored["tuner"]["classArgs"] == {"optimizeMode": "max"}
    again = parse_config(stored, tmp_path / "elsewhere")
    assert again == dataclasses.replace(cfg, search_space_file=None)


def test_redaction(tmp_path: Path, fake_remote: type[FakeRemoteConfig]) -> None:
    cfg = parse_config(
        minimal(
            trainingService={
                "platform": "fakeremote",
                "host": "gpu1",
                "password": "hunter2",
                "sshKeyFile": "~/.ssh/id_ed25519",
                "apiToken": "t0k",
            },
            trialEnv={"WANDB_API_KEY": "abc", "HOME": "/root"},
            tuner={"name": "tpe", "classArgs": {"secret": "s", "seed": 1}},
        ),
        tmp_path,
    )
    shown = config_to_dict(cfg, redact=True)
    service = shown["trainingService"]
    assert service["password"] == "***" and service["apiToken"] == "***"
    assert service["sshKeyFile"] == "~/.ssh/id_ed25519"
    assert shown["trialEnv"] == {"WANDB_API_KEY": "***", "HOME": "/root"}
    assert shown["tuner"]["classArgs"] == {"secret": "***", "seed": 1}
    assert "hunter2" not in json.dumps(shown)
    assert config_to_dict(cfg)["trainingService"]["password"] == "hunter2"


# --- the registry ----------------------------------------------------------------------


def test_registered_platforms_validate_their_own_fields(
    tmp_path: Path, fake_remote: type[FakeRemoteConfig]
) -> None:
    cfg = parse_config(
        minimal(trainingService={"platform": "fakeremote", "host": "h", "mode": "safe"}), tmp_path
    )
    assert cfg.training_service == FakeRemoteConfig(host="h", mode=Mode.SAFE)
    assert cfg.training_service.platform == "fakeremote"
    assert config_to_dict(cfg)["trainingService"]["mode"] == "safe"
    found = errors(
        minimal(trainingService={"platform": "fakeremote", "mode": "slow", "shell": "zsh"}),
        tmp_path,
    )
    assert found == {
        "trainingService.host": "required key is missing (a string)",
        "trainingService.mode": "expected one of 'fast', 'safe', got 'slow'",
        "trainingService.shell": "expected one of 'bash', 'sh', got 'zsh'",
    }
    found = errors(minimal(trainingService={"platform": "fakeremot"}), tmp_path)
    assert found == {
        "trainingService.platform": (
            "unknown platform 'fakeremot'; did you mean 'fakeremote'? "
            f"valid: {', '.join(TRAINING_SERVICES)}"
        )
    }


def test_register_training_service_refuses_bad_classes() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Other(TrainingServiceConfig):
        PLATFORM: ClassVar[str] = "local"

    with pytest.raises(ValueError, match="already registered"):
        register_training_service(Other)

    @dataclass(frozen=True, kw_only=True)
    class Nameless(TrainingServiceConfig):
        pass

    with pytest.raises(TypeError, match="PLATFORM"):
        register_training_service(Nameless)
    with pytest.raises(TypeError, match="not a dataclass subclass"):
        register_training_service(ExperimentConfig)  # type: ignore[type-var]
    assert register_training_service(LocalConfig) is LocalConfig  # idempotent
    assert TRAINING_SERVICES["local"] is LocalConfig


# --- fuzzing -------------------------------------------------------------------------------

FIELD_NAMES = sorted(
    {
        f.name
        for cls in (ExperimentConfig, LocalConfig, TunerConfig, CoordinatorSettings)
        for f in dataclasses.fields(cls)
    }
)
KNOWN_KEYS = FIELD_NAMES + [re.sub(r"_(.)", lambda m: m[1].upper(), n) for n in FIELD_NAMES]
LOCAL_KEYS = [f.name for f in dataclasses.fields(LocalConfig) if f.init]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["local", ".", "1h", "0,1", "127.0.0.1:0", "[::1]:1", "a:B", "~", "~nobody9"])
    | st.sampled_from([1, 2, True, False, {}, [], [0, 1], {"A": "b"}])
)
KEYS = st.sampled_from(KNOWN_KEYS) | st.text(max_size=10)
DATA = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.integers(), inner, max_size=6)
    ),
    max_leaves=40,
)
CONFIGS = (
    DATA
    | st.dictionaries(KEYS, DATA, max_size=8)
    | st.builds(
        lambda over, ts: {**minimal(trainingService={"platform": "local", **ts}), **over},
        st.dictionaries(KEYS, DATA, max_size=4),
        st.dictionaries(KEYS, DATA, max_size=4),
    )
    # Mostly valid: a few known keys changed, so that parsing often gets to the end.
    | st.builds(
        lambda over, ts: {**minimal(trainingService={"platform": "local", **ts}), **over},
        st.dictionaries(st.sampled_from(KNOWN_KEYS), SCALARS, max_size=1),
        st.dictionaries(st.sampled_from(LOCAL_KEYS), SCALARS, max_size=1),
    )
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=CONFIGS)
def test_random_data_only_ever_raises_config_error(
    tmp_path_factory: pytest.TempPathFactory, data: object
) -> None:
    base = tmp_path_factory.getbasetemp()
    with mock.patch.dict(sys.modules, {SEARCHSPACE: None}):
        try:
            cfg = parse_config(data, base)
        except ConfigError as e:
            assert e.issues and all(isinstance(i, ConfigIssue) for i in e.issues)
            return
        # Whatever parses can be stored, and the stored form parses back to the same.
        stored = json.loads(json.dumps(config_to_dict(cfg)))
        assert parse_config(stored, base) == dataclasses.replace(cfg, search_space_file=None)


YAML_PIECES = [*":{}[]-,&*!|>'\"#\n 0.~", "!!set ", "!!binary ", "!!timestamp ", "<<", "yes"]
# Without trialConcurrency among the pieces, no text can be a valid config.
YAML_PIECES += ["trialCommand", "trainingService", "platform", "local", "searchSpaceFile"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.sampled_from(YAML_PIECES), max_size=40).map("".join))
def test_random_yaml_only_ever_raises_config_error(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    file = tmp_path_factory.getbasetemp() / "fuzz" / "config.yml"
    write(file, text)
    with mock.patch.dict(sys.modules, {SEARCHSPACE: None}), pytest.raises(ConfigError):
        load_config(file)


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    # Thirty levels of nine aliases each describe 9**30 leaves: refused by count, at once.
    lines = ["l0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"l{i + 1}: &a{i + 1} [{', '.join(['*a' + str(i)] * 9)}]" for i in range(30)]
    path = tmp_path / "bomb.yml"
    path.write_text("\n".join([*lines, "trialCommand: x", "trialConcurrency: 1"]))
    with pytest.raises(ConfigError, match="more than 200 aliases"):
        load_config(path)
