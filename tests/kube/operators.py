"""The real operators as local processes against the test API server of tests/kube.

Kubeflow's training operator (TFJob, PyTorchJob) is the one ``scripts/kube_operators.py``
builds from its Go module; its CRDs and its validating webhooks are its own manifests,
applied as they ship. The only change a loopback cluster needs is where the API server finds
the webhooks: the manifests name a Service a real cluster routes to, here they name
``https://127.0.0.1:<port>`` with a certificate made for the run.

AdaptDL's scheduler is its PyPI package in a virtualenv of its own (same script); its CRD
is ours, since AdaptDL ships it only in a Helm chart. Both start detached from the tests'
process, once per session (the fixtures ``kubeflow_operator`` and ``adaptdl_scheduler``).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import kube_operators  # the build script is the one place that knows the versions

log = logging.getLogger(__name__)

TRAINING_OPERATOR = kube_operators.TRAINING_OPERATOR
# The job kinds trialkeeper creates; the operator runs only their controllers.
SCHEMES = {"tfjob": "tfjobs", "pytorchjob": "pytorchjobs"}
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
WEBHOOK_CONFIGURATION = "trialkeeper-test-training-operator"


def build_command() -> str:
    return "python scripts/kube_operators.py build"


def missing() -> str:
    """Why the operator cannot run here ("" when it can)."""
    if not kube_operators.is_built(TRAINING_OPERATOR):
        return f"the training operator {TRAINING_OPERATOR.version} is not built (run `{build_command()}`)"
    return ""


@dataclass
class RunningOperator:
    name: str
    process: psutil.Process  # started detached: no child of the tests' process
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _start(name: str, argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> RunningOperator:
    from kube.cluster import kube_env

    return RunningOperator(name, kube_env.spawn_detached(argv, log_path, env, cwd), log_path)


def _exited(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stop(process: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except psutil.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _certificate(directory: Path) -> bytes:
    """A self-signed serving certificate for 127.0.0.1, as the webhook server reads it."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(directory / "tls.key"),
            "-out",
            str(directory / "tls.crt"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return (directory / "tls.crt").read_bytes()


def _wait(predicate: Any, timeout: float, what: str, operator: RunningOperator | None = None) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not predicate():
        if operator is not None and _exited(operator.process):
            raise RuntimeError(f"{operator.name} exited while {what}:\n{operator.log_tail()}")
        if time.monotonic() >= deadline:
            tail = f":\n{operator.log_tail()}" if operator is not None else ""
            raise RuntimeError(f"timed out after {timeout:.0f} s {what}{tail}")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def apply_crds(api: Any, bodies: list[dict[str, Any]]) -> None:
    """Create the CRDs (kept if already there) and wait until the server serves them."""
    from kubernetes import client

    ext = client.ApiextensionsV1Api(api)
    for body in bodies:
        _create_quietly(ext.create_custom_resource_definition, body)
    names = [b["metadata"]["name"] for b in bodies]
    _wait(lambda: all(_crd_established(api, n) for n in names), START_TIMEOUT_S,
          f"waiting for CRDs {', '.join(names)} to be established")
    for body in bodies:
        _wait_collected(api, body)


def _wait_collected(api: Any, crd: dict[str, Any]) -> None:
    """Wait until the garbage collector handles the CRD's kind as an owner.

    It learns of new kinds by polling discovery every 30 s; until then the pods of a deleted
    job stay (an operator is installed long before its first job on a real cluster). Probe:
    a ConfigMap owned by an object of the kind that does not exist is collected once the
    collector knows the kind."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api)
    spec = crd["spec"]
    version = next(v["name"] for v in spec["versions"] if v.get("storage"))
    name = f"gc-probe-{spec['names']['plural']}"
    owner = {"apiVersion": f"{spec['group']}/{version}", "kind": spec["names"]["kind"], "name": name,
             "uid": "00000000-0000-0000-0000-000000000000"}
    _create_quietly(core.create_namespaced_config_map, "default",
                    {"metadata": {"name": name, "ownerReferences": [owner]}, "data": {"probe": "gc"}})

    def collected() -> bool:
        try:
            core.read_namespaced_config_map(name, "default", _request_timeout=10)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    _wait(collected, START_TIMEOUT_S, f"waiting for the garbage collector to know {spec['names']['kind']}")


def _webhook_configuration(ca: bytes, port: int) -> dict[str, Any]:
    """The operator's own webhook manifest, its webhooks reached on loopback."""
    path = kube_operators.manifest(TRAINING_OPERATOR, "manifests/base/webhook/manifests.yaml")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    config = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    webhooks = []
    for hook in config["webhooks"]:
        if not set(hook["rules"][0]["resources"]) & set(SCHEMES.values()):
            continue
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{hook['clientConfig']['service']['path']}",
                                "caBundle": base64.b64encode(ca).decode()}
        hook["timeoutSeconds"] = 10
        webhooks.append(hook)
    return {**config, "metadata": {"name": WEBHOOK_CONFIGURATION}, "webhooks": webhooks}


