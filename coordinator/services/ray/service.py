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
import ipaddress
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._record import EnvRecord
from ..base import EnvironmentRequest, EnvironmentService, Observation, StartResult
from .config import RayConfig
from .node import LINGER_S, SETTLE_S, AgentHost, describe_error

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

ACTOR_PREFIX = "trialkeeper"
# launch, wait (ours and an adopter's), shutdown and describe may all be in flight at once.
_ACTOR_CONCURRENCY = 8
# A poll holds up the coordinator's loop: Ray gets less time there than elsewhere.
POLL_TIMEOUT_S = 10.0
MAX_CODE_FILES = 2000
MAX_CODE_BYTES = 300 * 1024 * 1024
_T = TypeVar("_T")


class RaySetupError(ValueError):
    """The experiment cannot use the Ray platform (the extra is missing, no cluster)."""


def actor_name(experiment_id: str, env_id: str) -> str:
    """The actor's name: how ``adopt`` and ``sweep`` find an environment again."""
    return f"{ACTOR_PREFIX}/{experiment_id}/{env_id}"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RaySetupError(f"platform ray needs the ray package: pip install 'trialkeeper[ray]' ({e})") from e
    return ray


def _connected_ray() -> Any:
    """``ray``, refusing to go on unconnected: most Ray calls would otherwise start a
    private local cluster in this process."""
    ray = _import_ray()
    if not ray.is_initialized():
        raise RaySetupError("not connected to the Ray cluster")
    return ray


class _Connection:
    """The process's one connection to the cluster (``ray.init`` is per process).

    Services of the same process share it; the last one to close disconnects, unless the
    embedding application had connected before us.
    """

    _lock = threading.Lock()
    _users = 0
    _address: str | None = None
    _owned = False

    @classmethod
    def acquire(cls, address: str) -> None:
        ray = _import_ray()
        with cls._lock:
            if cls._users and cls._address != address:
                raise RaySetupError(
                    f"this process is already connected to the Ray cluster at {cls._address}; "
                    f"it cannot also use {address}"
                )
            if not ray.is_initialized():
                try:
                    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
                except Exception as e:
                    raise RaySetupError(f"cannot connect to the Ray cluster at {address}: {e}") from e
                cls._owned = True
            cls._address = address
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users = max(0, cls._users - 1)
            if cls._users == 0 and cls._owned:
                _import_ray().shutdown()
                cls._owned, cls._address = False, None


@dataclass
class _Env(EnvRecord):
    name: str = ""  # the actor's name in the namespace
    actor: Any = None  # the ActorHandle
    launched: Any = None  # ObjectRef of launch()/describe(): where the agent runs
    ended: Any = None  # ObjectRef of wait(): how the agent ended
    info: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    error: str = ""
    released: bool = False  # the actor was killed after its agent ended, freeing its resources


