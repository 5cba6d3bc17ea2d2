"""NNI v2 experiment configs, taken as they are.

`translate` runs on the plain data before the walker: it accepts keys in any case, with or
without underscores (NNI compares keys lower-cased without `_`), lifts NNI's per-service
fields (`trainingService.trialCommand`, ...) to where they live here, turns NNI's forms
into this project's (`nniManagerIp`, NNI's memory sizes), and refuses each NNI field that
has no counterpart with a message naming it and what to do instead, so that none is
silently ignored. `FIELDS` lists every field of NNI's schema with what becomes of it; the
README's "Coming from NNI" table is that list.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..platforms import config_class
from .rules import Issues, join_path, show, split_address, to_camel

__all__ = ["FIELDS", "NniField", "NniStatus", "canonical", "translate"]


def canonical(key: str) -> str:
    """A key as NNI compares it: lower case, without underscores."""
    return key.lower().replace("_", "")


class NniStatus(str, enum.Enum):
    SAME = "same"  # the same name and meaning here
    TRANSLATED = "translated"  # NNI's form taken and turned into this project's
    REFUSED = "refused"  # no counterpart: the config is refused, naming what to write instead
    SEARCH = "search"  # the tuner, assessor and advisor: the search settings' own rules


@dataclass(frozen=True)
class NniField:
    """One field of NNI's schema: where (`scope`), its status here, and why or how."""

    scope: str  # "" (top level), "trainingService", a platform, "machineList[]", "sharedStorage"
    name: str  # NNI's camelCase name
    status: NniStatus
    note: str = ""


def _f(scope: str, names: str, status: str, note: str = "") -> list[NniField]:
    return [NniField(scope, name, NniStatus(status), note) for name in names.split()]


_K8S_DISTRIBUTED = (
    "each trial runs as one pod here, so distributed roles are not run: give one worker "
    "(replicas: 1), or image, cpuNumber, memorySize and gpuNumber in trainingService"
)
_K8S_ROLE = (
    "its one role (replicas or taskNumber 1) gives the pod: dockerImage as image, command as trialCommand, "
    "gpuNumber, cpuNumber, memorySize (NNI's sizes: a bare number is MB)"
)
_K8S_STORAGE = "storageType nfs becomes nfs: {server, path}; for Azure storage give persistentVolumeClaim instead"
_EXPAND = (
    "NNI's annotations ('@nni.variable' comments) are not supported here, nor by nni 3.0: read the "
    "parameters with `params = nni.get_next_parameter()`, report with "
    "`nni.report_intermediate_result(...)` and `nni.report_final_result(...)`, and set "
    "useAnnotation: false (or remove it)"
)
FIELDS: tuple[NniField, ...] = (
    *_f(
        "",
        "experimentName searchSpaceFile searchSpace trialCommand trialCodeDirectory trialConcurrency "
        "trialGpuNumber maxExperimentDuration maxTrialNumber maxTrialDuration experimentWorkingDirectory",
        "same",
    ),
    *_f(
        "",
        "sharedStorage",
        "same",
        "mounted by openpai and dlts environments; refused with a platform that would not use it",
    ),
    *_f(
        "",
        "experimentType",
        "translated",
        "'hpo' (the default) is accepted; 'nas' is refused: NAS experiments need NNI's own nni.nas",
    ),
    *_f(
        "",
        "nniManagerIp",
        "translated",
        "the address agents dial: the coordinator listens there (coordinator.address ip:0) and remote agents dial it",
    ),
    *_f("", "useAnnotation", "translated", "false is accepted; true is refused: " + _EXPAND),
    *_f("", "debug", "translated", "true means logLevel debug"),
    *_f(
        "",
        "logLevel",
        "translated",
        "the coordinator's log level when `trialkeeper run` is given no --log-level "
        "(fatal and trace read as critical and debug)",
    ),
    *_f(
        "",
        "tunerGpuIndices",
        "refused",
        "the tuner runs in the coordinator's process: "
        "start `trialkeeper run` with CUDA_VISIBLE_DEVICES set to those GPUs",
    ),
    *_f("", "tuner assessor advisor", "search", "see the search settings"),
    *_f("", "trainingService", "same", "a list (hybrid mode) follows its own rules"),
    *_f("trainingService", "platform", "same"),
    *_f(
        "trainingService",
        "trialCommand trialCodeDirectory trialGpuNumber nniManagerIp debug",
        "translated",
        "lifted to the top level, where it overrides the top-level value as NNI does; in a list (hybrid) "
        "each service's value, its own or the top level's, must be the same",
    ),
    *_f("local", "useActiveGpu maxTrialNumberPerGpu gpuIndices", "same"),
    *_f("local", "reuseMode", "same", "defaults to true here (NNI: false)"),
    *_f("remote", "machineList", "same"),
    *_f("remote", "reuseMode", "same", "defaults to true here (NNI: false)"),
    *_f(
        "machineList[]",
        "host port user password sshKeyFile sshPassphrase useActiveGpu maxTrialNumberPerGpu gpuIndices",
        "same",
    ),
    *_f("machineList[]", "pythonPath", "same", "a directory put first on PATH, as in NNI, or a Python executable"),
    *_f(
        "openpai",
        "host username token trialCpuNumber storageConfigName dockerImage virtualCluster "
        "localStorageMountPoint containerStorageMountPoint reuseMode",
        "same",
    ),
    *_f("openpai", "trialMemorySize", "translated", "NNI's sizes: a bare number is MB, units count by 1024"),
    *_f(
        "openpai",
        "openpaiConfig openpaiConfigFile",
        "refused",
        "set the job's resources with trialCpuNumber, trialMemorySize, trialGpuNumber and dockerImage",
    ),
    *_f("aml", "subscriptionId resourceGroup workspaceName computeTarget dockerImage maxTrialNumberPerGpu", "same"),
    *_f(
        "dlc",
        "type image jobType podCount ecsSpec region workspaceId nasDataSourceId ossDataSourceId "
        "accessKeyId accessKeySecret localStorageMountPoint containerStorageMountPoint",
        "same",
    ),
    *_f("kubeflow", "operator apiVersion namespace reuseMode", "same"),
    *_f("kubeflow", "worker", "translated", _K8S_ROLE + "; codeDirectory as trialCodeDirectory"),
    *_f("kubeflow", "ps master", "refused", _K8S_DISTRIBUTED),
    *_f("kubeflow", "storage", "translated", _K8S_STORAGE),
    *_f("frameworkcontroller", "serviceAccountName namespace reuseMode", "same"),
    *_f(
        "frameworkcontroller",
        "taskRoles",
        "translated",
        _K8S_ROLE + "; name as taskRoleName; with one task its "
        "frameworkAttemptCompletionPolicy is met by the trial's own end",
    ),
    *_f("frameworkcontroller", "storage", "translated", _K8S_STORAGE),
    *_f(
        "sharedStorage",
        "storageType localMountPoint remoteMountPoint localMounted storageAccountName "
        "storageAccountKey containerName nfsServer exportedDirectory",
        "same",
    ),
)

