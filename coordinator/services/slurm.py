"""Slurm environments: each is one ``sbatch`` job running one agent.

The job is named ``tk-<experiment>-<environment>`` and carries the experiment id in its
comment, so ``squeue`` finds every job of an experiment from the id alone (``sweep``).
Its script (``slurm_script``), kept at ``<experiment>/envs/<env>/job.sh`` with no secret in it, runs
``python -m trialkeeper.agent`` under a small supervisor; the experiment token travels in
the environment of the ``sbatch`` call, which Slurm hands to the job (``--export=ALL``) and
which neither ``ps`` nor ``scontrol show job`` shows. The agent's output goes to
``agent.log`` beside the script, and the supervisor writes the agent's exit status to
``agent.exit``. The supervisor also kills the trials of an agent that died: Slurm tracks a
job's processes by cgroup on most clusters but by parentage where cgroups are off
(``proctrack/linuxproc``), and there a trial orphaned by its agent would outlive the job.

A job ended by Slurm (``scancel``, its time limit, preemption) sends SIGTERM to every
process of the job at once, the trials included: the agent then reports its trial killed
by SIGTERM, a failure of the trial (retried with ``retryFailedTrials``), and the
environment ends with Slurm's reason; in reuse mode a new job replaces it.

Slurm clusters need a shared file system here: the compute nodes read the trial code
directory in place and the agents write trial directories into the experiment directory
that the coordinator reads (``shares_filesystem``).

State comes from ``squeue --states=all``, asked at most every ``pollInterval`` in the
background (the job base, :mod:`._jobs`) so that ``poll`` waits on the controller for a
second at most. A job that has left Slurm's
memory (``MinJobAge``) is judged by ``scontrol``, then ``sacct`` (which needs accounting
storage), then the agent's exit file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trialkeeper.protos.wire import TOKEN_ENV

from ._jobs import Job, JobEnvironmentService, JobError, JobState, env_of
from ._launch import log_tail, with_environment
from .base import EnvironmentRequest, Observation, StartResult
from .slurm_config import SlurmConfig
from .slurm_script import COMMENT_PREFIX, JobScripts

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

# How long a stopped job may take to be gone (Slurm's KillWait is 30 s by default).
STOP_WAIT_S = 60.0
JOB_LOG_LINES = 4  # of a group job's own log, in the reason a member failed
_ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                     "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})
_WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


@dataclass(frozen=True)
class _Run:
    """One Slurm command's outcome; ``rc`` is -1 when it could not run or timed out."""

    rc: int
    out: str
    err: str

    @property
    def why(self) -> str:
        text = (self.err.strip() or self.out.strip()).splitlines()
        return text[-1] if text else f"exit status {self.rc}"


