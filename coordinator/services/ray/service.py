"""Ray environments: each is a detached, named actor of an existing Ray cluster running one agent.

The actor asks for the configured ``num_cpus``/``num_gpus`` (and ``memory``, custom
resources), so Ray's own scheduler decides which node an environment lands on and holds
those resources for the agent's life; the GPUs Ray assigns to the actor are the ones the
agent offers to trials. The trial code directory is packed once per experiment (as for
the remote platform: ``.nniignore`` honoured, size limits checked), put into Ray's object
store, and unpacked on each node by the first actor that needs it; each trial runs in its
own copy. A ``runtimeEnv.working_dir`` (a URI Ray fetches) replaces that upload.

Actors are named ``trialkeeper/<experiment id>/<env id>`` in the configured namespace and
are detached, so a crashed coordinator's environments can be found again by name
(``adopt`` on resume, ``sweep`` for orphans).

On the node (see ``_ray_node``) the actor starts the agent through a launcher that ends
the agent and its trials as soon as the actor goes away, so killing an actor mid-trial
is a lost environment, like any other.

All Ray calls block, so they run in a thread pool with deadlines. The experiment token
travels as a method argument (never stored in the actor's spec) and reaches the agent in
its environment, never its argv.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import logging
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..base import EnvironmentRequest, Observation, StartResult
from ..lifecycle import LifecycleService, PlatformError, State
from .actors import Actor, Actors
from .cluster import Connection, RaySetupError, named_actors, pack_code, put, resources_asked, unreachable
from .config import RayConfig
from .node import LINGER_S, SETTLE_S, describe_error
from .placement import ANY_BUNDLE, ExperimentGroup, remove_gangs

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

ACTOR_PREFIX = "trialkeeper"
# A poll holds up the coordinator's loop: Ray gets less time there than elsewhere.
POLL_TIMEOUT_S = 10.0
_T = TypeVar("_T")


def actor_name(experiment_id: str, env_id: str) -> str:
    """The actor's name: how ``adopt`` and ``sweep`` find an environment again."""
    return f"{ACTOR_PREFIX}/{experiment_id}/{env_id}"


