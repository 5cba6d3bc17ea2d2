"""The Kubernetes operator platforms against the fake API server of tests/fake_k8s.py.

The fake runs each pod's container command as a local process, so the agents are real
and dial back to a real coordinator: trials run end to end on Kubeflow, FrameworkController
and AdaptDL. Plain pods and Jobs run against the real API server in test_kubernetes.py,
whose tests take a flavour as a parameter.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    quickstart_code,
    quickstart_data,
    run_async,
    service_from_config,
)
from fake_k8s import NO_SUCH_IMAGE, FakeKubernetes, running, section
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config import parse_config
from trialkeeper.coordinator.services.base import EnvironmentRequest, Observation
from trialkeeper.coordinator.services.kubernetes import (
    KubernetesEnvironmentService,
)
from trialkeeper.coordinator.store import Store

pytest.importorskip("kubernetes", reason="the Kubernetes platforms need trialkeeper[k8s]")

WAIT_S = 45.0

@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeKubernetes]:
    with running(tmp_path_factory.mktemp("fake-k8s")) as server:
        yield server


def _config_data(fake: FakeKubernetes, tmp_path: Path, platform: str, **ts: Any) -> dict[str, Any]:
    return quickstart_data(tmp_path, f"k8s-{platform}", section(fake, platform, tmp_path, **ts))


def _ours(fake: FakeKubernetes, experiment_id: str) -> list[dict[str, Any]]:
    """The objects of one experiment that the fake still holds."""
    return [o for o in fake.objects() if o["metadata"].get("labels", {}).get("trialkeeper/experiment") == experiment_id]


def _assert_token_only_in_its_secret(fake: FakeKubernetes, experiment_id: str, token: str) -> None:
    encoded = base64.b64encode(token.encode()).decode()
    created = [o for o in fake.history if o["metadata"].get("labels", {}).get("trialkeeper/experiment") == experiment_id]
    assert any(o["kind"] == "Pod" for o in created)
    for obj in created:
        text = json.dumps(obj)
        assert token not in text, f"the token in {obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] != "Secret":
            assert encoded not in text
    for pod in (o for o in created if o["kind"] == "Pod"):
        env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
        assert "value" not in env["TRIALKEEPER_TOKEN"] and env["TRIALKEEPER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"


async def _poll_until(service: KubernetesEnvironmentService, env_id: str, state: str, detail: str = "") -> Observation:
    """Poll until the service reports ``state`` (with ``detail`` in its detail) for ``env_id``."""
    deadline = time.monotonic() + WAIT_S
    while not ((seen := (await service.poll([env_id]))[env_id]).state == state and detail in seen.detail):
        assert time.monotonic() < deadline, f"{env_id} never became {state} ({detail}): {seen}"
        await asyncio.sleep(0.05)
    return seen


# ---- end to end --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("platform", "extra"),
    [
        ("kubeflow", {"operator": "pytorchjob"}),
        ("frameworkcontroller", {}),
        ("adl", {"adaptive": True}),
    ],
    ids=["kubeflow", "frameworkcontroller", "adl"],
)
def test_quickstart_end_to_end(
    fake: FakeKubernetes, tmp_path: Path, capfd: pytest.CaptureFixture[str], platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path)
    config_file = tmp_path / "code" / "config.yml"  # where the quickstart keeps it
    config_file.write_text(yaml.safe_dump(_config_data(fake, tmp_path, platform, **extra)))
    exp_dir = tmp_path / "exp"

    rc = cli.main(["run", str(config_file), "--quiet", "--experiment-dir", str(exp_dir)])
    assert rc == 0, capfd.readouterr()

    store = Store.in_dir(exp_dir, readonly=True)
    try:
        experiment_id = store.experiment()["id"]
        trials, envs = store.trials(), store.envs()
    finally:
        store.close()
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
    reuse = extra.get("reuseMode", True)
    assert len(envs) == (2 if reuse else 4), [(e["id"], e["status"], e["reason"]) for e in envs]
    created = {o["metadata"]["name"] for o in fake.history if o["metadata"].get("labels", {}).get("trialkeeper/experiment") == experiment_id}
    # `trialkeeper envs` shows the platform's own name for each environment.
    assert all(e["platform_id"] in created for e in envs), [e["platform_id"] for e in envs]
    capfd.readouterr()
    assert cli.main(["envs", str(exp_dir)]) == 0
    shown = capfd.readouterr().out
    assert all(e["platform_id"] in shown for e in envs), shown
    # `trialkeeper logs` has what the trial printed inside its pod.
    assert cli.main(["logs", str(exp_dir), trials[0]["id"]]) == 0
    assert "held-out accuracy" in capfd.readouterr().out
    # Nothing of the experiment is left on the cluster, and the token was only ever in its Secret.
    assert _ours(fake, experiment_id) == []
    _assert_token_only_in_its_secret(fake, experiment_id, (exp_dir / ".token").read_text().strip())


# ---- errors are data; config -------------------------------------------------------------


def test_an_image_without_the_python_fails_the_environment_with_the_reason(
    fake: FakeKubernetes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quickstart_code(tmp_path)
    data = _config_data(fake, tmp_path, "kubeflow", python="/no/such/python")
    # No kubeconfig in the config: $KUBECONFIG names it, as for kubectl.
    monkeypatch.setenv("KUBECONFIG", data["trainingService"].pop("kubeconfig"))
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", "nopython", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        seen = await _poll_until(service, "env-1", "failed")
        assert "/no/such/python" in seen.detail and "StartError" in seen.detail, seen
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    assert _ours(fake, "nopython") == []


@pytest.mark.parametrize("platform", ["kubeflow"])
def test_an_image_that_cannot_be_pulled_fails_the_environment_after_image_pull_timeout(
    fake: FakeKubernetes, tmp_path: Path, platform: str
) -> None:
    quickstart_code(tmp_path)
    data = _config_data(fake, tmp_path, platform, image=f"registry.example/{NO_SUCH_IMAGE}:1", imagePullTimeout="1s")
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", f"pull{platform[:4]}", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        # A registry may be down for a while: waiting, saying why...
        seen = await _poll_until(service, "env-1", "starting", "ImagePullBackOff")
        assert NO_SUCH_IMAGE in seen.detail, seen
        # ...until imagePullTimeout, then failed with the reason.
        seen = await _poll_until(service, "env-1", "failed", "could not be pulled")
        assert "ImagePullBackOff" in seen.detail and NO_SUCH_IMAGE in seen.detail, seen
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    assert _ours(fake, request.experiment_id) == []


def test_the_fake_refuses_what_a_real_server_refuses(fake: FakeKubernetes) -> None:
    def post(path: str, body: dict[str, Any], token: str = fake.token) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(fake.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "i", "command": ["true"], "bogus": 1}]}}
    assert post("/api/v1/namespaces/default/pods", pod, token="wrong")[0] == 401
    code, status = post("/api/v1/namespaces/default/pods", pod)
    assert code == 422 and status["reason"] == "Invalid" and "bogus" in status["message"], status
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"},
           "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": {"spec": {"containers": []}}}}}}
    code, status = post("/apis/kubeflow.org/v1/namespaces/default/pytorchjobs", job)
    assert code == 422 and "Master" in status["message"], status
    assert fake.objects("pods") == [] or all(o["metadata"]["name"] != "p" for o in fake.objects("pods"))
