"""The experiment config: parsed and validated once, at start, then passed down.

The YAML uses the field names NNI users know. Every key may be written in camelCase or
snake_case; inside, everything is snake_case. Validation is driven by the dataclasses
below: a small walker reads each field's type hint and the `_Rule` in its metadata and
collects every problem, each with the path of the key as the user spelled it, before
raising one `ConfigError`. Checks that span fields live in a `_finalize` classmethod
on the dataclass that needs them.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import importlib
import ipaddress
import json
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union

import yaml

__all__ = [
    "TRAINING_SERVICES",
    "ConfigError",
    "ConfigIssue",
    "CoordinatorSettings",
    "ExperimentConfig",
    "LocalConfig",
    "TrainingServiceConfig",
    "TunerConfig",
    "config_to_dict",
    "load_config",
    "parse_config",
    "parse_duration",
    "register_training_service",
    "split_address",
]

_SEARCHSPACE_MODULE = "trialkeeper.coordinator.searchspace"


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: where (`trainingService.environmentCount`) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """An invalid config; `issues` holds every problem found, not just the first."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))


def _show(value: object) -> str:
    """A value as the user wrote it, short enough for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if not isinstance(value, (str, int, float, list, tuple)):
        return f"a {type(value).__name__}"
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        return f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


_DURATION_TEXT = "a number of seconds or a string like '90s', '30m', '1.5h', '2d'"
_DURATION_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*")
_DURATION_UNITS = {
    **dict.fromkeys(["", "s", "sec", "secs", "second", "seconds"], 1),
    **dict.fromkeys(["m", "min", "mins", "minute", "minutes"], 60),
    **dict.fromkeys(["h", "hr", "hrs", "hour", "hours"], 3600),
    **dict.fromkeys(["d", "day", "days"], 86400),
}


def parse_duration(value: object) -> float:
    """Seconds in `value`: a number of seconds, or a string like "90s", "30m", "1.5h", "2d".

    Raises ValueError, naming the accepted forms, for anything else (booleans, negative
    or non-finite numbers, unknown units).
    """
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = None
    elif isinstance(value, str):
        match = _DURATION_RE.fullmatch(value)
        if match and match.group(2).lower() in _DURATION_UNITS:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a duration ({_DURATION_TEXT}), got {_show(value)}")
    return seconds


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tb": 1000**4, "tib": 2**40}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")
_SIZE_TEXT = "bytes as a number, or a string like '512MiB', '8GB', '16GiB'"


def parse_size(value: object) -> int:
    """Bytes in `value`: a number of bytes or a string with a unit ("8GiB", "500MB")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ValueError(f"expected a size ({_SIZE_TEXT}), got {_show(value)}")


_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def split_address(address: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """(host, port) of "host:port"; an IPv6 host is written in brackets, "[::1]:50051".

    The host comes back without brackets. Raises ValueError saying what is wrong.
    """
    low = 0 if allow_port_zero else 1
    shape = f"expected host:port with a port {low}-65535, got {address!r}"
    bracketed = re.fullmatch(r"\[([^\]]*)\]:([0-9]{1,5})", address)
    if bracketed:
        host, port_text = bracketed.groups()
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"invalid IPv6 address [{host}] in {address!r}") from None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not re.fullmatch(r"[0-9]{1,5}", port_text):
            raise ValueError(shape)
        if ":" in host:
            raise ValueError(f"write an IPv6 host in brackets, like '[::1]:50051'; got {address!r}")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"invalid IPv4 address {host!r} in {address!r}") from None
        elif not _HOSTNAME_RE.fullmatch(host):
            raise ValueError(f"invalid host name {host!r} in {address!r}")
    port = int(port_text)
    if not low <= port <= 65535:
        raise ValueError(shape)
    return host, port


def _bind_address(value: object) -> object:
    if isinstance(value, str):
        split_address(value, allow_port_zero=True)
    return value


def _dial_address(value: object) -> object:
    # Agents dial this address, so "any free port" (0) means nothing here.
    if isinstance(value, str):
        split_address(value, allow_port_zero=False)
    return value


_GPU_TEXT = "a list of distinct non-negative GPU indices, or a comma string like '0,1,3'"


def _gpu_indices(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, str):
        return value
    parts = [part.strip() for part in value.split(",")]
    if not all(re.fullmatch(r"[0-9]{1,6}", part) for part in parts):
        raise ValueError(f"expected {_GPU_TEXT}, got {_show(value)}")
    return [int(part) for part in parts]


def _valid_env(env: dict[str, str]) -> bool:
    return all(
        name and "=" not in name and "\0" not in name and "\0" not in value
        for name, value in env.items()
    )


@dataclass(frozen=True)
class _Rule:
    """What a field accepts beyond its type hint.

    `coerce` turns another accepted form into the hinted type (raising ValueError with
    the message to show); `check` is tried on the converted value; `expect` describes a
    valid value in messages.
    """

    expect: str | None = None
    check: Callable[[Any], bool] | None = None
    coerce: Callable[[Any], Any] | None = None


