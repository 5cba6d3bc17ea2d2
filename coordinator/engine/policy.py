"""What the decision core knows of an experiment's config, as plain values: one
:class:`PlatformPolicy` per platform section, and the experiment's :class:`Policy`.

``core.py`` builds them from the config and the services; the engine's machines
(``book.py``, ``fleet.py``) decide with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# How long an agent may take to register once its platform runs it (queue time not counted).
AGENT_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PlatformPolicy:
    """What the core needs to know of one platform's section: each platform starts and
    replaces its own environments."""

    name: str
    reuse: bool
    environment_count: int
    trial_slots: int  # per environment in reuse mode
    simulated_gpus: int = 0
    gpu_indices: tuple[int, ...] | None = None
    # Agents see the coordinator's file system: streamed logs of its own agents are dropped.
    shares_filesystem: bool = False
    working_directory: str = ""  # where trials run, as agents see it
    # Why the platform could not be prepared (its code not packed, its SDK missing): it
    # starts nothing, and its environments adopted on resume take no new trial.
    unusable: str = ""
    # The section's (maxTrialNumberPerGpu, useActiveGpu). An environment whose platform sets
    # its own (one machine of several) brings them when it starts.
    gpu_sharing: tuple[int, bool] = (1, False)
    # The experiment's checkpoint directory as its agents would see it through shared
    # storage ("": they upload checkpoints to the coordinator).
    checkpoint_dir: str = ""
    # The platform starts environments as groups, one object per group (a PyTorchJob, a
    # Framework): in reuse mode, each waiting trial is given a group of its trialNodes.
    groups_environments: bool = False

    def gpus_offered(self) -> int:
        """GPUs its agents pretend to have (simulatedGpus), 0 when they report real ones."""
        if not self.simulated_gpus:
            return 0
        return min(self.simulated_gpus, len(self.gpu_indices)) if self.gpu_indices else self.simulated_gpus


@dataclass(frozen=True)
class Policy:
    """What the core needs to know of the experiment's config, as plain values."""

    experiment_id: str
    trial_concurrency: int
    # One per platform, in the config's order (one for most experiments).
    platforms: tuple[PlatformPolicy, ...]
    # The platforms trials may use, most preferred first; () for every platform in the
    # order above. An agent started by hand that reports a platform not in ``platforms``
    # counts as one of the first of them (counted_as).
    trial_platforms: tuple[str, ...] = ()
    max_trial_retries: int = 0
    retry_failed_trials: bool = False
    max_trial_duration_s: float = 0.0
    trial_env: Mapping[str, str] = field(default_factory=dict)
    trial_gpu_memory: int = 0
    heartbeat_interval_s: float = 1.0
    max_heartbeats_per_second: float = 1000.0
    agent_lost_timeout_s: float = 10.0
    trial_lost_timeout_s: float = 30.0
    agent_start_timeout_s: float = AGENT_START_TIMEOUT_S
    placement: str = "pack"
    # Environments per trial (trialNodes; a trial may ask for its own), and whether the
    # environments of one trial may be of several platforms.
    trial_nodes: int = 1
    gang_across_platforms: bool = False
    # Checkpoints: object storage for them ("" none), the largest taken (0: no limit), how many
    # of each trial's are kept, how long a trial asked to pause has to save one, and whether
    # a loss after one does not count against max_trial_retries.
    checkpoint_storage: str = ""
    max_checkpoint_bytes: int = 0
    checkpoints_per_trial: int = 1
    pause_grace_s: float = 120.0
    progress_resets_retries: bool = True
    # Which checkpoints an experiment that finished keeps: succeeded | all | none.
    checkpoints_after_end: str = "succeeded"
    # The coordinator's port for uploads' bytes (transport/bulk.py; 0: by the stream only).
    checkpoint_data_port: int = 0

    def __post_init__(self) -> None:
        if not self.platforms:
            raise ValueError("a policy needs at least one platform")

    def section(self, platform: str) -> PlatformPolicy:
        """The policy of ``platform``; the first platform's for any other (an agent an
        operator started by hand joins as one of it)."""
        return next((p for p in self.platforms if p.name == platform), self.platforms[0])

    def counted_as(self, platform: str) -> str:
        """The platform an environment of ``platform`` counts as when trials are placed (as
        the supply counts it, environments.wanted_new): its own, or the first for an agent
        started by hand that reports one this experiment does not have."""
        return self.section(platform).name

    @property
    def reuse(self) -> bool:
        return any(p.reuse for p in self.platforms)

    def preference(self) -> tuple[str, ...]:
        return self.trial_platforms or tuple(p.name for p in self.platforms)


def gang_bound(nodes: int, counts: Iterable[int], across: bool) -> int | None:
    """The most environments a trial of ``nodes`` could ever have at once, when that is fewer
    than ``nodes`` (it can never start); None when it could start. ``counts``: the
    environmentCount of each platform it may use in reuse mode, which add up ``across``
    platforms (gangAcrossPlatforms). One of 0 (agents started by hand only) sets no bound:
    the trial waits until enough of them have joined. The config and submit both check it."""
    counts = list(counts)
    if nodes <= 1 or 0 in counts:
        return None
    most = sum(counts) if across else max(counts, default=0)
    return most if most < nodes else None
