"""A real Kubernetes control plane with one node of our own, for tests.

:class:`KubeCluster` runs etcd, kube-apiserver and kube-controller-manager (built and started
by ``scripts/kube_env.py``) on 127.0.0.1 in a folder of its own, plus the kubelet stand-in of
``kubelet.py`` as its one Node. The session fixture ``kube_cluster`` (tests/conftest.py)
starts one for the whole test session through :func:`session_cluster`.

When the binaries are not built: in CI (``CI`` set) the fixture builds them, or waits for
the build ``.ci/run`` started in the background, and fails if that does not work; elsewhere
the tests are skipped with the command that builds them (``TRIALKEEPER_KUBE_BUILD=1`` builds
instead of skipping). Without Debian's etcd they are skipped (failed in CI) the same way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kube.kubelet import NO_SUCH_IMAGE, StandInKubelet

__all__ = ["NO_SUCH_IMAGE", "KubeCluster", "KubeUnavailable", "kube_env", "section", "session_cluster"]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kube_env.py"
START_TIMEOUT_S = 90.0  # all three start in ~5 s on an idle machine; a loaded 2-core one is slower
BUILD_WAIT_S = 1500.0  # CI: a cold build takes ~13 min of both cores, longer beside the test run


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("kube_env", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kube_env", module)
    spec.loader.exec_module(module)
    return module


kube_env = _load_script()
KubeUnavailable = kube_env.KubeEnvError


class KubeCluster:
    """The control plane of ``scripts/kube_env.py`` plus a stand-in kubelet as its one node.

    ``url``, ``token``, ``ca_file`` and ``kubeconfig`` say how to reach it (the token's user
    is in ``system:masters``); ``node`` is the :class:`StandInKubelet`.
    """

    def __init__(self, root: Path, *, version: str = kube_env.KUBE_VERSION, gpus: int = 4, cpus: int = 16) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.plane = kube_env.ControlPlane(root.resolve(), version)
        self.node = StandInKubelet(self.plane, root.resolve() / "node", cpus=cpus, gpus=gpus)

    @property
    def version(self) -> str:
        return str(self.plane.version)

    @property
    def url(self) -> str:
        return str(self.plane.url)

    @property
    def token(self) -> str:
        return str(self.plane.token)

    @property
    def ca_file(self) -> Path:
        return Path(self.plane.ca_file)

    @property
    def kubeconfig(self) -> Path:
        return Path(self.plane.kubeconfig)

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the control plane, wait until it takes pods, then register the node."""
        try:
            self.plane.start()
            self.wait_ready(timeout)
            self.node.start()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        self.plane.wait_ready(timeout)

    def stop(self) -> None:
        self.node.stop()
        self.plane.stop()

    def request(self, method: str, path: str, body: object = None, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        """One REST call as the admin: (HTTP status, decoded answer)."""
        return self.plane.request(method, path, body, **kwargs)  # type: ignore[no-any-return]

    def write_kubeconfig(self, path: Path, *, namespace: str = "default", server: str = "") -> Path:
        return Path(self.plane.write_kubeconfig(path, namespace=namespace, server=server))

    def objects(self, plural: str, *, group: str = "", version: str = "v1", selector: str = "") -> list[dict[str, Any]]:
        """The objects of a kind in every namespace, now (``group`` "" is the core API)."""
        base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
        query = f"?labelSelector={selector}" if selector else ""
        status, answer = self.request("GET", f"{base}/{plural}{query}")
        assert status == 200, f"listing {plural}: {status} {answer.get('message')}"
        kind = str(answer.get("kind", "")).removesuffix("List")  # a list's items do not say their kind
        return [{"kind": kind, **item} for item in answer.get("items", [])]

    def created(self) -> list[dict[str, Any]]:
        """Every object created so far, as its request carried it (from the audit log), so
        that what was sent can be checked after the objects are gone."""
        out: list[dict[str, Any]] = []
        if not self.plane.audit_log.exists():
            return out
        for line in self.plane.audit_log.read_text().splitlines():
            event = json.loads(line)
            if event.get("verb") == "create" and (event.get("responseStatus") or {}).get("code") == 201 \
                    and isinstance(event.get("requestObject"), dict) and "objectRef" in event \
                    and not event["objectRef"].get("subresource"):
                obj = event["requestObject"]
                obj.setdefault("metadata", {}).setdefault("name", event["objectRef"].get("name", ""))
                out.append(obj)
        return out

    def delete_pod(self, namespace: str, name: str, grace_s: int = 0) -> dict[str, Any]:
        """Delete a pod as a user would; the answer is the pod as the deletion left it."""
        status, answer = self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                      {"gracePeriodSeconds": grace_s})
        assert status in (200, 202), f"deleting pod {name}: {status} {answer.get('message')}"
        return answer


def section(cluster: KubeCluster, platform: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A `trainingService` section for ``platform`` on this cluster, as a user writes it.

    The NFS export is a folder under ``tmp_path``, mounted in the pods at its own path and
    seen at the same path here (``localMountPath``), so the trial code is copied there; the
    stand-in kubelet takes an NFS volume's path as the local folder it stands for.
    """
    share = tmp_path / "k8s-share"
    share.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "platform": platform,
        "image": "registry.example/trialkeeper:test",
        "kubeconfig": str(cluster.write_kubeconfig(tmp_path / "kubeconfig")),
        "nfs": {"server": "127.0.0.1", "path": str(share)},
        "containerMountPath": str(share),
        "localMountPath": str(share),
        "cpuNumber": 1,
        "memorySize": "512Mi",
    }
    out.update(extra)
    return out


def _unavailable(reason: str) -> None:
    """Fail in CI, where the environment must work; skip elsewhere with what would fix it."""
    if os.environ.get("CI"):
        pytest.fail(f"the Kubernetes test environment cannot start: {reason}", pytrace=False)
    pytest.skip(f"the Kubernetes test environment cannot start: {reason}")


def ensure_built(version: str = kube_env.KUBE_VERSION) -> None:
    """The binaries of ``version``, built (in CI, or with TRIALKEEPER_KUBE_BUILD=1) or reused."""
    if kube_env.built(version):
        return
    if not (os.environ.get("CI") or os.environ.get("TRIALKEEPER_KUBE_BUILD")):
        _unavailable(f"kube-apiserver {version} is not built; build it (~13 min on 2 cores) with: "
                     f"python3 {SCRIPT} build   (or set TRIALKEEPER_KUBE_BUILD=1)")
    try:
        started = time.monotonic()
        kube_env.build(version, wait_s=BUILD_WAIT_S)  # waits for a build already under way
        print(f"kube binaries ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
    except kube_env.KubeEnvError as e:
        _unavailable(str(e))


def session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """The body of the session fixture: one cluster for every test that asks, torn down at the end."""
    pytest.importorskip("kubernetes", reason="the Kubernetes platforms need trialkeeper[k8s]")
    if shutil.which("etcd") is None:
        _unavailable(f"no etcd on PATH: apt-get install {kube_env.ETCD_PACKAGE}")
    ensure_built()
    cluster = KubeCluster(tmp_path_factory.mktemp("kube"))
    try:
        cluster.start()
    except kube_env.KubeEnvError as e:
        _unavailable(str(e))
    try:
        yield cluster
    finally:
        cluster.stop()
