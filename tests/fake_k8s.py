"""A fake Kubernetes API server on 127.0.0.1 that really runs the containers as local processes.

It remains for one flavour only, FrameworkController, whose operator CI cannot build: no
registry serves its source (the Go module proxy answers 403 for its module). Where a binary
of it is given, test_kubernetes.py runs that flavour on the real cluster too. Plain
pods and Jobs, Kubeflow's PyTorchJob and TFJob and AdaptDL's jobs run on the real API
server and controller manager of tests/kube, with the real training operator and AdaptDL
scheduler (tests/kube/operators.py).

It speaks the REST endpoints the official client calls for what a Framework environment
uses: core/v1 pods, secrets and persistentvolumeclaims, and frameworkcontroller.microsoft.com
Frameworks: create (also as a dry run), get, list (with a label selector), replace (secrets) and delete.
Requests need the bearer token of the kubeconfig it writes.

Core objects are validated against the schema the client package ships (unknown fields
and wrong types are refused with a 422 Status, like a real server in strict mode); custom
resources are checked as their CRD checks them (a Framework's pod template is free-form JSON
there, as in FrameworkController's own CRD).

The one node has ``gpus`` GPUs and ``node_labels``: a pod asking for more
``nvidia.com/gpu`` than is free, or selecting other labels, stays Pending (Unschedulable)
until it fits. A pod "runs" as a subprocess: the container's command and args, its env (secretKeyRef
resolved from stored secrets), PATH led by this Python's bin directory (the "image" has
trialkeeper installed) and HOME in a sandbox of its own. Volumes: an NFS volume is the
local directory named by its path, a PVC a directory the fake keeps; a mount at another
path is applied by rewriting that prefix in command, args, env and workingDir. Phases
follow the process: Running, then Succeeded or Failed with the exit code. Deleting a pod
sends SIGTERM, waits out the grace period, then kills every process of the pod (found by
a marker in their environment, as a container's cgroup would hold them); the object goes
away once they are gone. The Framework controller creates the pod a real one would, takes
its status from it, and fails when its pod is deleted from under it.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psutil
from kube.podenv import path_rewriter

POD_MARKER = "FAKE_K8S_POD_UID"
MAX_GRACE_S = 5.0  # a fake need not wait 30 s for a pod that ignores SIGTERM
# An image whose name holds this cannot be pulled: its pod waits in ImagePullBackOff.
NO_SUCH_IMAGE = "no-such-image"

Obj = dict[str, Any]
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


class ApiError(Exception):
    """Answered to the client as a Status object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@dataclass(frozen=True)
class Resource:
    group: str  # "" for core
    version: str
    plural: str
    kind: str
    model: str | None = None  # the client's model that validates it (core kinds)
    check: Callable[[Obj], list[str]] | None = None  # what an operator needs (custom kinds)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


# FrameworkController's CRD: names of Frameworks and task roles (no '-', unlike Kubernetes').
_FRAMEWORK_NAME_RE = re.compile(r"[a-z0-9]{1,63}")


def _framework_check(obj: Obj) -> list[str]:
    errors: list[str] = []
    if not _FRAMEWORK_NAME_RE.fullmatch(str(obj.get("metadata", {}).get("name", ""))):
        errors.append(f"metadata.name: Invalid value: in body should match '^{_FRAMEWORK_NAME_RE.pattern}$'")
    roles = obj.get("spec", {}).get("taskRoles")
    if not isinstance(roles, list) or not roles:
        return [*errors, "spec.taskRoles: at least one task role is required"]
    for i, role in enumerate(roles):
        where = f"spec.taskRoles[{i}]"
        if not isinstance(role.get("name"), str) or not _FRAMEWORK_NAME_RE.fullmatch(role["name"]):
            errors.append(f"{where}.name: in body should match '^{_FRAMEWORK_NAME_RE.pattern}$'")
        if not isinstance(role.get("taskNumber"), int) or role["taskNumber"] < 1:
            errors.append(f"{where}.taskNumber: a positive integer is required")
        # Like the real CRD, which keeps the pod template as free-form JSON: a misspelt field
        # in it is not refused here (the service checks it first, by a dry run of the pod).
        if not isinstance(role.get("task", {}).get("pod"), dict):
            errors.append(f"{where}.task.pod: a pod template is required")
    return errors


RESOURCES = [
    Resource("", "v1", "pods", "Pod", model="V1Pod"),
    Resource("", "v1", "secrets", "Secret", model="V1Secret"),
    Resource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", model="V1PersistentVolumeClaim"),
    Resource("frameworkcontroller.microsoft.com", "v1", "frameworks", "Framework", check=_framework_check),
]
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}


