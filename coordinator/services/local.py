"""Local environments: each is an agent process on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from .base import EnvironmentRequest, EnvironmentService, Observation, StartResult

log = logging.getLogger(__name__)


class LocalEnvironmentService(EnvironmentService):
    """Starts agents as child processes of the coordinator, in their own sessions."""

    platform = "local"
    shares_filesystem = True

    def __init__(self, experiment_dir: Path, code_directory: Path, *, python: str = sys.executable) -> None:
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.python = python
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        # Agents a previous coordinator started (not our children): env id -> pid.
        self._adopted: dict[str, int] = {}

    def adopt(self, env_id: str, platform_id: str) -> None:
        pid = platform_id.removeprefix("pid ")
        if pid.isdigit() and env_id not in self._procs:
            self._adopted[env_id] = int(pid)

    def working_directory(self) -> str:
        return str(self.code_directory)

    async def start(self, request: EnvironmentRequest) -> StartResult:
        existing = self._procs.get(request.env_id)
        if existing is not None:
            return StartResult(platform_id=f"pid {existing.pid}")
        env_dir = self.experiment_dir / "envs" / request.env_id
        env_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.python, "-m", "trialkeeper.agent",
            "--coordinator", request.coordinator_address,
            "--environment-id", request.env_id,
            "--workdir", str(self.experiment_dir),
            "--platform", self.platform,
            *request.agent_args,
        ]
        if request.tls_cert_pem is not None:
            cert = env_dir / "coordinator.pem"
            cert.write_bytes(request.tls_cert_pem)
            argv += ["--tls-cert", str(cert)]
        env = dict(os.environ)
        env["TRIALKEEPER_TOKEN"] = request.token
        try:
            with open(env_dir / "agent.log", "ab") as out:  # noqa: ASYNC230 - a local file, once per agent
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        except OSError as e:
            return StartResult(error=f"could not start the agent with {self.python}: {e}")
        self._procs[request.env_id] = proc
        return StartResult(platform_id=f"pid {proc.pid}")

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        out: dict[str, Observation] = {}
        for env_id in env_ids:
            proc = self._procs.get(env_id)
            if proc is None and env_id in self._adopted:
                pid = self._adopted[env_id]
                alive = _is_agent(pid)
                out[env_id] = Observation("running" if alive else "exited", "" if alive else "agent exited", f"pid {pid}")
            elif proc is None:
                out[env_id] = Observation("unknown")
            elif proc.returncode is None:
                out[env_id] = Observation("running", platform_id=f"pid {proc.pid}")
            elif proc.returncode == 0:
                out[env_id] = Observation("exited", "agent exited normally", f"pid {proc.pid}")
            else:
                detail = _exit_detail(proc.returncode)
                tail = _tail(self.experiment_dir / "envs" / env_id / "agent.log")
                out[env_id] = Observation("failed", f"agent {detail}{': ' + tail if tail else ''}", f"pid {proc.pid}")
        return out

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        if env_id in self._adopted:
            pid = self._adopted.pop(env_id)
            if _is_agent(pid) and not await asyncio.to_thread(_wait_gone, pid, grace_s):
                await asyncio.to_thread(kill_process_tree, pid, reap_root=True)
            return
        proc = self._procs.get(env_id)
        if proc is None or proc.returncode is not None:
            return
        # The coordinator has already asked the agent to shut down over its stream; give it
        # the grace period, then take the agent and every trial process it left down hard.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), grace_s)
        if proc.returncode is None:
            await asyncio.to_thread(kill_process_tree, proc.pid)
            await asyncio.wait_for(proc.wait(), 10.0)

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(env_id) for env_id in [*self._procs, *self._adopted]))


def _is_agent(pid: int) -> bool:
    """Whether ``pid`` is still a live trialkeeper agent (pids are reused)."""
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and "trialkeeper.agent" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.TimeoutExpired:
        return False
    except psutil.Error:
        pass
    return True


def kill_process_tree(pid: int, *, reap_root: bool = False) -> None:
    """SIGKILL a process, its descendants and their process groups (trials run in their own)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    groups = set()
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(p.pid))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    # The root is normally the caller's child, which reaps it: then only the descendants
    # are waited on here.
    psutil.wait_procs(procs if reap_root else procs[1:], timeout=10.0)


def _exit_detail(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _tail(path: Path, limit: int = 600) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    lines = [ln for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""
