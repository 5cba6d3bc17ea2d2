"""Local environments: each is an agent process on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
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
from .base import EnvironmentRequest, Observation
from .lifecycle import LifecycleService, PlatformError, Record, State
from .local_config import LocalConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config.experiment import ExperimentConfig

log = logging.getLogger(__name__)


@dataclass
class _Agent(Record):
    """An agent process: our child (``proc``), or one a previous coordinator started, or the
    processes a sweep found (``platform_id`` names their pids: ``pid 12 13``)."""

    proc: asyncio.subprocess.Process | None = None

    @property
    def pids(self) -> list[int]:
        return [int(p) for p in self.platform_id.removeprefix("pid ").split() if p.isdigit()]


class LocalEnvironmentService(LifecycleService[LocalConfig, _Agent]):
    """Starts agents as child processes of the coordinator, in their own sessions."""

    platform = "local"
    shares_filesystem = True
    kind = "agent process"
    record_type = _Agent
    STOP_WAIT_S = 10.0
    STOP_POLL_S = 0.05
    STOP_ON_CLOSE = 5.0

    def __init__(self, experiment_dir: Path, code_directory: Path, *,
                 python: str = sys.executable) -> None:
        # A process is watched where it runs: every poll looks.
        super().__init__(poll_interval=0.0)
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.python = python
        self._experiment_id = ""  # known once an agent is started or adopted

    @classmethod
    def from_config(cls, config: ExperimentConfig, platform: LocalConfig, experiment_dir: Path) -> Self:
        # The section's GPU fields reach the agents as arguments the coordinator adds.
        return cls(experiment_dir, Path(config.trial_code_directory))

    def adopt(self, env_id: str, platform_id: str) -> None:
        if platform_id.removeprefix("pid ").isdigit():
            super().adopt(env_id, platform_id)

    def working_directory(self) -> str:
        return str(self.code_directory)

    # ---- the provider ---------------------------------------------------------------

    async def ready_adopted(self, experiment_id: str) -> None:
        self._experiment_id = experiment_id
        await super().ready_adopted(experiment_id)

    async def launch(self, record: _Agent, request: EnvironmentRequest) -> str:
        self._experiment_id = request.experiment_id
        env_dir = self.experiment_dir / "envs" / request.env_id
        env_dir.mkdir(parents=True, exist_ok=True)
        cert = write_tls_cert(env_dir, request.tls_cert_pem)
        # The agent writes the trials' logs into the experiment directory, where the
        # coordinator reads them: streaming them too would only cost memory and time.
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform,
                          python=self.python, workdir=str(self.experiment_dir), tls_cert=cert,
                          agent_args=(*request.agent_args, "--logs-shared"))
        env = with_environment(agent_environment(request.token, request.experiment_id, request.env_id))
        try:
            with open(env_dir / "agent.log", "ab") as out:  # noqa: ASYNC230 - once per agent
                record.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        except OSError as e:
            raise PlatformError(f"could not start the agent with {self.python}: {e}") from None
        return f"pid {record.proc.pid}"

    def launch_error(self, request: EnvironmentRequest, error: PlatformError) -> str:
        return str(error)

    async def observe(self, records: Sequence[_Agent]) -> dict[str, State]:
        return {record.env_id: self._state(record) for record in records}

    async def kill(self, record: _Agent) -> None:
        # The agent and every trial process it left go down hard; our own child is reaped
        # by its asyncio watcher, an adopted agent here.
        if record.proc is not None:
            # Its trials are its descendants while it lives; a dead agent's are orphans.
            orphaned = record.proc.returncode is not None
            await asyncio.to_thread(kill_process_tree, record.proc.pid)
            await asyncio.wait_for(record.proc.wait(), 10.0)
        else:
            orphaned = True
            for pid in record.pids:
                await asyncio.to_thread(kill_process_tree, pid, reap_root=record.adopted)
        if orphaned:
            await asyncio.to_thread(self._end_orphans, record.env_id)

    def _end_orphans(self, env_id: str) -> None:
        """What the environment's agent started and outlives it (its trials, in sessions of
        their own, once a killed agent is gone): found by the environment they inherited."""
        if self._experiment_id:
            for pid in _find_experiment_processes(self._experiment_id).get(env_id, []):
                kill_process_tree(pid)

    async def list_alive(self, experiment_id: str) -> dict[str, str]:
        found = await asyncio.to_thread(_find_experiment_processes, experiment_id)
        return {env_id: "pid " + " ".join(map(str, pids)) for env_id, pids in found.items()}

    def ended(self, record: _Agent) -> Observation:
        # A killed agent's trials go too: they would run on, their work already given to a retry.
        self._end_orphans(record.env_id)
        if record.proc is None:
            return Observation("exited", "agent exited", record.platform_id)
        if record.phase == "succeeded":
            return Observation("exited", "agent exited normally", record.platform_id)
        return Observation("failed", record.detail, record.platform_id)

    def _state(self, record: _Agent) -> State:
        if record.proc is None:
            # Not our child: an adopted agent (pids are reused: is it still one?), or what a
            # sweep found, of which a zombie counts as gone (its parent reaps it).
            alive = _is_agent if record.adopted else _running
            return State("running" if any(alive(pid) for pid in record.pids) else "succeeded")
        code = record.proc.returncode
        if code is None:
            return State("running")
        if code == 0:
            return State("succeeded")
        tail = log_tail(self.experiment_dir / "envs" / record.env_id / "agent.log")
        return State("failed", f"agent {exit_detail(code)}{': ' + tail if tail else ''}")


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


def exit_detail(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"

