"""The Kubernetes platforms against a real API server and controller manager.

The cluster of tests/kube runs the real kube-apiserver (admission, validation, the binding
and status subresources) and kube-controller-manager (Jobs, garbage collection, service
accounts); its one node is the stand-in kubelet, which runs each pod's container command as a
local process, so the agents are real and dial back to a real coordinator.

The tests take a flavour, (platform, trainingService fields), from the lists below: plain Pods
and Jobs, Kubeflow's PyTorchJob and TFJob run by the real training operator, and AdaptDLJobs
run by AdaptDL's real scheduler, and Frameworks run by FrameworkController where a binary of it
is given (tests/kube/operators.py; a flavour's operator is started for the session when a test
first takes it). No registry serves FrameworkController's source, so without that binary (in
CI) its flavour is skipped here and runs on the fake, in test_kubernetes_operators.py. The
config tests need no cluster.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import (
    GATED_TRIAL,
    async_wait_until,
    environment,
    pid_gone,
    quickstart_code,
    quickstart_data,
    run_async,
    service_from_config,
    stored_rows,
    wait_until,
)
from kube.checks import assert_token_only_in_its_secret, poll_until
from kube.cluster import NO_SUCH_IMAGE, KubeCluster, section
from netproxy import CuttingProxy
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.kubernetes.config import AdlConfig, KubeflowConfig
from trialkeeper.coordinator.services.kubernetes.objects import kind_of, selector
from trialkeeper.coordinator.services.kubernetes.service import (
    KubernetesEnvironmentService,
    KubernetesSetupError,
    object_name,
)
from trialkeeper.coordinator.store.store import Store

WAIT_S = 60.0
NS = "default"

# Every flavour on the cluster: one environment per workload, trials reuse it.
FLAVOURS = [
    pytest.param("kubernetes", {"workload": "pod"}, id="pod"),
    pytest.param("kubernetes", {"workload": "job"}, id="job"),
    pytest.param("kubeflow", {"operator": "pytorchjob"}, id="pytorchjob"),
    pytest.param("kubeflow", {"operator": "tfjob"}, id="tfjob"),
    pytest.param("adl", {"adaptive": True}, id="adl"),
    pytest.param("frameworkcontroller", {}, id="framework"),
]
# The session fixture that runs each operator platform's operator.
OPERATORS = {"kubeflow": "kubeflow_operator", "adl": "adaptdl_scheduler", "frameworkcontroller": "framework_controller"}
# Where the operator takes a deleted pod for a rescale and starts another in its place
# (AdaptDL, for a preemptible job); elsewhere (restartPolicy Never) the workload fails.
REPLACES_PODS = ("adl",)
# Kubeflow's training operator recreates a replica pod deleted before it saw that pod fail
# (restartPolicy applies to pods that fail, not to pods that are gone): whether it does is a
# race with the node marking the pod failed, so the environment fails or gets a new agent.
MAY_REPLACE_PODS = ("kubeflow",)
# The quickstart on each, with and without reuse.
QUICKSTARTS = [
    pytest.param("kubernetes", {}, id="pod-reuse"),
    pytest.param("kubernetes", {"reuseMode": False, "workload": "job"}, id="job-no-reuse"),
    pytest.param("kubeflow", {"operator": "pytorchjob"}, id="pytorchjob"),
    pytest.param("kubeflow", {"operator": "tfjob", "reuseMode": False}, id="tfjob-no-reuse"),
    pytest.param("adl", {"adaptive": True}, id="adl"),
    pytest.param("adl", {"adaptive": True, "checkpoint": {"storageClass": "standard", "storageSize": "1Gi"}},
                 id="adl-checkpoint"),
    pytest.param("frameworkcontroller", {}, id="framework"),
]
# What an experiment may leave on the cluster: (plural, API group/version); operators' kinds
# are asked for only once their CRDs are there.
LEFT_BEHIND = [("pods", ""), ("secrets", ""), ("persistentvolumeclaims", ""), ("jobs", "batch"),
               ("pytorchjobs", "kubeflow.org"), ("tfjobs", "kubeflow.org"), ("adaptdljobs", "adaptdl.petuum.com"),
               ("frameworks", "frameworkcontroller.microsoft.com")]


@pytest.fixture(autouse=True)
def _operator(request: pytest.FixtureRequest) -> None:
    """The operator of the test's flavour, running before the test starts."""
    platform = getattr(request.node, "callspec", None) and request.node.callspec.params.get("platform")
    if platform in OPERATORS:
        request.getfixturevalue(OPERATORS[platform])


