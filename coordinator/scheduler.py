"""Placing waiting trials on environments: a pure function of the current picture.

FIFO with backfill: trials are considered in submission order, and one that does not fit
never blocks those behind it. GPU-aware: a trial that needs n GPUs is placed on n GPUs of
one environment, each with room for another trial (``maxTrialNumberPerGpu``) and, unless
``useActiveGpu``, no foreign process on it. A slot stays held until the coordinator
releases it, which it does only once the agent reports the trial's process tree gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class GpuSlot:
    uuid: str
    index: int
    capacity: int = 1
    holders: set[str] = field(default_factory=set)
    # A process that is not one of our trials' is using this GPU.
    foreign_busy: bool = False

    def free(self) -> int:
        return self.capacity - len(self.holders)


@dataclass
class EnvCapacity:
    env_id: str
    trial_slots: int
    holders: set[str] = field(default_factory=set)
    gpus: list[GpuSlot] = field(default_factory=list)
    use_active_gpu: bool = False
    accepting: bool = True

    def free_slots(self) -> int:
        return self.trial_slots - len(self.holders)

    def usable_gpus(self) -> list[GpuSlot]:
        return [g for g in self.gpus if g.free() > 0 and (self.use_active_gpu or not g.foreign_busy)]


@dataclass(frozen=True)
class Demand:
    trial_id: str
    gpus: int = 0


@dataclass(frozen=True)
class Placement:
    trial_id: str
    env_id: str
    gpu_uuids: tuple[str, ...] = ()
    gpu_indices: tuple[int, ...] = ()


@dataclass
class Decision:
    placements: list[Placement]
    # Why each trial that was not placed still waits, in words a user reads.
    waiting: dict[str, str]


def place(
    waiting: Sequence[Demand],
    envs: Sequence[EnvCapacity],
    *,
    max_running: int | None = None,
    running: int = 0,
    policy: str = "pack",
) -> Decision:
    """Decide where waiting trials go. Mutates the holders of ``envs`` it places on."""
    placements: list[Placement] = []
    reasons: dict[str, str] = {}
    open_envs = [e for e in envs if e.accepting]
    budget = None if max_running is None else max_running - running
    for demand in waiting:
        if budget is not None and budget <= 0:
            reasons[demand.trial_id] = f"waiting: {max_running} trials are running (trialConcurrency)"
            continue
        found = _choose(demand, open_envs, policy)
        if found is None:
            reasons[demand.trial_id] = _why_not(demand, envs)
            continue
        env, gpus = found
        env.holders.add(demand.trial_id)
        for g in gpus:
            g.holders.add(demand.trial_id)
        placements.append(
            Placement(
                demand.trial_id,
                env.env_id,
                tuple(g.uuid for g in gpus),
                tuple(g.index for g in gpus),
            )
        )
        if budget is not None:
            budget -= 1
    return Decision(placements, reasons)


def _choose(demand: Demand, envs: Sequence[EnvCapacity], policy: str) -> tuple[EnvCapacity, list[GpuSlot]] | None:
    fits: list[tuple[EnvCapacity, list[GpuSlot]]] = []
    for env in envs:
        if env.free_slots() <= 0:
            continue
        if demand.gpus == 0:
            fits.append((env, []))
            continue
        usable = env.usable_gpus()
        if len(usable) < demand.gpus:
            continue
        # Pack fills GPUs that already hold trials first; spread prefers the emptiest.
        usable.sort(key=lambda g: (g.free() if policy == "pack" else -g.free(), g.index))
        fits.append((env, usable[: demand.gpus]))
    if not fits:
        return None
    if policy == "spread":
        return max(fits, key=lambda f: (f[0].free_slots(), _free_gpu_count(f[0])))
    # pack: the busiest environment that still fits, leaving others whole for big trials.
    return min(fits, key=lambda f: (f[0].free_slots(), _free_gpu_count(f[0])))


def _free_gpu_count(env: EnvCapacity) -> int:
    return sum(1 for _ in env.usable_gpus())


def _why_not(demand: Demand, envs: Sequence[EnvCapacity]) -> str:
    accepting = [e for e in envs if e.accepting]
    if not accepting:
        return "waiting: no environment is ready yet"
    if demand.gpus == 0:
        return "waiting: every environment is running as many trials as it takes"
    best = max(accepting, key=lambda e: len(e.usable_gpus()))
    free = len(best.usable_gpus())
    n = demand.gpus
    return (
        f"waiting: no environment has {n} free GPU{'s' if n != 1 else ''}; "
        f"{best.env_id} has {free} free"
    )


def max_gpus_offered(envs: Sequence[EnvCapacity]) -> int:
    """The most GPUs any one environment has, free or not."""
    return max((len(e.gpus) for e in envs), default=0)
