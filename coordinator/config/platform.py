"""The base of every platform's `trainingService` section, built-in or plug-in.

What the coordinator reads of any platform is declared here, typed and defaulted, so a
platform that has no say in it (GPU indices, GPU sharing, placement) needs no field for
it and the core never asks `getattr`. A platform that lets users set one declares a
dataclass field of the same name, which takes the place of the default below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

from ..engine.policy import gang_bound
from .rules import POSITIVE_INT

__all__ = ["EnvironmentPoolConfig", "GpuSharing", "Placement", "TrainingServiceConfig"]

Placement = Literal["pack", "spread"]


class GpuSharing(NamedTuple):
    """How the trials of one environment share its GPUs."""

    max_trials_per_gpu: int
    use_active_gpu: bool


@dataclass(frozen=True, kw_only=True)
class TrainingServiceConfig:
    """Base of the per-platform configs; each subclass names its `PLATFORM` (the name
    `platforms` registers it under).

    `platform` is filled in from the class, so an instance cannot contradict its type.
    """

    PLATFORM: ClassVar[str] = ""
    # Whether this platform's environments mount the top-level `sharedStorage`; a config
    # giving it for a platform that would not use it is refused rather than ignored.
    MOUNTS_SHARED_STORAGE: ClassVar[bool] = False
    platform: str = field(default="", init=False)
    reuse_mode: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "platform", self.PLATFORM)

    def effective_environment_count(self, trial_concurrency: int) -> int:
        """How many environments the experiment keeps; by default one per running trial."""
        return trial_concurrency

    def trial_slots_per_environment(self, trial_concurrency: int) -> int:
        """How many trials one environment runs at once in reuse mode (GPUs permitting)."""
        return 1

    def sections(self) -> tuple[TrainingServiceConfig, ...]:
        """The platform sections this one stands for: itself, or each of a hybrid's."""
        return (self,)

    def preferred_platforms(self) -> tuple[str, ...]:
        """The platforms trials may use, most preferred first."""
        return tuple(self.trial_platforms or (s.platform for s in self.sections()))

    # ---- read by the core; a subclass may declare any of these as a config field -------

    @property
    def gpu_indices(self) -> list[int] | None:
        """The GPUs agents may use (`--gpu-indices`); None: all they find."""
        return None

    @property
    def simulated_gpus(self) -> int:
        """GPUs each agent pretends to have (tests and demos); 0: the real ones."""
        return 0

    @property
    def max_trial_number_per_gpu(self) -> int:
        """Trials that may share one GPU."""
        return 1

    @property
    def use_active_gpu(self) -> bool:
        """Whether trials may go to GPUs that processes of others are using."""
        return False

    @property
    def trial_platforms(self) -> list[str] | None:
        """The platforms trials may use, most preferred first; None: every one, in order."""
        return None

    @property
    def placement(self) -> Placement:
        """How trials are spread over environments: fill one first, or spread them."""
        return "pack"

    def gpu_sharing(self, per_environment: tuple[int | None, bool | None] = (None, None)) -> GpuSharing:
        """GPU sharing in one environment, the one place that decides it: what the platform
        sets for that environment (`EnvironmentService.gpu_policy`, per machine), else
        this section's values."""
        per_gpu, active = per_environment
        return GpuSharing(
            self.max_trial_number_per_gpu if per_gpu is None else per_gpu,
            self.use_active_gpu if active is None else active,
        )

    def gpu_shortfall(self, trial_gpu_number: int) -> tuple[str, str] | None:
        """When no environment of this config could ever give a trial `trial_gpu_number`
        GPUs: (the field of this config at fault, in camelCase; what is wrong and what
        would do). None when it could, or when only the machines can tell."""
        return None


@dataclass(frozen=True, kw_only=True)
class EnvironmentPoolConfig(TrainingServiceConfig):
    """Base of the platforms that keep a pool of environments, each running
    `trials_per_environment` trials at once in reuse mode."""

    environment_count: int | None = field(default=None, metadata=POSITIVE_INT)
    trials_per_environment: int = field(default=1, metadata=POSITIVE_INT)

    def effective_environment_count(self, trial_concurrency: int) -> int:
        """`environment_count` if given, else enough environments for the concurrency.

        Without reuse mode every trial gets its own environment and the count is ignored.
        """
        if not self.reuse_mode:
            return trial_concurrency
        if self.environment_count is not None:
            return self.environment_count
        return -(-trial_concurrency // self.trials_per_environment)

    def trial_slots_per_environment(self, trial_concurrency: int) -> int:
        return self.trials_per_environment


def gang_shortfall(service: TrainingServiceConfig, nodes: int, concurrency: object, across: object) -> str:
    """Why a trial of ``nodes`` environments could never start on ``service`` ("" if it could):
    the rule of :func:`~trialkeeper.coordinator.engine.policy.gang_bound` (which submit checks
    too), over the platforms trials may use, said with the fields to change."""
    concurrency = concurrency if isinstance(concurrency, int) else 1
    allowed = set(service.preferred_platforms())
    counts = {s.platform: s.effective_environment_count(concurrency * nodes) for s in service.sections()
              if s.platform in allowed and s.reuse_mode}
    if not counts:
        return f"a trial of {nodes} nodes needs reuseMode: true (environments that wait for its other nodes)"
    most = gang_bound(nodes, counts.values(), bool(across))
    if most is None:
        return ""
    kept = ", ".join(f"{p}: {n}" for p, n in counts.items())
    return (
        f"a trial of {nodes} nodes needs {nodes} environments at once{'' if across else ' of one platform'}, "
        f"but the experiment keeps at most {most} ({kept}); set trainingService.environmentCount "
        f"(or list as many machines) to {nodes} or more, or lower trialNodes"
    )