class SlurmEnvironmentService(JobEnvironmentService[SlurmConfig]):
    """Starts agents as Slurm batch jobs; see the module docstring."""

    platform = "slurm"
    shares_filesystem = True
    kind = "Slurm job"
    STOP_WAIT_S = STOP_WAIT_S
    STOP_ON_CLOSE = 0.0  # nobody collects an agent once its coordinator is gone

    def __init__(self, config: SlurmConfig, experiment_dir: Path, code_directory: Path, *,
                 trial_gpu_number: int = 0) -> None:
        # Each command has its own deadline (commandTimeout); a sweep may run several.
        super().__init__(poll_interval=config.poll_interval, call_timeout=STOP_WAIT_S + 4 * config.command_timeout)
        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.scripts = JobScripts(experiment_dir, config.python_interpreter or sys.executable,
                                  config.sbatch_directives(trial_gpu_number), config.prologue,
                                  config.requests_gpus(trial_gpu_number), self.platform)
        self._states: dict[str, tuple[str, str]] = {}  # job id -> Slurm's (state, reason)
        # jobPerTrial: one job of a node per member for each group of environments.
        self.groups_environments = config.job_per_trial

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: SlurmConfig, experiment_dir: Path) -> Self:
        return cls(ts, experiment_dir, Path(config.trial_code_directory),
                   trial_gpu_number=config.trial_gpu_number)

    # ---- the contract -------------------------------------------------------------

    def working_directory(self) -> str:
        # Read in place by the compute nodes: the cluster must share this file system.
        return str(self.code_directory)

    def adopt(self, env_id: str, platform_id: str) -> None:
        if _job_id(platform_id).isdigit():
            super().adopt(env_id, platform_id)

    async def prepare(self) -> None:
        self.experiment_dir.mkdir(parents=True, exist_ok=True)

    async def start_group(self, group: str, requests: Sequence[EnvironmentRequest]) -> list[StartResult]:
        """One job for the group, named after its first member: a node per member, each
        running the agent of one (``slurm_script``); stopping one member cancels the job."""
        if not self.groups_environments:
            return await super().start_group(group, requests)
        return await self.start_as_one(requests)

    def named(self, platform_id: str) -> str:
        return f"Slurm {platform_id}"  # the id says "job <n>" already

    # ---- the four platform calls ---------------------------------------------------

    async def submit(self, request: EnvironmentRequest, name: str) -> str:
        env_dir = self.scripts.env_dir(request.env_id)
        try:
            env_dir.mkdir(parents=True, exist_ok=True)
            script = env_dir / "job.sh"
            if len(request.group_members) > 1:
                text, task = self.scripts.group_script(request, env_dir)
                _write_private(env_dir / "task.sh", task)
            else:
                text = self.scripts.script(request, env_dir)
            _write_private(script, text)
        except OSError as e:
            raise JobError(f"cannot write the job script for {request.env_id}: {e}") from None
        # The token travels in sbatch's environment, which Slurm hands to the job.
        env = with_environment({TOKEN_ENV: request.token})
        fixed = self.scripts.fixed_options(request, env_dir)
        run = await self._run(["sbatch", "--parsable", *fixed, str(script)], env=env)
        if run.rc == 0:
            job_id = run.out.strip().split(";")[0]
            if not job_id.isdigit():
                raise JobError(f"sbatch gave no job id for {request.env_id}: {run.out.strip()!r}")
            return f"job {job_id}"
        # A timed-out sbatch may still have queued the job: look for it by name.
        found = await self.list_jobs(request.experiment_id) if run.rc == -1 else {}
        if request.env_id not in found:
            raise JobError(f"sbatch could not queue the job of {request.env_id}: {run.why}")
        return found[request.env_id]

    async def observe(self, jobs: Sequence[Job]) -> dict[str, JobState]:
        run = await self._run(["squeue", "--me", "--states=all", "--noheader", "--format=%i|%T|%r"])
        if run.rc != 0:
            raise JobError(f"squeue failed: {run.why}")
        seen: dict[str, tuple[str, str]] = {}
        for line in run.out.splitlines():
            parts = line.strip().split("|", 2)
            if len(parts) == 3:
                seen[parts[0]] = (parts[1], parts[2])
        out: dict[str, JobState] = {}
        for job in jobs:
            job_id = _job_id(job.platform_id)
            state, reason = seen.get(job_id, ("", ""))
            if not state:
                state = await self._final_state(job_id)
            self._states[job_id] = (state, reason)
            if state in _WAITING:
                why = f" ({reason})" if reason and reason != "None" else ""
                out[job.env_id] = JobState("waiting", f"Slurm job {job_id} {state.lower()}{why}")
            elif state in _ACTIVE:
                out[job.env_id] = JobState("running", f"Slurm job {job_id} {state.lower()}")
            else:  # how it ended is told by ``ended``, which reads the agent's exit file too
                out[job.env_id] = JobState("stopped" if state.startswith("CANCELLED") else "failed")
        return out

    async def kill(self, job: Job) -> None:
        run = await self._run(["scancel", _job_id(job.platform_id)])
        if run.rc != 0 and "Invalid job id" not in run.err:  # an unknown id: gone already
            raise JobError(f"scancel {_job_id(job.platform_id)}: {run.why}")

    async def list_jobs(self, experiment_id: str) -> dict[str, str]:
        """env id -> platform id of the experiment's jobs Slurm still runs or queues: by
        name and by the comment that names the experiment."""
        run = await self._run(["squeue", "--me", "--noheader", "--format=%i|%T|%j|%k"])
        if run.rc != 0:
            raise JobError(f"squeue failed, cannot list the jobs of {experiment_id}: {run.why}")
        found: dict[str, str] = {}
        for line in run.out.splitlines():
            parts = line.strip().split("|", 3)
            if len(parts) != 4 or parts[1] not in _ACTIVE:
                continue
            job_id, _, name, comment = parts
            env_id = env_of(name, experiment_id)
            if env_id is not None and comment.strip() == f"{COMMENT_PREFIX}{experiment_id}":
                found[env_id] = f"job {job_id}"
        return found

    def ended(self, job: Job) -> Observation:
        job_id = _job_id(job.platform_id)
        state = self._states.get(job_id, ("ENDED", ""))[0] or "ENDED"
        exit_file = self.experiment_dir / "envs" / job.env_id / "agent.exit"
        try:
            code: int | None = int(exit_file.read_text().strip())
        except (OSError, ValueError):
            code = None
        if code == 0 and state in ("COMPLETED", "ENDED"):
            return Observation("exited", "agent exited normally", job.platform_id)
        what = {
            "CANCELLED": "was cancelled (scancel)",
            "FAILED": "failed",
            "TIMEOUT": "reached its time limit",
            "NODE_FAIL": "lost its node",
            "PREEMPTED": "was preempted",
            "OUT_OF_MEMORY": "ran out of memory",
            "ENDED": "ended",
        }.get(state.split()[0], f"ended {state}")
        detail = f"Slurm job {job_id} {what}"
        detail += f"; the agent exited with status {code}" if code is not None else "; the agent left no exit status"
        tail = log_tail(self.experiment_dir / "envs" / job.env_id / "agent.log")
        detail = f"{detail}: {tail}" if tail else detail
        # A group's job: srun's own errors (a task that could not start or ended at once) are
        # in the job's log, not in any agent's.
        job_tail = log_tail(self._job_log(job), limit=2000, lines=JOB_LOG_LINES)
        detail += f"; the job's log ends: {job_tail}" if job_tail else ""
        return Observation("failed", self.redact(detail), job.platform_id)

    def _job_log(self, job: Job) -> Path:
        """The output of ``job``'s group job: in the env directory of the member it is named
        after, the first of those that share its platform id (``slurm_script``)."""
        ids = [job.env_id, *(r.env_id for r in self._records.values() if r.platform_id == job.platform_id)]
        logs = [self.scripts.env_dir(env_id) / "job.log" for env_id in ids]
        return next((path for path in logs if path.exists()), logs[0])

    # ---- helpers ------------------------------------------------------------------

    async def _final_state(self, job_id: str) -> str:
        """The state of a job squeue no longer lists: scontrol, else sacct, else unknown."""
        run = await self._run(["scontrol", "show", "job", "--oneliner", job_id])
        match = re.search(r"\bJobState=(\S+)", run.out) if run.rc == 0 else None
        if match:
            return match.group(1)
        run = await self._run(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id,
                               "--format=State"])
        words = run.out.split() if run.rc == 0 else []
        return words[0] if words else "ENDED"

    async def _run(self, argv: list[str], *, env: dict[str, str] | None = None) -> _Run:
        exe = argv[0]
        if self.config.slurm_bin_directory is not None:
            exe = str(self.config.slurm_bin_directory / exe)
        elif shutil.which(exe) is None:
            return _Run(-1, "", f"{exe} not found on PATH: is the Slurm client installed here?")
        try:
            proc = await asyncio.create_subprocess_exec(
                exe, *argv[1:], stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env,
            )
        except OSError as e:
            return _Run(-1, "", f"cannot run {exe}: {e}")
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.config.command_timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return _Run(-1, "", f"{argv[0]} did not answer within {self.config.command_timeout:g} s")
        assert proc.returncode is not None
        return _Run(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _write_private(path: Path, text: str) -> None:
    """Write a script only its owner reads: the site's prologue and the agent's options are in it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _job_id(platform_id: str) -> str:
    """Slurm's job id in a platform id ``job <id>``."""
    return platform_id.removeprefix("job ").strip()