def _rule(
    expect: str,
    check: Callable[[Any], bool] | None = None,
    coerce: Callable[[Any], Any] | None = None,
) -> dict[str, _Rule]:
    return {"rule": _Rule(expect, check, coerce)}


_POSITIVE_INT = _rule("a positive integer", lambda v: v >= 1)
_NON_NEGATIVE_INT = _rule("a non-negative integer", lambda v: v >= 0)
_NON_EMPTY_STR = _rule("a non-empty string", lambda v: bool(v.strip()))
_POSITIVE_DURATION = _rule(
    f"a positive duration ({_DURATION_TEXT})", lambda v: v > 0, coerce=parse_duration
)
_SIZE = _rule(f"a size ({_SIZE_TEXT})", lambda v: v >= 0, coerce=parse_size)
_BIND_ADDRESS = _rule("host:port (port 0 = any free port)", coerce=_bind_address)
_DIAL_ADDRESS = _rule("host:port", coerce=_dial_address)
_GPU_INDICES = _rule(
    _GPU_TEXT, lambda v: all(i >= 0 for i in v) and len(set(v)) == len(v), coerce=_gpu_indices
)
_IMPORT_PATH = _rule(
    "an import path like 'my_package.tuners:MyTuner' or 'my_package.tuners.MyTuner'",
    lambda v: re.fullmatch(r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*", v) is not None,
)
_ENV = _rule("a mapping of environment variable names (without '=') to strings", _valid_env)


_Issues = list[tuple[str, str]]  # (field path, message), from a `_finalize` hook


@dataclass(frozen=True, kw_only=True)
class TunerConfig:
    """A built-in tuner by `name`, or a third-party one by `class_name` ("module:Class")."""

    name: str | None = field(default="random", metadata=_NON_EMPTY_STR)
    class_name: str | None = field(default=None, metadata=_IMPORT_PATH)
    code_directory: Path | None = None
    class_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> _Issues:
        issues: _Issues = []
        if "class_name" in given:
            if "name" in given:
                issues.append(
                    (
                        "class_name",
                        f"give either {names['name']} or {names['class_name']}, not both",
                    )
                )
            values["name"] = None
        code_directory = values.get("code_directory")
        if code_directory is not None and not _is_dir(code_directory):
            issues.append(("code_directory", f"not an existing directory: {code_directory}"))
        return issues


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    """Where the coordinator's gRPC server listens and how it judges agents alive."""

    address: str = field(default="127.0.0.1:0", metadata=_BIND_ADDRESS)
    advertise_address: str | None = field(default=None, metadata=_DIAL_ADDRESS)
    heartbeat_interval: float = field(default=1.0, metadata=_POSITIVE_DURATION)
    agent_lost_timeout: float = field(default=5.0, metadata=_POSITIVE_DURATION)
    # Silence after which an unreachable agent's trials are given up (failed or retried)
    # and its environment replaced; until then it may come back and carry on.
    trial_lost_timeout: float = field(default=15.0, metadata=_POSITIVE_DURATION)
    reconnect_window: float = field(default=60.0, metadata=_POSITIVE_DURATION)
    # The most heartbeats per second the coordinator takes from all agents together: a
    # fleet too large for heartbeatInterval gets a longer interval (and lost timeouts
    # stretched by the same factor) instead of a saturated coordinator.
    max_heartbeats_per_second: float = field(default=2000.0, metadata=_rule("a positive number", lambda v: v > 0))
    # Serve agents over TLS with a certificate made for this experiment, which they pin.
    tls: bool = False

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> _Issues:
        beat, lost = values.get("heartbeat_interval"), values.get("agent_lost_timeout")
        if beat is not None and lost is not None and lost <= beat:
            return [
                (
                    "agent_lost_timeout",
                    f"must be longer than {names['heartbeat_interval']} ({beat:g}s), got {lost:g}s",
                )
            ]
        trial_lost = values.get("trial_lost_timeout")
        if lost is not None and trial_lost is not None and trial_lost < lost:
            return [
                (
                    "trial_lost_timeout",
                    f"must be at least {names['agent_lost_timeout']} ({lost:g}s), got {trial_lost:g}s",
                )
            ]
        return []


@dataclass(frozen=True, kw_only=True)
class TrainingServiceConfig:
    """Base of the per-platform configs; each subclass names its `PLATFORM` and registers.

    `platform` is filled in from the class, so an instance cannot contradict its type.
    """

    PLATFORM: ClassVar[str] = ""
    platform: str = field(default="", init=False)
    reuse_mode: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "platform", self.PLATFORM)

    def effective_environment_count(self, trial_concurrency: int) -> int:
        """How many environments the experiment keeps; by default one per running trial."""
        return trial_concurrency

    def trial_slots_per_environment(self, trial_concurrency: int) -> int:
        """How many trials one environment runs at once in reuse mode (GPUs permitting)."""
        return 1

    def gpu_shortfall(self, trial_gpu_number: int) -> tuple[str, str] | None:
        """When no environment of this config could ever give a trial `trial_gpu_number`
        GPUs: (the field of this config at fault, in camelCase; what is wrong and what
        would do). None when it could, or when only the machines can tell."""
        return None


