"""The Kubernetes objects of an environment, as plain JSON, and what their status says.

Pure functions, no API calls: the service in ``kubernetes`` builds the bodies with these,
sends them through the official client, and reads the answers back with ``observe``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trialkeeper.protos.wire import TOKEN_ENV

from ..base import EnvironmentRequest, ObservedState
from .config import AdlConfig, FrameworkControllerConfig, KubeflowConfig, KubernetesConfig

if TYPE_CHECKING:
    from .config import KubernetesPlatformConfig

LABEL_EXPERIMENT = "trialkeeper/experiment"
LABEL_ENVIRONMENT = "trialkeeper/environment"
# Label values are limited to 63 plain characters; the exact ids are kept here as well.
ANNOTATION_EXPERIMENT = "trialkeeper/experiment-id"
ANNOTATION_ENVIRONMENT = "trialkeeper/environment-id"
TOKEN_KEY = "token"
VOLUME = "trialkeeper-storage"
CHECKPOINT_VOLUME = "adaptdl-checkpoint"


# ---- what the objects look like ----------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """An API resource: core/batch ones through their typed APIs, the rest as custom objects."""

    group: str
    version: str
    plural: str
    kind: str
    container: str = "agent"  # the name the operator expects for the main container
    # Whether the server checks the pod template inside the object against the pod schema.
    # AdaptDL's and FrameworkController's CRDs keep the template as free-form JSON: a misspelt
    # field there would be dropped without a word when the operator creates the pod, so it is
    # checked first.
    checks_template: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def custom(self) -> bool:
        return self.group not in ("", "batch")


POD = Kind("", "v1", "pods", "Pod")
SECRET = Kind("", "v1", "secrets", "Secret")
PVC = Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim")
JOB = Kind("batch", "v1", "jobs", "Job")


def kind_of(config: KubernetesPlatformConfig) -> Kind:
    """The object that wraps each environment's pod on this platform."""
    if isinstance(config, KubeflowConfig):
        if config.operator == "tfjob":
            return Kind("kubeflow.org", config.api_version, "tfjobs", "TFJob", "tensorflow")
        return Kind("kubeflow.org", config.api_version, "pytorchjobs", "PyTorchJob", "pytorch")
    if isinstance(config, FrameworkControllerConfig):
        return Kind("frameworkcontroller.microsoft.com", "v1", "frameworks", "Framework", checks_template=False)
    if isinstance(config, AdlConfig):
        return Kind("adaptdl.petuum.com", "v1", "adaptdljobs", "AdaptDLJob", "main", checks_template=False)
    if isinstance(config, KubernetesConfig) and config.workload == "job":
        return JOB
    return POD