def _config_data(cluster: KubeCluster, tmp_path: Path, platform: str = "kubernetes", **ts: Any) -> dict[str, Any]:
    return quickstart_data(tmp_path, f"k8s-{platform}", section(cluster, platform, tmp_path, **ts))


def _ours(cluster: KubeCluster, experiment_id: str) -> list[dict[str, Any]]:
    """The objects of one experiment the cluster still holds."""
    mine = selector(experiment_id)
    served = [(plural, group) for plural, group in LEFT_BEHIND
              if not group or cluster.request("GET", f"/apis/{group}/v1")[0] == 200]
    return [o for plural, group in served for o in cluster.objects(plural, group=group, selector=mine)]


def _created(cluster: KubeCluster, experiment_id: str) -> list[dict[str, Any]]:
    label = selector(experiment_id).split("=", 1)[1]
    return [
        o
        for o in cluster.created()
        if (o.get("metadata") or {}).get("labels", {}).get("trialkeeper/experiment") == label
    ]


# ---- end to end --------------------------------------------------------------------------


@pytest.mark.parametrize(("platform", "extra"), QUICKSTARTS)
@pytest.mark.slow
def test_quickstart_end_to_end(
    kube_cluster: KubeCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str], platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path)
    config_file = tmp_path / "code" / "config.yml"  # where the quickstart keeps it
    data = _config_data(kube_cluster, tmp_path, platform, **extra)
    config_file.write_text(yaml.safe_dump(data))
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
    kind = kind_of(parse_config(data, tmp_path / "code").training_service).kind  # type: ignore[arg-type]
    created = {o["metadata"]["name"] for o in _created(kube_cluster, experiment_id) if o["kind"] == kind}
    # `trialkeeper envs` shows the platform's own name for each environment.
    assert all(e["platform_id"] in created for e in envs), ([e["platform_id"] for e in envs], created)
    capfd.readouterr()
    assert cli.main(["envs", str(exp_dir)]) == 0
    shown = capfd.readouterr().out
    assert all(e["platform_id"] in shown for e in envs), shown
    # `trialkeeper logs` has what the trial printed inside its pod.
    assert cli.main(["logs", str(exp_dir), trials[0]["id"]]) == 0
    assert "held-out accuracy" in capfd.readouterr().out
    # Nothing of the experiment is left on the cluster, and the token was only ever in its Secret.
    assert _ours(kube_cluster, experiment_id) == []
    assert_token_only_in_its_secret(_created(kube_cluster, experiment_id), (exp_dir / ".token").read_text().strip())


# ---- losing a pod --------------------------------------------------------------------------


@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
@pytest.mark.slow
def test_deleting_a_pod_mid_trial_loses_its_environment(
    kube_cluster: KubeCluster, tmp_path: Path, platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path, GATED_TRIAL)
    data = _config_data(kube_cluster, tmp_path, platform, **extra)
    data.update(
        trialCommand="python3 trial.py", trialEnv={"GATE": str(tmp_path / "gate")}, searchSpace={}, maxTrialNumber=None
    )
    del data["searchSpaceFile"]
    config = parse_config(data, tmp_path / "code")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            victim = await c.submit({"x": 1, "wait": True})
            await async_wait_until(lambda: victim.info.status is TrialStatus.RUNNING, WAIT_S, message="trial never ran")
            env = next(e for e in c.environments() if e.id == victim.info.environment_id)
            pods = kube_cluster.objects("pods", selector=selector(c.experiment_id, env.id))
            assert len(pods) == 1, pods
            name = pods[0]["metadata"]["name"]
            pids = kube_cluster.node.pod_pids(NS, name)
            assert pids, "the pod runs no process"
            token = (tmp_path / "exp" / ".token").read_text().strip()
            for pid in pids:  # neither in the agent's nor the trial's arguments
                assert token not in " ".join(psutil.Process(pid).cmdline())

            kube_cluster.delete_pod(NS, name, grace_s=0)

            info = await victim.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED and "environment lost" in info.reason, info.reason

            def replaced() -> bool:  # the operator's new pod runs a new agent of the environment
                now = environment(c, env.id)
                return now.status is EnvStatus.READY and now.instance_id != env.instance_id

            def failed() -> bool:
                return environment(c, env.id).status is EnvStatus.FAILED

            if platform in REPLACES_PODS:
                await async_wait_until(replaced, WAIT_S, message=env.id)
            elif platform in MAY_REPLACE_PODS:
                await async_wait_until(lambda: replaced() or failed(), WAIT_S, message=env.id)
            else:
                await async_wait_until(failed, WAIT_S, message=env.id)
            kept = not failed()
            # The node kills the pod's processes: the agent's first (so the environment ends), its trial's after.
            await async_wait_until(lambda: all(pid_gone(p) for p in pids), WAIT_S, message="pod processes lived")
            # A replacement environment (or the replaced pod's) takes the next trial.
            after = await c.submit({"x": 2})
            done = await after.wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED, done.reason
            assert kept or done.environment_id != env.id
            experiment_id = c.experiment_id
        assert _ours(kube_cluster, experiment_id) == []

    run_async(body, timeout=180)


