"""NNI's v1 config files (``trainingServicePlatform``, ``searchSpacePath``, ``trial.command``,
``tuner.builtinTunerName``, ...) turned into NNI's v2 form, as nnictl 3.0 runs them.

The keys move as NNI's own converter (``nni.experiment.config.convert.to_v2``) moves them;
the v2 data then goes through `nni.translate` and the walker like any v2 config. Fields NNI
dropped in v2 (``authorName``, ``multiThread``, ...) are dropped and named in the note; a key
NNI's v1 format does not have is refused by its path, so nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .nni import canonical
from .rules import Issues, join_path, show

__all__ = ["V1Conversion", "is_v1", "to_v2"]

_PLATFORM_KEY = "trainingServicePlatform"
# What nnictl 3.0 converts; its others (adl, dlts, hybrid) only its legacy launcher ran.
_PLATFORMS = {
    "local": "local",
    "remote": "remote",
    "pai": "openpai",
    "aml": "aml",
    "kubeflow": "kubeflow",
    "frameworkcontroller": "frameworkcontroller",
}
# Keys only NNI's v1 format has at the top level: a config with them but no platform is v1
# with its platform missing.
_V1_ONLY = (
    "authorName",
    "maxExecDuration",
    "maxTrialNum",
    "searchSpacePath",
    "trial",
    "localConfig",
    "machineList",
    "remoteConfig",
    "paiConfig",
    "amlConfig",
    "kubeflowConfig",
    "frameworkcontrollerConfig",
)


@dataclass
class V1Conversion:
    """The v2 data, the fields dropped (as NNI drops them), and the keys refused."""

    v2: dict[str, Any]
    dropped: list[str] = field(default_factory=list)
    issues: Issues = field(default_factory=list)

    def note(self) -> str:
        """The one line that says the config was converted."""
        dropped = f"; dropped, as NNI does: {', '.join(self.dropped)}" if self.dropped else ""
        return (
            f"NNI's v1 config format, converted to v2 as nnictl converts it{dropped} "
            "(`trialkeeper run CONFIG --print-config` prints the v2 form)"
        )


def _find(section: Mapping[Any, Any], name: str) -> Any:
    return next(
        (k for k in section if isinstance(k, str) and canonical(k) == canonical(name)), None
    )


def is_v1(data: object) -> bool:
    """Whether ``data`` is an NNI v1 config: it names ``trainingServicePlatform``."""
    return isinstance(data, Mapping) and _find(data, _PLATFORM_KEY) is not None


def v1_hint(data: object) -> str | None:
    """For a config with v1-only keys but no ``trainingServicePlatform``: what to do."""
    if not isinstance(data, Mapping) or is_v1(data):
        return None
    found = [name for name in _V1_ONLY if _find(data, name) is not None]
    if not found:
        return None
    return (
        f"{', '.join(found)}: keys of NNI's v1 config format; give {_PLATFORM_KEY} (local, "
        "remote, pai, aml, kubeflow, frameworkcontroller) to have it converted, or write the "
        "v2 form"
    )


class _Converter:
    def __init__(self) -> None:
        self.out = V1Conversion({})

    def take(self, section: dict[Any, Any], name: str) -> Any:
        key = _find(section, name)
        return None if key is None else section.pop(key)

    def move(
        self, src: dict[Any, Any], dst: dict[str, Any], name: str, to: str | None = None
    ) -> None:
        value = self.take(src, name)
        if value is not None:
            dst[to or name] = value

    def drop(self, section: dict[Any, Any], name: str, where: str = "") -> None:
        if _find(section, name) is not None:
            self.take(section, name)
            self.out.dropped.append(join_path(where, name))

    def section(self, parent: dict[Any, Any], name: str, where: str) -> dict[Any, Any]:
        value = self.take(parent, name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.out.issues.append(
                (join_path(where, name), f"expected a mapping, got {show(value)}")
            )
            return {}
        return dict(value)

    def leftover(self, section: Mapping[Any, Any], where: str) -> None:
        for key in section:
            self.out.issues.append(
                (join_path(where, str(key)), "not a field of NNI's v1 config format")
            )


def to_v2(data: Mapping[Any, Any]) -> V1Conversion:
    """NNI's v1 config ``data`` in NNI's v2 form (the input is not changed)."""
    c = _Converter()
    v1, v2 = dict(data), c.out.v2
    platform = c.take(v1, _PLATFORM_KEY)
    if platform not in _PLATFORMS:
        c.out.issues.append(
            (
                _PLATFORM_KEY,
                (
                    f"NNI's v1 platform {show(platform)} has no v2 form (nnictl converts "
                    f"{', '.join(_PLATFORMS)}): write the config in NNI's v2 format"
                ),
            )
        )
        return c.out
    c.drop(v1, "authorName")
    c.move(v1, v2, "experimentName")
    c.drop(v1, "description")
    c.move(v1, v2, "trialConcurrency")
    duration = c.take(v1, "maxExecDuration")
    if duration is not None:
        is_number = isinstance(duration, (int, float)) and not isinstance(duration, bool)
        v2["maxExperimentDuration"] = f"{duration}s" if is_number else duration
    c.move(v1, v2, "maxTrialNum", "maxTrialNumber")
    c.move(v1, v2, "searchSpacePath", "searchSpaceFile")
    multi_phase = c.take(v1, "multiPhase")
    if multi_phase:
        c.out.issues.append(
            ("multiPhase", "multi-phase trials are not supported (nor by NNI's v2)")
        )
    for name in ("multiThread", "versionCheck", "logCollection"):
        c.drop(v1, name)
    c.move(v1, v2, "nniManagerIp")
    c.move(v1, v2, "logDir", "experimentWorkingDirectory")
    c.move(v1, v2, "debug")
    c.move(v1, v2, "logLevel")
    c.move(v1, v2, "useAnnotation")
    trial = c.section(v1, "trial", "")
    c.move(trial, v2, "command", "trialCommand")
    c.move(trial, v2, "codeDir", "trialCodeDirectory")
    c.move(trial, v2, "gpuNum", "trialGpuNumber")
    for kind in ("tuner", "assessor", "advisor"):
        _algorithm(c, v1, kind)
    ts: dict[str, Any] = {"platform": _PLATFORMS[platform]}
    v2["trainingService"] = ts
    _PLATFORM_CONVERTERS[platform](c, v1, trial, ts)
    storage = c.section(v1, "sharedStorage", "")
    if storage:
        v2["sharedStorage"] = storage  # v1 and v2 name its fields alike
    c.leftover(trial, "trial")
    c.leftover(v1, "")
    return c.out


def _algorithm(c: _Converter, v1: dict[Any, Any], kind: str) -> None:
    algo = c.section(v1, kind, "")
    if not algo:
        return
    builtin = c.take(algo, f"builtin{kind.title()}Name")
    if builtin is not None:
        v2_algo: dict[str, Any] = {"name": builtin}
    else:
        code_dir, file_name = c.take(algo, "codeDir"), c.take(algo, "classFileName")
        class_name = c.take(algo, "className")
        if not (
            isinstance(file_name, str) and file_name.endswith(".py") and isinstance(class_name, str)
        ):
            c.out.issues.append(
                (
                    kind,
                    (
                        f"NNI's v1 {kind} needs builtin{kind.title()}Name, or codeDir, "
                        "classFileName (a .py file) and className"
                    ),
                )
            )
            return
        v2_algo = {"className": f"{file_name[:-3]}.{class_name}"}
        if code_dir is not None:
            v2_algo["codeDirectory"] = code_dir
    c.move(algo, v2_algo, "classArgs")
    c.out.v2[kind] = v2_algo
    c.drop(algo, "includeIntermediateResults", kind)
    c.move(algo, c.out.v2, "gpuIndices", "tunerGpuIndices")
    c.leftover(algo, kind)


def _local(c: _Converter, v1: dict[Any, Any], trial: dict[Any, Any], ts: dict[str, Any]) -> None:
    local = c.section(v1, "localConfig", "")
    c.move(local, ts, "gpuIndices")
    c.move(local, ts, "maxTrialNumPerGpu", "maxTrialNumberPerGpu")
    c.move(local, ts, "useActiveGpu")
    c.leftover(local, "localConfig")


_MACHINE_KEYS = {
    "ip": "host",
    "port": "port",
    "username": "user",
    "sshKeyPath": "sshKeyFile",
    "passphrase": "sshPassphrase",
    "gpuIndices": "gpuIndices",
    "maxTrialNumPerGpu": "maxTrialNumberPerGpu",
    "useActiveGpu": "useActiveGpu",
    "pythonPath": "pythonPath",
    "passwd": "password",
}


def _remote(c: _Converter, v1: dict[Any, Any], trial: dict[Any, Any], ts: dict[str, Any]) -> None:
    remote = c.section(v1, "remoteConfig", "")
    c.move(remote, ts, "reuse", "reuseMode")
    c.leftover(remote, "remoteConfig")
    machines = c.take(v1, "machineList")
    if not isinstance(machines, list):
        c.out.issues.append(("machineList", f"expected a list of machines, got {show(machines)}"))
        return
    ts["machineList"] = []
    for i, machine in enumerate(machines):
        if not isinstance(machine, Mapping):
            c.out.issues.append((f"machineList[{i}]", f"expected a mapping, got {show(machine)}"))
            continue
        given, v2_machine = dict(machine), dict[str, Any]()
        for old, new in _MACHINE_KEYS.items():
            c.move(given, v2_machine, old, new)
        ts["machineList"].append(v2_machine)
        c.leftover(given, f"machineList[{i}]")


def _openpai(c: _Converter, v1: dict[Any, Any], trial: dict[Any, Any], ts: dict[str, Any]) -> None:
    for old, new in (
        ("nniManagerNFSMountPath", "localStorageMountPoint"),
        ("containerNFSMountPath", "containerStorageMountPoint"),
        ("cpuNum", "trialCpuNumber"),
        ("memoryMB", "trialMemorySize"),
        ("image", "dockerImage"),
        ("virtualCluster", "virtualCluster"),
        ("paiStorageConfigName", "storageConfigName"),
        ("paiConfigPath", "openpaiConfigFile"),
    ):
        c.move(trial, ts, old, new)
    pai = c.section(v1, "paiConfig", "")
    for old, new in (
        ("userName", "username"),
        ("token", "token"),
        ("host", "host"),
        ("reuse", "reuseMode"),
        ("gpuNum", "trialGpuNumber"),
        ("cpuNum", "trialCpuNumber"),
        ("memoryMB", "trialMemorySize"),
    ):
        c.move(pai, ts, old, new)
    for name in ("password", "maxTrialNumPerGpu", "useActiveGpu"):
        c.drop(pai, name, "paiConfig")
    c.leftover(pai, "paiConfig")


def _aml(c: _Converter, v1: dict[Any, Any], trial: dict[Any, Any], ts: dict[str, Any]) -> None:
    c.move(trial, ts, "image", "dockerImage")
    aml = c.section(v1, "amlConfig", "")
    for name in ("subscriptionId", "resourceGroup", "workspaceName", "computeTarget"):
        c.move(aml, ts, name)
    c.move(aml, ts, "maxTrialNumPerGpu", "maxTrialNumberPerGpu")
    c.drop(aml, "useActiveGpu", "amlConfig")
    c.leftover(aml, "amlConfig")


def _storage(c: _Converter, config: dict[Any, Any], ts: dict[str, Any], where: str) -> None:
    name = c.take(config, "storage") or (
        "nfs" if _find(config, "nfs") is not None else "azureStorage"
    )
    if name == "nfs":
        nfs = c.section(config, "nfs", where)
        ts["storage"] = {"storageType": "nfs", "server": nfs.get("server"), "path": nfs.get("path")}
    elif name == "azureStorage":
        vault, azure = (
            c.section(config, "keyVault", where),
            c.section(config, "azureStorage", where),
        )
        ts["storage"] = {
            "storageType": "azureStorage",
            "azureAccount": azure.get("accountName"),
            "azureShare": azure.get("azureShare"),
            "keyVaultName": vault.get("vaultName"),
            "keyVaultKey": vault.get("name"),
        }
        c.drop(config, "uploadRetryCount", where)


_ROLE_KEYS = (
    ("replicas", "replicas"),
    ("taskNum", "taskNumber"),
    ("name", "name"),
    ("command", "command"),
    ("gpuNum", "gpuNumber"),
    ("cpuNum", "cpuNumber"),
    ("memoryMB", "memorySize"),
    ("image", "dockerImage"),
)


def _role(c: _Converter, role: object, where: str) -> dict[str, Any] | None:
    if not isinstance(role, Mapping):
        c.out.issues.append((where, f"expected a mapping, got {show(role)}"))
        return None
    given, v2_role = dict(role), dict[str, Any]()
    for old, new in _ROLE_KEYS:
        c.move(given, v2_role, old, new)
    c.drop(given, "privateRegistryAuthPath", where)
    policy = c.take(given, "frameworkControllerCompletionPolicy")
    if isinstance(policy, Mapping) and policy:
        v2_role["frameworkAttemptCompletionPolicy"] = {
            ("minSucceedTaskCount" if canonical(str(k)) == "minsucceededtaskcount" else k): v
            for k, v in policy.items()
        }
    c.leftover(given, where)
    return v2_role


def _kubeflow(c: _Converter, v1: dict[Any, Any], trial: dict[Any, Any], ts: dict[str, Any]) -> None:
    config = c.section(v1, "kubeflowConfig", "")
    c.move(config, ts, "operator")
    c.move(config, ts, "apiVersion")
    c.move(config, ts, "reuse", "reuseMode")
    _storage(c, config, ts, "kubeflowConfig")
    c.leftover(config, "kubeflowConfig")
    c.drop(trial, "nasMode", "trial")
    for name in ("worker", "ps", "master"):
        if _find(trial, name) is not None:
            role = _role(c, c.take(trial, name), f"trial.{name}")
            if role is not None:
                if "trialCodeDirectory" in c.out.v2:
                    role["codeDirectory"] = c.out.v2["trialCodeDirectory"]
                ts[name] = role


def _frameworkcontroller(
    c: _Converter, v1: dict[Any, Any], trial: dict[Any, Any], ts: dict[str, Any]
) -> None:
    config = c.section(v1, "frameworkcontrollerConfig", "")
    c.move(config, ts, "serviceAccountName")
    c.move(config, ts, "reuse", "reuseMode")
    _storage(c, config, ts, "frameworkcontrollerConfig")
    c.leftover(config, "frameworkcontrollerConfig")
    c.drop(trial, "nasMode", "trial")
    roles = c.take(trial, "taskRoles") or []
    if not isinstance(roles, list):
        c.out.issues.append(
            ("trial.taskRoles", f"expected a list of task roles, got {show(roles)}")
        )
        return
    ts["taskRoles"] = [
        r for i, role in enumerate(roles) if (r := _role(c, role, f"trial.taskRoles[{i}]"))
    ]


_PLATFORM_CONVERTERS = {
    "local": _local,
    "remote": _remote,
    "pai": _openpai,
    "aml": _aml,
    "kubeflow": _kubeflow,
    "frameworkcontroller": _frameworkcontroller,
}
