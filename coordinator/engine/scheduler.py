"""Placing waiting trials on environments: a pure function of the current picture.

FIFO with backfill: trials are considered in submission order, and one that does not fit
never blocks those behind it. GPU-aware: a trial that needs n GPUs is placed on n GPUs of
one environment, each with room for another trial (``maxTrialNumberPerGpu``) and, unless
``useActiveGpu``, no foreign process on it. A slot stays held until the coordinator
releases it, which it does only once the agent reports the trial's process tree gone and,
where NVML shows the GPU's processes, the trial's processes gone from the GPU as well
(:func:`trial_ended` and :func:`gpu_sampled` keep that ledger).

:func:`place` is the rule written plainly, over the whole queue; the coordinator runs
:func:`place_waiting`, the same rule over the waiting trials indexed by shape
(:mod:`.waiting`), which costs what changed since the last pass.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .waiting import Demand, Shape, WaitingTrials


@dataclass
class GpuSlot:
    uuid: str
    index: int
    capacity: int = 1
    # Trials holding this GPU: running ones, and ended ones whose processes NVML still lists.
    holders: set[str] = field(default_factory=set)
    # Ended trials still holding the GPU until their processes leave it.
    lingering: set[str] = field(default_factory=set)
    # A process that is not one of our trials' is using this GPU.
    foreign_busy: bool = False
    memory_total_bytes: int = 0
    # Measured, all processes together (0 until the first heartbeat).
    memory_used_bytes: int = 0
    # Measured per holder, from the GPU's process list.
    holder_usage: dict[str, int] = field(default_factory=dict)
    # What each holder asked for (trialGpuMemory), reserved until it is measured.
    requests: dict[str, int] = field(default_factory=dict)

    def free(self) -> int:
        return self.capacity - len(self.holders)

    def free_memory(self) -> int | None:
        """Bytes a new trial can count on: total, less foreign use, less what each holder
        uses or asked for (whichever is more). None when the total is not known."""
        if not self.memory_total_bytes:
            return None
        ours = sum(self.holder_usage.get(t, 0) for t in self.holders)
        foreign = max(0, self.memory_used_bytes - ours)
        held = sum(max(self.requests.get(t, 0), self.holder_usage.get(t, 0)) for t in self.holders)
        return max(0, self.memory_total_bytes - foreign - held)

    def take(self, trial_id: str, memory_bytes: int = 0) -> None:
        self.holders.add(trial_id)
        if memory_bytes:
            self.requests[trial_id] = memory_bytes

    def release(self, trial_id: str) -> None:
        self.holders.discard(trial_id)
        self.lingering.discard(trial_id)
        self.requests.pop(trial_id, None)
        self.holder_usage.pop(trial_id, None)


@dataclass
class EnvCapacity:
    env_id: str
    trial_slots: int
    holders: set[str] = field(default_factory=set)
    gpus: list[GpuSlot] = field(default_factory=list)
    use_active_gpu: bool = False
    accepting: bool = True
    platform: str = ""

    def free_slots(self) -> int:
        return self.trial_slots - len(self.holders)

    def usable_gpus(self, memory_bytes: int = 0) -> list[GpuSlot]:
        return [
            g
            for g in self.gpus
            if g.free() > 0 and (self.use_active_gpu or not g.foreign_busy) and _memory_fits(g, memory_bytes)
        ]


def _memory_fits(g: GpuSlot, memory_bytes: int) -> bool:
    if not memory_bytes:
        return True
    free = g.free_memory()
    return free is None or free >= memory_bytes


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
    # Capacity only shrinks during one call, so a shape (GPUs, memory) that did not fit
    # once will not fit later in the queue either: decide it once. This keeps a call
    # linear in the queue length.
    no_fit: dict[tuple[int, int, tuple[str, ...], bool], str] = {}
    offers = _Offers()
    for demand in waiting:
        if budget is not None and budget <= 0:
            reasons[demand.trial_id] = f"waiting: {max_running} trials are running (trialConcurrency)"
            continue
        shape = (demand.gpus, demand.gpu_memory_bytes, demand.platforms, demand.only_these)
        if shape in no_fit:
            reasons[demand.trial_id] = no_fit[shape]
            continue
        found = _choose(demand, open_envs, policy, offers)
        if found is None:
            reasons[demand.trial_id] = no_fit[shape] = _why_not(demand, envs)
            continue
        env, gpus = found
        env.holders.add(demand.trial_id)
        for g in gpus:
            g.take(demand.trial_id, demand.gpu_memory_bytes)
        offers.changed(env)
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


@dataclass
class WaitingDecision:
    placements: list[Placement]
    # Trials whose reason to wait changed (only those), in words a user reads.
    waiting: dict[str, str]
    # Whether every shape was walked (not cut short by trialConcurrency).
    complete: bool = True


def place_waiting(
    waiting: WaitingTrials,
    envs: Mapping[str, EnvCapacity],
    *,
    now: float = 0.0,
    max_running: int | None = None,
    running: int = 0,
    policy: str = "pack",
) -> WaitingDecision:
    """:func:`place` over the index: the same placements, in the same order, at the cost of
    what changed since the last pass. Removes the trials it places from ``waiting``;
    ``envs`` (in order) must be the environments the index's ``changed_envs`` speak of.

    The order is the queue's: the next trial tried is the first in queue order among the
    heads of the shapes not yet found not to fit in this pass, exactly the next one that
    :func:`place` would try. A shape found not to fit at the last pass is tried only on the
    environments that changed since (the others could not take it then and have not grown);
    any other shape on every open environment."""
    waiting.release_due(now)
    placements: list[Placement] = []
    reasons: dict[Shape, str] = {}
    if not waiting.pending(now):
        return WaitingDecision(placements, {})
    all_envs = list(envs.values())
    changed_ids = waiting.changed_envs
    changed = [e for e in all_envs if e.env_id in changed_ids] if changed_ids else []
    changed_open = [e for e in changed if e.accepting]
    open_envs: list[EnvCapacity] | None = None  # made when a shape not blocked is tried
    placed_on: dict[str, EnvCapacity] = {}
    budget = None if max_running is None else max_running - running
    offers = _Offers()
    heads: list[tuple[int, Shape]] = []
    for shape in waiting.shapes():
        head = waiting.head(shape) if shape.nodes == 1 else None  # gangs: gangs.place_gangs
        if head is not None:
            heads.append((head[0], shape))
    heapq.heapify(heads)
    failed: set[Shape] = set()
    fitted: set[Shape] = set()
    complete = True
    while heads:
        if budget is not None and budget <= 0:
            complete = False
            for _, shape in heads:
                reasons[shape] = f"waiting: {max_running} trials are running (trialConcurrency)"
            break
        _, shape = heapq.heappop(heads)
        head = waiting.head(shape)
        if head is None:
            continue
        demand = head[1]
        blocked = shape in waiting.blocked
        if not blocked and open_envs is None:
            open_envs = [e for e in all_envs if e.accepting]
        found = _choose(demand, changed_open if blocked else open_envs, policy, offers)  # type: ignore[arg-type]
        if found is None:
            failed.add(shape)
            before = waiting.why.get(shape)
            touched = [*changed, *(e for e in placed_on.values() if e.env_id not in changed_ids)]
            if blocked and before is not None:
                facts = _why_since(demand, before, touched, all_envs)
            else:
                facts = _why_facts(demand, all_envs)
            waiting.why[shape] = facts
            reasons[shape] = _why_text(demand, facts)
            continue
        env, gpus = found
        fitted.add(shape)
        waiting.remove(demand.trial_id)
        env.holders.add(demand.trial_id)
        for g in gpus:
            g.take(demand.trial_id, demand.gpu_memory_bytes)
        offers.changed(env)
        placed_on[env.env_id] = env
        placements.append(
            Placement(demand.trial_id, env.env_id, tuple(g.uuid for g in gpus), tuple(g.index for g in gpus))
        )
        if budget is not None:
            budget -= 1
        nxt = waiting.head(shape)
        if nxt is not None:
            heapq.heappush(heads, (nxt[0], shape))
    for shape in fitted - reasons.keys():
        waiting.fresh.pop(shape, None)
    waiting.capped = not complete
    if complete:
        waiting.blocked = {s for s in failed if s in waiting.shapes()}
        waiting.changed_envs = set()
    else:
        waiting.blocked = (waiting.blocked - fitted) | failed
    # The environments placed on hold less now: the reasons that name them are redone next time.
    waiting.changed_envs |= placed_on.keys()
    return WaitingDecision(placements, waiting.tell(reasons), complete)


class _Offers:
    """What each environment can offer, computed once per call and again only for an
    environment a placement changed; and, per kind of demand, the environments that fit it
    in a heap by preference. A placement then costs a look at the top of a heap instead of
    a walk over every environment: a burst of thousands of trials onto a thousand agents is
    placed in one pass of a fraction of a second."""

    def __init__(self) -> None:
        self._usable: dict[int, dict[int, list[GpuSlot]]] = {}
        self._heaps: dict[tuple[Any, ...], _Ranked] = {}

    def usable(self, env: EnvCapacity, memory_bytes: int) -> list[GpuSlot]:
        per_env = self._usable.setdefault(id(env), {})
        found = per_env.get(memory_bytes)
        if found is None:
            found = per_env[memory_bytes] = env.usable_gpus(memory_bytes)
        return found

    def key(self, demand: Demand, env: EnvCapacity, sign: int) -> tuple[int, int, int] | None:
        """Where ``env`` stands for ``demand`` (lower is better), or None if it cannot take it.
        Pack: the busiest environment that still fits, leaving others whole for big trials;
        spread: the emptiest. Either way, an environment of a more preferred platform first."""
        rank = demand.rank(env.platform)
        if rank is None:
            return None
        slots = env.free_slots()
        if slots <= 0:
            return None
        if demand.gpus and len(self.usable(env, demand.gpu_memory_bytes)) < demand.gpus:
            return None
        return (rank, sign * slots, sign * len(self.usable(env, 0)))

    def best(self, demand: Demand, envs: Sequence[EnvCapacity], sign: int) -> EnvCapacity | None:
        """The first environment of ``envs`` with the lowest key for ``demand``."""
        sig = (id(envs), demand.gpus, demand.gpu_memory_bytes, demand.platforms, demand.only_these, sign)
        ranked = self._heaps.get(sig)
        if ranked is None:
            ranked = self._heaps[sig] = _Ranked(envs, demand, sign)
            ranked.heap = [
                (k, pos, env) for pos, env in enumerate(envs) if (k := self.key(demand, env, sign)) is not None
            ]
            heapq.heapify(ranked.heap)
        heap = ranked.heap
        while heap:
            k, _, env = heap[0]
            # An entry pushed before its environment changed is stale: the changed one's
            # current key was pushed when it changed (see changed()).
            if self.key(demand, env, sign) == k:
                return env
            heapq.heappop(heap)
        return None

    def changed(self, env: EnvCapacity) -> None:
        self._usable.pop(id(env), None)
        for ranked in self._heaps.values():
            pos = ranked.position(env)
            if pos is not None and (k := self.key(ranked.demand, env, ranked.sign)) is not None:
                heapq.heappush(ranked.heap, (k, pos, env))


class _Ranked:
    """The environments of one list that fit one kind of demand, by key then by position."""

    def __init__(self, envs: Sequence[EnvCapacity], demand: Demand, sign: int) -> None:
        self.envs = envs  # held: the heaps are found by the list's id
        self.demand = demand
        self.sign = sign
        self.heap: list[tuple[tuple[int, int, int], int, EnvCapacity]] = []
        self._positions: dict[int, int] | None = None

    def position(self, env: EnvCapacity) -> int | None:
        if self._positions is None:
            self._positions = {id(e): i for i, e in enumerate(self.envs)}
        return self._positions.get(id(env))


def _choose(
    demand: Demand, envs: Sequence[EnvCapacity], policy: str, offers: _Offers
) -> tuple[EnvCapacity, list[GpuSlot]] | None:
    best = offers.best(demand, envs, 1 if policy != "spread" else -1)
    if best is None:
        return None
    if not demand.gpus:
        return best, []
    # Pack fills GPUs that already hold trials first; spread prefers the emptiest.
    usable = sorted(
        offers.usable(best, demand.gpu_memory_bytes),
        key=lambda g: (g.free() if policy == "pack" else -g.free(), g.index),
    )
    return best, usable[: demand.gpus]


def _why_not(demand: Demand, envs: Sequence[EnvCapacity]) -> str:
    return _why_text(demand, _why_facts(demand, envs))


@dataclass(frozen=True)
class Why:
    """The facts behind a waiting reason: an environment open at all, one open to this
    trial's platforms, and the one with room that has the most usable GPUs (the first such
    in order). Each is a witness: while it does not change, neither does the fact."""

    any_open: EnvCapacity | None
    open_for_it: EnvCapacity | None
    best: EnvCapacity | None
    best_free: int = 0


def _why_facts(demand: Demand, envs: Sequence[EnvCapacity]) -> Why:
    any_open = next((e for e in envs if e.accepting), None)
    open_for_it = next((e for e in envs if e.accepting and demand.rank(e.platform) is not None), None)
    best, best_free = None, -1
    if open_for_it is not None and demand.gpus:
        for e in envs:
            if e.accepting and e.free_slots() > 0 and demand.rank(e.platform) is not None:
                free = len(e.usable_gpus(demand.gpu_memory_bytes))
                if free > best_free:
                    best, best_free = e, free
    return Why(any_open, open_for_it, best, max(best_free, 0))


def _why_since(demand: Demand, before: Why, changed: Sequence[EnvCapacity], all_envs: Sequence[EnvCapacity]) -> Why:
    """``before`` brought up to date when only the ``changed`` environments (in order) may
    differ: a walk over them, or over every environment when a witness itself changed."""
    touched = {id(e) for e in changed}
    if any(w is not None and id(w) in touched for w in (before.any_open, before.open_for_it, before.best)):
        return _why_facts(demand, all_envs)
    any_open = before.any_open or next((e for e in changed if e.accepting), None)
    open_for_it = before.open_for_it or next(
        (e for e in changed if e.accepting and demand.rank(e.platform) is not None), None
    )
    best, best_free = before.best, before.best_free if before.best is not None else -1
    if open_for_it is not None and demand.gpus:
        order: dict[int, int] | None = None
        for e in changed:
            if e.accepting and e.free_slots() > 0 and demand.rank(e.platform) is not None:
                free = len(e.usable_gpus(demand.gpu_memory_bytes))
                if free > best_free:
                    best, best_free = e, free
                elif free == best_free and best is not None:
                    # A tie goes to the environment first in order, as a full walk finds it.
                    if order is None:
                        order = {id(x): i for i, x in enumerate(all_envs)}
                    if order[id(e)] < order[id(best)]:
                        best = e
    return Why(any_open, open_for_it, best, max(best_free, 0))


def _why_text(demand: Demand, why: Why) -> str:
    if why.open_for_it is None:
        if demand.only_these and why.any_open is not None:
            return f"waiting: no environment of {', '.join(demand.platforms)} is ready yet"
        return "waiting: no environment is ready yet"
    if demand.gpus == 0:
        return "waiting: every environment is running as many trials as it takes"
    n = demand.gpus
    need = f"{n} free GPU{'s' if n != 1 else ''}"
    if demand.gpu_memory_bytes:
        need += f" with {_gib(demand.gpu_memory_bytes)} free memory"
    best = why.best
    if best is None:
        return f"waiting: no environment has {need}; every environment is running as many trials as it takes"
    why_text = f"waiting: no environment has {need}; {best.env_id} has {why.best_free} free"
    stopping = sum(1 for g in best.gpus if g.lingering)
    if stopping:
        why_text += f" ({stopping} held by ended trials whose processes are still on the GPU)"
    elif not best.use_active_gpu and any(g.foreign_busy for g in best.gpus):
        why_text += f" ({sum(1 for g in best.gpus if g.foreign_busy)} in use by other programs; useActiveGpu is off)"
    return why_text


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def trial_ended(gpus: Iterable[GpuSlot], trial_id: str, seen: Mapping[str, Iterable[str]]) -> list[str]:
    """The trial's process tree is gone. Release its GPUs, except those whose last sample
    (``seen``: uuid -> trial ids with processes on it) still shows its processes; those stay
    held, as lingering, until a sample without them. Returns the uuids still held."""
    held = []
    for g in gpus:
        if trial_id not in g.holders:
            continue
        if trial_id in set(seen.get(g.uuid, ())):
            g.lingering.add(trial_id)
            held.append(g.uuid)
        else:
            g.release(trial_id)
    return held


def gpu_sampled(
    gpus: Iterable[GpuSlot],
    seen: Mapping[str, Iterable[str]],
    *,
    foreign: Iterable[str] = (),
    memory_used: Mapping[str, int] | None = None,
    usage: Mapping[str, Mapping[str, int]] | None = None,
) -> list[tuple[str, str]]:
    """A fresh GPU sample: which trials have processes on which GPU (``seen``), which GPUs
    other programs use, memory measured. Releases lingering holders no longer seen; returns
    the (uuid, trial id) pairs released."""
    # Runs for every heartbeat of every agent: the common case (no processes, nothing
    # lingering) does no more than it must.
    foreign_set = foreign if isinstance(foreign, (set, frozenset)) else set(foreign)
    released = []
    for g in gpus:
        uuid = g.uuid
        g.foreign_busy = uuid in foreign_set
        if memory_used is not None:
            used = memory_used.get(uuid)
            if used is not None:
                g.memory_used_bytes = used
        if usage is not None:
            per = usage.get(uuid)
            g.holder_usage = {t: b for t, b in per.items() if t in g.holders} if per else {}
        if g.lingering:
            for tid in sorted(g.lingering.difference(seen.get(uuid, ()))):
                g.release(tid)
                released.append((uuid, tid))
    return released


def max_gpus_offered(envs: Sequence[EnvCapacity]) -> int:
    """The most GPUs any one environment has, free or not."""
    return max((len(e.gpus) for e in envs), default=0)
