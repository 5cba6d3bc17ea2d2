"""``platform: procjobs``: a platform plug-in written against the job base, for the tests.

Its "cluster" is this machine and a state directory: a job is a detached supervisor process
that runs one agent, with a directory ``<stateDirectory>/<job name>/`` holding its pid, its
exit status once it ended and the agent's log. The plug-in implements only the four calls
of :class:`~trialkeeper.coordinator.services._jobs.JobEnvironmentService` (submit, observe,
kill, list_jobs); start, poll, stop and sweep come from the base. It joins as a real plug-in
does: the ``trialkeeper.environment_services`` entry point names ``PLATFORM``, the registry
entry that gives its config class and its service (see ``tests/contract/harness_jobplugin.py``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import psutil
from trialkeeper.coordinator.config.experiment import ExperimentConfig
from trialkeeper.coordinator.config.platform import TrainingServiceConfig
from trialkeeper.coordinator.platforms import Platform
from trialkeeper.coordinator.services._jobs import (
    Job,
    JobEnvironmentService,
    JobError,
    JobState,
    env_of,
)
from trialkeeper.coordinator.services._launch import agent_argv, agent_environment, with_environment
from trialkeeper.coordinator.services.base import EnvironmentRequest

NAME = "procjobs"
# What the entry point names: the registry imports each part only when a config uses it.
PLATFORM = Platform(NAME, config="procjobs:ProcJobsConfig", service="procjobs:ProcJobsService")
SPAWN_TIMEOUT_S = 30.0

# The job's main process: runs the agent, then records its exit status. It ignores SIGTERM
# (the agent, in the same process group, gets its own and drains) so that the status is
# always written.
_SUPERVISOR = """\
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
log = open(sys.argv[2], "ab")
proc = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
code = proc.wait()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(code))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""

# Starts the supervisor in its own session and exits at once: the supervisor is nobody's
# child here, as a job on a cluster is not the coordinator's.
_DETACH = """\
import subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, start_new_session=True)
print(proc.pid)
"""


@dataclass(frozen=True, kw_only=True)
class ProcJobsConfig(TrainingServiceConfig):
    """`trainingService: {platform: procjobs, stateDirectory: ...}`"""

    PLATFORM: ClassVar[str] = NAME
    state_directory: str = ""
    poll_interval: float = 0.5


class ProcJobsService(JobEnvironmentService[ProcJobsConfig]):
    """One environment is one supervisor process on this machine; see the module docstring."""

    platform = NAME
    shares_filesystem = True
    kind = "procjobs job"

    @classmethod
    def from_config(cls, config: ExperimentConfig, platform: ProcJobsConfig, experiment_dir: Path) -> ProcJobsService:
        return cls(platform, experiment_dir, Path(config.trial_code_directory))

    def __init__(self, config: ProcJobsConfig, experiment_dir: Path, code_directory: Path) -> None:
        super().__init__(poll_interval=config.poll_interval)
        if not config.state_directory:
            raise ValueError("trainingService.stateDirectory: required, a directory path")
        self.state = Path(config.state_directory)
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory

    def working_directory(self) -> str:
        return str(self.code_directory)

    # ---- the four platform calls ------------------------------------------------------

    async def submit(self, request: EnvironmentRequest, name: str) -> str:
        job_dir = self.state / name
        if (job_dir / "pid").exists():  # submitted before (a retried submit): the same job
            return name
        job_dir.mkdir(parents=True, exist_ok=True)
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform, python=sys.executable,
                          workdir=str(self.experiment_dir), agent_args=request.agent_args)
        supervisor = [sys.executable, "-c", _SUPERVISOR, str(job_dir / "exit"), str(job_dir / "agent.log"), *argv]
        # The token reaches the agent through its environment, never its argv.
        env = with_environment(agent_environment(request.token, request.experiment_id, request.env_id))
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", _DETACH, *supervisor], env=env, capture_output=True, text=True,
            timeout=SPAWN_TIMEOUT_S, check=False,
        )
        if done.returncode != 0 or not done.stdout.strip().isdigit():
            raise JobError(f"could not start the supervisor: {done.stderr.strip() or done.returncode}")
        pid = int(done.stdout)
        (job_dir / "pid").write_text(f"{pid} {psutil.Process(pid).create_time()}")
        return name

    async def observe(self, jobs: Sequence[Job]) -> dict[str, JobState]:
        return {job.env_id: self._state_of(self.state / job.platform_id) for job in jobs}

    async def kill(self, job: Job) -> None:
        process = _alive(self.state / job.platform_id)
        if process is not None:
            (self.state / job.platform_id / "killed").touch()
            os.killpg(process.pid, signal.SIGTERM)

    async def list_jobs(self, experiment_id: str) -> dict[str, str]:
        if not self.state.is_dir():
            return {}
        found = {}
        for job_dir in self.state.iterdir():
            env_id = env_of(job_dir.name, experiment_id)
            if env_id is not None and _alive(job_dir) is not None:
                found[env_id] = job_dir.name
        return found

    # ---- inside -------------------------------------------------------------------------

    def _state_of(self, job_dir: Path) -> JobState:
        if not (job_dir / "pid").exists():
            return JobState("gone")
        if _alive(job_dir) is not None:
            return JobState("running")
        try:
            code = int((job_dir / "exit").read_text())
        except (OSError, ValueError):
            return JobState("failed", "the supervisor died without recording the agent's exit status")
        if (job_dir / "killed").exists():
            return JobState("stopped", f"exit status {code}")
        if code == 0:
            return JobState("succeeded")
        return JobState("failed", f"the agent exited with status {code}: {_tail(job_dir / 'agent.log')}")


def _alive(job_dir: Path) -> psutil.Process | None:
    """The job's supervisor if it still runs (pids are reused: its start time must match)."""
    try:
        pid, started = (job_dir / "pid").read_text().split()
        process = psutil.Process(int(pid))
        if abs(process.create_time() - float(started)) > 0.01 or process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except (OSError, ValueError, psutil.Error):
        return None


def _tail(path: Path) -> str:
    """The end of the agent's log: why it could not run."""
    try:
        return path.read_bytes()[-300:].decode("utf-8", "replace").strip()
    except OSError:
        return ""