class RayEnvironmentService(LifecycleService[RayConfig, Actor]):
    """Starts agents in actors of an existing Ray cluster; see the module docstring."""

    platform = "ray"
    shares_filesystem = False
    kind = "Ray actor"
    record_type = Actor
    STOP_ON_CLOSE = 0.0
    PLAIN_ERRORS = (PlatformError, RaySetupError)

    def __init__(self, config: RayConfig, experiment_dir: Path, code_directory: Path, *,
                 exclude: tuple[Path, ...] = (), environment_count: int = 1) -> None:
        # Every poll asks (without waiting); a start may pack and upload the code first.
        super().__init__(poll_interval=0.0,
                         call_timeout=max(config.ray_timeout, 300.0) + 3 * config.ray_timeout)
        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.exclude = exclude
        self._code: str | None = None  # the content hash of the packed code
        self._code_ref: Any = None  # the packed code in Ray's object store
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="trialkeeper-ray")
        self._connected = False
        self._connect_lock = asyncio.Lock()
        self._actors = Actors(config)
        self._warned_loopback = False
        # With placementStrategy: one bundle per environment the experiment keeps.
        self._group = ExperimentGroup(config, environment_count) if (
            config.placement_strategy and not config.placement_group_per_trial) else None
        # placementGroupPerTrial: a placement group per group of environments, by its id.
        self.groups_environments = config.placement_group_per_trial
        self._gangs: dict[str, ExperimentGroup] = {}
        self._gang_of: dict[str, tuple[str, int]] = {}  # env id -> (its group's id, its bundle)
        self._unstarted: set[str] = set()  # members whose actor could not be made: no bundle held
        self._experiment_id = ""  # as its environments name it: whose groups go on close
        #: How long an actor outlives its agent if no coordinator collects it.
        self.linger_s = LINGER_S

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: RayConfig, experiment_dir: Path) -> Self:
        missing = [m for m in ("ray", "pathspec") if importlib.util.find_spec(m) is None]
        if missing:
            raise RaySetupError(
                f"platform ray needs {' and '.join(missing)}: pip install 'trialkeeper[ray]'"
            )
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, experiment_dir, Path(config.trial_code_directory), exclude=exclude,
                   environment_count=ts.effective_environment_count(config.trial_concurrency * config.trial_nodes))

    def working_directory(self) -> str:
        # Relative to the agent's working directory (the experiment's directory on the
        # node), where the actor unpacked the code; or the runtime env's working_dir.
        if self._user_working_dir():
            return "."
        assert self._code is not None, "prepare() was not called"
        return f"code/{self._code}"

    async def prepare(self) -> None:
        await self._connect()
        await self._upload_code()

    def adopt(self, env_id: str, platform_id: str) -> None:
        if platform_id.startswith(f"{self.config.namespace}/{ACTOR_PREFIX}/"):
            self._experiment_id = platform_id.split("/")[2]
            super().adopt(env_id, platform_id)

    async def close(self) -> None:
        await super().close()  # its actors stopped first
        if self._connected:
            for group in [g for g in (self._group, *self._gangs.values()) if g is not None]:
                with contextlib.suppress(TimeoutError):
                    await self._blocking(group.remove)
            if self.groups_environments and self._experiment_id:  # a previous coordinator's too
                with contextlib.suppress(TimeoutError):
                    await self._blocking(remove_gangs, self._experiment_id)
        if self._connected:
            self._connected = False
            await asyncio.get_running_loop().run_in_executor(self._pool, Connection.release)
        self._pool.shutdown(wait=False)

    # ---- the provider ---------------------------------------------------------------

    async def launch(self, record: Actor, request: EnvironmentRequest) -> str:
        name = actor_name(request.experiment_id, request.env_id)
        record.platform_id = f"{self.config.namespace}/{name}"
        self._experiment_id = request.experiment_id
        self._warn_if_unreachable(request.coordinator_address)
        try:
            await self._connect()
            await self._upload_code()
            await self._blocking(self._create, record, request)
        except Exception as e:  # noqa: BLE001 - Ray's errors, told in a line
            raise PlatformError(describe_error(e)) from None
        return record.platform_id

    def launch_error(self, request: EnvironmentRequest, error: PlatformError) -> str:
        log.warning("environment %s: Ray actor not created: %s", request.env_id, error)
        return str(error)

    async def observe(self, records: Sequence[Actor]) -> dict[str, State]:
        await self._connect()
        await self._blocking(self._take_in, list(records), timeout=POLL_TIMEOUT_S)
        return {record.env_id: self._state(record) for record in records}

    async def terminate(self, record: Actor, grace_s: float) -> None:
        try:
            await self._connect()
            await self._blocking(self._actors.stop, record, grace_s, timeout=grace_s + 2 * SETTLE_S)
            await self._blocking(self._release_gangs)
        except Exception as e:  # noqa: BLE001 - Ray's errors, told in a line
            raise PlatformError(describe_error(e)) from None
        record.phase = "stopped"

    async def start_group(self, group: str, requests: Sequence[EnvironmentRequest]) -> list[StartResult]:
        """placementGroupPerTrial: one placement group for the group, a bundle per member,
        each member's actor in its own bundle; it is given back once they are all gone."""
        if self.groups_environments:
            self._gangs.setdefault(group, ExperimentGroup(self.config, len(requests), gang=group))
            self._gang_of.update((r.env_id, (group, i)) for i, r in enumerate(requests))
        results = await super().start_group(group, requests)
        if self.groups_environments:  # the group goes once its other members are gone
            self._unstarted.update(r.env_id for r, result in zip(requests, results) if result.error)
        return results

    async def list_alive(self, experiment_id: str) -> dict[str, str]:
        await self._connect()
        return await self._blocking(named_actors, actor_name(experiment_id, ""))

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        removed = await super().sweep(experiment_id, keep)
        if self._group is not None and not keep:  # no actor of the experiment left in its group
            await self._blocking(self._group.remove, experiment_id)
        if self.groups_environments and not keep:
            await self._blocking(remove_gangs, experiment_id)
        return removed

    def ended(self, record: Actor) -> Observation:
        if record.phase == "succeeded":
            return Observation("exited", record.detail, record.platform_id)
        return Observation("failed", record.detail, record.platform_id)

    def _state(self, record: Actor) -> State:
        if record.result is not None:
            ok = record.result.get("state", "failed") == "exited"
            return State("succeeded" if ok else "failed", record.result.get("detail", ""))
        if record.released:
            return State("stopped")
        if record.info is not None:
            if record.info.get("error"):
                return State("failed", record.info["error"])
            where = f"agent pid {record.info.get('pid')} on {record.info.get('node')}"
            gpus = record.info.get("gpus")
            return State("running", f"{where}, GPUs {gpus}" if gpus else where)
        where = self._placement_group(record.env_id)
        group = where.waiting() if where is not None else ""
        return State("waiting", group or f"waiting for Ray to place the actor ({resources_asked(self.config)})")

    def _warn_if_unreachable(self, coordinator: str) -> None:
        """Once: agents on other machines cannot dial a loopback coordinator address."""
        why = "" if self._warned_loopback else unreachable(self.config.address, coordinator)
        if why:
            self._warned_loopback = True
            log.warning("%s", why)

    # ---- Ray calls (blocking; run in the pool) ---------------------------------------

    async def _blocking(self, fn: Callable[..., _T], *args: Any,
                        timeout: float | None = None) -> _T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, fn, *args)
        limit = timeout or self.config.ray_timeout
        try:
            return await asyncio.wait_for(future, limit)
        except asyncio.TimeoutError:
            raise TimeoutError(f"Ray did not answer within {limit:g} s") from None

    async def _connect(self) -> None:
        async with self._connect_lock:
            if not self._connected:
                await self._blocking(Connection.acquire, self.config.address)
                self._connected = True

    def _user_working_dir(self) -> bool:
        return bool(self.config.runtime_env.get("working_dir"))

    async def _upload_code(self) -> None:
        """Pack the code directory and put it into the object store, once."""
        if self._code_ref is not None or self._user_working_dir():
            return
        async with self._connect_lock:
            if self._code_ref is None:
                pack_s = max(self.config.ray_timeout, 300.0)
                self._code, archive = await self._blocking(
                    pack_code, self.code_directory, self.experiment_dir / "ray", self.exclude,
                    timeout=pack_s)
                self._code_ref = await self._blocking(put, archive.read_bytes())

    def _take_in(self, envs: list[Actor]) -> None:
        for group in [g for g in (self._group, *self._gangs.values()) if g is not None]:
            group.check()
        self._actors.take_in(envs)
        self._release_gangs()

    def _create(self, env: Actor, request: EnvironmentRequest) -> None:
        where = self._placement_group(request.env_id)
        index = self._gang_of.get(request.env_id, ("", ANY_BUNDLE))[1]
        placement = where.options(request.experiment_id, index) if where is not None else {}
        code = self._code if self._code_ref is not None else None
        self._actors.create(env, request, placement, code, self._code_ref, self.linger_s)

    def _placement_group(self, env_id: str) -> ExperimentGroup | None:
        """The placement group ``env_id``'s actor goes into: its group's, or the experiment's."""
        return self._gangs.get(self._gang_of.get(env_id, ("", 0))[0]) or self._group

    def _release_gangs(self) -> None:
        """Give back the placement group of a group of environments whose actors are all gone."""
        for gang, group in list(self._gangs.items()):
            members = [e for e, (g, _) in list(self._gang_of.items()) if g == gang]
            if all(self._released(e) for e in members):
                group.remove()
                self._gangs.pop(gang, None)

    def _released(self, env_id: str) -> bool:
        """Whether ``env_id``'s actor is gone, or was never made (its start failed)."""
        record = self._records.get(env_id)
        return record.released if record is not None else env_id in self._unstarted
