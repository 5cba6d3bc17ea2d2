"""Placing multi-node trials: a gang of N environments taken at once, or not at all.

A trial that asks for N nodes (``trialNodes``) runs one process on each of N environments,
each with the trial's GPUs; it starts only when N environments can take it together. The
pass here runs before the one-node pass (:func:`.scheduler.place_waiting`) and decides, in
queue order, for every waiting gang:

- N environments of one platform (any platforms with ``gangAcrossPlatforms``) that can each
  take one of its ranks now: it is placed on them, all ranks at once. A gang never holds a
  part of what it needs, so two gangs can never each hold half and wait for the other.
- otherwise, for the first such gang in queue order only, a **reservation**: the N
  environments it will start on, those that could take a rank now first, then those it held
  in the last pass, then the least busy. Nothing new is placed on a reserved environment
  (a one-node trial, or a later gang), so the reserved ones only empty and the gang starts
  at the latest when the trials running on them at the time end: its wait is bounded by the
  longest trial, however many small trials keep coming. They keep the other environments.
- **backfill**: one-node trials, and later gangs that fit, go on starting on the environments
  the reservation leaves; and a one-node trial also takes a reserved environment's free room
  when its time limit (its own, or ``maxTrialDuration``) ends before the gang could start,
  that is before the last of the trials on the reserved environments is bound to end
  (``GangRoom`` in multinode.py, as Slurm's backfill does with its jobs' time limits).

A waiting gang's reason says what it waits for: how many of the N environments could take
it now, and which are reserved for it while their trials end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .scheduler import EnvCapacity, GpuSlot, Placement
from .waiting import Demand, WaitingTrials


@dataclass(frozen=True)
class GangPlacement:
    trial_id: str
    ranks: tuple[Placement, ...]  # rank 0 first


@dataclass
class GangDecision:
    placements: list[GangPlacement] = field(default_factory=list)
    # Why each gang that was not placed waits, in words a user reads.
    waiting: dict[str, str] = field(default_factory=dict)
    # The environments held for the first gang that could not start (none: every gang started,
    # or the first waits for environments that do not exist yet).
    reserved: tuple[str, ...] = ()
    reserved_for: str = ""


def waiting_gangs(waiting: WaitingTrials) -> list[tuple[int, Demand]]:
    """The waiting multi-node trials (not in their backoff), in queue order."""
    found = []
    for shape in list(waiting.shapes()):
        if shape.nodes > 1:
            found += [waiting.head_of(tid) for tid in waiting.members(shape)]
            waiting.fresh.pop(shape, None)  # their reasons are told here, each time
    found.sort(key=lambda e: e[0])
    return found


def place_gangs(
    gangs: Sequence[tuple[int, Demand]],
    envs: Mapping[str, EnvCapacity],
    *,
    budget: int | None = None,
    policy: str = "pack",
    across_platforms: bool = False,
    reserved_before: Sequence[str] = (),
    held: Mapping[str, str] | None = None,
) -> GangDecision:
    """Place what can start of ``gangs`` (queue order) on ``envs``, and reserve environments
    for the first that cannot. Mutates the holders and GPUs of the environments it places on.
    ``budget``: how many more trials may start (trialConcurrency; a gang is one). ``held``:
    environments that only one gang may take (a group started for it), with its id."""
    decision = GangDecision()
    all_envs = [e for e in envs.values() if e.accepting]
    fits = _Fits(all_envs, policy, held or {})
    taken: set[str] = set()  # reserved in this pass: no later gang takes them
    # Per kind of rank, the fewest nodes found not to fit and how many could take it: a gang of
    # that kind and at least as many nodes behind it does not fit either (placements only
    # take room), without a walk.
    failed: dict[tuple[object, ...], tuple[int, int]] = {}
    for _, demand in gangs:
        if budget is not None and budget <= 0:
            decision.waiting[demand.trial_id] = "waiting: as many trials are running as trialConcurrency allows"
            continue
        kind = (demand.gpus, demand.gpu_memory_bytes, demand.platforms, demand.only_these)
        if decision.reserved_for and kind in failed and demand.nodes >= failed[kind][0] and not fits.held:
            decision.waiting[demand.trial_id] = (
                f"waiting for {demand.nodes} environments at once: {failed[kind][1]} can take it now; "
                f"gang {decision.reserved_for} is ahead of it"
            )
            continue
        chosen = fits.group(demand, across_platforms, taken)
        if chosen is not None and len(chosen) >= demand.nodes:
            ranks = []
            for env in chosen[: demand.nodes]:
                gpus = take_rank(env, demand, policy)
                ranks.append(Placement(demand.trial_id, env.env_id, tuple(g.uuid for g in gpus),
                                       tuple(g.index for g in gpus)))
                fits.changed(env)
            decision.placements.append(GangPlacement(demand.trial_id, tuple(ranks)))
            if budget is not None:
                budget -= 1
            continue
        now_fit = len(chosen or ())
        if demand.trial_id in fits.owners:  # its own group is on its way: nothing else is held for it
            decision.waiting[demand.trial_id] = (
                f"waiting for the group of {demand.nodes} environments started for it: {now_fit} can take it now"
            )
            continue
        if decision.reserved_for:
            if demand.nodes < failed.get(kind, (demand.nodes + 1, 0))[0]:
                failed[kind] = (demand.nodes, now_fit)
            decision.waiting[demand.trial_id] = (
                f"waiting for {demand.nodes} environments at once: {now_fit} can take it now; "
                f"gang {decision.reserved_for} is ahead of it"
            )
            continue
        own = [e for e in all_envs if fits.held.get(e.env_id, demand.trial_id) == demand.trial_id]
        reserve = _reserve(demand, own, chosen or [], reserved_before, across_platforms)
        if reserve is None:
            decision.waiting[demand.trial_id] = (
                f"waiting for {demand.nodes} environments at once{_of(demand, across_platforms)}: "
                f"only {_most(demand, all_envs, across_platforms)} are ready"
            )
            decision.reserved_for = demand.trial_id  # the gangs behind it wait behind it
            continue
        decision.reserved, decision.reserved_for = tuple(e.env_id for e in reserve), demand.trial_id
        taken.update(decision.reserved)
        busy = [e.env_id for e in reserve if fits.key(demand, e) is None]
        decision.waiting[demand.trial_id] = (
            f"waiting for {demand.nodes} environments at once: {now_fit} can take it now, "
            f"{', '.join(busy)} reserved for it until their trials end"
        )
    return decision


def _of(demand: Demand, across: bool) -> str:
    return "" if across else " of one platform"


def _most(demand: Demand, envs: Sequence[EnvCapacity], across: bool) -> int:
    """The most environments that could ever take one of ``demand``'s ranks together."""
    counts: dict[str, int] = {}
    for e in envs:
        if demand.rank(e.platform) is not None and _could(demand, e):
            key = "" if across else e.platform
            counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0)