def _answers_tls(port: int, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=2) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1"),
        ):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def training_operator(kubeconfig: Path, workdir: Path) -> Iterator[RunningOperator]:
    """The training operator running against the cluster of ``kubeconfig`` until the block ends."""
    from kubernetes import client, config

    op = TRAINING_OPERATOR
    why = missing()
    if why:
        raise RuntimeError(why)
    api = config.new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    admission = client.AdmissionregistrationV1Api(api)
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    try:
        apply_crds(
            api, [yaml.safe_load(kube_operators.manifest(op, m).read_text()) for m in op.manifests if "/crds/" in m]
        )
        ca = _certificate(workdir / "webhook-certs")
        port = _free_port()
        log_path = workdir / "training-operator.log"
        running = _start(op.name, [str(kube_operators.binary(op)), f"--kubeconfig={kubeconfig}",
                                   *(f"--enable-scheme={s}" for s in SCHEMES), f"--webhook-port={port}",
                                   f"--webhook-cert-dir={workdir / 'webhook-certs'}"],
                         log_path, {**os.environ, "KUBECONFIG": str(kubeconfig)}, workdir)
        try:
            _wait(lambda: _answers_tls(port, workdir / "webhook-certs" / "tls.crt"), START_TIMEOUT_S,
                  "waiting for the training operator's webhook server", running)
            webhooks: Any = _webhook_configuration(ca, port)  # the client takes plain JSON as well as its models
            admission.create_validating_webhook_configuration(webhooks, _request_timeout=30)
            log.info(
                "training operator %s up in %.1f s (webhooks on 127.0.0.1:%d)",
                op.version,
                time.monotonic() - began,
                port,
            )
            yield running
        finally:
            with contextlib.suppress(Exception):
                admission.delete_validating_webhook_configuration(WEBHOOK_CONFIGURATION, _request_timeout=30)
            _stop(running.process)
    finally:
        api.close()


# ---- AdaptDL -----------------------------------------------------------------------------

ADAPTDL_SCHED = kube_operators.ADAPTDL_SCHED
# AdaptDL ships its CRD only in a Helm chart, not in the package: this is ours, with the
# constraints of the chart's (a name short enough for a label value, a pod template, the
# replica bounds) and the status subresource the scheduler writes through.
ADAPTDL_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "adaptdljobs.adaptdl.petuum.com"},
    "spec": {
        "group": "adaptdl.petuum.com", "scope": "Namespaced",
        "names": {"plural": "adaptdljobs", "singular": "adaptdljob", "kind": "AdaptDLJob"},
        "versions": [{
            "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {
                "type": "object", "required": ["spec"],
                "properties": {
                    "metadata": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 63}}},
                    "spec": {
                        "type": "object", "required": ["template"],
                        "properties": {
                            "minReplicas": {"type": "integer", "minimum": 0},
                            "maxReplicas": {"type": "integer", "minimum": 1},
                            "preemptible": {"type": "boolean"},
                            "template": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    },
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            }},
        }],
    },
}


def adaptdl_missing() -> str:
    if not kube_operators.scheduler_installed(ADAPTDL_SCHED):
        return f"AdaptDL's scheduler {ADAPTDL_SCHED.version} is not installed (run `{build_command()}`)"
    return ""


def _create_quietly(create: Any, *args: Any) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        create(*args, _request_timeout=30)
    except ApiException as e:
        if e.status != 409:
            raise


@contextlib.contextmanager
def adaptdl_scheduler(kubeconfig: Path, workdir: Path) -> Iterator[RunningOperator]:
    """AdaptDL's controller and allocator against the cluster of ``kubeconfig``."""
    from kubernetes import config

    why = adaptdl_missing()
    if why:
        raise RuntimeError(why)
    api = config.new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        apply_crds(api, [ADAPTDL_CRD])
        log_path = workdir / "adaptdl-sched.log"
        env = {**os.environ, "ADAPTDL_SCHED_VERSION": ADAPTDL_SCHED.version,
               # Only AdaptDL's training library calls the supervisor; the agent never does.
               "ADAPTDL_SUPERVISOR_URL": "http://127.0.0.1:9/", "PYTHONUNBUFFERED": "1"}
        running = _start(ADAPTDL_SCHED.name, [str(kube_operators.scheduler_python(ADAPTDL_SCHED)),
                                              str(Path(__file__).with_name("adaptdl_sched_main.py")), str(kubeconfig)],
                         log_path, env, workdir)
        try:
            _wait(lambda: "adaptdl scheduler: running" in log_path.read_text(errors="replace"), START_TIMEOUT_S,
                  "waiting for AdaptDL's scheduler", running)
            yield running
        finally:
            _stop(running.process)
    finally:
        api.close()


# ---- FrameworkController -----------------------------------------------------------------

# FrameworkController's Go module is served by no registry these machines reach (the module
# proxy answers 403 for it), so no script here builds it: a binary built elsewhere from its
# public source runs these tests on the real controller when this variable names it.
FRAMEWORKCONTROLLER_ENV = "TRIALKEEPER_FRAMEWORKCONTROLLER"
FRAMEWORK_CRD = "frameworks.frameworkcontroller.microsoft.com"