@dataclass(frozen=True, kw_only=True)
class EnvironmentPoolConfig(TrainingServiceConfig):
    """Base of the platforms that keep a pool of environments, each running
    `trials_per_environment` trials at once in reuse mode."""

    environment_count: int | None = field(default=None, metadata=_POSITIVE_INT)
    trials_per_environment: int = field(default=1, metadata=_POSITIVE_INT)

    def effective_environment_count(self, trial_concurrency: int) -> int:
        """`environment_count` if given, else enough environments for the concurrency.

        Without reuse mode every trial gets its own environment and the count is ignored.
        """
        if not self.reuse_mode:
            return trial_concurrency
        if self.environment_count is not None:
            return self.environment_count
        return -(-trial_concurrency // self.trials_per_environment)

    def trial_slots_per_environment(self, trial_concurrency: int) -> int:
        return self.trials_per_environment


@dataclass(frozen=True, kw_only=True)
class LocalConfig(EnvironmentPoolConfig):
    """Trials run by agents on this machine."""

    PLATFORM: ClassVar[str] = "local"
    use_active_gpu: bool = False
    max_trial_number_per_gpu: int = field(default=1, metadata=_POSITIVE_INT)
    gpu_indices: list[int] | None = field(default=None, metadata=_GPU_INDICES)
    simulated_gpus: int = field(default=0, metadata=_NON_NEGATIVE_INT)
    placement: Literal["pack", "spread"] = "pack"


@dataclass(frozen=True, kw_only=True)
class SharedStorageConfig:
    """`sharedStorage`: storage every environment mounts, holding the trial code and outputs.

    The environments mount it at `remote_mount_point` before their agent starts; this machine
    sees it at `local_mount_point` (mounted by the user, `usermount`, or by trialkeeper at
    start, `nnimount`). The code is copied there once instead of being uploaded.
    """

    storage_type: Literal["NFS", "AzureBlob"]
    local_mount_point: Path
    remote_mount_point: str = field(metadata=_NON_EMPTY_STR)
    local_mounted: Literal["usermount", "nnimount", "nomount"] = "usermount"
    nfs_server: str | None = field(default=None, metadata=_NON_EMPTY_STR)
    exported_directory: str | None = field(default=None, metadata=_NON_EMPTY_STR)
    storage_account_name: str | None = field(default=None, metadata=_NON_EMPTY_STR)
    storage_account_key: str | None = field(default=None, repr=False)
    container_name: str | None = field(default=None, metadata=_NON_EMPTY_STR)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> _Issues:
        needed = {
            "NFS": ("nfs_server", "exported_directory"),
            "AzureBlob": ("storage_account_name", "storage_account_key", "container_name"),
        }.get(values.get("storage_type") or "", ())
        issues: _Issues = [
            (name, f"required with storageType {values['storage_type']}") for name in needed if values.get(name) is None
        ]
        if values.get("local_mounted") == "nomount":
            issues.append(("local_mounted", "nomount is not supported: this machine must see the storage to put the code there"))
        return issues


def _default_working_directory() -> Path:
    return Path("~/trialkeeper-experiments").expanduser()


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A whole experiment, as parsed by `parse_config`: paths absolute, durations in seconds.

    `search_space` always holds the space, loaded from `search_space_file` when that was
    given (the file's path is kept for the record).
    """

    trial_command: str = field(metadata=_NON_EMPTY_STR)
    trial_concurrency: int = field(metadata=_POSITIVE_INT)
    training_service: TrainingServiceConfig
    experiment_name: str | None = None
    search_space: dict[str, Any] | None = None
    search_space_file: Path | None = None
    trial_code_directory: Path = Path(".")
    trial_gpu_number: int = field(default=0, metadata=_NON_NEGATIVE_INT)
    # Free memory each trial needs on each of its GPUs, checked against what NVML measures.
    trial_gpu_memory: int = field(default=0, metadata=_SIZE)
    max_trial_number: int | None = field(default=None, metadata=_POSITIVE_INT)
    max_experiment_duration: float | None = field(default=None, metadata=_POSITIVE_DURATION)
    max_trial_duration: float | None = field(default=None, metadata=_POSITIVE_DURATION)
    max_trial_retries: int = field(default=0, metadata=_NON_NEGATIVE_INT)
    # Retry trials that failed on their own (non-zero exit) too, within maxTrialRetries.
    retry_failed_trials: bool = False
    tuner: TunerConfig = field(default_factory=TunerConfig)
    experiment_working_directory: Path = field(default_factory=_default_working_directory)
    trial_env: dict[str, str] = field(default_factory=dict, metadata=_ENV)
    coordinator: CoordinatorSettings = field(default_factory=CoordinatorSettings)
    shared_storage: SharedStorageConfig | None = None

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> _Issues:
        issues: _Issues = []
        space_file = values.get("search_space_file")
        if "search_space" in given and "search_space_file" in given:
            issues.append(
                (
                    "search_space_file",
                    f"give either {names['search_space']} or {names['search_space_file']}, not both",
                )
            )
        elif space_file is not None:
            try:
                values["search_space"] = _load_search_space(space_file)
            except ConfigError as e:
                issues += [("search_space_file", str(issue)) for issue in e.issues]
        if "search_space" not in given and values.get("search_space") is None:
            values["search_space"] = {}
        space = values.get("search_space")
        if space and not issues:
            issues += _search_space_issues(space)
        service, gpus = values.get("training_service"), values.get("trial_gpu_number")
        if isinstance(service, TrainingServiceConfig) and isinstance(gpus, int) and gpus > 0:
            shortfall = service.gpu_shortfall(gpus)
            if shortfall is not None:
                issues.append((f"training_service.{shortfall[0]}", shortfall[1]))
        code = values.get("trial_code_directory")
        if code is not None and not _is_dir(code):
            problem = "is not a directory" if _exists(code) else "does not exist"
            issues.append(("trial_code_directory", f"{code} {problem}"))
        return issues


TRAINING_SERVICES: dict[str, type[TrainingServiceConfig]] = {}
_TS = TypeVar("_TS", bound=type[TrainingServiceConfig])


def register_training_service(cls: _TS) -> _TS:
    """Make `cls` the config of `trainingService.platform: cls.PLATFORM`; use as a decorator.

    `cls` must be a dataclass subclass of TrainingServiceConfig (frozen and kw_only, like
    the base) that declares `PLATFORM: ClassVar[str]` and uses field types this module
    can validate. Raises TypeError or ValueError otherwise, or if the name is taken.
    """
    if not (dataclasses.is_dataclass(cls) and issubclass(cls, TrainingServiceConfig)):
        raise TypeError(f"{cls!r} is not a dataclass subclass of TrainingServiceConfig")
    platform = cls.__dict__.get("PLATFORM")
    if not isinstance(platform, str) or not platform:
        raise TypeError(f"{cls.__qualname__} must declare its own PLATFORM: ClassVar[str]")
    existing = TRAINING_SERVICES.get(platform)
    if existing is not None and existing is not cls:
        raise ValueError(f"platform {platform!r} is already registered by {existing.__qualname__}")
    # Refuse field types the walker cannot validate now, rather than at parse time.
    _specs(typing.cast(type, cls))
    TRAINING_SERVICES[platform] = cls
    return cls


# Dataclass types parsed as one of several subclasses, picked by a tag key.
_POLYMORPHIC: dict[type, tuple[str, dict[str, type[TrainingServiceConfig]]]] = {
    TrainingServiceConfig: ("platform", TRAINING_SERVICES),
}


_INVALID: Any = object()  # a value that failed validation; its issues are already recorded
_NONE_TYPE = type(None)


@dataclass(frozen=True)
class _Spec:
    name: str
    camel: str
    type: Any
    rule: _Rule | None
    default: Any  # dataclasses.MISSING when the key is required
    factory: Any


def _to_snake(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _to_camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


@functools.cache
def _specs(cls: type) -> tuple[_Spec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        _check_supported(hints[f.name], f"{cls.__qualname__}.{f.name}")
        specs.append(
            _Spec(
                f.name,
                _to_camel(f.name),
                hints[f.name],
                f.metadata.get("rule"),
                f.default,
                f.default_factory,
            )
        )
    return tuple(specs)


def _check_supported(tp: Any, where: str) -> None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not _NONE_TYPE]
        if len(inner) != 1:
            raise TypeError(f"{where}: only Optional[X] unions are supported, not {tp}")
        _check_supported(inner[0], where)
    elif origin is list:
        _check_supported(args[0] if args else Any, where)
    elif origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: mapping keys must be str, not {args[0]}")
        _check_supported(args[1] if args else Any, where)
    elif dataclasses.is_dataclass(tp) and isinstance(tp, type):
        for spec in _specs(tp):
            _check_supported(spec.type, f"{where}.{spec.name}")
    elif not (
        tp in (Any, str, int, float, bool, Path, list, dict)
        or origin is Literal
        or (isinstance(tp, type) and issubclass(tp, enum.Enum))
    ):
        raise TypeError(f"{where}: unsupported config field type {tp!r}")


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _describe(next(a for a in args if a is not _NONE_TYPE))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if tp in _POLYMORPHIC:
        tag, registry = _POLYMORPHIC[tp]
        return f"a mapping with '{tag}' (one of: {', '.join(registry)})"
    simple = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path",
        list: "a list",
        Any: "any value",
    }
    if origin is list:
        return "a list"
    return simple.get(tp) or "a mapping"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _style(data: Mapping[Any, Any], inherited: str) -> str:
    """The key spelling a mapping uses, to name keys the user did not write."""
    keys = [k for k in data if isinstance(k, str)]
    if any(c.isupper() for k in keys for c in k):
        return "camel"
    if any("_" in k for k in keys):
        return "snake"
    return inherited


def _unknown_key(key: str, names: list[str]) -> str:
    spell = (lambda n: n) if "_" in key else _to_camel
    match = difflib.get_close_matches(_to_snake(key), names, n=1, cutoff=0.6)
    if match:
        return f"unknown key; did you mean '{spell(match[0])}'?"
    return "unknown key; valid keys are: " + ", ".join(spell(n) for n in names)


class _Walker:
    """Converts plain data to config dataclasses, recording every problem on the way."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.issues: list[ConfigIssue] = []
        self.style = "camel"

    def report(self, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(path, message))

    def field_value(self, spec: _Spec, value: Any, path: str) -> Any:
        rule, given = spec.rule, value
        if rule and rule.coerce and value is not None:
            try:
                value = rule.coerce(value)
            except ValueError as e:
                self.report(path, str(e))
                return _INVALID
        result = self.convert(spec.type, value, path, rule.expect if rule else None)
        if result is None or result is _INVALID or rule is None or rule.check is None:
            return result
        if not rule.check(result):
            self.report(path, f"expected {rule.expect}, got {_show(given)}")
            return _INVALID
        return result

    def convert(self, tp: Any, value: Any, path: str, expect: str | None = None) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)

        def bad(hint: str = "") -> Any:
            self.report(path, f"expected {expect or _describe(tp)}, got {_show(value)}{hint}")
            return _INVALID

        if origin in (Union, types.UnionType):
            if value is None and _NONE_TYPE in args:
                return None
            inner = next(a for a in args if a is not _NONE_TYPE)
            return self.convert(inner, value, path, expect)
        if tp is Any:
            problems: _Issues = []
            plain = _plain_data(value, path, problems)
            for where, message in problems:
                self.report(where, message)
            return _INVALID if problems else plain
        if value is None:
            return bad()
        if origin is Literal:
            choices = [a for a in args if type(a) is type(value) and a == value]
            return choices[0] if choices else bad()
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            members = [m for m in tp if type(m.value) is type(value) and m.value == value]
            return members[0] if members else bad()
        if tp in _POLYMORPHIC:
            return self.variant(tp, value, path)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, path)
        if origin is list or tp is list:
            if not isinstance(value, list):
                return bad()
            elem = args[0] if args else Any
            items = [self.convert(elem, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return _INVALID if any(i is _INVALID for i in items) else items
        if origin is dict or tp is dict:
            if not isinstance(value, Mapping):
                return bad()
            return self.mapping(args[1] if args else Any, value, path)
        if tp is bool:
            return value if isinstance(value, bool) else bad()
        if tp is int:
            return value if isinstance(value, int) and not isinstance(value, bool) else bad()
        if tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)
                except OverflowError:
                    return bad()
                return number if math.isfinite(number) else bad()
            return bad()
        if tp is str:
            if isinstance(value, str):
                return value
            scalar = isinstance(value, (int, float, bool))
            return bad(" (quote it in YAML to make it a string)" if scalar else "")
        if tp is Path:
            return self.path(value, path, bad)
        raise TypeError(f"unsupported config field type {tp!r}")  # _check_supported missed it

    def mapping(self, value_type: Any, value: Mapping[Any, Any], path: str) -> Any:
        result: dict[str, Any] = {}
        failed = False
        for key, item in value.items():
            if not isinstance(key, str):
                self.report(_join(path, _show(key)), f"keys must be strings, got {_show(key)}")
                failed = True
                continue
            result[key] = self.convert(value_type, item, _join(path, key))
            failed = failed or result[key] is _INVALID
        return _INVALID if failed else result

    def path(self, value: Any, path: str, bad: Callable[[], Any]) -> Any:
        if isinstance(value, str) and value.strip() and "\0" not in value:
            raw = Path(value)
        elif isinstance(value, Path):
            raw = value
        else:
            return bad()
        try:
            raw = raw.expanduser()
        except RuntimeError:
            self.report(path, f"cannot expand '~' in {value!r}: no such user")
            return _INVALID
        return Path(os.path.normpath(self.base_dir / raw))

    def variant(self, base: type, value: Any, path: str) -> Any:
        tag_key, registry = _POLYMORPHIC[base]
        if not isinstance(value, Mapping):
            self.report(path, f"expected {_describe(base)}, got {_show(value)}")
            return _INVALID
        tag = value.get(tag_key)
        valid = ", ".join(registry)
        if tag is None:
            self.report(_join(path, tag_key), f"required key is missing (one of: {valid})")
            return _INVALID
        if not isinstance(tag, str):
            self.report(_join(path, tag_key), f"expected one of: {valid}, got {_show(tag)}")
            return _INVALID
        if tag not in registry:
            close = difflib.get_close_matches(tag, list(registry), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            self.report(_join(path, tag_key), f"unknown {tag_key} {tag!r}; {hint}valid: {valid}")
            return _INVALID
        return self.dataclass(registry[tag], value, path, extra_keys=(tag_key,))

    def dataclass(self, cls: type, data: Any, path: str, extra_keys: tuple[str, ...] = ()) -> Any:
        if not isinstance(data, Mapping):
            self.report(path, f"expected a mapping, got {_show(data)}")
            return _INVALID
        specs = _specs(cls)
        by_key = {s.name: s for s in specs} | {s.camel: s for s in specs}
        outer_style, self.style = self.style, _style(data, self.style)
        try:
            failed, values, given, spelled = self._fields(specs, by_key, data, path, extra_keys)
            names = {
                s.name: spelled.get(s.name, s.name if self.style == "snake" else s.camel)
                for s in specs
            }
        finally:
            self.style = outer_style
        for spec in specs:
            if spec.name in given:
                continue
            if spec.default is not dataclasses.MISSING:
                values[spec.name] = self._default(spec.default)
            elif spec.factory is not dataclasses.MISSING:
                values[spec.name] = self._default(spec.factory())
            else:
                expect = (
                    spec.rule.expect if spec.rule and spec.rule.expect else _describe(spec.type)
                )
                self.report(_join(path, names[spec.name]), f"required key is missing ({expect})")
                failed = True
        finalize = getattr(cls, "_finalize", None)
        for where, message in finalize(values, given, names) if finalize else ():
            head = re.split(r"[.\[]", where, maxsplit=1)[0]
            self.report(_join(path, names.get(head, head) + where[len(head) :]), message)
            failed = True
        if failed:
            return _INVALID
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            self.report(path, str(e))
            return _INVALID

    def _fields(
        self,
        specs: tuple[_Spec, ...],
        by_key: dict[str, _Spec],
        data: Mapping[Any, Any],
        path: str,
        extra_keys: tuple[str, ...],
    ) -> tuple[bool, dict[str, Any], set[str], dict[str, str]]:
        failed = False
        values: dict[str, Any] = {}
        given: set[str] = set()
        spelled: dict[str, str] = {}
        for key, raw in data.items():
            if not isinstance(key, str):
                self.report(_join(path, _show(key)), f"keys must be strings, got {_show(key)}")
                failed = True
                continue
            if key in extra_keys:
                continue
            spec = by_key.get(key)
            if spec is None:
                candidates = [s.name for s in specs] + list(extra_keys)
                self.report(_join(path, key), _unknown_key(key, candidates))
                failed = True
                continue
            if spec.name in spelled:
                self.report(
                    _join(path, key), f"the same key as '{spelled[spec.name]}'; give it once"
                )
                failed = True
                continue
            spelled[spec.name] = key
            has_default = not (spec.default is spec.factory is dataclasses.MISSING)
            if raw is None and has_default:
                continue  # an empty YAML value means "the default"
            given.add(spec.name)
            value = self.field_value(spec, raw, _join(path, key))
            if value is _INVALID:
                failed = True
            else:
                values[spec.name] = value
        return failed, values, given, spelled

    def _default(self, value: Any) -> Any:
        # Relative default paths (trial_code_directory = ".") are relative to the config.
        return Path(os.path.normpath(self.base_dir / value)) if isinstance(value, Path) else value


def _plain_data(value: Any, path: str, problems: _Issues, ancestors: tuple[int, ...] = ()) -> Any:
    """A copy of JSON-like data, so that the stored config can always be serialised."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, Mapping)) and id(value) in ancestors:
        problems.append((path, "a structure that contains itself"))
        return None
    inner = (*ancestors, id(value))
    if isinstance(value, (list, tuple)):
        return [_plain_data(v, f"{path}[{i}]", problems, inner) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        result = {}
        for key, item in value.items():
            if isinstance(key, str):
                result[key] = _plain_data(item, _join(path, key), problems, inner)
            else:
                problems.append(
                    (_join(path, _show(key)), f"keys must be strings, got {_show(key)}")
                )
        return result
    problems.append(
        (
            path,
            f"expected plain data (mappings, lists, strings, numbers, booleans), got {_show(value)}",
        )
    )
    return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _load_search_space(file: Path) -> dict[str, Any]:
    try:
        is_file = file.is_file()
    except (OSError, ValueError):
        is_file = False
    if not is_file:
        problem = "is not a file" if _exists(file) else "does not exist"
        raise ConfigError([ConfigIssue(str(file), problem)])
    data = _read_data(file)
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue(str(file), f"expected a mapping, got {_show(data)}")])
    problems: _Issues = []
    space = _plain_data(data, "", problems)
    if problems:
        raise ConfigError([ConfigIssue(f"{file}:{where}".rstrip(":"), m) for where, m in problems])
    return typing.cast(dict[str, Any], space)


def _search_space_issues(space: dict[str, Any]) -> _Issues:
    # The search-space module is optional here: without it, the tuner checks the space.
    try:
        module = importlib.import_module(_SEARCHSPACE_MODULE)
    except ImportError:
        return []
    validate = getattr(module, "validate_search_space", None)
    error_type = getattr(module, "SearchSpaceError", None)
    if validate is None or not (isinstance(error_type, type) and issubclass(error_type, Exception)):
        return []
    try:
        validate(space)
    except error_type as e:
        return [
            (_subpath("search_space", where), str(message))
            for where, message in getattr(e, "issues", [])
        ]
    return []


def _subpath(prefix: str, where: object) -> str:
    if isinstance(where, (list, tuple)):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where).lstrip(".")
    where = str(where)
    if where in ("", "<root>"):
        return prefix
    return prefix + where if where.startswith("[") else f"{prefix}.{where}"


class _Loader(yaml.SafeLoader):
    """YAML as JSON users expect it: only true/false are booleans (`yes`, `on` and `no`
    stay strings), dates stay strings, and a key given twice is an error."""

    #: Aliases one document may use. Each alias shares its anchor's object, so a few
    #: nested ones describe an exponentially large tree (a "billion laughs" document)
    #: that every later walk over the config would have to visit.
    MAX_ALIASES = 200

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases = getattr(self, "_aliases", 0) + 1
            if self._aliases > self.MAX_ALIASES:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {self.MAX_ALIASES} aliases (*name) in one config", self.peek_event().start_mark
                )
        return super().compose_node(parent, index)  # type: ignore[arg-type]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if (key_node.tag, key_node.value) in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_constructor(  # PyYAML's own crashes on a malformed explicit !!timestamp
    "tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str
)


def _read_data(file: Path) -> Any:
    """The data in a YAML (or, by its suffix, JSON) file; ConfigError located by line."""

    def fail(where: str, message: str) -> ConfigError:
        return ConfigError([ConfigIssue(where, message)])

    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise fail(str(file), "file not found") from None
    except IsADirectoryError:
        raise fail(str(file), "is a directory, not a file") from None
    except UnicodeDecodeError:
        raise fail(str(file), "is not UTF-8 text") from None
    except OSError as e:
        raise fail(str(file), f"cannot read: {e.strerror or e}") from None
    try:
        if file.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.load(text, Loader=_Loader)
    except json.JSONDecodeError as e:
        raise fail(f"{file}:{e.lineno}:{e.colno}", f"invalid JSON: {e.msg}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        context = f" ({e.context})" if e.context else ""
        raise fail(where, f"invalid YAML: {e.problem}{context}") from None
    except (yaml.YAMLError, ValueError, TypeError) as e:
        raise fail(str(file), f"invalid YAML: {e}") from None
    except RecursionError:
        raise fail(str(file), "nested too deeply") from None


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate an experiment config file (YAML; JSON by a `.json` suffix).

    Relative paths inside are relative to the file's directory. Raises ConfigError with
    every problem, or with the file's own problem (missing, bad syntax with line:column).
    """
    file = Path(os.path.abspath(Path(path).expanduser()))
    data = _read_data(file)
    if data is None:
        raise ConfigError([ConfigIssue(str(file), "the file is empty")])
    return parse_config(data, file.parent)


def parse_config(data: object, base_dir: str | Path) -> ExperimentConfig:
    """Validate plain data (as loaded from YAML) into an ExperimentConfig.

    Keys may be camelCase or snake_case. Relative paths are taken against `base_dir`;
    the search-space file is loaded. Raises ConfigError listing every problem found.
    """
    walker = _Walker(Path(os.path.abspath(Path(base_dir).expanduser())))
    try:
        config = walker.convert(ExperimentConfig, data, "")
    except RecursionError:
        walker.report("", "the config is nested too deeply")
        config = _INVALID
    if walker.issues or config is _INVALID:
        raise ConfigError(walker.issues or [ConfigIssue("", "invalid config")])
    return typing.cast(ExperimentConfig, config)


_SECRET_WORDS = frozenset({"password", "passphrase", "token", "secret", "key"})
_NOT_SECRET_ENDINGS = frozenset({"file", "path", "dir", "directory"})  # ssh_key_file names a file


def _is_secret(name: str) -> bool:
    parts = [part for part in re.split(r"[^a-z0-9]+", _to_snake(name)) if part]
    return (
        bool(parts) and parts[-1] not in _NOT_SECRET_ENDINGS and not _SECRET_WORDS.isdisjoint(parts)
    )


def config_to_dict(cfg: ExperimentConfig, *, redact: bool = False) -> dict[str, Any]:
    """The config as JSON-serialisable data with camelCase keys, fit to store and re-parse.

    The search space is stored inline (its file is left out), so the record does not
    change when the file does. With `redact`, secret-looking fields, and string values
    of secret-looking keys in user mappings (trialEnv, classArgs), read "***".
    """
    data = typing.cast(dict[str, Any], _to_plain(cfg, redact))
    data.pop("searchSpaceFile", None)
    return data


def _to_plain(value: Any, redact: bool) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        result = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            secret = redact and item is not None and _is_secret(f.name)
            result[_to_camel(f.name)] = "***" if secret else _to_plain(item, redact)
        return result
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return _to_plain(value.value, redact)
    if isinstance(value, Mapping):
        return {
            str(k): "***"
            if redact and isinstance(v, str) and _is_secret(str(k))
            else _to_plain(v, redact)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, redact) for v in value]
    return value


register_training_service(LocalConfig)


# ---- remote machines over SSH -----------------------------------------------------------


def _secret_text(value: object) -> object:
    # A number where a password belongs is refused without showing it: YAML reads an
    # unquoted 0123 as 123, and error messages must never echo a secret.
    if isinstance(value, str) or value is None:
        return value
    raise ValueError("expected a string (quote it in YAML); the value is not shown")


def _dial_host(value: object) -> object:
    """`host` or `host:port`; the port, when left out, is the one the coordinator binds."""
    if not isinstance(value, str):
        return value
    try:
        split_address(value, allow_port_zero=False)
        return value
    except ValueError as with_port:
        try:
            ipaddress.IPv6Address(value)
            return value
        except ValueError:
            pass
        try:
            split_address(f"{value}:1")
        except ValueError:
            raise with_port from None
    return value


_SECRET = _rule("a string", coerce=_secret_text)
_PORT = _rule("a port number 1-65535", lambda v: 1 <= v <= 65535)
_DIAL_HOST = _rule("host or host:port", coerce=_dial_host)
_POSITIVE_NUMBER = _rule("a positive number", lambda v: v > 0)


@dataclass(frozen=True, kw_only=True)
class RemoteMachineConfig:
    """One SSH machine of `trainingService.machineList` (NNI's field names)."""

    host: str = field(metadata=_NON_EMPTY_STR)
    port: int = field(default=22, metadata=_PORT)
    user: str = field(metadata=_NON_EMPTY_STR)
    # Secrets stay out of reprs, so that no assertion message or log line can show them.
    password: str | None = field(default=None, repr=False, metadata=_SECRET)
    ssh_key_file: Path | None = None
    ssh_passphrase: str | None = field(default=None, repr=False, metadata=_SECRET)
    # A path on the remote machine: a Python executable, or (as in NNI) its bin directory.
    python_path: str | None = field(default=None, metadata=_NON_EMPTY_STR)
    gpu_indices: list[int] | None = field(default=None, metadata=_GPU_INDICES)
    max_trial_number_per_gpu: int = field(default=1, metadata=_POSITIVE_INT)
    use_active_gpu: bool = False

    @property
    def label(self) -> str:
        """`user@host:port`, how messages name the machine."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}:{self.port}"

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> _Issues:
        issues: _Issues = []
        if "password" in given and "ssh_key_file" in given:
            issues.append(
                ("password", f"give either {names['password']} or {names['ssh_key_file']}, not both")
            )
        if "ssh_passphrase" in given and "ssh_key_file" not in given:
            issues.append(("ssh_passphrase", f"needs {names['ssh_key_file']} (the key it unlocks)"))
        key = values.get("ssh_key_file")
        if key is not None and not _exists(key):
            issues.append(("ssh_key_file", f"{key} does not exist"))
        return issues


@dataclass(frozen=True, kw_only=True)
class RemoteConfig(TrainingServiceConfig):
    """Trials run by agents that trialkeeper starts over SSH on the machines listed.

    In reuse mode each machine runs one agent for the whole experiment; without it, each
    trial gets an agent of its own on the least busy machine.
    """

    PLATFORM: ClassVar[str] = "remote"
    machine_list: list[RemoteMachineConfig]
    # The address agents dial back to; auto-detected per machine (with a warning) when unset.
    coordinator_address: str | None = field(default=None, metadata=_DIAL_HOST)
    known_hosts_file: Path | None = None  # default: ~/.ssh/known_hosts
    accept_unknown_host_keys: bool = False
    # Install this coordinator's own trialkeeper into a per-experiment virtualenv remotely.
    bootstrap: bool = False
    max_code_dir_files: int = field(default=2000, metadata=_POSITIVE_INT)
    max_code_dir_size_mb: float = field(default=300.0, metadata=_POSITIVE_NUMBER)
    ssh_timeout: float = field(default=20.0, metadata=_POSITIVE_DURATION)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> _Issues:
        machines = values.get("machine_list")
        if machines is None:
            return []
        if not machines:
            return [("machine_list", "list at least one machine")]
        issues: _Issues = []
        seen: dict[tuple[str, int, str], int] = {}
        for i, m in enumerate(machines):
            first = seen.setdefault((m.host.lower(), m.port, m.user), i)
            if first != i:
                issues.append(
                    (
                        f"machine_list[{i}]",
                        (
                            f"the same machine as {names['machine_list']}[{first}] ({m.label}); "
                            "list each machine once"
                        ),
                    )
                )
        return issues

    def effective_environment_count(self, trial_concurrency: int) -> int:
        """Reuse mode: one environment (one agent) per machine. Otherwise one per trial."""
        return len(self.machine_list) if self.reuse_mode else trial_concurrency

    def trial_slots_per_environment(self, trial_concurrency: int) -> int:
        """Enough slots on each machine's agent for the concurrency (GPUs permitting)."""
        return max(1, -(-trial_concurrency // len(self.machine_list)))

    # The scheduler reads these two experiment-wide; per machine they can only narrow it.
    @property
    def max_trial_number_per_gpu(self) -> int:
        return min(m.max_trial_number_per_gpu for m in self.machine_list)

    @property
    def use_active_gpu(self) -> bool:
        return all(m.use_active_gpu for m in self.machine_list)


register_training_service(RemoteConfig)

# Cluster platforms keep their configs beside their services; importing one registers it.
for _platform in ("slurm", "kubernetes", "ray", "openpai", "dlts", "aml", "dlc"):
    importlib.import_module(f"{__package__}.services.{_platform}_config")


def _load_plugins() -> None:
    """Import every environment-service plug-in, so that the config class its module
    registers is known before a config naming its platform is parsed."""
    import logging
    from importlib import metadata

    from .services import ENTRY_POINT_GROUP

    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not break the other platforms
            logging.getLogger(__name__).warning("platform plug-in %s (%s) cannot be loaded: %s", ep.name, ep.value, e)


_load_plugins()