class RayEnvironmentService(EnvironmentService[RayConfig]):
    """Starts agents in actors of an existing Ray cluster; see the module docstring."""

    platform = "ray"
    shares_filesystem = False

    def __init__(self, config: RayConfig, experiment_dir: Path, code_directory: Path, *,
                 exclude: tuple[Path, ...] = ()) -> None:
        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.exclude = exclude
        self._code: str | None = None  # the content hash of the packed code
        self._code_ref: Any = None  # the packed code in Ray's object store
        self._envs: dict[str, _Env] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="trialkeeper-ray")
        self._connected = False
        self._connect_lock = asyncio.Lock()
        self._actor_class: Any = None
        self._warned_loopback = False
        #: How long an actor outlives its agent if no coordinator collects it.
        self.linger_s = LINGER_S

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: RayConfig, experiment_dir: Path) -> Self:
        missing = [m for m in ("ray", "pathspec") if importlib.util.find_spec(m) is None]
        if missing:
            raise RaySetupError(f"platform ray needs {' and '.join(missing)}: pip install 'trialkeeper[ray]'")
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, experiment_dir, Path(config.trial_code_directory), exclude=exclude)

    # ---- the contract -------------------------------------------------------------

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

    async def start(self, request: EnvironmentRequest) -> StartResult:
        env = self._envs.get(request.env_id)
        if env is None:
            env = _Env(request.env_id, name=actor_name(request.experiment_id, request.env_id))
            self._envs[request.env_id] = env  # before any await: a second start finds it
            self._warn_if_unreachable(request.coordinator_address)
            try:
                await self._connect()
                await self._upload_code()
                await self._blocking(self._create, env, request)
            except Exception as e:  # noqa: BLE001 - returned as data, per the contract
                env.error = describe_error(e)
                log.warning("environment %s: Ray actor not created: %s", request.env_id, env.error)
        if env.error:
            return StartResult(error=env.error)
        return StartResult(platform_id=self._platform_id(env))

    def _warn_if_unreachable(self, coordinator: str) -> None:
        """Once: agents on other machines cannot dial a loopback coordinator address."""
        if self._warned_loopback or not _is_loopback(coordinator.rpartition(":")[0]):
            return
        cluster = self.config.address.removeprefix("ray://").rpartition(":")[0]
        if self.config.address != "auto" and not _is_loopback(cluster):
            self._warned_loopback = True
            log.warning(
                "agents will dial the coordinator at %s, which only this machine can reach; "
                "on a Ray cluster of several machines set coordinator.address (or "
                "coordinator.advertiseAddress) to an address the Ray nodes can reach", coordinator,
            )

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        known = [self._envs[i] for i in env_ids if i in self._envs]
        if known and self._connected:
            try:
                await self._blocking(self._refresh, known, timeout=POLL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - what was seen before still stands
                log.warning("polling Ray actors failed: %s", describe_error(e))
        return {i: self._observe(self._envs.get(i)) for i in env_ids}

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        env = self._envs.get(env_id)
        if env is None or env.stop_requested or env.error:
            return
        env.stop_requested = True
        if env.released:
            return
        try:
            await self._connect()
            await self._blocking(self._stop_actor, env, grace_s, timeout=grace_s + 2 * SETTLE_S)
        except Exception as e:  # noqa: BLE001 - stop is best effort and must not raise
            log.warning("environment %s: stopping its Ray actor failed: %s", env_id, describe_error(e))

    def adopt(self, env_id: str, platform_id: str) -> None:
        name = platform_id.partition("/")[2] if platform_id.startswith(f"{self.config.namespace}/") else ""
        if name.startswith(f"{ACTOR_PREFIX}/") and env_id not in self._envs:
            self._envs[env_id] = _Env(env_id, name=name, adopted=True)

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        try:
            await self._connect()
            removed = await self._blocking(self._sweep, experiment_id, set(keep), timeout=3 * SETTLE_S)
        except Exception as e:  # noqa: BLE001 - reported, per the contract
            log.warning("sweeping Ray actors of experiment %s failed: %s", experiment_id, describe_error(e))
            return []
        for env_id in removed:
            if env_id in self._envs:
                self._envs[env_id].stop_requested = True
        return removed

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(env_id, 0.0) for env_id in list(self._envs)))
        if self._connected:
            self._connected = False
            await asyncio.get_running_loop().run_in_executor(self._pool, _Connection.release)
        self._pool.shutdown(wait=False)

    # ---- Ray calls (blocking; run in the pool) ---------------------------------------

    async def _blocking(self, fn: Callable[..., _T], *args: Any, timeout: float | None = None) -> _T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(future, timeout or self.config.ray_timeout)
        except asyncio.TimeoutError:
            limit = timeout or self.config.ray_timeout
            raise TimeoutError(f"Ray did not answer within {limit:g} s") from None

    async def _connect(self) -> None:
        async with self._connect_lock:
            if not self._connected:
                await self._blocking(_Connection.acquire, self.config.address)
                self._connected = True

    def _user_working_dir(self) -> bool:
        return bool(self.config.runtime_env.get("working_dir"))

    async def _upload_code(self) -> None:
        """Pack the code directory and put it into the object store, once."""
        if self._code_ref is not None or self._user_working_dir():
            return
        async with self._connect_lock:
            if self._code_ref is None:
                self._code, archive = await self._blocking(self._pack, timeout=max(self.config.ray_timeout, 300.0))
                self._code_ref = await self._blocking(_put, archive.read_bytes())

    def _pack(self) -> tuple[str, Path]:
        """(content hash, archive) of the experiment's code.

        A resumed experiment runs the code it started with: its adopted agents have that
        unpacked, and the code directory may have changed since.
        """
        from .. import _codedir

        out = self.experiment_dir / "ray"
        previous = sorted(out.glob("code-*.tar.gz"))
        if previous:
            return previous[0].name.removeprefix("code-").removesuffix(".tar.gz"), previous[0]
        packed = _codedir.pack(
            self.code_directory, out, max_files=MAX_CODE_FILES, max_bytes=MAX_CODE_BYTES, exclude=self.exclude,
        )
        log.info(
            "code directory %s packed for Ray: %d files, %.1f MB, content %s",
            self.code_directory, packed.files, packed.bytes / 1e6, packed.short,
        )
        return packed.short, packed.archive

    def _create(self, env: _Env, request: EnvironmentRequest) -> None:
        ray = _connected_ray()
        if self._actor_class is None:
            self._actor_class = ray.remote(AgentHost)
        ts = self.config
        options: dict[str, Any] = {
            "name": env.name,
            "namespace": ts.namespace,
            "lifetime": "detached",
            "num_cpus": ts.num_cpus,
            "num_gpus": ts.num_gpus,
            "max_concurrency": _ACTOR_CONCURRENCY,
            "max_restarts": 0,
        }
        if ts.runtime_env:
            options["runtime_env"] = dict(ts.runtime_env)
        if ts.memory:
            options["memory"] = ts.memory
        if ts.resources:
            options["resources"] = dict(ts.resources)
        try:
            env.actor = self._actor_class.options(**options).remote()
        except ValueError as e:  # the name is taken: an environment of a previous run
            raise RaySetupError(f"cannot create Ray actor {env.name!r} in namespace {ts.namespace!r}: {e}") from e
        spec = {
            "experiment_id": request.experiment_id,
            "env_id": request.env_id,
            "coordinator": request.coordinator_address,
            "agent_args": list(request.agent_args),
            "num_gpus": ts.num_gpus,
            "node_dir": ts.node_working_directory,
            "code": self._code if self._code_ref is not None else None,
            "linger_s": self.linger_s,
        }
        env.launched = env.actor.launch.remote(spec, request.token, self._code_ref)
        env.ended = env.actor.wait.remote()
        if env.stop_requested:  # stop() ran while the actor was being created
            ray.kill(env.actor, no_restart=True)
        log.info("environment %s: Ray actor %s requested", env.env_id, env.name)

    def _refresh(self, envs: list[_Env]) -> None:
        """Take in, without waiting, every launch and end the cluster has reported."""
        ray = _connected_ray()
        for env in envs:
            if env.adopted and env.actor is None and not env.stop_requested:
                self._attach(env)
        pending: dict[Any, tuple[_Env, str]] = {}
        for env in envs:
            if env.launched is not None and env.info is None:
                pending[env.launched] = (env, "info")
            if env.ended is not None and env.result is None:
                pending[env.ended] = (env, "result")
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0, fetch_local=True)
            for ref in ready:
                env, slot = pending[ref]
                setattr(env, slot, _fetch(ray, ref))
        for env in envs:
            if env.result is not None and not env.released and env.actor is not None:
                # The agent is gone: free the actor's CPUs and GPUs for the next environment.
                with contextlib.suppress(Exception):
                    ray.kill(env.actor, no_restart=True)
                env.released = True

    def _attach(self, env: _Env) -> None:
        """An adopted environment: find its actor by name and ask it how its agent does."""
        ray = _connected_ray()
        try:
            env.actor = ray.get_actor(env.name, namespace=self.config.namespace)
        except ValueError:
            env.result = {"state": "failed", "detail": f"Ray actor {env.name} no longer exists"}
            env.released = True
            return
        env.launched = env.actor.describe.remote()
        env.ended = env.actor.wait.remote()

    def _stop_actor(self, env: _Env, grace_s: float) -> None:
        ray = _connected_ray()
        actor = env.actor
        if actor is None:
            try:
                actor = ray.get_actor(env.name, namespace=self.config.namespace)
            except ValueError:
                return
        if env.launched is not None:
            ray.wait([env.launched], timeout=min(5.0, SETTLE_S))  # a launch under way finishes first
        if env.info is not None or (env.launched is not None and _is_ready(ray, env.launched)):
            # Let the agent finish what the coordinator asked of it, then end its whole tree.
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(grace_s), timeout=grace_s + SETTLE_S)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        log.info("environment %s: Ray actor %s stopped", env.env_id, env.name)

    def _sweep(self, experiment_id: str, keep: set[str]) -> list[str]:
        ray = _connected_ray()
        from ray.util import list_named_actors

        prefix = actor_name(experiment_id, "")
        found: dict[str, Any] = {}
        for entry in list_named_actors(all_namespaces=True):
            name, namespace = entry["name"], entry["namespace"]
            env_id = name[len(prefix):] if name.startswith(prefix) else ""
            if env_id and env_id not in keep:
                with contextlib.suppress(ValueError):
                    found[env_id] = ray.get_actor(name, namespace=namespace)
        # Ask every actor at once to end its agent, give them a moment, then kill them all;
        # an actor that was never placed holds no processes and just goes.
        stops = [actor.shutdown.remote(0.0) for actor in found.values()]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=SETTLE_S / 3)
        removed = []
        for env_id, actor in found.items():
            try:
                ray.kill(actor, no_restart=True)
                removed.append(env_id)
            except Exception as e:  # noqa: BLE001 - logged; the others still go
                log.warning("sweep: could not remove Ray actor of environment %s: %s", env_id, e)
        if removed:
            log.info("sweep: removed the Ray actors of environments %s", ", ".join(sorted(removed)))
        return sorted(removed)

    # ---- observations ---------------------------------------------------------------

    def _platform_id(self, env: _Env) -> str:
        return f"{self.config.namespace}/{env.name}"

    def _observe(self, env: _Env | None) -> Observation:
        if env is None:
            return Observation("unknown")
        pid = self._platform_id(env)
        if env.error:
            return Observation("failed", env.error, pid)
        if env.result is not None:
            state = env.result.get("state", "failed")
            if env.stop_requested and state == "failed":
                return Observation("exited", "stopped", pid)
            return Observation(state, env.result.get("detail", ""), pid)
        if env.stop_requested:
            return Observation("exited", "stopped", pid)
        if env.info is not None:
            if env.info.get("error"):
                return Observation("failed", env.info["error"], pid)
            where = f"agent pid {env.info.get('pid')} on {env.info.get('node')}"
            gpus = env.info.get("gpus")
            return Observation("running", f"{where}, GPUs {gpus}" if gpus else where, pid)
        return Observation("starting", f"waiting for Ray to place the actor ({self._ask()})", pid)

    def _ask(self) -> str:
        """What each actor asks Ray for, as a message shows it."""
        ts = self.config
        parts = [f"{ts.num_cpus:g} CPU", f"{ts.num_gpus:g} GPU"]
        if ts.memory:
            parts.append(f"{ts.memory / 2**30:.3g} GiB memory")
        parts += [f"{amount:g} {name}" for name, amount in ts.resources.items()]
        return ", ".join(parts)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _put(data: bytes) -> Any:
    return _connected_ray().put(data)


def _is_ready(ray: Any, ref: Any) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _fetch(ray: Any, ref: Any) -> dict[str, Any]:
    """The value of a finished actor call; a dead actor's calls say how it died."""
    try:
        value = ray.get(ref, timeout=SETTLE_S)
    except Exception as e:  # noqa: BLE001 - a dead actor is an observation, not an error
        return {"state": "failed", "detail": f"the Ray actor died: {describe_error(e)}", "error": describe_error(e)}
    return value if isinstance(value, dict) else {"state": "failed", "detail": f"unexpected answer {value!r}"}
