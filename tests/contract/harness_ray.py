"""A local Ray cluster on loopback for the `ray` platform, and its contract-suite harness.

One head node (``ray start --head``) per test session, 2 CPUs, its own temporary
directory and free ports for everything it listens on, shared by every module that uses
it. Teardown ends exactly the processes this cluster started (its process group, and any
process naming its temporary directory), never other Ray clusters on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

PLATFORMS: tuple[str, ...] = ("ray",)

START_TIMEOUT_S = 90.0
NUM_CPUS = 2
# GPUs Ray believes the node has (there need be none): enough to see its scheduler hand
# distinct GPU ids to actors and hold back one that does not fit.
NUM_GPUS = 2
# For the head, its workers and our driver. Without the first, Ray resolves 127.0.0.1 to
# the machine's routable address; with it everything stays on loopback. A cluster that
# only loopback can reach needs no token (Ray would otherwise write one into ~/.ray).
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class RayUnavailable(Exception):
    """Ray cannot run here; the message says why."""


@dataclass
class LocalRay:
    """A running head node: ``address`` is what ``trainingService.address`` takes."""

    address: str
    temp_dir: Path
    group: int
    client_address: str = ""  # ray://127.0.0.1:PORT, the Ray Client server of the head

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster (its group, or naming its temp dir)."""
        marker = str(self.temp_dir)
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if os.getpgid(p.pid) == self.group or marker in " ".join(p.info["cmdline"] or ()):
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        return found

    def stop(self) -> None:
        """SIGTERM the cluster's processes, then SIGKILL what is left."""
        # Its GCS server and raylet do not end on SIGTERM: a short grace, then SIGKILL.
        for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
            procs = self.processes()
            if not procs:
                break
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            psutil.wait_procs(procs, timeout=wait_s)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_local_ray(temp_dir: Path) -> LocalRay:
    """Start a head node on loopback whose every port is free now; raise RayUnavailable."""
    ray_cli = Path(sys.executable).with_name("ray")
    if not ray_cli.exists():
        raise RayUnavailable(f"the ray package is not installed ({ray_cli} missing): pip install 'trialkeeper[ray]'")
    temp_dir.mkdir(parents=True, exist_ok=True)
    port, client_port = _free_port(), _free_port()
    argv = [
        str(ray_cli), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
        f"--num-cpus={NUM_CPUS}", f"--num-gpus={NUM_GPUS}", "--include-dashboard=false",
        f"--temp-dir={temp_dir}", "--disable-usage-stats", "--log-style=record",
        "--object-store-memory=100000000", f"--ray-client-server-port={client_port}",
        *(f"--{flag}={_free_port()}" for flag in (
            "dashboard-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
        )),
    ]
    env = {**os.environ, **LOOPBACK_ENV}
    with open(temp_dir / "start.log", "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    cluster = LocalRay(f"127.0.0.1:{port}", temp_dir, proc.pid, f"ray://127.0.0.1:{client_port}")
    try:
        code = proc.wait(START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0:
        log = (temp_dir / "start.log").read_text(errors="replace")[-1500:]
        cluster.stop()
        raise RayUnavailable(f"`ray start --head` failed ({code}): {log}")
    return cluster


# A node joining the head at argv[1] on loopback, until SIGTERM. `ray start --address` would
# need RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, with which Ray takes this machine's routable address
# for the head instead of 127.0.0.1; Ray's own Node class (what its multi-node test helper
# ray.cluster_utils uses) keeps the address it is given.
_SECOND_NODE = """
import signal, sys, time
from ray._private.node import Node
from ray._private.parameter import RayParams
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
params = RayParams(gcs_address=sys.argv[1], node_ip_address="127.0.0.1", num_cpus=int(sys.argv[2]), num_gpus=0,
                   object_store_memory=100_000_000, min_worker_port=0, max_worker_port=0, node_manager_port=0,
                   include_log_monitor=False)
params.dashboard_agent_listen_port = None
Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
print("node up", flush=True)
while True:
    time.sleep(3600)
"""


@contextlib.contextmanager
def second_node(cluster: LocalRay, num_cpus: int = 1) -> Iterator[None]:
    """Another node of ``cluster`` on this machine, alive (as Ray sees it) until the block
    ends; then its processes, and only those, are ended."""
    import ray

    def alive() -> int:
        return sum(1 for node in ray.nodes() if node.get("Alive"))

    before = alive()
    log_path = cluster.temp_dir / f"second-node-{_free_port()}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _SECOND_NODE, cluster.address, str(num_cpus)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **LOOPBACK_ENV}, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while alive() <= before:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RayUnavailable(f"a second Ray node did not join: {log_path.read_text(errors='replace')[-1500:]}")
            time.sleep(0.2)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # it drains, then ends its raylet and agents
        try:
            proc.wait(45.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10.0)


# One cluster per test session, whichever module asks first; stopped when the last one
# that asked is done.
_shared_lock = threading.Lock()
_shared: LocalRay | None = None
_users = 0
_saved_env: dict[str, str | None] = {}
_unavailable = ""  # why the cluster could not start, once it failed


@contextlib.contextmanager
def shared_local_ray() -> Iterator[LocalRay]:
    """The session's cluster; skips the test when Ray cannot run here."""
    global _shared, _users, _unavailable
    with _shared_lock:
        if _unavailable:
            pytest.skip(_unavailable)
        if _shared is None:
            # Unix sockets live under the temp dir: keep its path short (108-byte limit).
            temp_dir = Path(tempfile.mkdtemp(prefix="tkray-"))
            try:
                _shared = start_local_ray(temp_dir)
            except RayUnavailable as e:
                _unavailable = f"no local Ray cluster: {e}"
                pytest.skip(_unavailable)
            _saved_env.update({key: os.environ.get(key) for key in (*LOOPBACK_ENV, "RAY_ADDRESS")})
            # RAY_ADDRESS: a Ray API used before any ray.init joins this cluster instead of
            # starting a private one.
            os.environ.update({**LOOPBACK_ENV, "RAY_ADDRESS": _shared.address})
            _patch_imported_ray()
        _users += 1
        cluster = _shared
    try:
        yield cluster
    finally:
        with _shared_lock:
            _users -= 1
            if _users == 0 and _shared is not None:
                _disconnect()
                _shared.stop()
                _shared = None
                for key, old in _saved_env.items():
                    if old is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = old
                _saved_env.clear()


def _patch_imported_ray() -> None:
    """Ray reads LOOPBACK_ENV when imported; if it already was, set what it read."""
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


def _disconnect() -> None:
    """Drop this process's driver connection before the cluster goes away."""
    if "ray" in sys.modules:
        ray: Any = sys.modules["ray"]
        with contextlib.suppress(Exception):
            ray.shutdown()


@pytest.fixture(scope="session")
def ray_training_service() -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """``section(platform, tmp_path)``: a `trainingService` dict for the local cluster."""
    with shared_local_ray() as cluster:

        def section(platform: str, tmp_path: Path) -> dict[str, Any]:
            assert platform in PLATFORMS, platform
            return {
                "platform": platform,
                "address": cluster.address,
                "numCpus": 0.5,
                "nodeWorkingDirectory": str(tmp_path / "ray-nodes"),
            }

        yield section
