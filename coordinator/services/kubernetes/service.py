"""Kubernetes environments: one workload per environment (per group: ``groups``), one agent each.

One service serves four platforms, which differ only in the object that wraps the pod:
``kubernetes`` (a bare Pod or a batch Job), ``kubeflow`` (a PyTorchJob's Master or a TFJob's
Worker), ``frameworkcontroller`` (a Framework with one task role) and ``adl`` (an
AdaptDLJob). The bodies are built as plain JSON by the functions in ``objects``, which
also read their status; ``api`` talks to the API server. The lifecycle (one start per env
id, polling, stop with grace, sweep, errors as data) is :mod:`..lifecycle`'s: here an
environment is launched (secret, claim, workload), observed (listed by its labels, its
pod's image pulls watched) and terminated (deleted with grace, then its pods waited for).

Every object carries the labels ``trialkeeper/experiment`` and ``trialkeeper/environment``,
so a fresh service finds what a crashed coordinator left (``sweep``). The experiment token
lives in one Secret per experiment and reaches the agent as an env var taken from it
(``secretKeyRef``): never a literal in the pod spec, never an argument.
"""


from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._launch import agent_argv, copy_code
from .._record import Phase
from ..base import EnvironmentRequest, Observation, StartResult
from ..lifecycle import LifecycleService, PlatformError, Record, State
from .api import CONNECT_TIMEOUT_S, ApiFailure, KubeApi, KubernetesSetupError, api_client
from .config import AdlConfig, KubernetesPlatformConfig
from .groups import PLACEHOLDER, group_job, index_variable, member_command
from .objects import (
    POD,
    PVC,
    SECRET,
    checkpoint_claim,
    checkpoint_claim_name,
    ids_of,
    kind_of,
    object_name,
    observe,
    pod_state,
    secret_name,
    selector,
    template_pod,
    token_secret,
    workload,
)
from .pulls import waiting_state

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig

__all__ = ["KubernetesEnvironmentService", "KubernetesSetupError", "object_name"]

log = logging.getLogger(__name__)

STOP_WAIT_S = 20.0  # after the grace period: how long a stop waits for the pods to go
# What the objects' status says, as the lifecycle's phases.
_PHASES: dict[str, Phase] = {
    "starting": "waiting", "running": "running", "exited": "succeeded", "failed": "failed",
}


@dataclass
class _Env(Record):
    """One workload; ``platform_id`` is its name."""

    pull_failing_since: float | None = None  # monotonic; while its pod cannot pull the image

    @property
    def name(self) -> str:
        return self.platform_id


