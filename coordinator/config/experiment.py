"""The experiment config: parsed and validated once, at start, then passed down.

The YAML uses the field names NNI users know. Every key may be written in camelCase or
snake_case; inside, everything is snake_case. This module holds the experiment-level
sections; each platform's `trainingService` section stands beside its service
(`services/<platform>_config.py`) and is found through `platforms`, which imports only
the platform a config names. The rules and the walker that validate them all are
`configrules` and `configwalk`: every problem is collected, each with the path of the
key as the user spelled it, before one `ConfigError` is raised.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..platforms import TRAINING_SERVICES, register_training_service
from . import nniv1
from .nni import translate as translate_nni
from .objectives import ObjectivesError
from .objectives import parse as parse_objectives
from .platform import TrainingServiceConfig, gang_shortfall
from .rules import (
    BIND_ADDRESS,
    CHECKPOINT_URL,
    DIAL_ADDRESS,
    ENV,
    NON_EMPTY_STR,
    NON_NEGATIVE_INT,
    POSITIVE_DURATION,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    SIZE,
    ConfigError,
    ConfigIssue,
    Issues,
    exists,
    is_dir,
    not_both,
    parse_duration,
    show,
    split_address,
    to_camel,
    to_snake,
)
from .tuning import AdvisorConfig, AssessorConfig, TunerConfig
from .walk import INVALID, Walker, plain_data

__all__ = [
    "TRAINING_SERVICES",
    "AdvisorConfig",
    "AssessorConfig",
    "ConfigError",
    "ConfigIssue",
    "CoordinatorSettings",
    "ExperimentConfig",
    "SharedStorageConfig",
    "TrainingServiceConfig",
    "TunerConfig",
    "config_to_dict",
    "load_config",
    "parse_config",
    "parse_duration",
    "register_training_service",
    "split_address",
]

_SEARCHSPACE_MODULE = "trialkeeper.coordinator.search.space"


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    """Where the coordinator's gRPC server listens and how it judges agents alive."""

    address: str = field(default="127.0.0.1:0", metadata=BIND_ADDRESS)
    advertise_address: str | None = field(default=None, metadata=DIAL_ADDRESS)
    heartbeat_interval: float = field(default=1.0, metadata=POSITIVE_DURATION)
    agent_lost_timeout: float = field(default=5.0, metadata=POSITIVE_DURATION)
    # Silence after which an unreachable agent's trials are given up (failed or retried)
    # and its environment replaced; until then it may come back and carry on.
    trial_lost_timeout: float = field(default=15.0, metadata=POSITIVE_DURATION)
    reconnect_window: float = field(default=60.0, metadata=POSITIVE_DURATION)
    # The most heartbeats per second the coordinator takes from all agents together: a
    # fleet too large for heartbeatInterval gets a longer interval (and lost timeouts
    # stretched by the same factor) instead of a saturated coordinator.
    max_heartbeats_per_second: float = field(default=2000.0, metadata=POSITIVE_NUMBER)
    # Serve agents over TLS with a certificate made for this experiment, which they pin.
    tls: bool = False
    # Take the bytes of checkpoints uploaded by agents on a plain TCP port of their own (one
    # per file, sendfile), not as 1 MiB messages of their stream; never with TLS. False: by
    # the stream only (where only the gRPC port is reachable).
    checkpoint_port: bool = True

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
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
class SharedStorageConfig:
    """`sharedStorage`: storage every environment mounts, holding the trial code and outputs.

    The environments mount it at `remote_mount_point` before their agent starts; this machine
    sees it at `local_mount_point` (mounted by the user, `usermount`, or by trialkeeper at
    start, `nnimount`). The code is copied there once instead of being uploaded.
    """

    storage_type: Literal["NFS", "AzureBlob"]
    local_mount_point: Path
    remote_mount_point: str = field(metadata=NON_EMPTY_STR)
    local_mounted: Literal["usermount", "nnimount", "nomount"] = "usermount"
    nfs_server: str | None = field(default=None, metadata=NON_EMPTY_STR)
    exported_directory: str | None = field(default=None, metadata=NON_EMPTY_STR)
    storage_account_name: str | None = field(default=None, metadata=NON_EMPTY_STR)
    storage_account_key: str | None = field(default=None, repr=False)
    container_name: str | None = field(default=None, metadata=NON_EMPTY_STR)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        needed = {
            "NFS": ("nfs_server", "exported_directory"),
            "AzureBlob": ("storage_account_name", "storage_account_key", "container_name"),
        }.get(values.get("storage_type") or "", ())
        issues: Issues = [
            (name, f"required with storageType {values['storage_type']}") for name in needed if values.get(name) is None
        ]
        if values.get("local_mounted") == "nomount":
            issues.append(
                ("local_mounted", "nomount is not supported: this machine must see the storage to put the code there")
            )
        return issues


