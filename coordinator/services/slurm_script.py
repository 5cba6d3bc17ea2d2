"""The batch script of a Slurm environment's job: the options trialkeeper relies on, the
site's resource options as ``#SBATCH`` lines, the site's prologue, and the agent under a
small supervisor (:data:`SUPERVISOR`) that kills the trials an ended agent left and records
its exit status in ``agent.exit``. Pure text, no Slurm command: ``slurm.py`` submits it."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._jobs import job_name
from ._launch import agent_argv, write_tls_cert
from .base import EnvironmentRequest

__all__ = ["COMMENT_PREFIX", "JobScripts"]

# The comment of every job of an experiment: how squeue finds them from its id alone.
COMMENT_PREFIX = "trialkeeper-experiment:"


@dataclass(frozen=True)
class JobScripts:
    """How an experiment's jobs are written: where (``experiment_dir``), with which Python
    on the compute nodes, the site's resource options and prologue, and whether the jobs
    ask Slurm for GPUs (``gpus``; else their agents are told to use none)."""

    experiment_dir: Path
    python: str
    directives: Sequence[str]
    prologue: Sequence[str]
    gpus: bool
    platform: str = "slurm"

    def env_dir(self, env_id: str) -> Path:
        """Where an environment's script, agent log and exit status are kept."""
        return self.experiment_dir / "envs" / env_id

    def fixed_options(self, request: EnvironmentRequest, env_dir: Path) -> list[str]:
        """The options trialkeeper relies on. They stand in the script for whoever reads it
        and on sbatch's command line too, where SBATCH_* variables cannot override them. A
        group's job (``request.group_members``) asks for a node per member, a task on each,
        its own output in ``job.log`` (each agent's goes to its member's ``agent.log``)."""
        members = len(request.group_members)
        layout = [f"--nodes={members}", f"--ntasks={members}", "--ntasks-per-node=1"] if members > 1 else []
        return [
            f"--job-name={job_name(request.experiment_id, request.env_id)}",
            f"--comment={COMMENT_PREFIX}{request.experiment_id}",
            f"--output={env_dir / ('job.log' if layout else 'agent.log')}",
            "--open-mode=append",
            f"--chdir={self.experiment_dir}",
            "--no-requeue",  # a requeued agent would come back as a stranger to the coordinator
            "--export=ALL",
            *layout,
        ]

    def script(self, request: EnvironmentRequest, env_dir: Path) -> str:
        """The job script of one environment: its agent runs as the job's main process."""
        return "\n".join([*self._header(request, env_dir), *self._agent(request, env_dir)]) + "\n"

    def group_script(self, request: EnvironmentRequest, env_dir: Path) -> tuple[str, str]:
        """The job script of a group of environments (``request.group_members``, its own id
        first; ``env_dir`` the first's), and the script each of its tasks runs. The job has a
        node per member; ``srun`` starts one task on each, which runs the agent of the member
        its rank (``SLURM_PROCID``) names, its output in that member's ``agent.log``. The site's
        prologue runs in each task, on its own node, before its agent (not in the job's script,
        which runs on the first node only). A task that fails ends the others
        (``--kill-on-bad-exit``): the group lives and ends as one."""
        members = request.group_members
        cases = []
        for i, member in enumerate(members):
            member_dir = self.env_dir(member)
            member_dir.mkdir(parents=True, exist_ok=True)
            lines = self._agent(dataclasses.replace(request, env_id=member), member_dir)
            cases.append(f"{i}) exec >>{shlex.quote(str(member_dir / 'agent.log'))} 2>&1")
            cases += [*lines, ";;"]
        task = ["#!/bin/sh", *self.prologue, 'case "${SLURM_PROCID:?srun sets it}" in', *cases, "esac",
                'echo "task $SLURM_PROCID is beyond the group" >&2', "exit 2"]
        srun = ["srun", f"--nodes={len(members)}", f"--ntasks={len(members)}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=1", "/bin/sh", str(env_dir / "task.sh")]
        job = [*self._header(request, env_dir, prologue=False), "exec " + shlex.join(srun)]
        return "\n".join(job) + "\n", "\n".join(task) + "\n"

    def _header(self, request: EnvironmentRequest, env_dir: Path, *, prologue: bool = True) -> list[str]:
        directives = [*self.fixed_options(request, env_dir), *self.directives]
        return ["#!/bin/sh", *(f"#SBATCH {_quote_directive(d)}" for d in directives),
                *(self.prologue if prologue else ())]

    def _agent(self, request: EnvironmentRequest, env_dir: Path) -> list[str]:
        """Shell lines that run ``request``'s agent under the supervisor, in its place."""
        cert = write_tls_cert(env_dir, request.tls_cert_pem)
        # A job given no GPUs: its trials must not take any.
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform, python=self.python,
                          workdir=str(self.experiment_dir), no_gpu=not self.gpus, tls_cert=cert,
                          agent_args=request.agent_args)
        supervisor = [self.python, "-I", "-S", "-c", SUPERVISOR, str(env_dir / "agent.exit")]
        if self.gpus and "--gpu-indices" not in request.agent_args:
            return [_GPU_SELECTION, "exec " + shlex.join([*supervisor, *argv]) + ' "$@"']
        return ["exec " + shlex.join([*supervisor, *argv])]


# Where a node's GPUs are not fenced off by cgroups, NVML shows the agent all of them: it
# is then told the ones Slurm gave it, by their physical indices. In a group's task (an
# srun step) those are its step's GPUs on its own node, SLURM_STEP_GPUS; in a job's batch
# script, which srun(1) says has no SLURM_STEP_GPUS, the job's, SLURM_JOB_GPUS; where
# Slurm sets neither (older releases), the CUDA_VISIBLE_DEVICES its GPU plugin sets.
# Where GPUs are fenced, NVML shows only the job's own, numbered from 0: nothing is passed.
_GPU_SELECTION = """\
set --
tk_gpus="${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}}"
if [ -n "$tk_gpus" ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt \\
     "$(printf '%s\\n' "$tk_gpus" | tr ',' '\\n' | wc -l)" ]; then
    set -- --gpu-indices "$tk_gpus"
fi"""

# The job's main process: runs the agent, and when the agent ends, however it ends, kills
# the trials it left (orphans are reparented here, as a child subreaper, whatever the
# cluster's process tracking), then records the agent's exit status.
SUPERVISOR = """\
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
signal.signal(signal.SIGTERM, lambda *_: None)  # the agent gets its own; wait for it
code = subprocess.Popen(sys.argv[2:]).wait()
code = 128 - code if code < 0 else code
def orphans():
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    yield int(entry)
        except (OSError, ValueError, IndexError):
            pass
while True:
    try:
        if os.waitpid(-1, os.WNOHANG)[0]:
            continue
    except ChildProcessError:
        break
    for pid in orphans():
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.05)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(code))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
sys.exit(code)
"""


def _quote_directive(option: str) -> str:
    # sbatch splits #SBATCH lines on whitespace unless quoted.
    return option if not any(c.isspace() for c in option) else f'"{option}"'
