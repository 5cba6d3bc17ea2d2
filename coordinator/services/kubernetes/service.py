"""Kubernetes environments: one workload per environment, running one agent.

One service serves four platforms, which differ only in the object that wraps the pod:
``kubernetes`` (a bare Pod or a batch Job), ``kubeflow`` (a PyTorchJob's Master or a TFJob's
Worker), ``frameworkcontroller`` (a Framework with one task role) and ``adl`` (an
AdaptDLJob). The bodies are built as plain JSON by the functions in ``_k8s_objects``, which
also read their status; the service here talks to the API server through the official
client, whose calls block: each runs in a thread with a timeout, and every failure comes
back as data.

Every object carries the labels ``trialkeeper/experiment`` and ``trialkeeper/environment``,
so a fresh service finds what a crashed coordinator left (``sweep``). The experiment token
lives in one Secret per experiment and reaches the agent as an env var taken from it
(``secretKeyRef``): never a literal in the pod spec, never an argument.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._launch import agent_argv, copy_code
from .._record import EnvRecord
from ..base import EnvironmentRequest, EnvironmentService, Observation, StartResult
from .config import AdlConfig, KubernetesPlatformConfig
from .objects import (
    POD,
    PVC,
    SECRET,
    Kind,
    checkpoint_claim,
    checkpoint_claim_name,
    ids_of,
    kind_of,
    object_name,
    observe,
    pod_state,
    pull_failure,
    secret_name,
    selector,
    template_pod,
    token_secret,
    workload,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
STOP_WAIT_S = 20.0  # after the grace period: how long stop() waits for the pods to go


class KubernetesSetupError(ValueError):
    """The service cannot be created as configured (client missing, kubeconfig unusable)."""


class _ApiFailure(Exception):
    """A call to the API server failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ---- the service -----------------------------------------------------------------------


@dataclass
class _Env(EnvRecord):
    experiment_id: str | None = None  # None when adopted, until its labels are read
    last: Observation | None = None
    pull_failing_since: float | None = None  # monotonic; while its pod cannot pull the image

    @property
    def name(self) -> str:
        """The workload's name, which is its platform id."""
        return self.platform_id


