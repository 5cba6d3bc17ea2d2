"""The process's connection to a Ray cluster and the small Ray calls the service makes.

Everything here blocks: the service runs it in its thread pool, under a deadline.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .node import SETTLE_S, describe_error

if TYPE_CHECKING:
    from .config import RayConfig

log = logging.getLogger(__name__)

# launch, wait (ours and an adopter's), shutdown and describe may all be in flight at once.
_ACTOR_CONCURRENCY = 8
MAX_CODE_FILES = 2000
MAX_CODE_BYTES = 300 * 1024 * 1024


class RaySetupError(ValueError):
    """The experiment cannot use the Ray platform (the extra is missing, no cluster)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RaySetupError(
            f"platform ray needs the ray package: pip install 'trialkeeper[ray]' ({e})"
        ) from e
    return ray


def connected_ray() -> Any:
    """``ray``, refusing to go on unconnected: most Ray calls would otherwise start a
    private local cluster in this process."""
    ray = import_ray()
    if not ray.is_initialized():
        raise RaySetupError("not connected to the Ray cluster")
    return ray


class Connection:
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
        ray = import_ray()
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
                    why = f"cannot connect to the Ray cluster at {address}: {e}"
                    raise RaySetupError(why) from e
                cls._owned = True
            cls._address = address
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users = max(0, cls._users - 1)
            if cls._users == 0 and cls._owned:
                import_ray().shutdown()
                cls._owned, cls._address = False, None


def actor_options(ts: RayConfig, name: str) -> dict[str, Any]:
    """What an environment's actor is created with: detached, named, never restarted."""
    options: dict[str, Any] = {
        "name": name,
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
    return options


def resources_asked(ts: RayConfig) -> str:
    """What each actor asks Ray for, as a message shows it."""
    parts = [f"{ts.num_cpus:g} CPU", f"{ts.num_gpus:g} GPU"]
    if ts.memory:
        parts.append(f"{ts.memory / 2**30:.3g} GiB memory")
    parts += [f"{amount:g} {name}" for name, amount in ts.resources.items()]
    return ", ".join(parts)


def pack_code(code_directory: Path, out: Path, exclude: tuple[Path, ...]) -> tuple[str, Path]:
    """(content hash, archive) of the experiment's code, packed into ``out`` once.

    A resumed experiment runs the code it started with: its adopted agents have that
    unpacked, and the code directory may have changed since.
    """
    from .. import _codedir

    previous = sorted(out.glob("code-*.tar.gz"))
    if previous:
        return previous[0].name.removeprefix("code-").removesuffix(".tar.gz"), previous[0]
    packed = _codedir.pack(code_directory, out, max_files=MAX_CODE_FILES,
                           max_bytes=MAX_CODE_BYTES, exclude=exclude)
    log.info(
        "code directory %s packed for Ray: %d files, %.1f MB, content %s",
        code_directory, packed.files, packed.bytes / 1e6, packed.short,
    )
    return packed.short, packed.archive


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unreachable(address: str, coordinator: str) -> str:
    """Why agents on a cluster of other machines cannot dial ``coordinator`` ("" if they can)."""
    cluster = address.removeprefix("ray://").rpartition(":")[0]
    if not is_loopback(coordinator.rpartition(":")[0]) or address == "auto" or is_loopback(cluster):
        return ""
    return (f"agents will dial the coordinator at {coordinator}, which only this machine can reach; "
            "on a Ray cluster of several machines set coordinator.address (or "
            "coordinator.advertiseAddress) to an address the Ray nodes can reach")


def put(data: bytes) -> Any:
    return connected_ray().put(data)


def is_ready(ray: Any, ref: Any) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def fetch(ray: Any, ref: Any) -> dict[str, Any]:
    """The value of a finished actor call; a dead actor's calls say how it died."""
    try:
        value = ray.get(ref, timeout=SETTLE_S)
    except Exception as e:  # noqa: BLE001 - a dead actor is an observation, not an error
        why = describe_error(e)
        return {"state": "failed", "detail": f"the Ray actor died: {why}", "error": why}
    if isinstance(value, dict):
        return value
    return {"state": "failed", "detail": f"unexpected answer {value!r}"}


def named_actors(prefix: str) -> dict[str, str]:
    """env id -> ``<namespace>/<name>`` of the actors whose names start with ``prefix``."""
    connected_ray()
    from ray.util import list_named_actors

    found: dict[str, str] = {}
    for entry in list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        env_id = name[len(prefix):] if name.startswith(prefix) else ""
        if env_id:
            found[env_id] = f"{namespace}/{name}"
    return found