def _default_working_directory() -> Path:
    return Path("~/trialkeeper-experiments").expanduser()


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A whole experiment, as parsed by `parse_config`: paths absolute, durations in seconds.

    `search_space` always holds the space, loaded from `search_space_file` when that was
    given (the file's path is kept for the record).
    """

    trial_command: str = field(metadata=NON_EMPTY_STR)
    trial_concurrency: int = field(metadata=POSITIVE_INT)
    training_service: TrainingServiceConfig
    experiment_name: str | None = None
    search_space: dict[str, Any] | None = None
    search_space_file: Path | None = None
    trial_code_directory: Path = Path(".")
    trial_gpu_number: int = field(default=0, metadata=NON_NEGATIVE_INT)
    # Free memory each trial needs on each of its GPUs, checked against what NVML measures.
    trial_gpu_memory: int = field(default=0, metadata=SIZE)
    # Environments each trial runs on at once (one process each, docs/multinode.md), and
    # whether they may be of several platforms of a hybrid experiment.
    trial_nodes: int = field(default=1, metadata=POSITIVE_INT)
    gang_across_platforms: bool = False
    max_trial_number: int | None = field(default=None, metadata=POSITIVE_INT)
    max_experiment_duration: float | None = field(default=None, metadata=POSITIVE_DURATION)
    # The training the search may spend, in intermediate results (epochs) over every trial.
    max_trial_resource: float | None = field(default=None, metadata=POSITIVE_NUMBER)
    max_trial_duration: float | None = field(default=None, metadata=POSITIVE_DURATION)
    max_trial_retries: int = field(default=0, metadata=NON_NEGATIVE_INT)
    # Retry trials that failed on their own (non-zero exit) too, within maxTrialRetries.
    retry_failed_trials: bool = False
    # Checkpoints (docs/checkpoints.md). Where they are kept when not in the experiment's
    # directory: an object storage URL ("s3://bucket/prefix") agents write and read directly.
    checkpoint_storage: str | None = field(default=None, metadata=CHECKPOINT_URL)
    # The largest checkpoint taken (a larger save is refused with the reason), and how many
    # of each trial's are kept (the newest).
    max_checkpoint_size: int = field(default=10 * 1024**3, metadata=SIZE)
    checkpoints_per_trial: int = field(default=1, metadata=POSITIVE_INT)
    # How long a trial asked to pause has to save a checkpoint before it is stopped anyway.
    pause_grace_period: float = field(default=120.0, metadata=POSITIVE_DURATION)
    # A trial lost with its environment after it saved a checkpoint since its last loss is
    # retried without using up maxTrialRetries (preemptible capacity does not exhaust them).
    progress_resets_retries: bool = True
    # Which checkpoints are kept once the experiment has finished (one stopped to be resumed
    # keeps them all): those of succeeded trials, all, or none.
    checkpoints_after_end: Literal["succeeded", "all", "none"] = "succeeded"
    tuner: TunerConfig = field(default_factory=TunerConfig)
    assessor: AssessorConfig | None = None
    advisor: AdvisorConfig | None = None
    # An Optuna storage URL the experiment is mirrored into as an Optuna study, whatever
    # the tuner (optuna-dashboard and Optuna's analysis functions read it).
    optuna_storage: str | None = field(default=None, metadata=NON_EMPTY_STR)
    optuna_study_name: str | None = field(default=None, metadata=NON_EMPTY_STR)
    # Several objectives: the result keys optimized with their directions, the constraints,
    # and how one number ranks trials (docs/search.md, "Several objectives").
    objectives: dict[str, Any] | None = None
    experiment_working_directory: Path = field(default_factory=_default_working_directory)
    trial_env: dict[str, str] = field(default_factory=dict, metadata=ENV)
    # Modules a template process imports once per agent, forking each Python trial from it.
    trial_preload: list[str] = field(default_factory=list)
    coordinator: CoordinatorSettings = field(default_factory=CoordinatorSettings)
    shared_storage: SharedStorageConfig | None = None
    # NNI's logLevel (and debug): the coordinator's when `trialkeeper run` is given none.
    log_level: Literal["fatal", "error", "warning", "info", "debug", "trace"] | None = None

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues: Issues = []
        space_file = values.get("search_space_file")
        issues += not_both(given, names, "search_space", "search_space_file")
        if not issues and space_file is not None:
            try:
                values["search_space"] = _load_search_space(space_file)
            except ConfigError as e:
                issues += [("search_space_file", str(issue)) for issue in e.issues]
        if "search_space" not in given and values.get("search_space") is None:
            values["search_space"] = {}
        space = values.get("search_space")
        if space and not issues:
            tuner = values.get("tuner")
            issues += _search_space_issues(space, getattr(tuner, "name", None), getattr(tuner, "class_name", None))
        service, gpus = values.get("training_service"), values.get("trial_gpu_number")
        if isinstance(service, TrainingServiceConfig) and isinstance(gpus, int) and gpus > 0:
            shortfall = service.gpu_shortfall(gpus)
            if shortfall is not None:
                issues.append((f"training_service.{shortfall[0]}", shortfall[1]))
        nodes = values.get("trial_nodes")
        if isinstance(service, TrainingServiceConfig) and isinstance(nodes, int) and nodes > 1:
            why = gang_shortfall(service, nodes, values.get("trial_concurrency"), values.get("gang_across_platforms"))
            if why:
                issues.append(("trial_nodes", why))
        if values.get("shared_storage") is not None and isinstance(service, TrainingServiceConfig):
            ignored = [s.platform for s in service.sections() if not s.MOUNTS_SHARED_STORAGE]
            if ignored:
                issues.append(("shared_storage", (
                    f"environments on {', '.join(ignored)} do not mount it here (openpai and dlts ones do); "
                    "remove sharedStorage: the trial code reaches them without it"
                )))
        code = values.get("trial_code_directory")
        if code is not None and not is_dir(code):
            problem = "is not a directory" if exists(code) else "does not exist"
            issues.append(("trial_code_directory", f"{code} {problem}"))
        for i, module in enumerate(values.get("trial_preload") or []):
            if not (isinstance(module, str) and _MODULE_NAME.fullmatch(module)):
                issues.append(
                    (f"trial_preload[{i}]", f"expected a module name like numpy or sklearn.svm, got {module!r}")
                )
        if values.get("objectives") is not None:
            issues += _objectives_issues(values["objectives"])
        # NNI's rule: an advisor replaces both the tuner and the assessor.
        issues += not_both(given, names, "advisor", "tuner") + not_both(given, names, "advisor", "assessor")
        return issues


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _load_search_space(file: Path) -> dict[str, Any]:
    try:
        is_file = file.is_file()
    except (OSError, ValueError):
        is_file = False
    if not is_file:
        problem = "is not a file" if exists(file) else "does not exist"
        raise ConfigError([ConfigIssue(str(file), problem)])
    data = _read_data(file)
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue(str(file), f"expected a mapping, got {show(data)}")])
    problems: Issues = []
    space = plain_data(data, "", problems)
    if problems:
        raise ConfigError([ConfigIssue(f"{file}:{where}".rstrip(":"), m) for where, m in problems])
    return typing.cast(dict[str, Any], space)


def _search_space_issues(space: dict[str, Any], tuner_name: object, tuner_class: object) -> Issues:
    # The search-space module is optional here: without it, the tuner checks the space.
    try:
        module = importlib.import_module(_SEARCHSPACE_MODULE)
    except ImportError:
        return []
    validate = getattr(module, "validate_search_space", None)
    error_type = getattr(module, "SearchSpaceError", None)
    if validate is None or not (isinstance(error_type, type) and issubclass(error_type, Exception)):
        return []
    is_batch = getattr(module, "is_batch_tuner", None)
    try:
        if is_batch is not None and is_batch(tuner_name, tuner_class):
            validate(space, batch=True)
        else:
            validate(space)
    except error_type as e:
        return [
            (_subpath("search_space", where), str(message))
            for where, message in getattr(e, "issues", [])
        ]
    return []


def _objectives_issues(raw: Any) -> Issues:
    try:
        parse_objectives(raw)
    except ObjectivesError as e:
        return list(e.issues)
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
                    None,
                    None,
                    f"more than {self.MAX_ALIASES} aliases (*name) in one config",
                    self.peek_event().start_mark,
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


def read_config_data(path: str | Path) -> tuple[Path, Any]:
    """The absolute path of a config file and its data, as `load_config` reads them."""
    file = Path(os.path.abspath(Path(path).expanduser()))
    data = _read_data(file)
    if data is None:
        raise ConfigError([ConfigIssue(str(file), "the file is empty")])
    return file, data


def load_config(path: str | Path, *, notes: list[str] | None = None) -> ExperimentConfig:
    """Read and validate an experiment config file (YAML; JSON by a `.json` suffix).

    Relative paths inside are relative to the file's directory. Raises ConfigError with
    every problem, or with the file's own problem (missing, bad syntax with line:column).
    ``notes`` receives what the user should hear once (an NNI v1 file was converted).
    """
    file, data = read_config_data(path)
    said: list[str] = []
    try:
        return parse_config(data, file.parent, notes=said)
    finally:  # an invalid v1 file is still said to be one: its problems name v2 keys
        if notes is not None:
            notes += [f"{path}: {note}" for note in said]


def parse_config(
    data: object, base_dir: str | Path, *, notes: list[str] | None = None
) -> ExperimentConfig:
    """Validate plain data (as loaded from YAML) into an ExperimentConfig.

    Keys may be camelCase or snake_case; NNI's v1 format is converted to v2 first (see
    `nniv1`). Relative paths are taken against `base_dir`; the search-space file is
    loaded. Raises ConfigError listing every problem found.
    """
    walker = Walker(Path(os.path.abspath(Path(base_dir).expanduser())))
    data = _from_v1(data, walker, notes)
    data, nni_issues = translate_nni(data)  # an NNI config as it is (see nniconfig)
    for where, message in nni_issues:
        walker.report(where, message)
    try:
        config = walker.convert(ExperimentConfig, data, "")
    except RecursionError:
        walker.report("", "the config is nested too deeply")
        config = INVALID
    if walker.issues or config is INVALID:
        raise ConfigError(walker.issues or [ConfigIssue("", "invalid config")])
    return typing.cast(ExperimentConfig, config)


def _from_v1(data: object, walker: Walker, notes: list[str] | None) -> object:
    """NNI's v1 format as v2 (NNI's own names), its refusals reported; other data as it is."""
    hint = nniv1.v1_hint(data)
    if hint is not None:
        walker.report("", hint)
    if not nniv1.is_v1(data):
        return data
    converted = nniv1.to_v2(typing.cast(Mapping[Any, Any], data))
    for where, message in converted.issues:
        walker.report(where, message)
    if notes is not None:
        notes.append(converted.note())
    return converted.v2


_SECRET_WORDS = frozenset({"password", "passphrase", "token", "secret", "key"})
_NOT_SECRET_ENDINGS = frozenset({"file", "path", "dir", "directory"})  # ssh_key_file names a file


def _is_secret(name: str) -> bool:
    parts = [part for part in re.split(r"[^a-z0-9]+", to_snake(name)) if part]
    return (
        bool(parts) and parts[-1] not in _NOT_SECRET_ENDINGS and not _SECRET_WORDS.isdisjoint(parts)
    )


# A password in a URL's user part (``postgresql://user:pass@host/db``, an ``optunaStorage``
# or a tuner's ``classArgs.storage``): redacting only the password keeps the rest readable.
_URL_PASSWORD = re.compile(r"(://[^/:@\s]*:)[^/@\s]*@")
_URL_PASSWORD_REDACTED = re.compile(r"://[^/:@\s]*:\*\*\*@")


def without_url_password(text: str) -> str:
    """``text`` with the password of each URL in it replaced by ``***``."""
    return _URL_PASSWORD.sub(r"\1***@", text)


def has_redacted_url_password(text: str) -> bool:
    """Whether ``text`` holds a URL whose password ``without_url_password`` replaced."""
    return _URL_PASSWORD_REDACTED.search(text) is not None


def config_to_dict(cfg: ExperimentConfig, *, redact: bool = False) -> dict[str, Any]:
    """The config as JSON-serialisable data with camelCase keys, fit to store and re-parse.

    The search space is stored inline (its file is left out), so the record does not
    change when the file does. With `redact`, secret-looking fields, and string values
    of secret-looking keys in user mappings (trialEnv, classArgs), read "***", and so
    does the password of a URL anywhere (``optunaStorage``).
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
            result[to_camel(f.name)] = "***" if secret else _to_plain(item, redact)
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
    if redact and isinstance(value, str):
        return without_url_password(value)
    return value


# ---- remote machines over SSH -----------------------------------------------------------