class KubernetesEnvironmentService(LifecycleService[KubernetesPlatformConfig, _Env]):
    """Starts agents as Kubernetes workloads; see the module docstring."""

    platform = "kubernetes"
    shares_filesystem = False
    record_type = _Env
    PLAIN_ERRORS = (PlatformError, ApiFailure)

    def __init__(self, config: KubernetesPlatformConfig, experiment_dir: Path,
                 code_directory: Path, api_client: Any, *, exclude: tuple[Path, ...] = ()) -> None:
        # Every poll asks; a start makes up to five calls (secret, claim, checks, workload).
        super().__init__(poll_interval=0.0,
                         call_timeout=5 * (config.api_timeout + CONNECT_TIMEOUT_S))
        self.config = config
        self.platform = config.platform  # type: ignore[misc]  # one class serves four platforms
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.exclude = exclude
        self._api = KubeApi(config, api_client)
        self._kind = kind_of(config)
        self.kind = self._kind.kind  # type: ignore[misc]  # the workload of this platform
        # jobPerTrial: one PyTorchJob or Framework per group of environments (groups.py).
        self.groups_environments = bool(getattr(config, "job_per_trial", False))
        self._secret: asyncio.Future[None] | None = None
        self._secret_name = ""
        # <storage>/<subdir> holds this experiment's code and agent directories.
        digest = hashlib.sha256(str(experiment_dir.resolve()).encode()).hexdigest()[:8]
        self._subdir = f"trialkeeper/{experiment_dir.name}-{digest}"

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: KubernetesPlatformConfig,
                    experiment_dir: Path) -> Self:
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, experiment_dir, Path(config.trial_code_directory), api_client(ts),
                   exclude=exclude)

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
        await asyncio.to_thread(copy_code, self.code_directory, target,
                                (*self.exclude, local.resolve()))
        log.info("%s: trial code copied to %s (pods see it at %s)",
                 self.platform, target, self.working_directory())

    async def start_group(self, group: str, requests: Sequence[EnvironmentRequest]) -> list[StartResult]:
        """One object for the group: its first member's start makes it, the others are its
        Workers or tasks (the same object; stopping one member stops the group)."""
        if not self.groups_environments:
            return await super().start_group(group, requests)
        return await self.start_as_one(requests)

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        env = self._records.get(env_id)
        if env is not None and env.observation is not None and not env.stop_requested:
            # Ended, yet its workload (a failed Job, a pod that cannot pull its image) holds
            # its object and maybe its node's GPUs until deleted.
            env.observation, env.phase = None, "running"
        await super().stop(env_id, grace_s)

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        removed = await super().sweep(experiment_id, keep)
        if isinstance(self.config, AdlConfig):
            await self._sweep_claims(experiment_id, keep)
        if not keep:
            await self._api.delete_quietly(SECRET, secret_name(experiment_id))
        return removed

    async def close(self) -> None:
        await super().close()
        secret = self._secret
        if secret is not None and secret.done() and not (secret.cancelled() or secret.exception()):
            await self._api.delete_quietly(SECRET, self._secret_name)
        await self._api.close()

    # ---- the provider ---------------------------------------------------------------

    async def launch(self, env: _Env, request: EnvironmentRequest) -> str:
        name = env.platform_id = object_name(request.experiment_id, request.env_id, self._kind)
        await self._ensure_secret(request)
        if claim := isinstance(self.config, AdlConfig) and self.config.checkpoint is not None:
            assert isinstance(self.config, AdlConfig)
            await self._api.create(PVC, checkpoint_claim(self.config, request, name),
                                   exists_ok=True)
        try:
            members = request.group_members
            if len(members) > 1:
                argv = member_command(self._agent_argv(dataclasses.replace(request, env_id=PLACEHOLDER)), members,
                                      index_variable(self._kind))
                body = group_job(self._kind, workload(self._kind, self.config, request, name, argv), members)
            else:
                body = workload(self._kind, self.config, request, name, self._agent_argv(request))
            if not self._kind.checks_template:
                await self._api.create(POD, template_pod(body), exists_ok=False, dry_run=True)
            await self._api.create(self._kind, body, exists_ok=True)
        except ApiFailure:
            if claim:  # no workload will use it
                await self._api.delete_quietly(PVC, checkpoint_claim_name(name))
            raise
        return name

    def launch_error(self, request: EnvironmentRequest, error: PlatformError) -> str:
        name = object_name(request.experiment_id, request.env_id, self._kind)
        return f"{self.platform}: could not create {self.kind} {name}: {error}"

    async def observe(self, records: Sequence[_Env]) -> dict[str, State]:
        states: dict[str, State] = {}
        groups: dict[str, list[_Env]] = {}
        for env in records:
            try:
                if env.experiment_id is None and await self._read_labels(env) is None:
                    states[env.env_id] = State("gone")
                    continue
                assert env.experiment_id is not None
                groups.setdefault(env.experiment_id, []).append(env)
            except ApiFailure as e:
                states[env.env_id] = State(env.phase, f"cannot ask the API server: {e}")
        for experiment_id, envs in groups.items():
            try:
                states.update(await self._observe_experiment(experiment_id, envs))
            except ApiFailure as e:  # what was seen last, not a guess
                states.update({env.env_id: State(env.phase, f"cannot ask the API server: {e}")
                               for env in envs})
        return states

    async def terminate(self, env: _Env, grace_s: float) -> None:
        if env.experiment_id is None:
            # Adopted and not seen yet: its labels say which pods to wait for.
            with contextlib.suppress(ApiFailure):
                await self._read_labels(env)
        await self._call(self._delete_env(env.name, grace_s))
        if env.experiment_id is not None:
            await self._call(self._wait_pods_gone(env, grace_s + STOP_WAIT_S),
                             grace_s + STOP_WAIT_S + self.call_timeout)
        env.phase = "gone"

    async def list_alive(self, experiment_id: str) -> dict[str, str]:
        found: dict[str, str] = {}
        for obj in await self._api.list(self._kind, selector(experiment_id)):
            exp, env_id = ids_of(obj)
            if env_id is not None and exp == experiment_id:
                found[env_id] = obj["metadata"]["name"]
        return found

    def ended(self, env: _Env) -> Observation:
        name = env.name
        if env.phase == "succeeded":
            return Observation("exited", env.detail or "agent exited normally", name)
        if env.phase == "gone":
            return Observation("failed", f"{self.kind} {name} was deleted", name)
        return Observation("failed", env.detail or f"{self.kind} {name} failed", name)

    # ---- inside ---------------------------------------------------------------------

    def _agent_argv(self, request: EnvironmentRequest) -> list[str]:
        c = self.config
        workdir = None
        if c.local_mount_path is not None:
            # On the shared storage: each trial works in a copy of the code; agent files persist.
            workdir = f"{c.container_mount_path.rstrip('/')}/{self._subdir}/envs/{request.env_id}"
        return agent_argv(request.coordinator_address, request.env_id, self.platform,
                          python=c.python, workdir=workdir,
                          copy_working_directory=workdir is not None, no_gpu=c.gpu_number == 0,
                          agent_args=request.agent_args)

    async def _ensure_secret(self, request: EnvironmentRequest) -> None:
        secret = self._secret
        if secret is None or (secret.done() and (secret.cancelled() or secret.exception())):
            self._secret_name = secret_name(request.experiment_id)
            secret = self._secret = asyncio.ensure_future(self._put_secret(request))
        await asyncio.shield(secret)

    async def _put_secret(self, request: EnvironmentRequest) -> None:
        body = token_secret(self.config, request)
        try:
            await self._api.create(SECRET, body, exists_ok=False)
        except ApiFailure as e:
            if e.status != 409:
                raise
            # Left by an earlier coordinator of this experiment: make sure it holds this token.
            await self._api.replace_secret(body)

    async def _delete_env(self, name: str, grace_s: float) -> None:
        await self._api.delete(self._kind, name, grace_s)
        if isinstance(self.config, AdlConfig) and self.config.checkpoint is not None:
            await self._api.delete(PVC, checkpoint_claim_name(name), 0.0)

    async def _wait_pods_gone(self, env: _Env, timeout: float) -> None:
        """Deletion is accepted at once; the pods go once their processes are gone."""
        assert env.experiment_id is not None
        deadline = time.monotonic() + timeout
        delay = 0.05
        while await self._api.list(POD, selector(env.experiment_id, env.env_id)):
            if time.monotonic() >= deadline:
                log.warning("environment %s: its pods are still terminating after %.0f s",
                            env.env_id, timeout)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _sweep_claims(self, experiment_id: str, keep: Collection[str]) -> None:
        """Checkpoint claims whose AdaptDLJob is gone already (a crash between two deletes)."""
        try:
            claims = await self._api.list(PVC, selector(experiment_id))
        except ApiFailure as e:
            log.warning("sweep of experiment %s: cannot list its checkpoint claims: %s",
                        experiment_id, e)
            return
        for claim in claims:
            if ids_of(claim)[1] not in keep:
                await self._api.delete_quietly(PVC, claim["metadata"]["name"])

    async def _read_labels(self, env: _Env) -> dict[str, Any] | None:
        """An adopted environment's object, its experiment read from its labels."""
        obj = await self._api.get(self._kind, env.name)
        if obj is not None:
            env.experiment_id = ids_of(obj)[0]
        return obj

    async def _observe_experiment(self, experiment_id: str,
                                  envs: list[_Env]) -> dict[str, State]:
        listed = await self._api.list(self._kind, selector(experiment_id))
        found = {o["metadata"]["name"]: o for o in listed}
        seen = {env.env_id: observe(self._kind, found[env.name])
                for env in envs if env.name in found}
        pods: dict[str | None, list[dict[str, Any]]] | None = {}
        if self._kind is POD:
            pods = {env.env_id: [found[env.name]] for env in envs if env.name in found}
        elif any(seen.get(e.env_id, ("",))[0] in ("starting", "failed") for e in envs):
            # The workloads' pods, in one listing: why one waits or failed.
            try:
                pods = {}
                for pod in await self._api.list(POD, selector(experiment_id)):
                    pods.setdefault(ids_of(pod)[1], []).append(pod)
            except ApiFailure:
                pods = None
        states: dict[str, State] = {}
        for env in envs:
            its_pods = [] if pods is None else pods.get(env.env_id, [])
            if env.env_id not in seen:
                states[env.env_id] = State("gone")
                continue
            state, detail = seen[env.env_id]
            if state == "failed" and self._kind is not POD:
                # An operator's own words are often terse: add how the container ended.
                ended = [d for _, d in (pod_state(p.get("status") or {}) for p in its_pods) if d]
                detail = "; ".join(d for d in (detail, *ended) if d)
            if state == "starting" and pods is not None:
                states[env.env_id], env.pull_failing_since = waiting_state(
                    self._kind, its_pods, detail, env.pull_failing_since, time.monotonic(),
                    self.config.image_pull_timeout)
            else:
                states[env.env_id] = State(_PHASES.get(state, "waiting"), detail)
        return states