def _dns_name(text: str, limit: int) -> str:
    """``text`` as a lowercase RFC 1123 name of at most ``limit`` characters (hashed if cut)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower())
    name = re.sub(r"-{2,}", "-", name).strip("-") or "x"
    if len(name) > limit or name != text.lower():
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        name = f"{name[: limit - 9].rstrip('-')}-{digest}"
    return name


def _label_value(text: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", text):
        return text
    return _dns_name(text, 63)


def _plain_name(text: str, limit: int) -> str:
    """``text`` as lowercase letters and digits only, FrameworkController's form for the names
    of Frameworks and task roles (``^[a-z0-9]{1,63}$`` in its CRD); hashed if anything but
    dashes was dropped or it was cut."""
    kept = text.lower().replace("-", "")
    name = re.sub(r"[^a-z0-9]+", "", kept) or "x"
    if len(name) > limit or name != kept:
        name = name[: limit - 8] + hashlib.sha256(text.encode()).hexdigest()[:8]
    return name


def object_name(experiment_id: str, env_id: str, kind: Kind | None = None) -> str:
    # Short enough for what controllers append (-worker-0, -ckpt, a Job's pod suffix).
    if kind is not None and kind.plural == "frameworks":
        return _plain_name(f"tk{experiment_id}{env_id}", 50)
    return _dns_name(f"tk-{experiment_id}-{env_id}", 50)


def secret_name(experiment_id: str) -> str:
    return _dns_name(f"tk-{experiment_id}-token", 63)


def checkpoint_claim_name(object_name: str) -> str:
    return f"{object_name}-ckpt"


def selector(experiment_id: str, env_id: str | None = None) -> str:
    text = f"{LABEL_EXPERIMENT}={_label_value(experiment_id)}"
    return text if env_id is None else f"{text},{LABEL_ENVIRONMENT}={_label_value(env_id)}"


def _metadata(name: str, experiment_id: str, env_id: str | None) -> dict[str, Any]:
    labels = {LABEL_EXPERIMENT: _label_value(experiment_id)}
    annotations = {ANNOTATION_EXPERIMENT: experiment_id}
    if env_id is not None:
        labels[LABEL_ENVIRONMENT] = _label_value(env_id)
        annotations[ANNOTATION_ENVIRONMENT] = env_id
    meta: dict[str, Any] = {"labels": labels, "annotations": annotations}
    if name:
        meta["name"] = name
    return meta


def ids_of(obj: dict[str, Any]) -> tuple[str | None, str | None]:
    """(experiment id, environment id) of an object this service created."""
    meta = obj.get("metadata") or {}
    notes, labels = meta.get("annotations") or {}, meta.get("labels") or {}
    return (notes.get(ANNOTATION_EXPERIMENT) or labels.get(LABEL_EXPERIMENT),
            notes.get(ANNOTATION_ENVIRONMENT) or labels.get(LABEL_ENVIRONMENT))


def token_secret(config: KubernetesPlatformConfig, request: EnvironmentRequest) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _metadata(secret_name(request.experiment_id), request.experiment_id, None),
        "stringData": {TOKEN_KEY: request.token},
    }


def checkpoint_claim(config: AdlConfig, request: EnvironmentRequest, name: str) -> dict[str, Any]:
    assert config.checkpoint is not None
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": _metadata(checkpoint_claim_name(name), request.experiment_id, request.env_id),
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": config.checkpoint.storage_class,
            "resources": {"requests": {"storage": str(config.checkpoint.storage_size)}},
        },
    }


def _resources(config: KubernetesPlatformConfig) -> dict[str, Any]:
    amounts: dict[str, str] = {}
    if config.cpu_number is not None:
        amounts["cpu"] = f"{config.cpu_number:g}"
    if config.memory_size is not None:
        amounts["memory"] = str(config.memory_size)
    if config.gpu_number:
        amounts["nvidia.com/gpu"] = str(config.gpu_number)
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _pod_spec(config: KubernetesPlatformConfig, request: EnvironmentRequest, name: str,
              argv: list[str], container: str) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {
            "name": TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": secret_name(request.experiment_id), "key": TOKEN_KEY}},
        },
    ]
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if config.nfs is not None:
        volumes.append({"name": VOLUME, "nfs": {"server": config.nfs.server, "path": config.nfs.path}})
    elif config.persistent_volume_claim is not None:
        volumes.append({"name": VOLUME, "persistentVolumeClaim": {"claimName": config.persistent_volume_claim}})
    if volumes:
        mounts.append({"name": VOLUME, "mountPath": config.container_mount_path})
    if isinstance(config, AdlConfig):
        env.append({"name": "ADAPTDL_TENSORBOARD_LOGDIR", "value": config.tensorboard_log_dir})
        if config.checkpoint is not None:
            path = config.checkpoint.container_mount_path
            volumes.append(
                {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": checkpoint_claim_name(name)}}
            )
            mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": path})
            env.append({"name": "ADAPTDL_CHECKPOINT_PATH", "value": path})
    main: dict[str, Any] = {"name": container, "image": config.image, "command": argv[:3], "args": argv[3:], "env": env}
    if mounts:
        main["volumeMounts"] = mounts
    resources = _resources(config)
    if resources:
        main["resources"] = resources
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [main]}
    if volumes:
        spec["volumes"] = volumes
    if config.service_account_name:
        spec["serviceAccountName"] = config.service_account_name
    if config.node_selector:
        spec["nodeSelector"] = dict(config.node_selector)
    if config.tolerations:
        spec["tolerations"] = [dict(t) for t in config.tolerations]
    if config.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in config.image_pull_secrets]
    return spec


def workload(kind: Kind, config: KubernetesPlatformConfig, request: EnvironmentRequest, name: str,
             argv: list[str]) -> dict[str, Any]:
    """The object that runs one environment's agent."""
    meta = _metadata(name, request.experiment_id, request.env_id)
    template = {"metadata": _metadata("", request.experiment_id, request.env_id),
                "spec": _pod_spec(config, request, name, argv, kind.container)}
    head = {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": meta}
    if kind is POD:
        return {**head, "spec": template["spec"]}
    if kind is JOB:
        return {**head, "spec": {"backoffLimit": 0, "template": template}}
    if kind.plural in ("pytorchjobs", "tfjobs"):
        role, key = ("Master", "pytorchReplicaSpecs") if kind.plural == "pytorchjobs" else ("Worker", "tfReplicaSpecs")
        return {**head, "spec": {key: {role: {"replicas": 1, "restartPolicy": "Never", "template": template}}}}
    if kind.plural == "frameworks":
        assert isinstance(config, FrameworkControllerConfig)
        never = {"fancyRetryPolicy": False, "maxRetryCount": 0}
        task_role = {
            "name": config.task_role_name, "taskNumber": 1,
            "frameworkAttemptCompletionPolicy": {"minFailedTaskCount": 1, "minSucceededTaskCount": 1},
            "task": {"retryPolicy": never, "pod": template},
        }
        return {**head, "spec": {"executionType": "Start", "retryPolicy": never, "taskRoles": [task_role]}}
    assert isinstance(config, AdlConfig)
    return {**head, "spec": {"preemptible": config.adaptive, "minReplicas": 1, "maxReplicas": 1, "template": template}}


def template_pod(body: dict[str, Any]) -> dict[str, Any]:
    """The pod an AdaptDLJob's template or a Framework's (first) task role makes, for the server
    to check (a dry run)."""
    spec = body["spec"]
    template = spec["taskRoles"][0]["task"]["pod"] if "taskRoles" in spec else spec["template"]
    meta = {**template.get("metadata", {}), "name": body["metadata"]["name"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


# ---- what the platform says ------------------------------------------------------------

_JOB_ENDED: dict[str, ObservedState] = {"Complete": "exited", "SuccessCriteriaMet": "exited",
                                        "Failed": "failed", "FailureTarget": "failed"}


def observe(kind: Kind, obj: dict[str, Any]) -> tuple[ObservedState, str]:
    """The state of one environment from its object's status."""
    status = obj.get("status") or {}
    if kind is POD:
        return pod_state(status)
    if kind is JOB:
        # The Job controller says FailureTarget/SuccessCriteriaMet as soon as it decides, and
        # Failed/Complete only once the pod is gone; ``active`` counts pods that are still
        # pulling their image, ``ready`` only those whose container runs.
        for c in status.get("conditions") or []:
            if c.get("status") == "True" and c.get("type") in _JOB_ENDED:
                return _JOB_ENDED[c["type"]], c.get("message") or c.get("reason") or c["type"]
        return ("running" if status.get("ready") else "starting"), ""
    if kind.plural in ("pytorchjobs", "tfjobs"):
        true = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
        last = true[-1] if true else {}
        mapping: dict[str, ObservedState] = {"Succeeded": "exited", "Failed": "failed", "Running": "running"}
        return mapping.get(last.get("type", ""), "starting"), last.get("message", "")
    if kind.plural == "frameworks":
        if status.get("state") == "Completed":
            completion = (status.get("attemptStatus") or {}).get("completionStatus") or {}
            ok = (completion.get("type") or {}).get("name") == "Succeeded"
            return ("exited" if ok else "failed"), completion.get("diagnostics", "")
        return ("running" if status.get("state") == "AttemptRunning" else "starting"), ""
    phases: dict[str, ObservedState] = {"Succeeded": "exited", "Failed": "failed", "Running": "running"}
    phase = status.get("phase", "Pending")
    if phase == "Pending" and not status.get("allocation"):
        # AdaptDL's allocator creates no pod until a node has room: nothing else says so.
        return "starting", "waiting for AdaptDL's scheduler to place it on a node"
    detail = ": ".join(str(status[k]) for k in ("reason", "message") if status.get(k))
    return phases.get(phase, "starting"), detail


# A container waiting for one of these will not start without someone changing something.
_HOPELESS = frozenset({"InvalidImageName", "CreateContainerConfigError", "CreateContainerError"})
# One waiting for these may yet start (a registry that was down); after imagePullTimeout, not.
_PULL_FAILING = frozenset({"ImagePullBackOff", "ErrImagePull"})


def pull_failure(pod: dict[str, Any]) -> str:
    """Why a pod cannot pull its image ("" when it is not stuck on that)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _PULL_FAILING:
            return f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return ""


def pod_state(status: dict[str, Any]) -> tuple[ObservedState, str]:
    phase = status.get("phase", "Pending")
    if phase == "Running":
        return "running", ""
    statuses = status.get("containerStatuses") or []
    if phase in ("Succeeded", "Failed"):
        detail = status.get("message") or status.get("reason") or ""
        for cs in statuses:
            ended = (cs.get("state") or {}).get("terminated")
            if ended:
                why = ", ".join(w for w in (ended.get("reason"), ended.get("message")) if w)
                detail = f"container {cs.get('name')} exited with status {ended.get('exitCode')} ({why})"
        return ("exited" if phase == "Succeeded" else "failed"), detail
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _HOPELESS:
            return "failed", f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')}"
    pending = [
        c.get("message") or c.get("reason") for c in status.get("conditions") or [] if c.get("status") == "False"
    ]
    pending += [(cs.get("state") or {}).get("waiting", {}).get("reason") for cs in statuses]
    return "starting", "; ".join(p for p in pending if p)