# ---- the coordinator dies -----------------------------------------------------------------


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


@pytest.mark.slow
@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
def test_resume_after_a_crash_adopts_its_pods_and_sweeps_strays(
    kube_cluster: KubeCluster, tmp_path: Path, platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path, GATED_TRIAL)
    gate = tmp_path / "gate"
    data = _config_data(kube_cluster, tmp_path, platform, **extra)
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
        wait_until(
            lambda: sum(t["status"] == "RUNNING" for t in stored_rows(exp, "trials")) == 2 or first.poll() is not None,
            WAIT_S,
            message="two trials never ran",
        )
        assert first.poll() is None, first.communicate()[0].decode(errors="replace")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        experiment_id = Store.in_dir(exp, readonly=True).experiment()["id"]
        known = {str(e["id"]) for e in stored_rows(exp, "envs")}
        # An environment the dead coordinator asked for but never recorded: a stray.
        config = parse_config(data, tmp_path / "code")
        stray_service = create_service(config, exp)
        token = (exp / ".token").read_text().strip()

        async def start_stray_then_sweep() -> list[str]:
            await stray_service.prepare()
            started = await stray_service.start(
                EnvironmentRequest("env-99", experiment_id, "127.0.0.1:9", token, ("--reconnect-window", "60"))
            )
            assert started.error is None, started.error
            fresh = create_service(config, exp)  # knows nothing: works from the labels alone
            try:
                return await fresh.sweep(experiment_id, keep=known)
            finally:
                await fresh.close()
                await stray_service.close()

        assert run_async(start_stray_then_sweep) == ["env-99"]
        kind = kind_of(config.training_service)  # type: ignore[arg-type]
        names = {o["metadata"]["name"] for o in _ours(kube_cluster, experiment_id) if o["kind"] == kind.kind}
        assert len(names) == 2, names

        resumed = _cli("resume", str(exp), "--quiet")
        wait_until(
            lambda: _reconnected(exp, known) or resumed.poll() is not None,
            WAIT_S,
            message="the agents did not come back",
        )
        gate.write_text("")
        out, _ = resumed.communicate(timeout=WAIT_S)
        assert resumed.returncode == 0, out.decode(errors="replace")
        trials = stored_rows(exp, "trials")
        assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["status"], t["reason"]) for t in trials]
        # The agents from before the crash finished the trials: adopted, not replaced.
        assert {str(e["id"]) for e in stored_rows(exp, "envs")} == known
        assert _ours(kube_cluster, experiment_id) == []
    finally:
        for proc in (first, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


# ---- errors are data ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_training_operators_own_webhook_refuses_a_job_it_cannot_run(
    kube_cluster: KubeCluster, kubeflow_operator: Any
) -> None:
    # Its validating webhook is live: the operator itself, not a schema of ours, refuses a
    # PyTorchJob whose Master has no container named "pytorch" or more than one replica.
    template = {"spec": {"containers": [{"name": "main", "image": "registry.example/tk:1"}]}}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "tk-webhook-probe"},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 2, "restartPolicy": "Never", "template": template}}}}
    status, answer = kube_cluster.request("POST", f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs", job)
    message = answer.get("message", "")
    assert status == 403 and "denied the request" in message, (status, message)
    assert "pytorch" in message and "must be 1" in message, message
    assert kube_cluster.request("GET", f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs/tk-webhook-probe")[0] == 404


@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
@pytest.mark.slow
def test_a_refused_object_is_a_start_error_not_an_exception(
    kube_cluster: KubeCluster, tmp_path: Path, platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path)
    data = _config_data(kube_cluster, tmp_path, platform, tolerations=[{"key": "gpu", "operatorr": "Exists"}], **extra)
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", f"refused{kind_of(service.config).kind.lower()}", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        result = await service.start(request)
        # The server refuses the unknown field (it would drop it silently if not asked to be
        # strict), in an operator's object too: its CRD's schema has the pod template's fields.
        assert result.error is not None and "operatorr" in result.error, result.error
        assert (await service.poll(["env-1"]))["env-1"].state == "failed"
        await service.stop("env-1")
        await service.stop("never-started")
        await service.close()

    run_async(body)
    assert _ours(kube_cluster, request.experiment_id) == []


@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
@pytest.mark.slow
def test_an_image_without_the_python_fails_the_environment_with_the_reason(
    kube_cluster: KubeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path)
    data = _config_data(kube_cluster, tmp_path, platform, python="/no/such/python", **extra)
    # No kubeconfig in the config: $KUBECONFIG names it, as for kubectl.
    monkeypatch.setenv("KUBECONFIG", data["trainingService"].pop("kubeconfig"))
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", f"nopython{kind_of(service.config).kind.lower()}", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        seen = await poll_until(service, "env-1", "failed", wait_s=WAIT_S)
        assert "/no/such/python" in seen.detail and "StartError" in seen.detail, seen
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    assert _ours(kube_cluster, request.experiment_id) == []


@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
@pytest.mark.slow
def test_an_image_that_cannot_be_pulled_fails_the_environment_after_image_pull_timeout(
    kube_cluster: KubeCluster, tmp_path: Path, platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path)
    data = _config_data(kube_cluster, tmp_path, platform, image=f"registry.example/{NO_SUCH_IMAGE}:1",
                        imagePullTimeout="1s", **extra)
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", f"pull{kind_of(service.config).kind.lower()}", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        # A registry may be down for a while: waiting, saying why (the kubelet says
        # ErrImagePull after a failed pull, ImagePullBackOff while it waits to try again)...
        seen = await poll_until(service, "env-1", "starting", NO_SUCH_IMAGE, wait_s=WAIT_S)
        assert "ErrImagePull" in seen.detail or "ImagePullBackOff" in seen.detail, seen
        # ...until imagePullTimeout, then failed with the reason.
        seen = await poll_until(service, "env-1", "failed", "could not be pulled", wait_s=WAIT_S)
        assert NO_SUCH_IMAGE in seen.detail, seen
        assert "ErrImagePull" in seen.detail or "ImagePullBackOff" in seen.detail, seen
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    assert _ours(kube_cluster, request.experiment_id) == []


@pytest.mark.slow
@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
def test_an_api_server_out_of_reach_keeps_what_was_seen_last_and_says_so(
    kube_cluster: KubeCluster, tmp_path: Path, platform: str, extra: dict[str, Any]
) -> None:
    # The API server unreachable is no news about the workload: the service reports what it
    # saw last, says why it cannot tell more, and carries on once the server answers again.
    quickstart_code(tmp_path)
    experiment_id = f"unreach-{platform}-{secrets.token_hex(3)}"

    async def body() -> None:
        proxy = await CuttingProxy().start()
        proxy.target = ("127.0.0.1", kube_cluster.plane.port)
        kubeconfig = kube_cluster.write_kubeconfig(tmp_path / "kubeconfig-proxy", server=f"https://127.0.0.1:{proxy.port}")
        data = _config_data(kube_cluster, tmp_path, platform, kubeconfig=str(kubeconfig), apiTimeout="3s", **extra)
        service = service_from_config(
            KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp"
        )
        request = EnvironmentRequest("env-1", experiment_id, "127.0.0.1:9", "t0ken")
        try:
            assert (await service.start(request)).error is None
            before = await poll_until(service, "env-1", "running", wait_s=WAIT_S)
            proxy.target = None  # new connections are refused...
            proxy.cut()  # ...and the open ones broken
            seen = (await service.poll(["env-1"]))["env-1"]
            assert seen.state == before.state and "cannot ask the API server" in seen.detail, seen
            assert seen.platform_id == before.platform_id
            proxy.target = ("127.0.0.1", kube_cluster.plane.port)
            seen = (await service.poll(["env-1"]))["env-1"]
            assert "cannot ask" not in seen.detail and seen.state in ("running", "exited", "failed"), seen
            await service.stop("env-1", 0.0)
            await service.close()
        finally:
            await proxy.close()

    run_async(body)
    assert _ours(kube_cluster, experiment_id) == []


@pytest.mark.slow
def test_an_environment_failing_to_start_is_removed_at_once(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    quickstart_code(tmp_path)
    data = _config_data(kube_cluster, tmp_path, image=f"registry.example/{NO_SUCH_IMAGE}:1", imagePullTimeout="1s")
    config = parse_config(data, tmp_path / "code")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await c.submit({"x": 1})
            failed = await async_wait_until(
                lambda: [e for e in c.environments() if e.status is EnvStatus.FAILED],
                WAIT_S,
                message="no environment failed",
            )
            assert "could not be pulled" in failed[0].reason and NO_SUCH_IMAGE in failed[0].reason, failed[0].reason
            # Its pod (which would hold its node's GPUs) is deleted now, not at the experiment's end.
            name = object_name(c.experiment_id, failed[0].id)
            await async_wait_until(
                lambda: not [o for o in kube_cluster.objects("pods") if o["metadata"]["name"] == name], WAIT_S,
                message=f"pod {name} of a failed environment is still there",
            )

    run_async(body)


@pytest.mark.slow
@pytest.mark.parametrize(("platform", "extra"), FLAVOURS)
def test_long_and_odd_ids_still_make_names_and_labels_the_server_takes(
    kube_cluster: KubeCluster, tmp_path: Path, platform: str, extra: dict[str, Any]
) -> None:
    # RFC 1123 names (lowercase, at most 63 with what controllers append) and label values
    # (at most 63, alphanumeric at both ends): the server refuses anything else.
    quickstart_code(tmp_path)
    data = _config_data(kube_cluster, tmp_path, platform, **extra)
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    experiment_id = f"An_Experiment.Named-{platform}-{extra}-" + "x" * 80
    env_id = "Env_" + "y" * 70 + "."
    request = EnvironmentRequest(env_id, experiment_id, "127.0.0.1:9", "t0ken")

    async def body() -> None:
        started = await service.start(request)
        assert started.error is None, started.error
        assert started.platform_id is not None and len(started.platform_id) <= 63
        await async_wait_until(lambda: kube_cluster.objects("pods", selector=selector(experiment_id, env_id)), WAIT_S,
                               message="no pod carries the environment's labels")
        pod = kube_cluster.objects("pods", selector=selector(experiment_id, env_id))[0]
        # The exact ids are kept beside the labels, which had to be shortened.
        notes = pod["metadata"]["annotations"]
        assert (notes["trialkeeper/experiment-id"], notes["trialkeeper/environment-id"]) == (experiment_id, env_id), (
            notes
        )
        await service.stop(env_id, 0.0)
        await service.close()

    run_async(body)
    assert _ours(kube_cluster, experiment_id) == []


# The flavours whose pod exists while it waits for a node (AdaptDL's allocator creates none
# until a node fits).
PLACED_BY_THE_NODE = [p for p in FLAVOURS if p.values[0] != "adl"]


@pytest.mark.parametrize(("platform", "extra"), PLACED_BY_THE_NODE)
@pytest.mark.slow
def test_pod_placement_fields_reach_the_scheduler(
    kube_cluster: KubeCluster, tmp_path: Path, platform: str, extra: dict[str, Any]
) -> None:
    quickstart_code(tmp_path)
    gpus = int(kube_cluster.node.capacity["nvidia.com/gpu"]) + 1  # more than the node has
    status, answer = kube_cluster.request(
        "POST",
        f"/api/v1/namespaces/{NS}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer"}},
    )
    assert status in (201, 409), answer
    data = _config_data(
        kube_cluster, tmp_path, gpuNumber=gpus, nodeSelector={"kubernetes.io/os": "linux"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        serviceAccountName="trainer", imagePullSecrets=[{"name": "regcred"}], platform=platform, **extra,
    )
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", f"placement{kind_of(service.config).kind.lower()}", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        # The node has fewer GPUs: the pod waits, and the service says why.
        seen = await poll_until(service, "env-1", "starting", "Insufficient nvidia.com/gpu", wait_s=WAIT_S)
        assert seen.platform_id == object_name(request.experiment_id, "env-1", kind_of(service.config))
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    pod = next(o for o in _created(kube_cluster, request.experiment_id) if o["kind"] == "Pod")
    spec = pod["spec"]
    assert spec["containers"][0]["resources"]["limits"] == {
        "cpu": "1",
        "memory": str(512 * 2**20),
        "nvidia.com/gpu": str(gpus),
    }
    assert "--no-gpu" not in spec["containers"][0]["args"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"} and spec["serviceAccountName"] == "trainer"
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu" and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert _ours(kube_cluster, request.experiment_id) == []


@pytest.mark.slow
def test_a_workload_created_while_a_poll_lists_is_not_taken_for_deleted(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    # A listing answered before a workload was created does not have it; it must not be
    # taken for deleted. The lifecycle observes only environments whose launch had finished
    # when the poll began: here env-1's create completes while a poll's listing, answered
    # before it, is on its way, and that poll never judges env-1.
    quickstart_code(tmp_path)
    data = _config_data(kube_cluster, tmp_path)
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    requests = [EnvironmentRequest(f"env-{i}", "racing1", "127.0.0.1:9", "t0ken") for i in (0, 1)]

    async def body() -> None:
        assert (await service.start(requests[0])).error is None
        real_launch, real_observe = service.launch, service.observe
        go = asyncio.Event()
        judged: list[list[str]] = []

        async def held_launch(env: Any, req: EnvironmentRequest) -> str:
            if req.env_id == "env-1":
                await go.wait()
            return await real_launch(env, req)

        async def answered_before_the_create(records: Any) -> Any:
            judged.append([r.env_id for r in records])
            answer = await real_observe(records)
            if not go.is_set():
                go.set()
                await first  # the create completes while the answer is on its way
            return answer

        service.launch = held_launch  # type: ignore[method-assign]
        service.observe = answered_before_the_create  # type: ignore[method-assign]
        first = asyncio.ensure_future(service.start(requests[1]))
        await async_wait_until(lambda: "env-1" in service._starting, 10.0,
                               message="the start never began")
        assert (await service.poll(["env-1"]))["env-1"].state == "starting"
        assert (await first).error is None
        assert judged and judged[0] == ["env-0"], judged

        async def judged_by_a_later_poll() -> bool:
            await service.poll(["env-1"])
            return any("env-1" in ids for ids in judged)

        await async_wait_until(judged_by_a_later_poll, 30.0, message="no later poll judged env-1")
        seen = (await service.poll(["env-1"]))["env-1"]
        assert seen.state in ("starting", "running") and "deleted" not in seen.detail, seen
        service.observe = real_observe  # type: ignore[method-assign]
        assert (await service.poll(["env-1"]))["env-1"].state in ("starting", "running")
        for request in requests:
            await service.stop(request.env_id, 0.0)
        await service.close()

    run_async(body)
    assert _ours(kube_cluster, "racing1") == []


# ---- config (no cluster) -------------------------------------------------------------------


def test_config_takes_nni_field_forms_and_reports_every_problem(tmp_path: Path) -> None:
    def ts(section: dict[str, Any]) -> Any:
        return parse_config(
            {"trialCommand": "x", "trialConcurrency": 2, "trainingService": section}, tmp_path
        ).training_service

    kubeflow = ts({"platform": "kubeflow", "image": "i", "operator": "tf-operator", "gpuNumber": 1,
                   "imagePullSecrets": [{"name": "regcred"}], "memorySize": "8Gi", "nodeSelector": {"pool": "gpu"}})
    assert isinstance(kubeflow, KubeflowConfig)
    assert (kubeflow.operator, kubeflow.image_pull_secrets, kubeflow.memory_size) == ("tfjob", ["regcred"], 8 * 2**30)
    adl = ts(
        {"platform": "adl", "image": "i", "adaptive": True, "checkpoint": {"storageClass": "dfs", "storageSize": "1Gi"}}
    )
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