def _could(demand: Demand, env: EnvCapacity) -> bool:
    """Whether ``env`` could take one of the ranks once it is empty."""
    return env.trial_slots > 0 and len(env.gpus) >= demand.gpus


def _reserve(
    demand: Demand, envs: Sequence[EnvCapacity], now_fit: Sequence[EnvCapacity],
    before: Sequence[str], across: bool,
) -> list[EnvCapacity] | None:
    """The N environments to hold for ``demand``: of its most preferred platform that has N
    that could take it (any, ``across``), those that can take it now first, then those held
    before, then the least busy. None when no platform has N."""
    held_before = set(before)
    now_ids = {e.env_id for e in now_fit}
    groups: dict[str, list[EnvCapacity]] = {}
    for e in envs:
        rank = demand.rank(e.platform)
        if rank is not None and _could(demand, e):
            groups.setdefault("" if across else e.platform, []).append(e)
    best: list[EnvCapacity] | None = None
    best_rank = None
    for name, group in groups.items():
        if len(group) < demand.nodes:
            continue
        rank = min(demand.rank(e.platform) or 0 for e in group) if across else demand.rank(name)
        if best_rank is None or (rank or 0) < best_rank:
            best, best_rank = group, rank or 0
    if best is None:
        return None
    order = {e.env_id: i for i, e in enumerate(best)}
    best = sorted(best, key=lambda e: (e.env_id not in now_ids, e.env_id not in held_before,
                                       len(e.holders), order[e.env_id]))
    return best[: demand.nodes]


