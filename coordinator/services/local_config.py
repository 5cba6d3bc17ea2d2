"""The `trainingService` section for `platform: local`: agents on this machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..config.platform import EnvironmentPoolConfig, Placement
from ..config.rules import GPU_INDICES, NON_NEGATIVE_INT, POSITIVE_INT

__all__ = ["LocalConfig"]


@dataclass(frozen=True, kw_only=True)
class LocalConfig(EnvironmentPoolConfig):
    """Trials run by agents on this machine."""

    PLATFORM: ClassVar[str] = "local"
    use_active_gpu: bool = False
    max_trial_number_per_gpu: int = field(default=1, metadata=POSITIVE_INT)
    gpu_indices: list[int] | None = field(default=None, metadata=GPU_INDICES)
    simulated_gpus: int = field(default=0, metadata=NON_NEGATIVE_INT)
    placement: Placement = "pack"