_BY_SCOPE: dict[str, dict[str, NniField]] = {}
for _field in FIELDS:
    _BY_SCOPE.setdefault(_field.scope, {})[canonical(_field.name)] = _field

_NNI_LEVELS = ("fatal", "error", "warning", "info", "debug", "trace")


def _key(section: Mapping[Any, Any], name: str) -> Any:
    """The key `section` spells NNI's field `name` with (any case, with or without
    underscores), or None. Keys are left as written: messages name them so."""
    return next((k for k in section if isinstance(k, str) and canonical(k) == canonical(name)), None)


def _take(section: dict[Any, Any], name: str) -> tuple[Any, object]:
    """Remove field `name` in whatever spelling: (the key as written or `name`, its value)."""
    key = _key(section, name)
    return (name, None) if key is None else (key, section.pop(key))


def translate(data: object) -> tuple[object, Issues]:
    """NNI's forms of `data` turned into this project's, and the NNI fields refused.

    Anything that is not an NNI form is left for the walker to judge, so a config written
    for trialkeeper comes out as it went in. The input is not changed.
    """
    if not isinstance(data, Mapping):
        return data, []
    issues: Issues = []
    top = dict(data)  # only copies of the sections changed are written to
    _refuse_fields(top, "", "", issues)
    service_key = _key(top, "trainingService")
    services = _services(top, service_key, issues)
    _experiment_type(top, issues)
    _annotation(top, issues)
    _log_level(top, issues)
    _manager_ip(top, services, issues)
    return top, issues


# NNI's fields of every training service that are the experiment's trial settings here.
_LIFTED = ("trialCommand", "trialCodeDirectory", "trialGpuNumber", "nniManagerIp", "debug")


def _services(top: dict[Any, Any], service_key: Any, issues: Issues) -> list[dict[Any, Any]]:
    """Translate the one service section, or each of a list (NNI's hybrid mode, or this
    project's `platform: hybrid` with `platforms`), in place; the sections translated."""
    if service_key is None:
        return []
    container: Any = top[service_key]
    path = service_key
    if isinstance(container, Mapping):
        service = dict(container)
        top[service_key] = service
        platforms_key = _key(service, "platforms")
        if service.get(_key(service, "platform")) != "hybrid" or platforms_key is None:
            _lift(top, [_service(top, service, service_key, issues)], issues)
            return [service]
        container, path = service[platforms_key], join_path(service_key, platforms_key)
        if isinstance(container, list):
            service[platforms_key] = container = list(container)
    elif isinstance(container, list):
        top[service_key] = container = list(container)
    if not isinstance(container, list):
        return []  # the walker names what is wrong with it
    sections: list[dict[Any, Any]] = []
    lifted: list[dict[str, tuple[str, object]]] = []
    for i, section in enumerate(container):
        if isinstance(section, Mapping):
            container[i] = dict(section)
            sections.append(container[i])
            lifted.append(_service(top, container[i], f"{path}[{i}]", issues))
    _lift(top, lifted, issues)
    return sections