def take_rank(env: EnvCapacity, demand: Demand, policy: str) -> list[GpuSlot]:
    """Take a slot of ``env`` and the GPUs ``demand`` asks for (pack or spread), for one rank."""
    env.holders.add(demand.trial_id)
    gpus: list[GpuSlot] = []
    if demand.gpus:
        usable = sorted(env.usable_gpus(demand.gpu_memory_bytes),
                        key=lambda g: (g.free() if policy == "pack" else -g.free(), g.index))
        gpus = usable[: demand.gpus]
    for g in gpus:
        g.take(demand.trial_id, demand.gpu_memory_bytes)
    return gpus


class _Fits:
    """Per kind of rank (GPUs, memory, platforms), the environments that can take one now,
    found once per pass and kept up to date as gangs are placed: a pass over thousands of
    waiting gangs costs a walk over the environments per kind, not per gang."""

    def __init__(self, envs: Sequence[EnvCapacity], policy: str, held: Mapping[str, str]) -> None:
        self.envs = envs
        self.held = held
        self.owners = set(held.values())
        self.sign = 1 if policy != "spread" else -1
        self._lists: dict[tuple[object, ...], list[EnvCapacity]] = {}
        self._demands: dict[tuple[object, ...], Demand] = {}

    def key(self, demand: Demand, env: EnvCapacity) -> tuple[int, int, int] | None:
        rank = demand.rank(env.platform)
        if rank is None or env.free_slots() <= 0:
            return None
        if demand.gpus and len(env.usable_gpus(demand.gpu_memory_bytes)) < demand.gpus:
            return None
        return (rank, self.sign * env.free_slots(), self.sign * len(env.usable_gpus(0)))

    def _list(self, demand: Demand) -> list[EnvCapacity]:
        kind = (demand.gpus, demand.gpu_memory_bytes, demand.platforms, demand.only_these)
        found = self._lists.get(kind)
        if found is None:
            keyed = [(k, i, e) for i, e in enumerate(self.envs) if (k := self.key(demand, e)) is not None]
            found = self._lists[kind] = [e for _, _, e in sorted(keyed, key=lambda x: (x[0], x[1]))]
            self._demands[kind] = demand
        return found

    def group(self, demand: Demand, across: bool, taken: set[str]) -> list[EnvCapacity] | None:
        """The environments that can take one of ``demand``'s ranks now, best first: of the
        most preferred platform that has ``demand.nodes`` of them (any, ``across``); else of
        the platform that has the most."""
        fitting = [e for e in self._list(demand) if e.env_id not in taken] if taken else self._list(demand)
        if self.held:  # a group held for a gang is its own, and a gang with a group starts on it alone
            own = demand.trial_id
            if own in self.owners:
                return [e for e in fitting if self.held.get(e.env_id) == own]
            fitting = [e for e in fitting if self.held.get(e.env_id, own) == own]
        if across:
            return fitting
        groups: dict[str, list[EnvCapacity]] = {}
        for e in fitting:
            groups.setdefault(e.platform, []).append(e)
        enough = [g for g in groups.values() if len(g) >= demand.nodes]
        if enough:
            return min(enough, key=lambda g: demand.rank(g[0].platform) or 0)
        return max(groups.values(), key=len, default=None)

    def changed(self, env: EnvCapacity) -> None:
        """A rank was placed on ``env``: drop it from the lists of kinds it no longer fits."""
        for kind, found in self._lists.items():
            if env in found and self.key(self._demands[kind], env) is None:
                found.remove(env)
