"""Local environments: each is an agent process on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from trialkeeper.protos.wire import ENVIRONMENT_ENV, EXPERIMENT_ENV

from ._launch import (
    AGENT_MODULE,
    agent_argv,
    agent_environment,
    log_tail,
    with_environment,
    write_tls_cert,
)
from .base import EnvironmentRequest, EnvironmentService, Observation, StartResult
from .local_config import LocalConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

class LocalEnvironmentService(EnvironmentService[LocalConfig]):
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
        self._spawning: dict[str, asyncio.Future[StartResult]] = {}

    @classmethod
    def from_config(cls, config: ExperimentConfig, platform: LocalConfig, experiment_dir: Path) -> Self:
        # The section's GPU fields reach the agents as arguments the coordinator adds.
        return cls(experiment_dir, Path(config.trial_code_directory))

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
        # Concurrent starts of one id share one spawn; a failed one may be tried again.
        spawning = self._spawning.get(request.env_id)
        if spawning is None:
            spawning = self._spawning[request.env_id] = asyncio.ensure_future(self._spawn(request))
            spawning.add_done_callback(lambda _: self._spawning.pop(request.env_id, None))
        return await asyncio.shield(spawning)

    async def _spawn(self, request: EnvironmentRequest) -> StartResult:
        env_dir = self.experiment_dir / "envs" / request.env_id
        env_dir.mkdir(parents=True, exist_ok=True)
        cert = write_tls_cert(env_dir, request.tls_cert_pem)
        # The agent writes the trials' logs into the experiment directory, where the
        # coordinator reads them: streaming them too would only cost memory and time.
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform, python=self.python,
                          workdir=str(self.experiment_dir), tls_cert=cert,
                          agent_args=(*request.agent_args, "--logs-shared"))
        env = with_environment(agent_environment(request.token, request.experiment_id, request.env_id))
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
                tail = log_tail(self.experiment_dir / "envs" / env_id / "agent.log")
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

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        found = await asyncio.to_thread(_find_experiment_processes, experiment_id)
        removed = []
        for env_id, pids in sorted(found.items()):
            if env_id in keep:
                continue
            log.info("environment %s of experiment %s: removing %d leftover process(es)", env_id, experiment_id, len(pids))
            if await asyncio.to_thread(_kill_all, pids):
                removed.append(env_id)
            else:
                log.warning("environment %s: some of its processes could not be killed", env_id)
        return removed

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(env_id) for env_id in [*self._procs, *self._adopted]))


def _find_experiment_processes(experiment_id: str) -> dict[str, list[int]]:
    """Live processes of this user whose environment names ``experiment_id``, by environment id.

    Agents carry both variables from their start; their trials inherit them, so trials
    whose agent already died are found too."""
    me, my_group = os.getpid(), os.getpgid(0)
    uid = os.getuid()
    found: dict[str, list[int]] = {}
    for p in psutil.process_iter(["pid", "uids"]):
        try:
            if p.pid == me or p.info["uids"] is None or p.info["uids"].real != uid:
                continue
            if os.getpgid(p.pid) == my_group:
                continue  # agents and trials run in groups of their own; never take ours down
            environ = p.environ()
            if environ.get(EXPERIMENT_ENV) != experiment_id or not environ.get(ENVIRONMENT_ENV):
                continue
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        found.setdefault(environ[ENVIRONMENT_ENV], []).append(p.pid)
    return found


def _kill_all(pids: list[int], timeout: float = 10.0) -> bool:
    """SIGKILL ``pids``, their descendants and process groups; True once none runs.

    Nobody waits for an orphan's results, so there is no grace period. A process that is
    our own child (a service of this process started it) is left for its parent to reap:
    a zombie counts as gone."""
    for pid in pids:
        kill_process_tree(pid, reap_root=False)
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_agent(pid: int) -> bool:
    """Whether ``pid`` is still a live trialkeeper agent (pids are reused)."""
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and AGENT_MODULE in " ".join(p.cmdline())
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