def schema_errors(data: object, model_name: str) -> list[str]:
    """What the client's own model of ``model_name`` refuses in ``data`` (JSON field names)."""
    from kubernetes import client

    model = getattr(client, model_name)
    validate = getattr(model, "model_validate", None)
    if validate is None:  # clients before the pydantic models: required fields only
        try:
            client.ApiClient()._ApiClient__deserialize(data, model_name)  # type: ignore[attr-defined]
        except (ValueError, TypeError) as e:
            return [str(e)]
        return []
    import pydantic

    try:
        validate(data)
    except pydantic.ValidationError as e:
        return [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
    return []


def _meta_errors(obj: Obj) -> list[str]:
    meta = obj.get("metadata") or {}
    errors = []
    name = meta.get("name")
    if not isinstance(name, str) or len(name) > 253 or not _NAME_RE.fullmatch(name):
        errors.append(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 name is required")
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE_RE.fullmatch(value):
            errors.append(f"metadata.labels: Invalid value: {value!r}: not a valid label value")
        if len(key.rpartition("/")[2]) > 63:
            errors.append(f"metadata.labels: Invalid value: {key!r}: name part longer than 63")
    return errors


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, _, value = term.partition("!=")
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, _, value = term.replace("==", "=").partition("=")
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class _PodRun:
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    unschedulable: str = ""  # why the scheduler has not placed it (yet)
    deleting: threading.Thread | None = None
    error: str = ""
    reason: str = ""


@dataclass
class _Store:
    objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)  # (plural, ns, name)
    runs: dict[str, _PodRun] = field(default_factory=dict)  # pod uid -> process
    seen: set[str] = field(default_factory=set)  # controllers whose pod ran
    done: set[str] = field(default_factory=set)  # controllers in a final state


class FakeKubernetes:
    """The server: ``start()`` it, ``stop()`` it (which kills every pod), or use ``running()``."""

    def __init__(self, root: Path, *, token: str | None = None, python: str = sys.executable,
                 gpus: int = 0, node_labels: dict[str, str] | None = None) -> None:
        self.root = root
        # The one node: what it offers the scheduler.
        self.gpus = gpus
        self.node_labels = {"kubernetes.io/hostname": "fake-node", "kubernetes.io/os": "linux", **(node_labels or {})}
        self.token = token or uuid.uuid4().hex
        self.python = python
        self.requests: Counter[str] = Counter()  # "VERB plural" -> count, for tests and measurements
        self.history: list[Obj] = []  # every object as stored at creation, deleted ones included
        self._store = _Store()
        self._lock = threading.RLock()
        self._versions = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fake = self

        class Handler(_Handler):
            server_fake = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-k8s", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            uids = list(self._store.runs)
        for uid in uids:
            self._kill_pod(uid, grace_s=0.0)

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def write_kubeconfig(self, path: Path, *, namespace: str = "default") -> Path:
        """A kubeconfig for this server (plain HTTP, bearer token), mode 0600."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)  # JSON is YAML
        return path

    # ---- what tests look at ---------------------------------------------------------

    def objects(self, plural: str | None = None, namespace: str | None = None) -> list[Obj]:
        """Deep copies of the stored objects (status brought up to date)."""
        with self._lock:
            self._reconcile()
            return [
                copy.deepcopy(o)
                for (p, ns, _), o in sorted(self._store.objects.items())
                if (plural is None or p == plural) and (namespace is None or ns == namespace)
            ]

    def pod_pids(self, namespace: str, name: str) -> list[int]:
        """Every live process of a pod (its main process and what that started)."""
        with self._lock:
            pod = self._store.objects.get(("pods", namespace, name))
            uid = pod["metadata"]["uid"] if pod else None
        return _pod_processes(uid) if uid else []

    def delete_pod(self, namespace: str, name: str, grace_s: float = 0.0) -> None:
        """What `kubectl delete pod --grace-period=N` does, from outside the client."""
        with self._lock:
            self._delete(_BY_PATH[("", "v1", "pods")], namespace, name, grace_s, "Background")

    # ---- the API --------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Obj | None) -> tuple[int, Obj]:
        res, ns, name = self._route(path)
        self.requests[f"{method} {res.plural}"] += 1
        with self._lock:
            self._reconcile()
            if method == "POST" and name is None:
                assert body is not None
                if query.get("dryRun"):  # checked, not stored
                    self._validate(res, body)
                    return 201, copy.deepcopy(body)
                return 201, self._create(res, ns, body)
            if method == "GET" and name is None:
                selector = query.get("labelSelector", [""])[0]
                items = [
                    copy.deepcopy(o) for (p, n, _), o in sorted(self._store.objects.items())
                    if p == res.plural and n == ns and _matches(o["metadata"].get("labels") or {}, selector)
                ]
                return 200, {"kind": f"{res.kind}List", "apiVersion": res.api_version,
                             "metadata": {"resourceVersion": str(next(self._versions))}, "items": items}
            if name is None:
                raise ApiError(405, "MethodNotAllowed", f"{method} on a collection is not supported")
            if method == "GET":
                return 200, copy.deepcopy(self._get(res, ns, name))
            if method == "PUT" and res.plural == "secrets":
                assert body is not None
                return 200, self._replace(res, ns, name, body)
            if method == "DELETE":
                options = body or {}
                grace = options.get("gracePeriodSeconds")
                if grace is None:
                    grace = query.get("gracePeriodSeconds", [None])[0]
                policy = options.get("propagationPolicy") or query.get("propagationPolicy", ["Background"])[0]
                return 200, self._delete(res, ns, name, None if grace is None else float(grace), policy)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    def _route(self, path: str) -> tuple[Resource, str, str | None]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        if len(rest) not in (3, 4) or rest[0] != "namespaces":
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        res = _BY_PATH.get((group, version, rest[2]))
        if res is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        return res, rest[1], rest[3] if len(rest) == 4 else None

    def _get(self, res: Resource, ns: str, name: str) -> Obj:
        obj = self._store.objects.get((res.plural, ns, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
        return obj

    def _validate(self, res: Resource, body: Obj) -> None:
        errors = _meta_errors(body)
        if body.get("kind", res.kind) != res.kind or body.get("apiVersion", res.api_version) != res.api_version:
            errors.append(f"kind/apiVersion: expected {res.kind} {res.api_version}")
        if res.model is not None:
            errors += schema_errors(body, res.model)
        else:
            meta_only = {k: v for k, v in body.items() if k in ("apiVersion", "kind", "metadata")}
            errors += schema_errors(meta_only, "V1Pod")
        if res.check is not None:
            errors += res.check(body)
        if res.plural == "pods":
            spec = body.get("spec", {})
            if not spec.get("containers"):
                errors.append("spec.containers: Required value")
            if spec.get("restartPolicy", "Always") not in ("Always", "OnFailure", "Never"):
                errors.append("spec.restartPolicy: Unsupported value")
        if errors:
            name = (body.get("metadata") or {}).get("name", "")
            raise ApiError(422, "Invalid", f'{res.kind} "{name}" is invalid: ' + "; ".join(errors))

    def _create(self, res: Resource, ns: str, body: Obj, *, owner: Obj | None = None) -> Obj:
        self._validate(res, body)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        key = (res.plural, ns, meta["name"])
        if key in self._store.objects:
            raise ApiError(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        meta.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=str(next(self._versions)),
                    creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if owner is not None:
            meta["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                        "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
                                        "controller": True}]
        if res.plural == "secrets":
            data = obj.setdefault("data", {})
            for k, v in (obj.pop("stringData", None) or {}).items():
                data[k] = base64.b64encode(v.encode()).decode()
            obj.setdefault("type", "Opaque")
        elif res.plural == "persistentvolumeclaims":
            obj["status"] = {"phase": "Bound"}
        elif res.plural == "pods":
            obj["status"] = {"phase": "Pending"}
        else:
            obj["status"] = {}
        self._store.objects[key] = obj
        self.history.append(copy.deepcopy(obj))
        if res.plural == "pods":
            self._run_pod(obj)
        elif res.plural == "frameworks":
            self._create_controlled_pod(res, obj)
        return copy.deepcopy(obj)

    def _replace(self, res: Resource, ns: str, name: str, body: Obj) -> Obj:
        old = self._get(res, ns, name)
        del self._store.objects[(res.plural, ns, name)]
        try:
            return self._create(res, ns, body)
        except ApiError:
            self._store.objects[(res.plural, ns, name)] = old
            raise

    def _delete(self, res: Resource, ns: str, name: str, grace: float | None, policy: str) -> Obj:
        obj = self._get(res, ns, name)
        uid = obj["metadata"]["uid"]
        if res.plural == "pods":
            if "deletionTimestamp" not in obj["metadata"]:
                obj["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                if grace is None:
                    grace = float(obj.get("spec", {}).get("terminationGracePeriodSeconds", 30))
                run = self._store.runs.setdefault(uid, _PodRun())
                run.deleting = threading.Thread(target=self._terminate_pod, args=(ns, name, uid, grace), daemon=True)
                run.deleting.start()
            return copy.deepcopy(obj)
        del self._store.objects[(res.plural, ns, name)]
        if policy != "Orphan":
            for (p, n, child), o in list(self._store.objects.items()):
                owners = o["metadata"].get("ownerReferences") or []
                if n == ns and any(ref.get("uid") == uid for ref in owners):
                    self._delete(_BY_PATH[("", "v1", p)], ns, child, grace, policy)
        if res.plural == "persistentvolumeclaims":  # what the client expects back, by kind
            return copy.deepcopy(obj)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Success",
            "details": {"name": name, "kind": res.plural, "uid": uid},
        }

    # ---- pods as processes --------------------------------------------------------

    def _run_pod(self, pod: Obj) -> None:
        """Schedule the pod on the one node, then start its container (now, or once it fits)."""
        run = self._store.runs.setdefault(pod["metadata"]["uid"], _PodRun())
        why = self._unschedulable(pod)
        if why:
            run.unschedulable = why
            return
        run.unschedulable = ""
        self._start_container(pod, run)

    def _unschedulable(self, pod: Obj) -> str:
        spec = pod["spec"]
        wanted = spec.get("nodeSelector") or {}
        if any(self.node_labels.get(k) != v for k, v in wanted.items()):
            return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
        busy = sum(
            _gpus(o) for (p, _, _), o in self._store.objects.items()
            if p == "pods" and o is not pod and o["status"].get("phase") in ("Pending", "Running")
            and not self._store.runs.get(o["metadata"]["uid"], _PodRun()).unschedulable
        )
        if _gpus(pod) > self.gpus - busy:
            return "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
        return ""

    def _start_container(self, pod: Obj, run: _PodRun) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        sandbox = self.root / "pods" / f"{meta['namespace']}-{meta['name']}-{uid[:8]}"
        sandbox.mkdir(parents=True, exist_ok=True)
        try:
            container = spec["containers"][0]
            image = container.get("image", "")
            if NO_SUCH_IMAGE in image:  # as a kubelet: the pull fails, and it backs off and retries
                run.error, run.reason = f'Back-off pulling image "{image}"', "ImagePullBackOff"
                return
            mounts = self._mounts(meta["namespace"], spec, container)
            rewrite = path_rewriter(mounts)
            argv = [rewrite(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
            if not argv:
                raise ApiError(422, "Invalid", "the fake runs only containers with a command")
            env = {
                "PATH": f"{Path(self.python).parent}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin",
                "HOME": str(sandbox),
                "HOSTNAME": meta["name"],
                POD_MARKER: uid,
            }
            for var in container.get("env") or []:
                env[var["name"]] = rewrite(self._env_value(meta["namespace"], var))
            cwd = rewrite(container["workingDir"]) if container.get("workingDir") else str(sandbox)
            with open(sandbox / "container.log", "ab") as log:
                run.proc = subprocess.Popen(
                    argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            run.started_at = time.time()
        except ApiError as e:  # as a kubelet: the pod waits, saying why
            run.error, run.reason = e.message, "CreateContainerConfigError"
        except (OSError, KeyError) as e:  # the command cannot be started: the container fails
            run.error, run.reason = f"{type(e).__name__}: {e}", "StartError"

    def _env_value(self, ns: str, var: Obj) -> str:
        if "value" in var:
            return str(var["value"])
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            raise ApiError(422, "Invalid", f"env {var['name']}: the fake resolves only values and secretKeyRef")
        secret = self._store.objects.get(("secrets", ns, ref["name"]))
        if secret is None or ref["key"] not in secret.get("data", {}):
            raise ApiError(422, "Invalid", f"env {var['name']}: secret {ref['name']}/{ref['key']} not found")
        return base64.b64decode(secret["data"][ref["key"]]).decode()

    def _mounts(self, ns: str, spec: Obj, container: Obj) -> dict[str, str]:
        """mountPath -> the local directory standing for that volume."""
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        out = {}
        for m in container.get("volumeMounts") or []:
            v = volumes.get(m["name"])
            if v is None:
                raise ApiError(422, "Invalid", f"volumeMount {m['name']}: no such volume")
            if "nfs" in v:
                local = Path(v["nfs"]["path"])
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                if ("persistentvolumeclaims", ns, claim) not in self._store.objects:
                    raise ApiError(422, "Invalid", f"persistentvolumeclaim {claim!r} not found")
                local = self.root / "volumes" / ns / claim
            else:
                raise ApiError(
                    422, "Invalid", f"volume {m['name']}: the fake mounts only nfs and persistentVolumeClaim"
                )
            if m.get("subPath"):
                local = local / m["subPath"]
            local.mkdir(parents=True, exist_ok=True)
            out[m["mountPath"].rstrip("/") or "/"] = str(local)
        return out

    def _terminate_pod(self, ns: str, name: str, uid: str, grace: float) -> None:
        self._kill_pod(uid, grace_s=min(grace, MAX_GRACE_S))
        with self._lock:
            obj = self._store.objects.get(("pods", ns, name))
            if obj is not None and obj["metadata"]["uid"] == uid:
                del self._store.objects[("pods", ns, name)]
            self._store.runs.pop(uid, None)

    def _kill_pod(self, uid: str, grace_s: float) -> None:
        run = self._store.runs.get(uid)
        proc = run.proc if run else None
        if proc is not None and proc.poll() is None and grace_s > 0:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        procs = _pod_processes(uid)
        for pid in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        psutil.wait_procs([p for p in (_proc(pid) for pid in procs) if p is not None], timeout=10)

    # ---- status: pods from their processes, controllers from their pods -----------

    def _reconcile(self) -> None:
        for (plural, _, _), obj in list(self._store.objects.items()):
            if plural == "pods":
                self._pod_status(obj)
        for (plural, ns, _), obj in list(self._store.objects.items()):
            if plural not in ("pods", "secrets", "persistentvolumeclaims"):
                self._controller_status(plural, ns, obj)

    def _pod_status(self, pod: Obj) -> None:
        run = self._store.runs.get(pod["metadata"]["uid"])
        status = pod["status"]
        if run is None or status.get("phase") in ("Succeeded", "Failed"):
            return
        if run.unschedulable and "deletionTimestamp" not in pod["metadata"]:
            self._run_pod(pod)  # the scheduler tries again
            if run.unschedulable:
                status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": run.unschedulable}]
                return
        if run.reason == "StartError":
            ended = {"terminated": {"exitCode": 128, "reason": run.reason, "message": run.error}}
            status.update(phase="Failed", containerStatuses=[_container_status(pod, False, ended)])
            return
        if run.error:
            waiting = {"waiting": {"reason": run.reason, "message": run.error}}
            status.update(phase="Pending", containerStatuses=[_container_status(pod, False, waiting)])
            return
        if run.proc is None:
            return
        code = run.proc.poll()
        if code is None:
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(run.started_at))
            status.update(phase="Running", startTime=started, conditions=[{"type": "PodScheduled", "status": "True"}],
                          containerStatuses=[_container_status(pod, True, {"running": {"startedAt": started}})])
            return
        reason = "Completed" if code == 0 else "Error"
        exit_code = code if code >= 0 else 128 - code  # killed by a signal: 128 + its number
        status.update(
            phase="Succeeded" if code == 0 else "Failed",
            containerStatuses=[
                _container_status(pod, False, {"terminated": {"exitCode": exit_code, "reason": reason}})
            ],
        )

    def _children(self, ns: str, owner: Obj) -> list[Obj]:
        uid = owner["metadata"]["uid"]
        return [
            o
            for (p, n, _), o in self._store.objects.items()
            if p == "pods" and n == ns and any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
        ]

    def _controller_status(self, plural: str, ns: str, obj: Obj) -> None:
        # The controller's own memory: whether its pod was ever seen, whether it is done.
        uid = obj["metadata"]["uid"]
        if uid in self._store.done:
            return
        pods = self._children(ns, obj)
        # A task failing or deleted ends the Framework; it succeeds once every task has.
        phases = {"Deleted" if "deletionTimestamp" in p["metadata"] else p["status"].get("phase", "Pending")
                  for p in pods}
        phase = next((p for p in ("Failed", "Deleted") if p in phases), "")
        if not phase:
            phase = "Succeeded" if phases == {"Succeeded"} else "Running" if "Running" in phases else "Pending"
        if phase == "Deleted" or not pods:
            phase = "Deleted" if uid in self._store.seen else "Pending"
        if phase in ("Running", "Succeeded", "Failed", "Deleted"):
            self._store.seen.add(uid)
        if phase in ("Succeeded", "Failed", "Deleted"):
            self._store.done.add(uid)
        _CONTROLLER_STATUS[plural](obj["status"], phase)

    def _create_controlled_pod(self, res: Resource, obj: Obj) -> None:
        name, spec = obj["metadata"]["name"], obj["spec"]
        role = spec["taskRoles"][0]  # the one kind with a controller here: a Framework
        template = role["task"]["pod"]
        for index in range(role["taskNumber"]):  # a pod per task, told its index as the controller does
            meta = copy.deepcopy(template.get("metadata") or {})
            meta["name"] = f"{name}-{role['name']}-{index}"
            meta.setdefault("labels", {})["controller-uid"] = obj["metadata"]["uid"]
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": copy.deepcopy(template["spec"])}
            pod["spec"].setdefault("restartPolicy", "Never")
            told = [{"name": "FC_FRAMEWORK_NAME", "value": name}, {"name": "FC_TASKROLE_NAME", "value": role["name"]},
                    {"name": "FC_TASK_INDEX", "value": str(index)}]
            for container in pod["spec"]["containers"]:
                container["env"] = [*(container.get("env") or []), *told]
            self._create(_BY_PATH[("", "v1", "pods")], obj["metadata"]["namespace"], pod, owner=obj)


def _gpus(pod: Obj) -> int:
    total = 0
    for c in pod["spec"].get("containers", []):
        resources = c.get("resources") or {}
        amount = (resources.get("limits") or {}).get("nvidia.com/gpu") or (resources.get("requests") or {}).get(
            "nvidia.com/gpu"
        )
        total += int(amount or 0)
    return total


def _container_status(pod: Obj, ready: bool, state: Obj) -> Obj:
    container = pod["spec"]["containers"][0]
    return {"name": container["name"], "image": container.get("image", ""), "imageID": "", "restartCount": 0,
            "ready": ready, "state": state}


def _framework_status(status: Obj, phase: str) -> None:
    if phase in ("Pending", "Running"):
        status["state"] = "AttemptRunning" if phase == "Running" else "AttemptCreationPending"
        return
    name = "Succeeded" if phase == "Succeeded" else "Failed"
    diagnostics = "the pod was deleted" if phase == "Deleted" else f"task {name.lower()}"
    status.update(
        state="Completed", attemptStatus={"completionStatus": {"type": {"name": name}, "diagnostics": diagnostics}}
    )


_CONTROLLER_STATUS: dict[str, Callable[[Obj, str], None]] = {"frameworks": _framework_status}


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _pod_processes(uid: str) -> list[int]:
    """Live processes carrying the pod's marker: its "cgroup"."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(POD_MARKER) == uid:
                out.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return out


class _Handler(BaseHTTPRequestHandler):
    server_fake: FakeKubernetes
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _any(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            if self.headers.get("Authorization") != f"Bearer {self.server_fake.token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            body = json.loads(raw) if raw else None
            if body is not None and not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body must be a JSON object")
            code, answer = self.server_fake.handle(self.command, url.path, parse_qs(url.query), body)
        except ApiError as e:
            code, answer = (
                e.code,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": e.message,
                    "reason": e.reason,
                    "code": e.code,
                },
            )
        except json.JSONDecodeError as e:
            code, answer = (
                400,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": f"invalid JSON: {e}",
                    "reason": "BadRequest",
                    "code": 400,
                },
            )
        data = json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any


@contextlib.contextmanager
def running(root: Path) -> Iterator[FakeKubernetes]:
    """A started fake for ``with`` blocks; on exit every pod it runs is killed."""
    fake = FakeKubernetes(root)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def section(fake: FakeKubernetes, platform: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A `trainingService` section for ``platform`` on this fake, as a user writes it.

    The NFS export is a directory under ``tmp_path``, mounted in the pods at its own path
    and seen at the same path here (``localMountPath``), so the trial code is copied there.
    """
    share = tmp_path / "k8s-share"
    share.mkdir(parents=True, exist_ok=True)
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    out: dict[str, Any] = {
        "platform": platform,
        "image": "registry.example/trialkeeper:test",
        "kubeconfig": str(kubeconfig),
        "nfs": {"server": "127.0.0.1", "path": str(share)},
        "containerMountPath": str(share),
        "localMountPath": str(share),
        "cpuNumber": 1,
        "memorySize": "512Mi",
    }
    if platform == "adl":
        out["checkpoint"] = {"storageClass": "standard", "storageSize": "1Gi"}
    out.update(extra)
    return out
