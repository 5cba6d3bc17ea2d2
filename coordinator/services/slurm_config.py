"""The `trainingService` section for `platform: slurm`.

Each environment is one batch job running one agent. The coordinator, the agents and the
trials share one file system (the experiment directory and the trial code directory are
read and written in place by the compute nodes), as on any Slurm cluster with a shared
home or project file system.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..config.platform import EnvironmentPoolConfig
from ..config.rules import (
    NON_NEGATIVE_INT,
    POSITIVE_DURATION,
    POSITIVE_INT,
    SIZE,
    Issues,
    not_both,
    rule,
)

__all__ = ["SlurmConfig"]


def _sbatch_line(value: object) -> object:
    # Accept the line as it would stand in a script ("#SBATCH --constraint=a100") or bare.
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.upper().startswith("#SBATCH"):
            stripped = stripped[len("#SBATCH"):].strip()
        return stripped
    return value


def _is_option(line: str) -> bool:
    return line.startswith("-") and "\n" not in line and "\r" not in line


_SBATCH_LINES = rule(
    "a list of sbatch options such as '--constraint=a100' (one option per entry)",
    lambda v: all(_is_option(line) for line in v),
    coerce=lambda v: [_sbatch_line(x) for x in v] if isinstance(v, list) else v,
)
_SINGLE_LINE = rule("a non-empty string on one line", lambda v: bool(v.strip()) and "\n" not in v)
_SHELL_LINES = rule("a list of shell lines", lambda v: all("\0" not in line for line in v))
_GRES = rule(
    "a gres string such as 'gpu:2' or 'gpu:a100:2'",
    lambda v: bool(v.strip()) and not any(c.isspace() for c in v),
)


# Options every job needs as trialkeeper sets them, and why.
_RESERVED = {
    **dict.fromkeys(["--job-name", "-J", "--comment"], "it finds the experiment's jobs by them"),
    **dict.fromkeys(["--output", "-o", "--open-mode"], "the agent's log goes to the experiment directory"),
    **dict.fromkeys(["--export"], "the agent gets the experiment token through the job's environment"),
    **dict.fromkeys(["--chdir", "-D"], "the agent works in the experiment directory"),
    **dict.fromkeys(["--requeue"], "a requeued agent would come back as a stranger to the coordinator"),
}
# With jobPerTrial, the layout of a trial's job: a node per rank, a task (an agent) on each.
_GROUP_RESERVED = dict.fromkeys(["--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node"],
                                "with jobPerTrial a trial's job has a node per rank (trialNodes), an agent on each")


@dataclass(frozen=True, kw_only=True)
class SlurmConfig(EnvironmentPoolConfig):
    """`platform: slurm`: every environment is an `sbatch` job that runs one agent."""

    PLATFORM: ClassVar[str] = "slurm"
    partition: str | None = field(default=None, metadata=_SINGLE_LINE)
    account: str | None = field(default=None, metadata=_SINGLE_LINE)
    qos: str | None = field(default=None, metadata=_SINGLE_LINE)
    # Wall-clock limit of each job (`--time`); a job over it ends and is replaced.
    time_limit: float | None = field(default=None, metadata=POSITIVE_DURATION)
    # GPUs each job asks for (`--gpus-per-node`); by default trialGpuNumber times the trials
    # one environment runs at once. `gres` replaces it for sites that name GPU types.
    gpus_per_node: int | None = field(default=None, metadata=NON_NEGATIVE_INT)
    gres: str | None = field(default=None, metadata=_GRES)
    cpus_per_task: int | None = field(default=None, metadata=POSITIVE_INT)
    memory: int | None = field(default=None, metadata=SIZE)
    # More options for every job, written as `#SBATCH` lines.
    sbatch_options: list[str] = field(default_factory=list, metadata=_SBATCH_LINES)
    # Shell lines the job runs before the agent (`module load ...`, `source venv/bin/activate`).
    prologue: list[str] = field(default_factory=list, metadata=_SHELL_LINES)
    # The Python on the compute nodes that has trialkeeper installed; default: this one.
    python_interpreter: str | None = field(default=None, metadata=_SINGLE_LINE)
    # How often squeue is asked about the jobs; each call costs the controller some work.
    poll_interval: float = field(default=2.0, metadata=POSITIVE_DURATION)
    # The longest any one Slurm command (sbatch, squeue, scancel) may take.
    command_timeout: float = field(default=30.0, metadata=POSITIVE_DURATION)
    # Where the Slurm commands are, when they are not on PATH.
    slurm_bin_directory: Path | None = None
    # One job per trial in reuse mode: a job of `trialNodes` nodes whose `srun` runs an agent
    # on each (`--nodes=N --ntasks-per-node=1`), not one job per environment.
    job_per_trial: bool = False

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues = not_both(given, names, "gres", "gpus_per_node", at="gres")
        for i, option in enumerate(values.get("sbatch_options") or []):
            flag = option.split("=", 1)[0].split()[0]
            reserved = {**_RESERVED, **(_GROUP_RESERVED if values.get("job_per_trial") else {})}
            if flag in reserved:
                issues.append((f"sbatch_options[{i}]", f"{flag} is set by trialkeeper: {reserved[flag]}"))
        if values.get("job_per_trial") and values.get("reuse_mode", True) is False:
            need = f"needs {names['reuse_mode']}: true (its jobs' agents take trial after trial)"
            issues.append(("job_per_trial", f"{need}; set it, or leave this out"))
        bin_dir = values.get("slurm_bin_directory")
        if bin_dir is not None and not bin_dir.is_dir():
            issues.append(("slurm_bin_directory", f"{bin_dir} is not a directory"))
        return issues

    def sbatch_directives(self, trial_gpu_number: int) -> list[str]:
        """The resource options of every job, as `#SBATCH` option strings."""
        out: list[str] = []
        for flag, value in (("--partition", self.partition), ("--account", self.account), ("--qos", self.qos)):
            if value is not None:
                out.append(f"{flag}={value.strip()}")
        if self.time_limit is not None:
            out.append(f"--time={_slurm_time(self.time_limit)}")
        if self.gres is not None:
            out.append(f"--gres={self.gres}")
        else:
            slots = self.trials_per_environment if self.reuse_mode else 1
            gpus = self.gpus_per_node if self.gpus_per_node is not None else trial_gpu_number * slots
            if gpus:
                out.append(f"--gpus-per-node={gpus}")
        if self.cpus_per_task is not None:
            out.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.memory is not None:
            out.append(f"--mem={max(1, math.ceil(self.memory / 2**20))}M")
        return out + list(self.sbatch_options)

    def requests_gpus(self, trial_gpu_number: int) -> bool:
        """Whether the jobs ask Slurm for GPUs (else the agents are told to use none)."""
        return any(d.startswith(("--gres=", "--gpus")) for d in self.sbatch_directives(trial_gpu_number))


def _slurm_time(seconds: float) -> str:
    """`--time` in Slurm's `D-HH:MM:SS` form, rounded up to whole minutes (its resolution)."""
    minutes = max(1, math.ceil(seconds / 60))
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"
