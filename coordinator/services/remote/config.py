"""The `trainingService` section for `platform: remote`: agents started over SSH."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ...config.platform import TrainingServiceConfig
from ...config.rules import (
    DIAL_HOST,
    GPU_INDICES,
    NON_EMPTY_STR,
    PORT,
    POSITIVE_DURATION,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    SECRET,
    Issues,
    exists,
    not_both,
)

__all__ = ["RemoteConfig", "RemoteMachineConfig"]


@dataclass(frozen=True, kw_only=True)
class RemoteMachineConfig:
    """One SSH machine of `trainingService.machineList` (NNI's field names)."""

    host: str = field(metadata=NON_EMPTY_STR)
    port: int = field(default=22, metadata=PORT)
    user: str = field(metadata=NON_EMPTY_STR)
    # Secrets stay out of reprs, so that no assertion message or log line can show them.
    password: str | None = field(default=None, repr=False, metadata=SECRET)
    ssh_key_file: Path | None = None
    ssh_passphrase: str | None = field(default=None, repr=False, metadata=SECRET)
    # A path on the remote machine: a Python executable, or (as in NNI) its bin directory.
    python_path: str | None = field(default=None, metadata=NON_EMPTY_STR)
    gpu_indices: list[int] | None = field(default=None, metadata=GPU_INDICES)
    max_trial_number_per_gpu: int = field(default=1, metadata=POSITIVE_INT)
    use_active_gpu: bool = False

    @property
    def label(self) -> str:
        """`user@host:port`, how messages name the machine."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}:{self.port}"

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues: Issues = not_both(given, names, "password", "ssh_key_file", at="password")
        if "ssh_passphrase" in given and "ssh_key_file" not in given:
            issues.append(("ssh_passphrase", f"needs {names['ssh_key_file']} (the key it unlocks)"))
        key = values.get("ssh_key_file")
        if key is not None and not exists(key):
            issues.append(("ssh_key_file", f"{key} does not exist"))
        return issues


@dataclass(frozen=True, kw_only=True)
class RemoteConfig(TrainingServiceConfig):
    """Trials run by agents that trialkeeper starts over SSH on the machines listed.

    In reuse mode each machine runs one agent for the whole experiment; without it, each
    trial gets an agent of its own on the least busy machine.
    """

    PLATFORM: ClassVar[str] = "remote"
    machine_list: list[RemoteMachineConfig]
    # The address agents dial back to; auto-detected per machine (with a warning) when unset.
    coordinator_address: str | None = field(default=None, metadata=DIAL_HOST)
    known_hosts_file: Path | None = None  # default: ~/.ssh/known_hosts
    accept_unknown_host_keys: bool = False
    # Install this coordinator's own trialkeeper into a per-experiment virtualenv remotely.
    bootstrap: bool = False
    max_code_dir_files: int = field(default=2000, metadata=POSITIVE_INT)
    max_code_dir_size_mb: float = field(default=300.0, metadata=POSITIVE_NUMBER)
    ssh_timeout: float = field(default=20.0, metadata=POSITIVE_DURATION)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        machines = values.get("machine_list")
        if machines is None:
            return []
        if not machines:
            return [("machine_list", "list at least one machine")]
        issues: Issues = []
        seen: dict[tuple[str, int, str], int] = {}
        for i, m in enumerate(machines):
            first = seen.setdefault((m.host.lower(), m.port, m.user), i)
            if first != i:
                issues.append(
                    (
                        f"machine_list[{i}]",
                        (
                            f"the same machine as {names['machine_list']}[{first}] ({m.label}); "
                            "list each machine once"
                        ),
                    )
                )
        return issues

    def effective_environment_count(self, trial_concurrency: int) -> int:
        """Reuse mode: one environment (one agent) per machine. Otherwise one per trial."""
        return len(self.machine_list) if self.reuse_mode else trial_concurrency

    def trial_slots_per_environment(self, trial_concurrency: int) -> int:
        """Enough slots on each machine's agent for the concurrency (GPUs permitting)."""
        return max(1, -(-trial_concurrency // len(self.machine_list)))

    # The scheduler reads these two experiment-wide; per machine they can only narrow it.
    @property
    def max_trial_number_per_gpu(self) -> int:
        return min(m.max_trial_number_per_gpu for m in self.machine_list)

    @property
    def use_active_gpu(self) -> bool:
        return all(m.use_active_gpu for m in self.machine_list)

