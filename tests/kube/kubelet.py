"""A node of our own: a kubelet stand-in that runs the pods of a real API server as local processes.

There is no kube-scheduler and no container runtime here. The stand-in registers one Node
(CPUs, memory and ``nvidia.com/gpu`` of its own), watches every pod, binds the ones that
fit to itself through the ``binding`` subresource (a pod that does not fit gets the
scheduler's ``Unschedulable`` condition instead), and runs each container of a bound pod as
a local process: its command and args, its env, workingDir and volumes, as far as a local
process can have them (see ``podenv``). The "image" is this interpreter's environment:
PATH is led by its bin folder. An image whose name contains one of ``unpullable`` cannot be
pulled: its container waits in ErrImagePull, then ImagePullBackOff, like a real kubelet's.

Status goes through the ``status`` subresource: phases, container states with exit codes, and
restarts per the pod's restartPolicy. Deleting a pod sends SIGTERM to its processes, SIGKILL
once its grace period is over, reports the pod terminal and then deletes it with
gracePeriodSeconds=0. Every process of a container carries a marker in its environment (as a
cgroup would hold them), so the trials an agent starts in sessions of their own go with it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import queue
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kube.podenv import PodView, Waiting, expander, path_rewriter

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MARKER = "TRIALKEEPER_STAND_IN_CONTAINER"  # "<pod uid>/<container>" in each process's environment
NO_SUCH_IMAGE = "no-such-image"
TICK_S = 0.1  # how often processes are checked between watch events
_UNITS = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str | float) -> float:
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    if match is None:
        raise ValueError(f"not a quantity: {text!r}")
    return float(match.group(1)) * _UNITS.get(match.group(2), 1.0)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Container:
    name: str
    proc: subprocess.Popen[bytes] | None = None
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    restarts: int = 0
    pulls: int = 0  # failed pulls so far
    retry_at: float = 0.0  # monotonic: a waiting container is tried again then, not at every tick


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    sandbox: Path
    started: str = field(default_factory=_now)
    containers: dict[str, _Container] = field(default_factory=dict)
    kill_at: float | None = None  # monotonic: SIGKILL then (the grace period's end)
    reported: Obj = field(default_factory=dict)
    deleted: bool = False  # the final delete was sent


class StandInKubelet:
    """One Node backed by local processes; ``start()`` registers it and runs until ``stop()``."""

    def __init__(self, cluster: Any, root: Path, *, name: str = "trialkeeper-node", cpus: int = 16,
                 memory: str = "64Gi", gpus: int = 4, labels: dict[str, str] | None = None,
                 python: str = sys.executable, unpullable: tuple[str, ...] = (NO_SUCH_IMAGE,),
                 scheduler_names: tuple[str, ...] = ("default-scheduler",)) -> None:
        self.cluster = cluster  # scripts/kube_env.py's ControlPlane: url, token, ca_file, request()
        self.root = root
        self.name = name
        self.capacity = {"cpu": str(cpus), "memory": memory, "nvidia.com/gpu": str(gpus), "pods": "110"}
        self.labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", **(labels or {})}
        self.python = python
        self.unpullable = unpullable
        self.scheduler_names = scheduler_names
        self._events: queue.Queue[tuple[str, Obj]] = queue.Queue()
        self._pods: dict[str, Obj] = {}  # uid -> the latest object seen
        self._runs: dict[str, _Pod] = {}  # uid -> what runs here
        self._bound: dict[str, Obj] = {}  # uid -> pods bound here that the watch has not shown bound yet
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None
        self._view = PodView(cluster, name, root / "claims")

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": self.labels}}
        status, answer = self.cluster.request("POST", "/api/v1/nodes", node)
        if status not in (201, 409):
            raise RuntimeError(f"could not register node {self.name}: {status} {answer.get('message')}")
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "stand-in kubelet is ready",
                 "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}
        self._call("PATCH", f"/api/v1/nodes/{self.name}/status", {"status": {
            "capacity": self.capacity, "allocatable": self.capacity, "conditions": [ready],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}],
            "nodeInfo": {"kubeletVersion": "stand-in", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "local-process://1", "kernelVersion": "", "osImage": "",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""},
        }})
        # The API server taints a new Node not-ready; the node lifecycle controller (not run
        # here) lifts that once the node reports Ready, and schedulers that honour taints wait.
        status, answer = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        taints = (answer.get("spec") or {}).get("taints") or [] if status == 200 else []
        kept = [t for t in taints if t.get("key") != "node.kubernetes.io/not-ready"]
        if kept != taints:
            self._call("PATCH", f"/api/v1/nodes/{self.name}", {"spec": {"taints": kept or None}})
        threading.Thread(target=self._watch, name="kubelet-watch", daemon=True).start()
        self._worker = threading.Thread(target=self._work, name="kubelet-work", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        """Stop watching and kill every process still running here."""
        self._stopping.set()
        # The worker is joined; the watcher may sit in a watch for up to its 10 s timeout and
        # leaves by itself (a daemon thread touching nothing else).
        if self._worker is not None:
            self._worker.join(timeout=30)
        with self._lock:
            for run in self._runs.values():
                self._signal(run, signal.SIGKILL)
            for run in self._runs.values():
                for c in run.containers.values():
                    if c.proc is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            c.proc.wait(timeout=10)

    # ---- what tests ask ----------------------------------------------------------------

    def pod_pids(self, namespace: str, name: str) -> list[int]:
        """The live processes of a pod running here (every container, every descendant)."""
        with self._lock:
            uids = [r.uid for r in self._runs.values() if (r.namespace, r.name) == (namespace, name)]
        return [p.pid for uid in uids for p in _processes(uid)]

    def container_log(self, namespace: str, name: str, container: str | None = None) -> str:
        with self._lock:
            runs = [r for r in self._runs.values() if (r.namespace, r.name) == (namespace, name)]
        if not runs:
            return ""
        logs = sorted(runs[-1].sandbox.glob(f"{container or '*'}.log"))
        return "".join(p.read_text(errors="replace") for p in logs)

    # ---- talking to the API server -----------------------------------------------------

    def _call(self, method: str, path: str, body: Obj | None = None) -> tuple[int, Obj]:
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        status, answer = self.cluster.request(method, path, body, content_type=kind)
        if status >= 400 and status != 404:
            log.warning("kubelet stand-in: %s %s: %s %s", method, path, status, answer.get("message"))
        return status, answer

    def _watch(self) -> None:
        """List every pod, then follow the watch from there; start over when it ends."""
        context = ssl.create_default_context(cafile=str(self.cluster.ca_file))
        headers = {"Authorization": f"Bearer {self.cluster.token}", "Accept": "application/json"}
        while not self._stopping.is_set():
            try:
                status, listed = self.cluster.request("GET", "/api/v1/pods")
                if status != 200:
                    raise OSError(f"listing pods: {status} {listed.get('message')}")
                for pod in listed.get("items", []):
                    self._events.put(("SYNC", pod))
                query = urllib.parse.urlencode({"watch": "1", "resourceVersion": listed["metadata"]["resourceVersion"],
                                                "allowWatchBookmarks": "true", "timeoutSeconds": "10"})
                request = urllib.request.Request(f"{self.cluster.url}/api/v1/pods?{query}", headers=headers)
                with urllib.request.urlopen(request, timeout=20, context=context) as stream:
                    for line in stream:
                        event = json.loads(line)
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self._events.put((event["type"], event["object"]))
                        if self._stopping.is_set():
                            return
            except (OSError, ValueError, KeyError) as e:
                if not self._stopping.is_set():
                    log.info("kubelet stand-in: pod watch ended (%s); listing again", e)
                    self._stopping.wait(0.5)  # the API server may be restarting: do not spin

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                kind, pod = self._events.get(timeout=TICK_S)
                uid = pod["metadata"]["uid"]
                if kind == "DELETED":
                    self._pods.pop(uid, None)
                else:
                    self._pods[uid] = pod
                if kind == "DELETED" or pod["spec"].get("nodeName"):
                    self._bound.pop(uid, None)
            except queue.Empty:
                pass
            for uid, pod in list(self._pods.items()):
                try:
                    with self._lock:
                        self._sync(pod)
                except Exception:  # one pod's trouble must not stop the node
                    log.exception("kubelet stand-in: pod %s", pod["metadata"].get("name"))
            with self._lock:
                for uid in [u for u in self._runs if u not in self._pods]:
                    self._forget(self._runs.pop(uid))  # gone from the API server: nothing may keep running

    # ---- one pod -------------------------------------------------------------------------

    def _sync(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        if not spec.get("nodeName"):
            if meta["uid"] in self._bound or meta.get("deletionTimestamp"):
                return
            if spec.get("schedulerName", "default-scheduler") in self.scheduler_names:
                self._schedule(pod)
            return
        if spec["nodeName"] != self.name:
            return
        run = self._runs.get(meta["uid"])
        if run is None:
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                if meta.get("deletionTimestamp"):  # ended before; nothing runs: let it go
                    self._call(
                        "DELETE", _pod_path(meta), {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
                    )
                return
            run = self._runs[meta["uid"]] = _Pod(
                meta["uid"],
                meta["namespace"],
                meta["name"],
                self.root / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}",
            )
            run.sandbox.mkdir(parents=True, exist_ok=True)
            run.containers = {c["name"]: _Container(c["name"]) for c in spec["containers"]}
        if meta.get("deletionTimestamp"):
            self._terminate(pod, run)
            return
        for container in spec["containers"]:
            self._sync_container(pod, run, container)
        self._report(pod, run)

    def _schedule(self, pod: Obj) -> None:
        why = self._misfit(pod)
        meta = pod["metadata"]
        if not why:
            binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": self.name}}
            status, _ = self._call("POST", f"{_pod_path(meta)}/binding", binding)
            if status == 201:
                self._bound[meta["uid"]] = pod
            return
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why,
                     "lastTransitionTime": _now()}
        shown = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"]
        if not shown or shown[0].get("message") != why:
            self._call(
                "PATCH", f"{_pod_path(meta)}/status", {"status": {"phase": "Pending", "conditions": [condition]}}
            )

    def _misfit(self, pod: Obj) -> str:
        """Why the pod does not fit this node, in the scheduler's words ("" when it fits)."""
        wanted = pod["spec"].get("nodeSelector") or {}
        if any(self.labels.get(k) != v for k, v in wanted.items()):
            return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
        busy: dict[str, float] = {}
        here = [p for p in self._pods.values() if p["spec"].get("nodeName") == self.name]
        for other in [*here, *self._bound.values()]:
            if (other.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                for k, v in _requests(other).items():
                    busy[k] = busy.get(k, 0.0) + v
        short = [k for k, v in _requests(pod).items()
                 if k in self.capacity and v + busy.get(k, 0.0) > quantity(self.capacity[k]) + 1e-9]
        unknown = [k for k in _requests(pod) if k not in self.capacity]
        if short or unknown:
            return "0/1 nodes are available: " + ", ".join(f"1 Insufficient {k}" for k in sorted(short + unknown)) + "."
        return ""

    def _sync_container(self, pod: Obj, run: _Pod, container: Obj) -> None:
        c = run.containers[container["name"]]
        if c.proc is not None:
            code = c.proc.poll()
            if code is None:
                return
            self._signal(run, signal.SIGKILL, c.name)  # the main process is gone: so is the container
            ended = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                     "startedAt": c.state.get("running", {}).get("startedAt", _now()), "finishedAt": _now()}
            c.proc, c.state = None, {"terminated": ended}
            policy = pod["spec"].get("restartPolicy", "Always")
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                c.last_state, c.restarts = c.state, c.restarts + 1
            else:
                return
        elif "terminated" in c.state or time.monotonic() < c.retry_at:
            return
        c.retry_at = time.monotonic() + 1.0
        image = container.get("image", "")
        if any(marker in image for marker in self.unpullable):
            c.pulls += 1
            reason = "ErrImagePull" if c.pulls == 1 else "ImagePullBackOff"
            message = (f'failed to pull and unpack image "{image}": not found' if c.pulls == 1
                       else f'Back-off pulling image "{image}"')
            c.state = {"waiting": {"reason": reason, "message": message}}
            return
        try:
            self._launch(pod, run, container, c)
        except Waiting as e:
            c.state = {"waiting": {"reason": e.reason, "message": str(e)}}
        except OSError as e:  # the command cannot be run: the container fails to start
            message = f'exec: "{(container.get("command") or [""])[0]}": {e.strerror or e}'
            c.state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": message,
                                      "startedAt": _now(), "finishedAt": _now()}}

    def _launch(self, pod: Obj, run: _Pod, container: Obj, c: _Container) -> None:
        mounts = self._view.volumes(pod, run.sandbox, container)
        env = self._view.environment(pod, container)
        rewrite = path_rewriter(mounts)
        expand = expander(env)
        argv = [rewrite(expand(a)) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        if not argv:
            raise Waiting("CreateContainerError", "the stand-in has no image entrypoint: give the container a command")
        env = {k: rewrite(v) for k, v in env.items()}
        cwd = rewrite(container["workingDir"]) if container.get("workingDir") else str(run.sandbox)
        Path(cwd).mkdir(parents=True, exist_ok=True)
        meta = pod["metadata"]
        base = {
            "PATH": os.pathsep.join([str(Path(self.python).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": str(run.sandbox), "HOSTNAME": meta["name"],
            "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.cluster.port),
            MARKER: f"{run.uid}/{c.name}",
        }
        with open(run.sandbox / f"{c.name}.log", "ab") as out:
            c.proc = subprocess.Popen(argv, env={**base, **env}, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        c.state = {"running": {"startedAt": _now()}}

    # ---- status and ending ---------------------------------------------------------------

    def _report(self, pod: Obj, run: _Pod, *, terminal: bool = False) -> None:
        spec = pod["spec"]
        states = [run.containers[c["name"]] for c in spec["containers"]]
        codes = [c.state["terminated"]["exitCode"] for c in states if "terminated" in c.state]
        if len(codes) == len(states):
            phase = "Succeeded" if not any(codes) else "Failed"
        elif terminal:
            phase = "Failed"
        elif any("running" in c.state for c in states):
            phase = "Running"
        else:
            phase = "Pending"
        ready = "True" if all("running" in c.state for c in states) else "False"
        conditions = [{"type": t, "status": s, "lastTransitionTime": run.started}
                      for t, s in (("PodScheduled", "True"), ("Initialized", "True"),
                                   ("ContainersReady", ready), ("Ready", ready))]
        statuses = [{
            "name": c.name, "image": container.get("image", ""), "imageID": "", "ready": "running" in c.state,
            "started": "running" in c.state, "restartCount": c.restarts, "state": c.state,
            "lastState": c.last_state, "containerID": f"local-process://{run.uid[:8]}-{c.name}",
        } for c, container in zip(states, spec["containers"], strict=True)]
        status = {"phase": phase, "conditions": conditions, "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
                  "podIPs": [{"ip": "127.0.0.1"}], "startTime": run.started, "containerStatuses": statuses}
        if status != run.reported:
            code, _ = self._call("PATCH", f"{_pod_path(pod['metadata'])}/status", {"status": status})
            if code == 200:
                run.reported = status

    def _terminate(self, pod: Obj, run: _Pod) -> None:
        """SIGTERM, SIGKILL when the grace period is over, then the pod's final delete."""
        if run.deleted:
            return
        live = [c for c in run.containers.values() if c.proc is not None and c.proc.poll() is None]
        if live or _processes(run.uid):
            if run.kill_at is None:
                grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
                run.kill_at = time.monotonic() + grace
                self._signal(run, signal.SIGTERM)
            if time.monotonic() < run.kill_at:
                return
            self._signal(run, signal.SIGKILL)
            for c in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)  # type: ignore[union-attr]
        for c in run.containers.values():
            if c.proc is not None:
                code = c.proc.poll()
                started = c.state.get("running", {}).get("startedAt", _now())
                c.proc, c.state = (
                    None,
                    {
                        "terminated": {
                            "exitCode": code if code is not None else 137,
                            "reason": "Error" if code else "Completed",
                            "startedAt": started,
                            "finishedAt": _now(),
                        }
                    },
                )
            elif "terminated" not in c.state:
                c.state = {"terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown",
                                          "message": "the container was never started", "finishedAt": _now()}}
        self._report(pod, run, terminal=True)
        meta = pod["metadata"]
        status, _ = self._call(
            "DELETE", _pod_path(meta), {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        )
        run.deleted = status in (200, 202, 404, 409)

    def _signal(self, run: _Pod, sig: int, container: str | None = None) -> None:
        for p in _processes(run.uid, container):
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def _forget(self, run: _Pod) -> None:
        self._signal(run, signal.SIGKILL)
        for c in run.containers.values():
            if c.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)


def _pod_path(meta: Obj) -> str:
    return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"


def _requests(pod: Obj) -> dict[str, float]:
    total: dict[str, float] = {}
    for c in pod["spec"]["containers"]:
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[k] = total.get(k, 0.0) + quantity(v)
    return total


def _processes(uid: str, container: str | None = None) -> list[psutil.Process]:
    """Live processes of a pod (or one of its containers): their marker says whose they are."""
    out = []
    for p in psutil.process_iter():
        try:
            mark = p.environ().get(MARKER, "")
            if mark and mark.split("/")[0] == uid and (container is None or mark == f"{uid}/{container}") \
                    and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out