def _lift(top: dict[Any, Any], given: list[dict[str, tuple[str, object]]], issues: Issues) -> None:
    """The trial settings the services gave, as the experiment's.

    In NNI a service's own value overrides the top-level one for that service's trials.
    Here every platform runs the experiment's one trial command (and code, GPUs, ...), so
    the value each service would use must be the same; a service that differs is refused.
    """
    for name in _LIFTED:
        top_key = _key(top, name)
        fallback = (top_key, top[top_key]) if top_key is not None else None
        chosen: tuple[str, object] | None = None
        for service in given:
            used = service.get(name, fallback)
            if used is None:
                continue
            if chosen is None:
                chosen = used
            elif used[1] != chosen[1]:
                why = f"every platform runs the experiment's one {name} here; give it once, at the top level"
                issues.append((used[0], f"differs from {chosen[0]} ({show(chosen[1])}): {why}"))
        if chosen is not None and chosen is not fallback:
            _take(top, name)
            top[name] = chosen[1]


def _refuse_fields(section: dict[Any, Any], scope: str, path: str, issues: Issues) -> None:
    for f in _BY_SCOPE.get(scope, {}).values():
        if f.status is NniStatus.REFUSED:
            key, value = _take(section, f.name)
            if value is not None:
                issues.append((join_path(path, key), f"NNI's {f.name} is not supported here: {f.note}"))


def _service(top: dict[Any, Any], service: dict[Any, Any], path: str, issues: Issues) -> dict[str, tuple[str, object]]:
    """Translate one service section in place; the trial settings it gave (name -> (where, value)),
    which `_lift` makes the experiment's."""
    tag = _key(service, "platform")
    if tag is not None and tag != "platform":
        service["platform"] = service.pop(tag)
    platform = service.get("platform")
    scope = platform if isinstance(platform, str) else ""
    given: dict[str, tuple[str, object]] = {}
    for name in _LIFTED:
        if not _platform_has(scope, name):
            key, value = _take(service, name)
            if value is not None:
                given[name] = (join_path(path, key), value)
    _refuse_fields(service, scope, path, issues)
    size_key = _key(service, "trialMemorySize") if scope == "openpai" else None
    if size_key is not None:
        service[size_key] = _nni_size(service[size_key])
    if scope in ("kubeflow", "frameworkcontroller"):
        _k8s_storage(service, path, issues)
        role_key = _key(service, "worker" if scope == "kubeflow" else "taskRoles")
        if role_key is not None:
            _k8s_role(top, service, service.pop(role_key), join_path(path, role_key), issues)
    return given


# NNI's role fields -> this project's trainingService fields.
_ROLE_FIELDS = {"dockerimage": "image", "gpunumber": "gpuNumber", "cpunumber": "cpuNumber", "name": "taskRoleName"}


def _k8s_role(top: dict[Any, Any], service: dict[Any, Any], role: object, path: str, issues: Issues) -> None:
    """NNI's one worker (kubeflow) or task role (frameworkcontroller) as this pod's settings."""
    if isinstance(role, list):  # frameworkcontroller's taskRoles
        if len(role) != 1:
            issues.append((path, f"give one task role, not {len(role)}: {_K8S_DISTRIBUTED}"))
            return
        path, role = f"{path}[0]", role[0]
    if not isinstance(role, Mapping):
        issues.append((path, f"expected a mapping, got {show(role)}"))
        return
    for key, value in role.items():
        name = canonical(key) if isinstance(key, str) else ""
        where = join_path(path, str(key))
        if name in ("replicas", "tasknumber"):
            if value != 1:
                issues.append((where, f"expected 1, got {show(value)}: {_K8S_DISTRIBUTED}"))
        elif name in _ROLE_FIELDS:
            service[_ROLE_FIELDS[name]] = value
        elif name == "memorysize":
            service["memorySize"] = _nni_size(value)
        elif name in ("command", "codedirectory"):
            field_name = "trialCommand" if name == "command" else "trialCodeDirectory"
            given = top.get(_key(top, field_name))
            if given is not None and given != value:
                issues.append((where, f"differs from {field_name} ({show(given)}); give it once"))
            else:
                _take(top, field_name)
                top[field_name] = value
        elif name != "frameworkattemptcompletionpolicy":  # one task: its end is the trial's
            issues.append((where, "unknown key of an NNI role; " + _K8S_ROLE))


