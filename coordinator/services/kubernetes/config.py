"""The `trainingService` sections for Kubernetes.

Four platforms share one set of fields: `kubernetes` (a Pod or a batch Job per
environment) and the operator flavours `kubeflow` (PyTorchJob/TFJob), `frameworkcontroller`
(a Framework with one task role) and `adl` (an AdaptDLJob). Each environment is one
workload running one agent; the fields say what the pod asks for and where it finds the code.

Code reaches the pods through shared storage (an NFS export or a PersistentVolumeClaim,
mounted at `containerMountPath`). When this machine sees the same storage at
`localMountPath`, the trial code directory is copied there once per experiment; otherwise
the code is expected in the image at `containerCodeDirectory`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from ...config.platform import EnvironmentPoolConfig
from ...config.rules import (
    NON_EMPTY_STR,
    NON_NEGATIVE_INT,
    POSITIVE_DURATION,
    Issues,
    not_both,
    parse_size,
    rule,
)

__all__ = [
    "AdlCheckpoint",
    "AdlConfig",
    "FrameworkControllerConfig",
    "KubeflowConfig",
    "KubernetesConfig",
    "KubernetesPlatformConfig",
    "NfsStorage",
]


def _secret_names(value: object) -> object:
    # NNI writes `imagePullSecrets: [{name: regcred}]`; a plain list of names is accepted too.
    if isinstance(value, list):
        return [v["name"] if isinstance(v, dict) and set(v) == {"name"} else v for v in value]
    return value


def _operator(value: object) -> object:
    # NNI names the operators after their deployments (tf-operator, pytorch-operator).
    aliases = {"tf-operator": "tfjob", "pytorch-operator": "pytorchjob"}
    return aliases.get(value, value) if isinstance(value, str) else value


_QUANTITY_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)\s*")
_QUANTITY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
                   "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def _quantity(value: object) -> object:
    """Bytes in a Kubernetes quantity ("8Gi", "512M") or in any form `parse_size` takes."""
    if isinstance(value, str):
        match = _QUANTITY_RE.fullmatch(value)
        if match:
            return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2)])
    return parse_size(value)


_K8S_SIZE = rule("a size (bytes, or like '8Gi', '512Mi', '16GiB')", lambda v: v > 0, coerce=_quantity)
_ABSOLUTE_PATH = rule("an absolute path (starting with /)", lambda v: v.startswith("/"))
_CPU = rule("a positive number of CPUs", lambda v: v > 0)
_PULL_SECRETS = rule("a list of secret names (or of {name: ...})", coerce=_secret_names)
_DNS_LABEL = rule(
    "a Kubernetes name (lowercase letters, digits and '-', at most 63)",
    lambda v: re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", v) is not None,
)
# FrameworkController's CRD allows only this for the names of Frameworks and task roles.
_FRAMEWORK_NAME = rule(
    "a FrameworkController name (lowercase letters and digits only, no '-', at most 63)",
    lambda v: re.fullmatch(r"[a-z0-9]{1,63}", v) is not None,
)


@dataclass(frozen=True, kw_only=True)
class NfsStorage:
    """An NFS export mounted into every pod (`trainingService.nfs`)."""

    server: str = field(metadata=NON_EMPTY_STR)
    path: str = field(metadata=_ABSOLUTE_PATH)


@dataclass(frozen=True, kw_only=True)
class KubernetesPlatformConfig(EnvironmentPoolConfig):
    """The fields every Kubernetes flavour shares; the registered subclasses add their own."""

    PLATFORM: ClassVar[str] = ""
    image: str = field(metadata=NON_EMPTY_STR)
    namespace: str = field(default="default", metadata=_DNS_LABEL)
    # kubeconfig file; else $KUBECONFIG, ~/.kube/config, or the in-cluster service account.
    kubeconfig: Path | None = None
    context: str | None = field(default=None, metadata=NON_EMPTY_STR)
    cpu_number: float | None = field(default=None, metadata=_CPU)
    memory_size: int | None = field(default=None, metadata=_K8S_SIZE)
    gpu_number: int = field(default=0, metadata=NON_NEGATIVE_INT)
    service_account_name: str | None = field(default=None, metadata=NON_EMPTY_STR)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    image_pull_secrets: list[str] = field(default_factory=list, metadata=_PULL_SECRETS)
    nfs: NfsStorage | None = None
    persistent_volume_claim: str | None = field(default=None, metadata=NON_EMPTY_STR)
    container_mount_path: str = field(default="/trialkeeper", metadata=_ABSOLUTE_PATH)
    # Where this machine sees the same storage: the trial code is copied there.
    local_mount_path: Path | None = None
    # Where the trial code lies inside the image, when it is not copied to the storage.
    container_code_directory: str | None = field(default=None, metadata=NON_EMPTY_STR)
    # The Python in the image that has trialkeeper installed.
    python: str = field(default="python", metadata=NON_EMPTY_STR)
    api_timeout: float = field(default=30.0, metadata=POSITIVE_DURATION)
    # How long a pod may keep failing to pull its image before its environment fails.
    image_pull_timeout: float = field(default=300.0, metadata=POSITIVE_DURATION)

    def gpu_shortfall(self, trial_gpu_number: int) -> tuple[str, str] | None:
        if self.gpu_number >= trial_gpu_number:
            return None
        message = (
            f"is {self.gpu_number}, but trialGpuNumber asks for {trial_gpu_number} GPU(s) per trial: "
            f"no trial could start in a pod with {self.gpu_number}; set gpuNumber to at least "
            f"{trial_gpu_number} (times trialsPerEnvironment to run that many trials per pod)"
        )
        return "gpuNumber", message

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues = not_both(given, names, "nfs", "persistent_volume_claim")
        if "local_mount_path" in given:
            if "nfs" not in given and "persistent_volume_claim" not in given:
                issues.append(
                    (
                        "local_mount_path",
                        f"needs {names['nfs']} or {names['persistent_volume_claim']} (the storage it sees)",
                    )
                )
            local = values.get("local_mount_path")
            if local is not None and not local.is_dir():
                issues.append(("local_mount_path", f"{local} is not a directory"))
            if "container_code_directory" in given:
                issues.append(
                    (
                        "container_code_directory",
                        f"the code is copied to {names['local_mount_path']}; give one of the two",
                    )
                )
        kubeconfig = values.get("kubeconfig")
        if kubeconfig is not None and not kubeconfig.is_file():
            issues.append(("kubeconfig", f"{kubeconfig} is not a file"))
        return issues


@dataclass(frozen=True, kw_only=True)
class KubernetesConfig(KubernetesPlatformConfig):
    """`platform: kubernetes`: each environment is a bare Pod or a batch Job."""

    PLATFORM: ClassVar[str] = "kubernetes"
    workload: Literal["pod", "job"] = "pod"


@dataclass(frozen=True, kw_only=True)
class KubeflowConfig(KubernetesPlatformConfig):
    """`platform: kubeflow`: each environment is a PyTorchJob (its Master) or a TFJob (a Worker)."""

    PLATFORM: ClassVar[str] = "kubeflow"
    operator: Literal["pytorchjob", "tfjob"] = field(
        default="pytorchjob", metadata=rule("pytorchjob or tfjob", coerce=_operator)
    )
    api_version: str = field(default="v1", metadata=NON_EMPTY_STR)
    # One PyTorchJob per trial (a Master and a Worker per other node), not one per environment.
    job_per_trial: bool = False

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues = super()._finalize(values, given, names)
        if values.get("job_per_trial") and values.get("operator", "pytorchjob") != "pytorchjob":
            issues.append(("job_per_trial", f"takes operator pytorchjob, not {values.get('operator')}"))
        return issues


@dataclass(frozen=True, kw_only=True)
class FrameworkControllerConfig(KubernetesPlatformConfig):
    """`platform: frameworkcontroller`: each environment is a Framework with one task role."""

    PLATFORM: ClassVar[str] = "frameworkcontroller"
    task_role_name: str = field(default="agent", metadata=_FRAMEWORK_NAME)
    # One Framework per trial (its task role a task per node), not one per environment.
    job_per_trial: bool = False


@dataclass(frozen=True, kw_only=True)
class AdlCheckpoint:
    """A volume per environment for model checkpoints (`ADAPTDL_CHECKPOINT_PATH`)."""

    storage_class: str = field(metadata=NON_EMPTY_STR)
    storage_size: int = field(metadata=_K8S_SIZE)
    container_mount_path: str = field(default="/adaptdl/checkpoint", metadata=_ABSOLUTE_PATH)


@dataclass(frozen=True, kw_only=True)
class AdlConfig(KubernetesPlatformConfig):
    """`platform: adl`: each environment is an AdaptDLJob."""

    PLATFORM: ClassVar[str] = "adl"
    # Preemptible and rescalable by the AdaptDL scheduler.
    adaptive: bool = False
    checkpoint: AdlCheckpoint | None = None
    # ADAPTDL_TENSORBOARD_LOGDIR inside the pods.
    tensorboard_log_dir: str = field(default="/adaptdl/tensorboard", metadata=_ABSOLUTE_PATH)
