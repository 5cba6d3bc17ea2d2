"""FrameworkController against the fake API server of tests/fake_k8s.py (one Framework per
environment, and one per trial with ``jobPerTrial``).

No registry these machines reach serves FrameworkController's source (the Go module proxy
answers 403 for github.com/microsoft/frameworkcontroller), so CI cannot build it and the fake
plays its part. Where a binary of it is given (TRIALKEEPER_FRAMEWORKCONTROLLER), the same
flavour also runs on the real API server with the real controller, in test_kubernetes.py, as
every other flavour (plain pods and Jobs, Kubeflow, AdaptDL) does. The fake runs each pod's container command as a local
process, so the agents are real and dial back to a real coordinator.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
)
from fake_k8s import NO_SUCH_IMAGE, FakeKubernetes, running, section
from kube.checks import assert_token_only_in_its_secret, poll_until
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.kubernetes.service import KubernetesEnvironmentService
from trialkeeper.coordinator.store.store import Store

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




# ---- end to end --------------------------------------------------------------------------


PLATFORM = "frameworkcontroller"


def test_quickstart_end_to_end(fake: FakeKubernetes, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    quickstart_code(tmp_path)
    config_file = tmp_path / "code" / "config.yml"  # where the quickstart keeps it
    config_file.write_text(yaml.safe_dump(_config_data(fake, tmp_path, PLATFORM)))
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
    assert len(envs) == 2, [(e["id"], e["status"], e["reason"]) for e in envs]
    created = {
        o["metadata"]["name"]
        for o in fake.history
        if o["metadata"].get("labels", {}).get("trialkeeper/experiment") == experiment_id
    }
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
    made = [o for o in fake.history if o["metadata"].get("labels", {}).get("trialkeeper/experiment") == experiment_id]
    token = (exp_dir / ".token").read_text().strip()
    assert_token_only_in_its_secret(made, token)
    assert all(token not in json.dumps(o) for o in made if o["kind"] == "Secret")  # stored encoded


# ---- losing a pod --------------------------------------------------------------------------


def test_deleting_a_pod_mid_trial_loses_its_environment(fake: FakeKubernetes, tmp_path: Path) -> None:
    quickstart_code(tmp_path, GATED_TRIAL)
    data = _config_data(fake, tmp_path, PLATFORM)
    data.update(
        trialCommand="python3 trial.py", trialEnv={"GATE": str(tmp_path / "gate")}, searchSpace={}, maxTrialNumber=None
    )
    del data["searchSpaceFile"]
    config = parse_config(data, tmp_path / "code")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            victim = await c.submit({"x": 1, "wait": True})
            await async_wait_until(lambda: victim.info.status is TrialStatus.RUNNING, WAIT_S, message="trial never ran")
            env = environment(c, victim.info.environment_id)
            labels = {"trialkeeper/experiment": c.experiment_id, "trialkeeper/environment": env.id}
            pod = next(o for o in fake.objects("pods") if labels.items() <= o["metadata"]["labels"].items())
            pids = fake.pod_pids("default", pod["metadata"]["name"])
            assert pids, "the pod runs no process"

            fake.delete_pod("default", pod["metadata"]["name"], grace_s=0)

            info = await victim.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED and "environment lost" in info.reason, info.reason
            await async_wait_until(lambda: environment(c, env.id).status is EnvStatus.FAILED, WAIT_S, message=env.id)
            assert all(pid_gone(p) for p in pids)
            # A replacement environment takes the next trial.
            done = await (await c.submit({"x": 2})).wait(WAIT_S)
            assert done.status is TrialStatus.SUCCEEDED and done.environment_id != env.id, done
            experiment_id = c.experiment_id
        assert _ours(fake, experiment_id) == []

    run_async(body, timeout=120)


# ---- errors are data; config -------------------------------------------------------------


def test_an_image_without_the_python_fails_the_environment_with_the_reason(
    fake: FakeKubernetes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quickstart_code(tmp_path)
    data = _config_data(fake, tmp_path, PLATFORM, python="/no/such/python")
    # No kubeconfig in the config: $KUBECONFIG names it, as for kubectl.
    monkeypatch.setenv("KUBECONFIG", data["trainingService"].pop("kubeconfig"))
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", "nopython", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        seen = await poll_until(service, "env-1", "failed", wait_s=WAIT_S)
        assert "/no/such/python" in seen.detail and "StartError" in seen.detail, seen
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    assert _ours(fake, "nopython") == []


def test_an_image_that_cannot_be_pulled_fails_the_environment_after_image_pull_timeout(
    fake: FakeKubernetes, tmp_path: Path
) -> None:
    quickstart_code(tmp_path)
    data = _config_data(fake, tmp_path, PLATFORM, image=f"registry.example/{NO_SUCH_IMAGE}:1", imagePullTimeout="1s")
    service = service_from_config(KubernetesEnvironmentService, parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest("env-1", "pullframework", "127.0.0.1:9", "t0ken")

    async def body() -> None:
        assert (await service.start(request)).error is None
        # A registry may be down for a while: waiting, saying why...
        seen = await poll_until(service, "env-1", "starting", "ImagePullBackOff", wait_s=WAIT_S)
        assert NO_SUCH_IMAGE in seen.detail, seen
        # ...until imagePullTimeout, then failed with the reason.
        seen = await poll_until(service, "env-1", "failed", "could not be pulled", wait_s=WAIT_S)
        assert "ImagePullBackOff" in seen.detail and NO_SUCH_IMAGE in seen.detail, seen
        await service.stop("env-1", 0.0)
        await service.close()

    run_async(body)
    assert _ours(fake, request.experiment_id) == []


def test_the_fake_refuses_what_a_real_server_refuses(fake: FakeKubernetes) -> None:
    def post(path: str, body: dict[str, Any], token: str = fake.token) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            fake.url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
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
    framework = {"apiVersion": "frameworkcontroller.microsoft.com/v1", "kind": "Framework", "metadata": {"name": "f"},
                 "spec": {"executionType": "Start", "taskRoles": []}}
    code, status = post("/apis/frameworkcontroller.microsoft.com/v1/namespaces/default/frameworks", framework)
    assert code == 422 and "taskRoles" in status["message"], status
    assert fake.objects("pods") == [] or all(o["metadata"]["name"] != "p" for o in fake.objects("pods"))


# ---- one Framework per trial ---------------------------------------------------------------


def test_a_two_node_trial_runs_in_one_framework_with_a_task_per_node(fake: FakeKubernetes, tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "rank.py").write_text(
        "import os\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'task', os.environ['FC_TASK_INDEX'])\n"
    )
    data = {
        "trialCommand": "python3 rank.py", "trialConcurrency": 1, "trialNodes": 2, "searchSpace": {},
        "trialCodeDirectory": str(code), "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 10, "trialLostTimeout": 30},
        "trainingService": section(fake, PLATFORM, tmp_path, environmentCount=2, jobPerTrial=True),
    }
    exp = tmp_path / "exp"

    async def body() -> None:
        async with Coordinator(parse_config(data, code), experiment_dir=exp) as c:
            h = await c.submit({})
            info = await h.wait(WAIT_S * 2)
            assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
            made = [o for o in fake.history
                    if o["metadata"].get("annotations", {}).get("trialkeeper/experiment-id") == c.experiment_id]
            frameworks = [o for o in made if o["kind"] == "Framework"]
            assert len(frameworks) == 1 and frameworks[0]["spec"]["taskRoles"][0]["taskNumber"] == 2, made
            assert len([o for o in made if o["kind"] == "Pod"]) == 2
            # Each rank ran in a task of its own, its agent the environment its task index named.
            lines = [(exp / "trials" / h.id / sub / "stdout.log").read_text().split() for sub in ("", "rank1")]
            assert [ln[:4] for ln in lines] == [["rank", "0", "of", "2"], ["rank", "1", "of", "2"]], lines
            assert sorted(ln[5] for ln in lines) == ["0", "1"]

    run_async(body, timeout=WAIT_S * 2 + 60)
    store = Store.in_dir(exp, readonly=True)
    try:
        envs = store.envs()
    finally:
        store.close()
    assert len(envs) == 2 and len({e["platform_id"] for e in envs}) == 1, envs