def _k8s_storage(service: dict[Any, Any], path: str, issues: Issues) -> None:
    """NNI's `storage: {storageType: nfs, server, path}` as `nfs: {server, path}`."""
    key, storage = _take(service, "storage")
    if storage is None:
        return
    where = join_path(path, key)
    if not isinstance(storage, Mapping):
        issues.append((where, f"expected a mapping, got {show(storage)}"))
        return
    kind = storage.get(_key(storage, "storageType")) or storage.get(_key(storage, "storage"))
    if kind != "nfs":
        issues.append((where, f"NNI's storage {show(kind)} is not supported here: {_K8S_STORAGE}"))
        return
    service["nfs"] = {"server": storage.get(_key(storage, "server")), "path": storage.get(_key(storage, "path"))}


def _platform_has(platform: str, name: str) -> bool:
    """Whether this platform's own section declares `name` (openpai has trialGpuNumber)."""
    try:
        return any(to_camel(f.name) == name for f in dataclasses.fields(config_class(platform)))
    except (KeyError, ImportError):  # the walker names an unknown or broken platform
        return False


_NNI_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(tb|gb|mb|kb|b)\s*", re.IGNORECASE)
_NNI_SIZE_UNITS = {"tb": 1024**4, "gb": 1024**3, "mb": 1024**2, "kb": 1024, "b": 1}


def _nni_size(value: object) -> object:
    """Bytes in an NNI memory size: a bare number is MB, and units count by 1024."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value) * 1024**2
    if isinstance(value, str):
        match = _NNI_SIZE_RE.fullmatch(value)
        if match:
            return math.ceil(float(match.group(1)) * _NNI_SIZE_UNITS[match.group(2).lower()])
    return value  # another form of this project's own sizes ('2GiB'), judged by the walker


def _pop(top: dict[Any, Any], name: str, check: Callable[[object], bool], expect: str, issues: Issues) -> object:
    key, value = _take(top, name)
    if value is not None and not check(value):
        issues.append((key, f"expected {expect}, got {show(value)}"))
        return None
    return value


def _experiment_type(top: dict[str, Any], issues: Issues) -> None:
    kind = _pop(top, "experimentType", lambda v: isinstance(v, str), "'hpo'", issues)
    if kind is not None and kind != "hpo":
        issues.append(
            (
                "experimentType",
                f"only 'hpo' experiments run here, not {show(kind)}: NAS experiments need NNI's own nni.nas",
            )
        )


def _annotation(top: dict[str, Any], issues: Issues) -> None:
    if _pop(top, "useAnnotation", lambda v: isinstance(v, bool), "true or false", issues):
        issues.append(("useAnnotation", _EXPAND))


def _log_level(top: dict[str, Any], issues: Issues) -> None:
    debug = _pop(top, "debug", lambda v: isinstance(v, bool), "true or false", issues)
    level = _pop(
        top,
        "logLevel",
        lambda v: isinstance(v, str) and v.lower() in _NNI_LEVELS,
        "one of " + ", ".join(_NNI_LEVELS),
        issues,
    )
    if level is None and debug:
        level = "debug"
    if isinstance(level, str):
        top["logLevel"] = level.lower()  # any spelling given was taken above


def _is_manager_host(value: object) -> bool:
    if not isinstance(value, str) or not value.strip():
        return False
    host = value.strip()
    try:
        split_address(f"[{host}]:0" if ":" in host else f"{host}:0", allow_port_zero=True)
    except ValueError:
        return False
    return True


def _manager_ip(top: dict[Any, Any], services: list[dict[Any, Any]], issues: Issues) -> None:
    ip = _pop(
        top, "nniManagerIp", _is_manager_host, "a host name or IP address of this machine, without a port", issues
    )
    if not isinstance(ip, str):
        return
    ip = ip.strip()
    coordinator_key = _key(top, "coordinator") or "coordinator"
    coordinator = top.get(coordinator_key)
    if coordinator is not None and not isinstance(coordinator, Mapping):
        return  # the walker names what is wrong with it
    settings = dict(coordinator or {})
    if _key(settings, "address") is not None or _key(settings, "advertiseAddress") is not None:
        issues.append(("nniManagerIp", "give nniManagerIp or coordinator.address/advertiseAddress, not both"))
        return
    # Listening there on any free port makes it the address agents are told to dial.
    settings["address"] = f"[{ip}]:0" if ":" in ip else f"{ip}:0"
    top[coordinator_key] = settings
    for service in services:
        if service.get("platform") == "remote" and _key(service, "coordinatorAddress") is None:
            service["coordinatorAddress"] = ip
