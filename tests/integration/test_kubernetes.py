"""The Kubernetes platforms against the fake API server of tests/fake_k8s.py.

The fake runs each pod's container command as a local process, so the agents are real
and dial back to a real coordinator: trials run end to end on every flavour (plain pods
and jobs, Kubeflow, FrameworkController, AdaptDL).
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import (
    GATED_TRIAL,
    async_wait_until,
    environment,
    quickstart_code,
    quickstart_data,
    run_async,
    service_from_config,
    wait_until,
)
from fake_k8s import NO_SUCH_IMAGE, FakeKubernetes, running, section
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config import ConfigError, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.base import EnvironmentRequest, Observation
from trialkeeper.coordinator.services.kubernetes import (
    KubernetesEnvironmentService,
    KubernetesSetupError,
    object_name,
)
from trialkeeper.coordinator.services.kubernetes_config import AdlConfig, KubeflowConfig
from trialkeeper.coordinator.states import EnvStatus, TrialStatus
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
        ("kubernetes", {}),
        ("kubernetes", {"reuseMode": False, "workload": "job"}),
        ("kubeflow", {"operator": "pytorchjob"}),
        ("frameworkcontroller", {}),
        ("adl", {"adaptive": True}),
    ],
    ids=["pod-reuse", "job-no-reuse", "kubeflow", "frameworkcontroller", "adl"],
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


# ---- losing a pod --------------------------------------------------------------------------


def test_deleting_a_pod_mid_trial_loses_its_environment(fake: FakeKubernetes, tmp_path: Path) -> None:
    quickstart_code(tmp_path, GATED_TRIAL)
    data = _config_data(fake, tmp_path, "kubernetes", workload="job")
    data.update(trialCommand="python3 trial.py", trialEnv={"GATE": str(tmp_path / "gate")}, searchSpace={}, maxTrialNumber=None)
    del data["searchSpaceFile"]
    config = parse_config(data, tmp_path / "code")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            victim = await c.submit({"x": 1, "wait": True})
            await async_wait_until(lambda: victim.info.status is TrialStatus.RUNNING, WAIT_S, message="trial never ran")
            env = next(e for e in c.environments() if e.id == victim.info.environment_id)
            labels = {"trialkeeper/experiment": c.experiment_id, "trialkeeper/environment": env.id}
            pod = next(o for o in fake.objects("pods") if labels.items() <= o["metadata"]["labels"].items())
            pids = fake.pod_pids("default", pod["metadata"]["name"])
            assert pids, "the pod runs no process"
            token = (tmp_path / "exp" / ".token").read_text().strip()
            for pid in pids:  # neither in the agent's nor the trial's arguments
                assert token not in " ".join(psutil.Process(pid).cmdline())

            fake.delete_pod("default", pod["metadata"]["name"], grace_s=0)

            info = await victim.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED and "environment lost" in info.reason, info.reason
            await async_wait_until(lambda: environment(c, env.id).status is EnvStatus.FAILED, WAIT_S, message=env.id)
            env = environment(c, env.id)
            assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)
            # A replacement environment takes the next trial.
            after = await c.submit({"x": 2})
            done = await after.wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED, done.reason
            assert done.environment_id != env.id
            experiment_id = c.experiment_id
        assert _ours(fake, experiment_id) == []

    run_async(body, timeout=120)


# ---- the coordinator dies -----------------------------------------------------------------


def _rows(exp: Path, table: str) -> list[dict[str, Any]]:
    if not (exp / Store.FILENAME).exists():
        return []
    try:
        store = Store.in_dir(exp, readonly=True)
    except Exception:  # noqa: BLE001 - created but not yet initialised
        return []
    try:
        return store.trials() if table == "trials" else store.envs()
    except Exception:  # noqa: BLE001 - the schema is still being written
        return []
    finally:
        store.close()


def _reconnected(exp: Path, env_ids: set[str]) -> bool:
    """Every environment went from LOST (the coordinator restarted) back to work."""
    try:
        store = Store.in_dir(exp, readonly=True)
    except Exception:  # noqa: BLE001 - being written
        return False
    try:
        events = store.events()
    finally:
        store.close()
    back = {str(e["entity_id"]) for e in events if e["old"] == "LOST" and e["new"] in ("READY", "BUSY")}
    return env_ids <= back


def _cli(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_resume_after_a_crash_adopts_its_pods_and_sweeps_strays(fake: FakeKubernetes, tmp_path: Path) -> None:
    quickstart_code(tmp_path, GATED_TRIAL)
    gate = tmp_path / "gate"
    data = _config_data(fake, tmp_path, "kubeflow", operator="tfjob")
    data.update(
        trialCommand="python3 trial.py", trialEnv={"GATE": str(gate)}, tuner={"name": "grid"},
        searchSpace={"x": {"_type": "choice", "_value": [1, 2, 3, 4]}, "wait": {"_type": "choice", "_value": [True]}},
    )
    del data["searchSpaceFile"]
    config_file = tmp_path / "config.yml"
    config_file.write_text(json.dumps(data))
    exp = tmp_path / "exp"
    first = _cli("run", str(config_file), "--experiment-dir", str(exp), "--quiet")
    resumed = None
    try:
        wait_until(lambda: sum(t["status"] == "RUNNING" for t in _rows(exp, "trials")) == 2 or first.poll() is not None,
                   WAIT_S, message="two trials never ran")
        assert first.poll() is None, first.communicate()[0].decode(errors="replace")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        experiment_id = Store.in_dir(exp, readonly=True).experiment()["id"]
        known = {str(e["id"]) for e in _rows(exp, "envs")}
        # An environment the dead coordinator asked for but never recorded: a stray.
        config = parse_config(data, tmp_path / "code")
        stray_service = create_service(config, exp)
        token = (exp / ".token").read_text().strip()

        async def start_stray_then_sweep() -> list[str]:
            await stray_service.prepare()
            started = await stray_service.start(EnvironmentRequest("env-99", experiment_id, "127.0.0.1:9", token, ("--reconnect-window", "60")))
            assert started.error is None, started.error
            fresh = create_service(config, exp)  # knows nothing: works from the labels alone
            try:
                return await fresh.sweep(experiment_id, keep=known)
            finally:
                await fresh.close()
                await stray_service.close()

        assert run_async(start_stray_then_sweep) == ["env-99"]
        names = {o["metadata"]["name"] for o in _ours(fake, experiment_id) if o["kind"] == "TFJob"}
        assert len(names) == 2, names

        resumed = _cli("resume", str(exp), "--quiet")
        wait_until(lambda: _reconnected(exp, known) or resumed.poll() is not None, WAIT_S, message="the agents did not come back")
        gate.write_text("")
        out, _ = resumed.communicate(timeout=WAIT_S)
        assert resumed.returncode == 0, out.decode(errors="replace")
        trials = _rows(exp, "trials")
        assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
        # The agents from before the crash finished the trials: adopted, not replaced.
        assert {str(e["id"]) for e in _rows(exp, "envs")} == known
        assert _ours(fake, experiment_id) == []
    finally:
        for proc in (first, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


# ---- errors are data; config -------------------------------------------------------------


def test_a_refused_object_is_a_start_error_not_an_exception(fake: FakeKubernetes, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    data = _config_data(fake, tmp_path, "kubernetes", tolerations=[{"key": "gpu", "operatorr": "Exists"}])
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", "refused1", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        result = await service.start(request)
        # Refused by the client's own schema check or by the server (422): either way, data.
        assert result.error is not None and "operatorr" in result.error, result.error
        assert (await service.poll(["env-1"]))["env-1"].state == "failed"
        await service.stop("env-1")
        await service.stop("never-started")
        await service.close()

    run_async(body)
    assert _ours(fake, "refused1") == []


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


@pytest.mark.parametrize("platform", ["kubernetes", "kubeflow"])
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


def test_an_environment_failing_to_start_is_removed_at_once(fake: FakeKubernetes, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    data = _config_data(fake, tmp_path, "kubernetes", image=f"registry.example/{NO_SUCH_IMAGE}:1", imagePullTimeout="1s")
    config = parse_config(data, tmp_path / "code")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await c.submit({"x": 1})
            failed = await async_wait_until(
                lambda: [e for e in c.environments() if e.status is EnvStatus.FAILED], WAIT_S, message="no environment failed"
            )
            assert "could not be pulled" in failed[0].reason and NO_SUCH_IMAGE in failed[0].reason, failed[0].reason
            # Its pod (which would hold its node's GPUs) is deleted now, not at the experiment's end.
            name = object_name(c.experiment_id, failed[0].id)
            await async_wait_until(
                lambda: not [o for o in fake.objects("pods") if o["metadata"]["name"] == name], WAIT_S,
                message=f"pod {name} of a failed environment is still there",
            )

    run_async(body)


def test_pod_placement_fields_reach_the_scheduler(fake: FakeKubernetes, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    data = _config_data(
        fake, tmp_path, "kubernetes", gpuNumber=2, nodeSelector={"kubernetes.io/os": "linux"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        serviceAccountName="trainer", imagePullSecrets=[{"name": "regcred"}],
    )
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", "placement", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        # The fake's node has no GPU: the pod waits, and the service says why.
        seen = await _poll_until(service, "env-1", "starting", "Insufficient nvidia.com/gpu")
        assert seen.platform_id == "tk-placement-env-1"
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    pod = next(o for o in fake.history if o["kind"] == "Pod" and o["metadata"]["name"] == "tk-placement-env-1")
    spec = pod["spec"]
    assert spec["containers"][0]["resources"]["limits"] == {"cpu": "1", "memory": str(512 * 2**20), "nvidia.com/gpu": "2"}
    assert "--no-gpu" not in spec["containers"][0]["args"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"} and spec["serviceAccountName"] == "trainer"
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu" and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert _ours(fake, "placement") == []


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


def test_config_takes_nni_field_forms_and_reports_every_problem(tmp_path: Path) -> None:
    def ts(section: dict[str, Any]) -> Any:
        return parse_config({"trialCommand": "x", "trialConcurrency": 2, "trainingService": section}, tmp_path).training_service

    kubeflow = ts({"platform": "kubeflow", "image": "i", "operator": "tf-operator", "gpuNumber": 1,
                   "imagePullSecrets": [{"name": "regcred"}], "memorySize": "8Gi", "nodeSelector": {"pool": "gpu"}})
    assert isinstance(kubeflow, KubeflowConfig)
    assert (kubeflow.operator, kubeflow.image_pull_secrets, kubeflow.memory_size) == ("tfjob", ["regcred"], 8 * 2**30)
    adl = ts({"platform": "adl", "image": "i", "adaptive": True, "checkpoint": {"storageClass": "dfs", "storageSize": "1Gi"}})
    assert isinstance(adl, AdlConfig) and adl.checkpoint is not None and adl.checkpoint.storage_size == 2**30
    with pytest.raises(ConfigError) as e:
        ts({"platform": "frameworkcontroller", "namespace": "Not_OK", "nfs": {"server": "s", "path": "rel"},
            "persistentVolumeClaim": "c", "localMountPath": str(tmp_path / "missing")})
    text = str(e.value)
    for where in ("image", "namespace", "nfs.path", "persistentVolumeClaim", "localMountPath"):
        assert f"trainingService.{where}" in text, text


def test_pods_with_fewer_gpus_than_a_trial_needs_are_a_config_error(tmp_path: Path) -> None:
    # Such trials could never start (the agents would run with --no-gpu): said at once.
    def parse(gpus: int, **section: Any) -> Any:
        data = {"trialCommand": "x", "trialConcurrency": 2, "trialGpuNumber": gpus,
                "trainingService": {"platform": "kubernetes", "image": "i", **section}}
        return parse_config(data, tmp_path)

    with pytest.raises(ConfigError) as e:
        parse(1)
    text = str(e.value)
    assert "trainingService.gpuNumber" in text and "is 0, but trialGpuNumber asks for 1" in text, text
    with pytest.raises(ConfigError) as e:
        parse(4, platform="kubeflow", gpuNumber=2)
    assert "trainingService.gpuNumber" in str(e.value) and "at least 4" in str(e.value), str(e.value)
    assert parse(2, gpuNumber=2).training_service.gpu_number == 2
    assert parse(0).trial_gpu_number == 0


def test_an_unusable_kubeconfig_or_a_missing_client_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quickstart_code(tmp_path)
    broken = tmp_path / "kubeconfig-broken"
    broken.write_text("clusters: [\n")
    data = {"trialCommand": "x", "trialConcurrency": 1, "trialCodeDirectory": str(tmp_path / "code"),
            "trainingService": {"platform": "adl", "image": "i", "kubeconfig": str(broken)}}
    config = parse_config(data, tmp_path)
    with pytest.raises(KubernetesSetupError, match=f"cannot use kubeconfig {broken}"):
        create_service(config, tmp_path / "exp")
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if the extra were not installed
    with pytest.raises(KubernetesSetupError, match=r"install trialkeeper\[k8s\]"):
        create_service(config, tmp_path / "exp")


def test_a_workload_created_while_a_poll_lists_is_not_taken_for_deleted(fake: FakeKubernetes, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    data = _config_data(fake, tmp_path, "kubernetes")
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", "racing1", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        real_list, real_start = service._list, service._start
        go = asyncio.Event()

        async def held_start(env: Any, req: EnvironmentRequest) -> Any:
            await go.wait()
            return await real_start(env, req)

        service._start = held_start  # type: ignore[method-assign]
        first = asyncio.ensure_future(service.start(request))

        async def answered_before_the_create(kind: Any, label_selector: str) -> list[dict[str, Any]]:
            answer = await real_list(kind, label_selector)
            go.set()
            await first  # the create completes while the answer is on its way
            return [o for o in answer if not o["metadata"]["name"].endswith("-env-1")]

        await async_wait_until(
            lambda: "env-1" in service._envs and service._envs["env-1"].starting is not None, 10.0,
            message="the start never began",
        )
        service._list = answered_before_the_create  # type: ignore[method-assign]
        seen = await service.poll(["env-1"])
        assert (await first).error is None
        assert seen["env-1"].state == "starting", seen["env-1"]
        service._list = real_list  # type: ignore[method-assign]
        assert (await service.poll(["env-1"]))["env-1"].state in ("starting", "running")
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
