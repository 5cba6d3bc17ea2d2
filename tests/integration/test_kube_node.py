"""The Kubernetes test environment itself: the real API server and controller manager, and the
stand-in kubelet running their pods as local processes (tests/kube)."""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import pid_gone, wait_until
from kube.cluster import NO_SUCH_IMAGE, KubeCluster

pytestmark = pytest.mark.slow

WAIT_S = 30.0
NS = "default"


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "python:3", "command": command, **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "node-test"}},
            "spec": {"restartPolicy": "Never", "containers": [container], **spec}}


def _create(cluster: KubeCluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = cluster.request("POST", path, body)
    assert status == 201, answer
    return answer


def _get_pod(cluster: KubeCluster, name: str) -> dict[str, Any] | None:
    status, answer = cluster.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")
    return answer if status == 200 else None


def _phase(cluster: KubeCluster, name: str) -> str:
    pod = _get_pod(cluster, name)
    return "" if pod is None else str((pod.get("status") or {}).get("phase", ""))


def _waiting_reason(cluster: KubeCluster, name: str) -> str:
    pod = _get_pod(cluster, name) or {}
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        return str((cs.get("state") or {}).get("waiting", {}).get("reason", ""))
    return ""


def _delete(cluster: KubeCluster, name: str, grace_s: int = 0) -> None:
    cluster.delete_pod(NS, name, grace_s)
    wait_until(lambda: _get_pod(cluster, name) is None, WAIT_S, message=f"pod {name} was never removed")


def test_the_node_is_ready_untainted_with_its_cpus_and_gpus(kube_cluster: KubeCluster) -> None:
    status, node = kube_cluster.request("GET", f"/api/v1/nodes/{kube_cluster.node.name}")
    assert status == 200, node
    assert not (node.get("spec") or {}).get("taints"), node["spec"]  # the not-ready taint is lifted
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == kube_cluster.node.capacity["nvidia.com/gpu"]
    assert node["status"]["allocatable"]["cpu"] == kube_cluster.node.capacity["cpu"]


def test_a_pod_runs_with_its_command_env_working_dir_and_volumes(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    name = _name("env")
    _create(kube_cluster, f"/api/v1/namespaces/{NS}/secrets",
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"pw": "s3cret"}})
    _create(
        kube_cluster,
        f"/api/v1/namespaces/{NS}/configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name},
            "data": {"greeting": "hello", "file.txt": "in a file"},
        },
    )
    out = tmp_path / "out"
    script = (
        "import os, pathlib; p = pathlib.Path(os.environ['OUT']); "
        "p.write_text('|'.join([os.environ['PW'], os.environ['GREETING'], os.environ['POD'], os.environ['ARG'], "
        "os.getcwd(), "
        "pathlib.Path(os.environ['CONF'], 'file.txt').read_text()]))"
    )
    pod = _pod(name, [sys.executable, "-c", script], container={
        "workingDir": "/scratch/work",
        "env": [
            {"name": "OUT", "value": "/results/out"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": name, "key": "pw"}}},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": name, "key": "greeting"}}},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "ARG", "value": "$(GREETING)-$(POD)"},
            {"name": "CONF", "value": "/etc/conf"},
        ],
        "volumeMounts": [{"name": "results", "mountPath": "/results"}, {"name": "scratch", "mountPath": "/scratch"},
                         {"name": "conf", "mountPath": "/etc/conf"}],
    }, volumes=[{"name": "results", "hostPath": {"path": str(tmp_path)}}, {"name": "scratch", "emptyDir": {}},
                {"name": "conf", "configMap": {"name": name}}])
    _create(kube_cluster, f"/api/v1/namespaces/{NS}/pods", pod)
    wait_until(lambda: _phase(kube_cluster, name) in ("Succeeded", "Failed"), WAIT_S, message=f"pod {name} never ended")
    answer = _get_pod(kube_cluster, name)
    assert answer is not None and answer["spec"]["nodeName"] == kube_cluster.node.name
    assert answer["status"]["phase"] == "Succeeded", kube_cluster.node.container_log(NS, name)
    assert answer["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    pw, greeting, pod_name, arg, cwd, conf = out.read_text().split("|")
    assert (pw, greeting, pod_name, arg, conf) == ("s3cret", "hello", name, f"hello-{name}", "in a file")
    assert cwd.endswith("/volumes/scratch/work"), cwd
    _delete(kube_cluster, name)


def test_restart_policy_on_failure_restarts_and_counts(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    name = _name("restart")
    counter = tmp_path / "runs"
    script = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = len(p.read_text()) if p.exists() else 0; "
              "p.write_text('x' * (n + 1)); sys.exit(3 if n < 2 else 0)")
    _create(
        kube_cluster,
        f"/api/v1/namespaces/{NS}/pods",
        _pod(name, [sys.executable, "-c", script], restartPolicy="OnFailure"),
    )
    wait_until(lambda: _phase(kube_cluster, name) == "Succeeded", WAIT_S, message=f"pod {name} never succeeded")
    status = (_get_pod(kube_cluster, name) or {})["status"]["containerStatuses"][0]
    assert status["restartCount"] == 2 and status["lastState"]["terminated"]["exitCode"] == 3, status
    _delete(kube_cluster, name)


@pytest.mark.parametrize("ignores_term", [False, True], ids=["stops-on-sigterm", "killed-after-grace"])
def test_deleting_a_running_pod_honours_its_grace_period(
    kube_cluster: KubeCluster, tmp_path: Path, ignores_term: bool
) -> None:
    name = _name("grace")
    marker = tmp_path / "term"
    handler = "signal.SIG_IGN" if ignores_term else f"lambda *_: (open({str(marker)!r}, 'w').close(), sys.exit(0))"
    script = (
        f"import signal, sys, time\nsignal.signal(signal.SIGTERM, {handler})\n"
        "print('up', flush=True)\nwhile True: time.sleep(0.05)"
    )
    _create(kube_cluster, f"/api/v1/namespaces/{NS}/pods", _pod(name, [sys.executable, "-c", script]))
    wait_until(lambda: "up" in kube_cluster.node.container_log(NS, name), WAIT_S, message=f"pod {name} never ran")
    assert _phase(kube_cluster, name) == "Running"
    pids = kube_cluster.node.pod_pids(NS, name)
    assert pids
    grace = 1 if ignores_term else 5
    began = time.monotonic()
    answer = kube_cluster.delete_pod(NS, name, grace_s=grace)
    # The object stays, marked, while its processes run: the API server waits for the node.
    assert answer["metadata"].get("deletionTimestamp") and answer["metadata"]["deletionGracePeriodSeconds"] == grace
    wait_until(lambda: _get_pod(kube_cluster, name) is None, WAIT_S, message=f"pod {name} was never removed")
    assert all(pid_gone(p) for p in pids)
    if ignores_term:  # killed once the grace period was over, not before
        assert not marker.exists() and time.monotonic() - began >= grace
    else:  # it stopped on SIGTERM, well within its grace period
        assert marker.exists()


def test_a_pod_that_does_not_fit_waits_unschedulable(kube_cluster: KubeCluster) -> None:
    name = _name("gpus")
    gpus = int(kube_cluster.node.capacity["nvidia.com/gpu"]) + 1
    # The API server itself refuses an extended resource requested without a limit.
    status, answer = kube_cluster.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod(
        name, ["true"], container={"resources": {"requests": {"nvidia.com/gpu": "1"}}}))
    assert status == 422 and "Limit must be set for non overcommitable resources" in answer["message"], answer
    _create(kube_cluster, f"/api/v1/namespaces/{NS}/pods", _pod(
        name, ["true"], container={"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}))

    def unschedulable() -> str:
        conditions = ((_get_pod(kube_cluster, name) or {}).get("status") or {}).get("conditions") or []
        return next((c["message"] for c in conditions if c.get("reason") == "Unschedulable"), "")

    assert "Insufficient nvidia.com/gpu" in wait_until(unschedulable, WAIT_S, message="never reported unschedulable")
    assert not (_get_pod(kube_cluster, name) or {})["spec"].get("nodeName")
    _delete(kube_cluster, name)


def test_an_unpullable_image_backs_off(kube_cluster: KubeCluster) -> None:
    name = _name("pull")
    _create(kube_cluster, f"/api/v1/namespaces/{NS}/pods",
            _pod(name, ["true"], container={"image": f"registry.example/{NO_SUCH_IMAGE}:1"}))
    # ErrImagePull after the failed pull, then ImagePullBackOff while it waits to try again.
    wait_until(lambda: _waiting_reason(kube_cluster, name) in ("ErrImagePull", "ImagePullBackOff"), WAIT_S,
               message="the pull never failed")
    wait_until(lambda: _waiting_reason(kube_cluster, name) == "ImagePullBackOff", WAIT_S, message="never backed off")
    status = (_get_pod(kube_cluster, name) or {})["status"]["containerStatuses"][0]
    assert NO_SUCH_IMAGE in status["state"]["waiting"]["message"] and not status["ready"], status
    assert _phase(kube_cluster, name) == "Pending"
    _delete(kube_cluster, name, grace_s=30)  # nothing runs: the node lets it go at once


def test_a_job_runs_its_pod_through_the_job_controller(kube_cluster: KubeCluster) -> None:
    name = _name("job")
    template = _pod(name, [sys.executable, "-c", "print('done')"])
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": {"app": "node-test"}}, "spec": template["spec"]},
        },
    }
    _create(kube_cluster, f"/apis/batch/v1/namespaces/{NS}/jobs", job)

    def complete() -> bool:
        status, answer = kube_cluster.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}")
        return status == 200 and any(c["type"] == "Complete" and c["status"] == "True"
                                     for c in (answer.get("status") or {}).get("conditions") or [])

    wait_until(complete, WAIT_S, message=f"job {name} never completed")
    status, _ = kube_cluster.request(
        "DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}", {"propagationPolicy": "Foreground"}
    )
    assert status == 200
    # The garbage collector removes the job's pod, then the job (a foreground delete's finalizer).
    wait_until(
        lambda: not kube_cluster.objects("pods", selector=f"job-name={name}"), WAIT_S, message="the job's pod stayed"
    )
    wait_until(lambda: kube_cluster.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}")[0] == 404, WAIT_S,
               message="the job stayed")