def frameworkcontroller_missing() -> str:
    path = os.environ.get(FRAMEWORKCONTROLLER_ENV, "")
    if not path:
        return (f"no FrameworkController binary: its module is served by no registry this machine reaches; "
                f"set {FRAMEWORKCONTROLLER_ENV} to the path of one built from its public source")
    if not os.access(path, os.X_OK):
        return f"{FRAMEWORKCONTROLLER_ENV}={path} is not an executable file"
    return ""


@contextlib.contextmanager
def framework_controller(kubeconfig: Path, workdir: Path) -> Iterator[RunningOperator]:
    """FrameworkController against the cluster of ``kubeconfig``; it puts its own CRD there."""
    from kubernetes import client, config

    why = frameworkcontroller_missing()
    if why:
        raise RuntimeError(why)
    workdir.mkdir(parents=True, exist_ok=True)
    # It reads ./frameworkcontroller.yaml; the defaults otherwise (its own retry delays, no
    # pod failure classes: an exit code is a permanent failure, as trialkeeper asks).
    (workdir / "frameworkcontroller.yaml").write_text(yaml.safe_dump(
        {"kubeConfigFilePath": str(kubeconfig), "workerNumber": 4, "kubeClientQps": 50, "kubeClientBurst": 100}))
    api = config.new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    try:
        running = _start("frameworkcontroller", [os.environ[FRAMEWORKCONTROLLER_ENV]],
                         workdir / "frameworkcontroller.log", {**os.environ, "KUBECONFIG": str(kubeconfig)}, workdir)
        try:
            def established() -> bool:
                try:
                    return _crd_established(api, FRAMEWORK_CRD)
                except client.exceptions.ApiException as e:
                    if e.status == 404:
                        return False
                    raise

            _wait(established, START_TIMEOUT_S, "waiting for FrameworkController's CRD", running)
            crd = api.sanitize_for_serialization(
                client.ApiextensionsV1Api(api).read_custom_resource_definition(FRAMEWORK_CRD, _request_timeout=10))
            _wait_collected(api, crd)
            yield running
        finally:
            _stop(running.process)
    finally:
        api.close()


def _crd_established(api: Any, name: str) -> bool:
    from kubernetes import client

    crd = api.sanitize_for_serialization(
        client.ApiextensionsV1Api(api).read_custom_resource_definition(name, _request_timeout=10)
    )
    return any(
        c["type"] == "Established" and c["status"] == "True" for c in (crd.get("status") or {}).get("conditions") or []
    )


# ---- session fixtures' bodies -------------------------------------------------------------


def _ensure(why: str, build: Any) -> None:
    """Built or reused; in CI (or with TRIALKEEPER_KUBE_BUILD=1) built here, waiting for a build
    already under way (the build holds a lock); elsewhere the test is skipped with the command."""
    from kube.cluster import _unavailable

    if not why:
        return
    if not (os.environ.get("CI") or os.environ.get("TRIALKEEPER_KUBE_BUILD")):
        _unavailable(f"{why}   (or set TRIALKEEPER_KUBE_BUILD=1)")
    try:
        build()
    except SystemExit as e:  # the build script's way of saying what failed
        _unavailable(str(e))


def _session(why: str, build: Any, start: Any) -> Iterator[RunningOperator]:
    from kube.cluster import _unavailable

    _ensure(why, build)
    stack = contextlib.ExitStack()
    try:
        running = stack.enter_context(start())
    except RuntimeError as e:  # it exited or never answered: in CI a failure, else a skip
        _unavailable(str(e))
    with stack:
        yield running


def session_training_operator(cluster: Any, tmp_path_factory: Any) -> Iterator[RunningOperator]:
    """The body of the session fixture ``kubeflow_operator``: one operator for the session."""
    yield from _session(missing(), lambda: kube_operators.build(TRAINING_OPERATOR),
                        lambda: training_operator(cluster.kubeconfig, tmp_path_factory.mktemp("training-operator")))


def session_adaptdl_scheduler(cluster: Any, tmp_path_factory: Any) -> Iterator[RunningOperator]:
    """The body of the session fixture ``adaptdl_scheduler``."""
    yield from _session(adaptdl_missing(), lambda: kube_operators.build_scheduler(ADAPTDL_SCHED),
                        lambda: adaptdl_scheduler(cluster.kubeconfig, tmp_path_factory.mktemp("adaptdl-sched")))


def session_framework_controller(cluster: Any, tmp_path_factory: Any) -> Iterator[RunningOperator]:
    """The body of the session fixture ``framework_controller``: skipped, in CI too, without a
    binary (no registry serves its source; tests/fake_k8s.py plays it there)."""
    import pytest

    why = frameworkcontroller_missing()
    if why:
        pytest.skip(why)
    workdir = tmp_path_factory.mktemp("frameworkcontroller")
    yield from _session("", lambda: None, lambda: framework_controller(cluster.kubeconfig, workdir))
