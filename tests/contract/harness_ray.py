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
