"""The `trainingService` section for `platform: local`: agents on this machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config.platform import EnvironmentPoolConfig, Placement
from ..config.rules import GPU_INDICES, NON_NEGATIVE_INT, POSITIVE_INT, Issues

__all__ = ["LocalConfig"]


@dataclass(frozen=True, kw_only=True)
class LocalConfig(EnvironmentPoolConfig):
    """Trials run by agents on this machine."""

    PLATFORM: ClassVar[str] = "local"
    # 0: the coordinator starts no agent; agents its operators start by hand run the trials.
    environment_count: int | None = field(default=None, metadata=NON_NEGATIVE_INT)
    use_active_gpu: bool = False
    max_trial_number_per_gpu: int = field(default=1, metadata=POSITIVE_INT)
    gpu_indices: list[int] | None = field(default=None, metadata=GPU_INDICES)
    simulated_gpus: int = field(default=0, metadata=NON_NEGATIVE_INT)
    placement: Placement = "pack"

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        if values.get("environment_count") == 0 and not values.get("reuse_mode", True):
            return [("environment_count", (
                "0 (agents started by hand only) needs reuseMode: true, as agents started by hand "
                "join only in reuse mode; give 1 or more, or set reuseMode: true"))]
        return []
