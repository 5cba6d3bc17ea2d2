"""The `trainingService` section for `platform: openpai`.

Field names are those NNI users know: `host`, `username`, `token`, `trialCpuNumber`,
`trialMemorySize`, `dockerImage`, `virtualCluster`, `storageConfigName`,
`localStorageMountPoint` (where this machine sees the storage) and
`containerStorageMountPoint` (where the jobs see it). The storage fields may be left out
when the experiment has a `sharedStorage` section instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..config.platform import EnvironmentPoolConfig
from ..config.rules import (
    NON_EMPTY_STR,
    NON_NEGATIVE_INT,
    POSITIVE_DURATION,
    POSITIVE_INT,
    SECRET,
    SIZE,
    Issues,
    rule,
)

__all__ = ["OpenPaiConfig"]


def _host(value: object) -> object:
    # NNI accepts a bare host name and means https.
    if isinstance(value, str) and value.strip() and "://" not in value:
        return f"https://{value.strip()}"
    return value


_HOST = rule(
    "an http(s) URL or a host name (https is assumed)",
    lambda v: v.startswith(("http://", "https://")) and len(v.split("://", 1)[1].strip("/")) > 0,
    coerce=_host,
)
_ABSOLUTE_PATH = rule("an absolute path (starting with /)", lambda v: v.startswith("/"))
_JOB_NAME_PART = rule(
    "letters, digits, '_' and '-'", lambda v: bool(v) and all(c.isalnum() or c in "_-" for c in v)
)


@dataclass(frozen=True, kw_only=True)
class OpenPaiConfig(EnvironmentPoolConfig):
    """`platform: openpai`: every environment is one OpenPAI job (one task role, one instance)."""

    PLATFORM: ClassVar[str] = "openpai"
    MOUNTS_SHARED_STORAGE: ClassVar[bool] = True
    host: str = field(metadata=_HOST)
    username: str = field(metadata=_JOB_NAME_PART)
    token: str = field(repr=False, metadata=SECRET)
    trial_cpu_number: int = field(default=1, metadata=POSITIVE_INT)
    trial_memory_size: int = field(default=2 * 2**30, metadata=SIZE)
    # GPUs per trial; by default the experiment's trialGpuNumber.
    trial_gpu_number: int | None = field(default=None, metadata=NON_NEGATIVE_INT)
    # An image with trialkeeper installed (there is no useful default).
    docker_image: str = field(metadata=NON_EMPTY_STR)
    virtual_cluster: str = field(default="default", metadata=NON_EMPTY_STR)
    storage_config_name: str | None = field(default=None, metadata=NON_EMPTY_STR)
    local_storage_mount_point: Path | None = None
    container_storage_mount_point: str | None = field(default=None, metadata=_ABSOLUTE_PATH)
    # The Python inside the image that has trialkeeper installed.
    python_path: str = field(default="python3", metadata=NON_EMPTY_STR)
    poll_interval: float = field(default=2.0, metadata=POSITIVE_DURATION)
    api_timeout: float = field(default=30.0, metadata=POSITIVE_DURATION)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        storage = ("storage_config_name", "local_storage_mount_point", "container_storage_mount_point")
        issues: Issues = []
        if any(k in given for k in storage):
            issues += [
                (k, f"required with {names[next(g for g in storage if g in given)]}") for k in storage if k not in given
            ]
        local = values.get("local_storage_mount_point")
        if local is not None and not local.is_dir():
            issues.append(("local_storage_mount_point", f"{local} is not a directory"))
        return issues

    @property
    def has_storage(self) -> bool:
        return self.storage_config_name is not None

    def resources(self, experiment_gpus: int) -> dict[str, int]:
        """`resourcePerInstance` of each job: room for the trials it runs at once."""
        slots = self.trials_per_environment if self.reuse_mode else 1
        gpus = self.trial_gpu_number if self.trial_gpu_number is not None else experiment_gpus
        return {
            "cpu": self.trial_cpu_number * slots,
            "memoryMB": max(1, math.ceil(self.trial_memory_size / 2**20)) * slots,
            "gpu": gpus * slots,
        }