class KubernetesEnvironmentService(EnvironmentService[KubernetesPlatformConfig]):
    """Starts agents as Kubernetes workloads; see the module docstring."""

    platform = "kubernetes"
    shares_filesystem = False

    def __init__(self, config: KubernetesPlatformConfig, experiment_dir: Path, code_directory: Path,
                 api_client: Any, *, exclude: tuple[Path, ...] = ()) -> None:
        from kubernetes import client

        self.config = config
        self.platform = config.platform  # type: ignore[misc]  # one class serves four platforms
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.exclude = exclude
        self._api = api_client
        self._core = client.CoreV1Api(api_client)
        self._batch = client.BatchV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._kind = kind_of(config)
        self._envs: dict[str, _Env] = {}
        self._secret: asyncio.Future[None] | None = None
        self._secret_name = ""
        # <storage>/<subdir> holds this experiment's code and agent directories.
        digest = hashlib.sha256(str(experiment_dir.resolve()).encode()).hexdigest()[:8]
        self._subdir = f"trialkeeper/{experiment_dir.name}-{digest}"

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: KubernetesPlatformConfig, experiment_dir: Path) -> Self:
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, experiment_dir, Path(config.trial_code_directory), _api_client(ts), exclude=exclude)

    # ---- the contract -----------------------------------------------------------------

    def working_directory(self) -> str:
        c = self.config
        if c.local_mount_path is not None:
            return f"{c.container_mount_path.rstrip('/')}/{self._subdir}/code"
        return c.container_code_directory or "."

    async def prepare(self) -> None:
        local = self.config.local_mount_path
        if local is None:
            return
        target = local / self._subdir / "code"
        await asyncio.to_thread(copy_code, self.code_directory, target, (*self.exclude, local.resolve()))
        log.info("%s: trial code copied to %s (pods see it at %s)", self.platform, target, self.working_directory())

    def adopt(self, env_id: str, platform_id: str) -> None:
        if platform_id and env_id not in self._envs:
            self._envs[env_id] = _Env(env_id, platform_id, adopted=True)

    async def start(self, request: EnvironmentRequest) -> StartResult:
        env = self._envs.get(request.env_id)
        if env is None:
            name = object_name(request.experiment_id, request.env_id)
            env = self._envs[request.env_id] = _Env(request.env_id, name, experiment_id=request.experiment_id)
        elif env.adopted:
            return StartResult(platform_id=env.name)  # started by an earlier coordinator
        if env.starting is None:
            env.starting = asyncio.ensure_future(self._start(env, request))
        return await asyncio.shield(env.starting)

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        out = {i: Observation("unknown") for i in env_ids if i not in self._envs}
        known = [self._envs[i] for i in env_ids if i in self._envs]
        for experiment_id, envs in (await self._by_experiment(known)).items():
            # A workload created while the list below is on its way is not in the answer,
            # yet it is not gone: it is still being created as far as this answer tells.
            creating = {env.env_id for env in envs if env.starting is not None and not env.starting.done()}
            try:
                found = {o["metadata"]["name"]: o for o in await self._list(self._kind, selector(experiment_id))}
            except _ApiFailure as e:
                for env in envs:  # the platform cannot be asked now: what was seen last, not a guess
                    prev = env.last or Observation("starting")
                    out[env.env_id] = Observation(prev.state, f"cannot ask the API server: {e}", env.name)
                continue
            for env in envs:
                obj = found.get(env.name)
                if obj is None:
                    env.last = Observation("starting", "being created", env.name) if env.env_id in creating else self._missing(env)
                else:
                    env.last = await self._observe(env, experiment_id, obj)
            await self._check_image_pulls(experiment_id, envs, found)
            out.update({env.env_id: env.last for env in envs if env.last is not None})
        for env in known:  # not asked this time (the API server did not answer): as last seen
            out.setdefault(env.env_id, env.last or Observation("starting", "waiting for the API server", env.name))
        return out

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        env = self._envs.get(env_id)
        if env is None:
            return
        env.stop_requested = True
        if env.starting is not None and not env.starting.done():
            await asyncio.wait([env.starting], timeout=self.config.api_timeout + CONNECT_TIMEOUT_S)
        try:
            if env.experiment_id is None:
                await self._by_experiment([env])
            await self._delete_env(env.name, grace_s)
            if env.experiment_id is not None:
                await self._wait_pods_gone(env.experiment_id, env.env_id, grace_s + STOP_WAIT_S)
        except _ApiFailure as e:
            log.warning("environment %s: could not delete %s %s: %s", env_id, self._kind.kind, env.name, e)

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        try:
            found = await self._list(self._kind, selector(experiment_id))
        except _ApiFailure as e:
            log.warning("sweep of experiment %s: cannot list %s: %s", experiment_id, self._kind.plural, e)
            return []
        deleted: list[str] = []
        for obj in found:
            exp, env_id = ids_of(obj)
            if env_id is None or exp != experiment_id or env_id in keep:
                continue
            try:
                await self._delete_env(obj["metadata"]["name"], 0.0)
            except _ApiFailure as e:
                log.warning("sweep: could not remove %s %s: %s", self._kind.kind, obj["metadata"]["name"], e)
                continue
            if env_id in self._envs:
                self._envs[env_id].stop_requested = True
            deleted.append(env_id)
        removed: list[str] = []
        for env_id in deleted:  # all deletions are under way; now wait for their pods together
            try:
                await self._wait_pods_gone(experiment_id, env_id, STOP_WAIT_S)
                removed.append(env_id)
            except _ApiFailure as e:
                log.warning("sweep: cannot tell whether the pods of %s are gone: %s", env_id, e)
        if isinstance(self.config, AdlConfig):
            await self._sweep_claims(experiment_id, keep)
        if not keep:
            await self._delete_quietly(SECRET, secret_name(experiment_id))
        if removed:
            log.info("sweep of experiment %s: removed %s", experiment_id, ", ".join(removed))
        return removed

    async def _sweep_claims(self, experiment_id: str, keep: Collection[str]) -> None:
        """Checkpoint claims whose AdaptDLJob is gone already (a crash between two deletes)."""
        try:
            claims = await self._list(PVC, selector(experiment_id))
        except _ApiFailure as e:
            log.warning("sweep of experiment %s: cannot list its checkpoint claims: %s", experiment_id, e)
            return
        for claim in claims:
            if ids_of(claim)[1] not in keep:
                await self._delete_quietly(PVC, claim["metadata"]["name"])

    async def close(self) -> None:
        if self._secret is not None and self._secret.done() and not self._secret.cancelled() and not self._secret.exception():
            await self._delete_quietly(SECRET, self._secret_name)
        await asyncio.to_thread(self._api.close)

    # ---- starting ---------------------------------------------------------------------

    async def _start(self, env: _Env, request: EnvironmentRequest) -> StartResult:
        began = time.monotonic()
        try:
            await self._ensure_secret(request)
            if isinstance(self.config, AdlConfig) and self.config.checkpoint is not None:
                await self._create(PVC, checkpoint_claim(self.config, request, env.name), exists_ok=True)
            body = workload(self._kind, self.config, request, env.name, self._agent_argv(request))
            if not self._kind.checks_template:
                await self._create(POD, template_pod(body), exists_ok=False, dry_run=True)
            await self._create(self._kind, body, exists_ok=True)
        except _ApiFailure as e:
            env.last = Observation("failed", str(e), env.name)
            return StartResult(error=f"{self.platform}: could not create {self._kind.kind} {env.name}: {e}")
        log.info("environment %s: %s %s created in %.2f s", env.env_id, self._kind.kind, env.name, time.monotonic() - began)
        return StartResult(platform_id=env.name)

    def _agent_argv(self, request: EnvironmentRequest) -> list[str]:
        c = self.config
        workdir = None
        if c.local_mount_path is not None:
            # On the shared storage: each trial works in a copy of the code; agent files persist.
            workdir = f"{c.container_mount_path.rstrip('/')}/{self._subdir}/envs/{request.env_id}"
        return agent_argv(request.coordinator_address, request.env_id, self.platform, python=c.python,
                          workdir=workdir, copy_working_directory=workdir is not None, no_gpu=c.gpu_number == 0,
                          agent_args=request.agent_args)

    async def _ensure_secret(self, request: EnvironmentRequest) -> None:
        if self._secret is None or (self._secret.done() and (self._secret.cancelled() or self._secret.exception())):
            self._secret_name = secret_name(request.experiment_id)
            self._secret = asyncio.ensure_future(self._put_secret(request))
        await asyncio.shield(self._secret)

    async def _put_secret(self, request: EnvironmentRequest) -> None:
        body = token_secret(self.config, request)
        try:
            await self._create(SECRET, body, exists_ok=False)
        except _ApiFailure as e:
            if e.status != 409:
                raise
            # Left by an earlier coordinator of this experiment: make sure it holds this token.
            await self._call(self._core.replace_namespaced_secret, body["metadata"]["name"], self.config.namespace, body)

    # ---- calls ------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        kwargs["_request_timeout"] = (CONNECT_TIMEOUT_S, self.config.api_timeout)
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as e:
            raise _ApiFailure(e.status or 0, _api_message(e)) from None
        except Exception as e:  # noqa: BLE001 - urllib3/socket errors: the server did not answer
            raise _ApiFailure(0, f"{type(e).__name__}: {e}") from None

    async def _create(self, kind: Kind, body: dict[str, Any], *, exists_ok: bool, dry_run: bool = False) -> None:
        ns = self.config.namespace
        # Strict: a field the server does not know (a misspelt toleration key, say) is refused
        # with its name, where the server's default would drop it with a mere warning.
        strict: dict[str, str] = {"field_validation": "Strict"}
        if dry_run:  # checked and admitted, not stored
            strict["dry_run"] = "All"
        try:
            if kind.custom:
                await self._call(self._custom.create_namespaced_custom_object, kind.group, kind.version, ns,
                                 kind.plural, body, **strict)
            else:
                create: dict[str, Callable[..., Any]] = {
                    "pods": self._core.create_namespaced_pod, "secrets": self._core.create_namespaced_secret,
                    "persistentvolumeclaims": self._core.create_namespaced_persistent_volume_claim,
                    "jobs": self._batch.create_namespaced_job}
                await self._call(create[kind.plural], ns, body, **strict)
        except _ApiFailure as e:
            if not (exists_ok and e.status == 409):
                raise

    async def _list(self, kind: Kind, label_selector: str) -> list[dict[str, Any]]:
        ns = self.config.namespace
        if kind.custom:
            answer = await self._call(self._custom.list_namespaced_custom_object, kind.group, kind.version, ns,
                                      kind.plural, label_selector=label_selector)
            return list(answer.get("items", []))
        list_fn = {"pods": self._core.list_namespaced_pod, "jobs": self._batch.list_namespaced_job,
                   "persistentvolumeclaims": self._core.list_namespaced_persistent_volume_claim}[kind.plural]
        answer = await self._call(list_fn, ns, label_selector=label_selector)
        return [self._api.sanitize_for_serialization(item) for item in answer.items]

    async def _get(self, kind: Kind, name: str) -> dict[str, Any] | None:
        ns = self.config.namespace
        try:
            if kind.custom:
                return dict(await self._call(self._custom.get_namespaced_custom_object, kind.group, kind.version, ns, kind.plural, name))
            read = {"pods": self._core.read_namespaced_pod, "jobs": self._batch.read_namespaced_job}[kind.plural]
            return dict(self._api.sanitize_for_serialization(await self._call(read, name, ns)))
        except _ApiFailure as e:
            if e.status == 404:
                return None
            raise

    async def _delete(self, kind: Kind, name: str, grace_s: float) -> None:
        ns = self.config.namespace
        options = {"grace_period_seconds": max(0, int(grace_s)), "propagation_policy": "Background"}
        try:
            if kind.custom:
                await self._call(self._custom.delete_namespaced_custom_object, kind.group, kind.version, ns,
                                 kind.plural, name, **options)
            else:
                delete = {"pods": self._core.delete_namespaced_pod, "jobs": self._batch.delete_namespaced_job,
                          "secrets": self._core.delete_namespaced_secret,
                          "persistentvolumeclaims": self._core.delete_namespaced_persistent_volume_claim}[kind.plural]
                await self._call(delete, name, ns, **options)
        except _ApiFailure as e:
            if e.status != 404:
                raise

    async def _delete_env(self, name: str, grace_s: float) -> None:
        await self._delete(self._kind, name, grace_s)
        if isinstance(self.config, AdlConfig) and self.config.checkpoint is not None:
            await self._delete(PVC, checkpoint_claim_name(name), 0.0)

    async def _delete_quietly(self, kind: Kind, name: str) -> None:
        try:
            await self._delete(kind, name, 0.0)
        except _ApiFailure as e:
            log.warning("could not delete %s %s: %s", kind.plural, name, e)

    async def _wait_pods_gone(self, experiment_id: str, env_id: str, timeout: float) -> None:
        """Deletion is accepted at once; the pods go once their processes are gone."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while await self._list(POD, selector(experiment_id, env_id)):
            if time.monotonic() >= deadline:
                log.warning("environment %s: its pods are still terminating after %.0f s", env_id, timeout)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _observe(self, env: _Env, experiment_id: str, obj: dict[str, Any]) -> Observation:
        state, detail = observe(self._kind, obj)
        if state == "failed" and self._kind is not POD:
            if env.last is not None and env.last.state == "failed":
                return env.last  # the pod's story is already told
            # An operator's own words are often terse: add how the container ended.
            try:
                pods = await self._list(POD, selector(experiment_id, env.env_id))
            except _ApiFailure:
                pods = []
            ended = [d for _, d in (pod_state(p.get("status") or {}) for p in pods) if d]
            detail = "; ".join(d for d in (detail, *ended) if d)
        return Observation(state, detail or f"{self._kind.kind} {env.name} failed", env.name)

    async def _check_image_pulls(self, experiment_id: str, envs: list[_Env], found: dict[str, dict[str, Any]]) -> None:
        """Fail an environment whose pod has been failing to pull its image for longer than
        imagePullTimeout: a wrong image name or a missing pull secret waits forever. An
        operator's workload that is only "created" says why its pod waits (no node fits it)."""
        starting = [e for e in envs if e.last is not None and e.last.state == "starting"]
        if not starting:
            return
        if self._kind is POD:
            pods = [found[e.name] for e in starting if e.name in found]
        else:  # the workloads' pods: one listing for the experiment
            try:
                pods = await self._list(POD, selector(experiment_id))
            except _ApiFailure:
                return
        failures: dict[str, str] = {}
        waiting: dict[str, str] = {}  # an operator's pod: why it has not started yet
        for pod in pods:
            why = pull_failure(pod)
            env_id = ids_of(pod)[1]
            if why and env_id:
                failures[env_id] = why
            state, detail = pod_state(pod.get("status") or {})
            if self._kind is not POD and env_id and state == "starting" and detail:
                waiting[env_id] = detail
        now = time.monotonic()
        for env in starting:
            why = failures.get(env.env_id, "")
            if not why:
                env.pull_failing_since = None
                if env.env_id in waiting:
                    env.last = Observation("starting", waiting[env.env_id], env.name)
                continue
            if env.pull_failing_since is None:
                env.pull_failing_since = now
            waited = now - env.pull_failing_since
            assert env.last is not None
            if waited >= self.config.image_pull_timeout:
                env.last = Observation("failed", f"the image could not be pulled for {waited:.0f} s: {why}", env.name)
            else:
                env.last = Observation("starting", why, env.name)

    async def _by_experiment(self, envs: list[_Env]) -> dict[str, list[_Env]]:
        """Group by experiment; an adopted environment's comes from its object's labels."""
        groups: dict[str, list[_Env]] = {}
        for env in envs:
            if env.experiment_id is None:
                try:
                    obj = await self._get(self._kind, env.name)
                except _ApiFailure:
                    continue  # asked again on the next poll
                if obj is None:
                    env.last = self._missing(env)
                    continue
                env.experiment_id = ids_of(obj)[0]
            if env.experiment_id is not None:
                groups.setdefault(env.experiment_id, []).append(env)
        return groups

    def _missing(self, env: _Env) -> Observation:
        if env.stop_requested:
            return Observation("exited", "deleted", env.name)
        if env.starting is not None and not env.starting.done():
            return Observation("starting", "being created", env.name)
        if env.starting is not None and env.starting.result().error:
            return Observation("failed", env.starting.result().error or "", env.name)
        return Observation("failed", f"{self._kind.kind} {env.name} was deleted", env.name)


def _api_message(e: Exception) -> str:
    body = getattr(e, "body", None)
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    return f"{getattr(e, 'status', '?')} {getattr(e, 'reason', '')}: {message or body or e}"


def _api_client(ts: KubernetesPlatformConfig) -> Any:
    """A client for the cluster: the kubeconfig given, else $KUBECONFIG or ~/.kube/config,
    else the pod's own service account (in-cluster)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesSetupError(f"platform {ts.platform} needs the kubernetes client: install trialkeeper[k8s]") from None
    path = ts.kubeconfig
    if path is None:
        env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        default = Path("~/.kube/config").expanduser()
        path = Path(env) if env else default if default.is_file() else None
    try:
        if path is not None:
            return config.new_client_from_config(config_file=str(path), context=ts.context, persist_config=False)
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except Exception as e:  # noqa: BLE001 - a broken file fails deep in yaml or the client: say which file
        where = f"kubeconfig {path}" if path else "no kubeconfig (KUBECONFIG, ~/.kube/config) and not in a cluster"
        raise KubernetesSetupError(f"platform {ts.platform}: cannot use {where}: {e}") from None
