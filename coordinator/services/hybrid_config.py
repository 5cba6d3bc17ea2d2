"""The `trainingService` section of an experiment on several platforms at once.

NNI writes it as a list (`trainingService: [{platform: local}, {platform: remote, ...}]`);
the walker reads such a list as `platform: hybrid` with the list as `platforms`. Each
section keeps its own fields (reuseMode, environmentCount, GPU settings) and its platform
starts and replaces its own environments; trials go to any environment that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..config.platform import Placement, TrainingServiceConfig
from ..config.rules import Issues

__all__ = ["HybridConfig"]


@dataclass(frozen=True, kw_only=True)
class HybridConfig(TrainingServiceConfig):
    """Several platforms, one section each, in the order trials prefer them."""

    PLATFORM: ClassVar[str] = "hybrid"
    platforms: list[TrainingServiceConfig]
    # The platforms trials may use, most preferred first (say [local, slurm]: Slurm only
    # when local is full). None: every platform, in the order of `platforms`.
    trial_platforms: list[str] | None = None

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        sections = values.get("platforms")
        if not isinstance(sections, list):
            return []
        issues: Issues = []
        if not sections:
            issues.append(("platforms", "expected at least one platform section"))
        seen: dict[str, int] = {}
        for i, section in enumerate(sections):
            name = section.platform
            if isinstance(section, HybridConfig):
                issues.append(
                    (f"platforms[{i}].platform", "a hybrid section cannot hold another; list its platforms here")
                )
            elif name in seen:
                why = (
                    f"{name!r} is already section {seen[name]}; give each platform one section "
                    "(a remote section takes several machines in machineList)"
                )
                issues.append((f"platforms[{i}].platform", why))
            seen.setdefault(name, i)
        wanted = values.get("trial_platforms")
        if isinstance(wanted, list):
            if not wanted:
                issues.append(("trial_platforms", f"expected at least one of: {', '.join(seen)}"))
            for i, name in enumerate(wanted):
                if name not in seen:
                    issues.append((f"trial_platforms[{i}]", f"{name!r} has no section here; one of: {', '.join(seen)}"))
                elif name in wanted[:i]:
                    issues.append((f"trial_platforms[{i}]", f"{name!r} is listed twice"))
        return issues

    def sections(self) -> tuple[TrainingServiceConfig, ...]:
        return tuple(self.platforms)

    @property
    def placement(self) -> Placement:
        return self.platforms[0].placement if self.platforms else "pack"

    def gpu_shortfall(self, trial_gpu_number: int) -> tuple[str, str] | None:
        """Only when no platform a trial may use could give it the GPUs."""
        allowed = set(self.preferred_platforms())
        shortfalls = [
            (i, s.gpu_shortfall(trial_gpu_number)) for i, s in enumerate(self.platforms) if s.platform in allowed
        ]
        if not shortfalls or any(short is None for _, short in shortfalls):
            return None
        i, short = shortfalls[0]
        assert short is not None
        return f"platforms[{i}].{short[0]}", f"{short[1]} (and no other platform has enough)"
