"""The waiting trials, indexed by what they need, and what changed since the last pass.

Trials wait in one FIFO per shape (GPUs, memory per GPU, platforms allowed or preferred),
each ordered by its place in the one queue of the experiment: submitted trials go to the
back, a retried one to the front (after its backoff). :func:`scheduler.place_waiting`
walks the heads of the shapes in that order, so it places exactly the trials that
:func:`scheduler.place` would place walking the whole queue, but touches one trial per
shape that does not fit instead of every trial behind it.

The index also keeps what makes a pass cheap when little changed: which shapes were found
not to fit at the last pass (``blocked``: no environment untouched since then can take
them), which environments changed since (``changed_envs``: a freed slot or GPU, an agent
joining or leaving), and why each shape waits. A pass then tries a blocked shape only on
the changed environments, and a pass with nothing changed does nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Demand:
    trial_id: str
    gpus: int = 0
    # Memory the trial needs on each of its GPUs (0: no request).
    gpu_memory_bytes: int = 0
    # Platforms, most preferred first: an environment of an earlier one is taken over any
    # of a later one. With ``only_these``, environments of other platforms are not used;
    # without it they come last.
    platforms: tuple[str, ...] = ()
    only_these: bool = False
    nodes: int = 1  # environments it takes at once: more than one, a gang (gangs.py)

    def rank(self, platform: str) -> int | None:
        """Where ``platform`` stands in this trial's preference; None: not to be used."""
        try:
            return self.platforms.index(platform)
        except ValueError:
            return None if self.only_these else len(self.platforms)


class Shape(NamedTuple):
    gpus: int
    gpu_memory_bytes: int
    platforms: tuple[str, ...]
    only_these: bool
    nodes: int = 1


def shape_of(d: Demand) -> Shape:
    return Shape(d.gpus, d.gpu_memory_bytes, d.platforms, d.only_these, d.nodes)


class WaitingTrials:
    """The experiment's queue of waiting trials (those not yet placed)."""

    def __init__(self) -> None:
        # trial id -> (its place in the queue, what it asks for); queued and deferred ones.
        self._entries: dict[str, tuple[int, Demand]] = {}
        # One heap of (place, trial id) per shape; entries of removed trials are dropped lazily.
        self._shapes: dict[Shape, list[tuple[int, str]]] = {}
        self._sizes: dict[Shape, int] = {}
        # Retried trials waiting out their backoff: (not before, place, trial id).
        self._deferred: list[tuple[float, int, str]] = []
        self._deferred_ids: set[str] = set()
        self._back = 0
        self._front = 0
        self.blocked: set[Shape] = set()
        self.changed_envs: set[str] = set()
        # The last pass stopped at trialConcurrency: until a running trial ends, a pass can
        # place nothing, only tell new trials why they wait.
        self.capped = False
        # Why each shape waits, as last told to its trials, and the facts behind it
        # (scheduler.Why) so that a pass can bring it up to date from what changed.
        self.told: dict[Shape, str] = {}
        self.why: dict[Shape, Any] = {}  # scheduler.Why
        # Trials queued since their shape's reason was last told.
        self.fresh: dict[Shape, list[str]] = {}

    # ---- the queue ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, trial_id: object) -> bool:
        return trial_id in self._entries

    def __iter__(self) -> Iterator[str]:
        """Every waiting trial in queue order, deferred ones too (a full sort: rare uses)."""
        return iter(sorted(self._entries, key=lambda t: self._entries[t][0]))

    def append(self, demand: Demand) -> None:
        """A trial joins at the back of the queue."""
        self._back += 1
        self._add(self._back, demand)

    def push_front(self, demand: Demand, not_before: float) -> None:
        """A retried trial goes to the front of the queue, once ``not_before`` has come."""
        self._front -= 1
        self._entries[demand.trial_id] = (self._front, demand)
        self._deferred_ids.add(demand.trial_id)
        heapq.heappush(self._deferred, (not_before, self._front, demand.trial_id))

    def _add(self, place: int, demand: Demand) -> None:
        self._entries[demand.trial_id] = (place, demand)
        shape = shape_of(demand)
        heapq.heappush(self._shapes.setdefault(shape, []), (place, demand.trial_id))
        self._sizes[shape] = self._sizes.get(shape, 0) + 1
        self.fresh.setdefault(shape, []).append(demand.trial_id)

    def remove(self, trial_id: str) -> None:
        _, demand = self._entries.pop(trial_id)
        if trial_id in self._deferred_ids:
            self._deferred_ids.discard(trial_id)
            return
        shape = shape_of(demand)
        self._sizes[shape] -= 1
        if not self._sizes[shape]:
            # Nothing of this shape waits: forget it (a shape seen once costs nothing later).
            del self._sizes[shape], self._shapes[shape]
            self.fresh.pop(shape, None)
            self.blocked.discard(shape)
            self.told.pop(shape, None)
            self.why.pop(shape, None)

    def never_fit(self, never_fits: Callable[[int, int], str]) -> dict[tuple[int, int], str]:
        """The shapes (GPUs, memory per GPU) of waiting trials that can never run, and why
        (``never_fits(gpus, memory)``, asked once per shape: most find every shape fits)."""
        why = {(s.gpus, s.gpu_memory_bytes): "" for s in self.all_shapes()}
        for gpus, memory in why:
            why[gpus, memory] = never_fits(gpus, memory)
        return {shape: reason for shape, reason in why.items() if reason}

    def refused(self, why_by_shape: Mapping[tuple[int, int], str]) -> dict[str, str]:
        """The waiting trials of the shapes (GPUs, memory per GPU) that can never run, and why."""
        if not why_by_shape:
            return {}  # no trial walked
        found = {}
        for tid in self:
            d = self.demand(tid)
            why = why_by_shape.get((d.gpus, d.gpu_memory_bytes), "")
            if why:
                found[tid] = why
        return found

    def unplaceable(self, names: Sequence[str], platform_errors: Mapping[str, str], by_hand: bool) -> dict[str, str]:
        """The waiting trials that may use only platforms given up on, and their errors
        (``by_hand``: agents an operator started, which count as the first of ``names``,
        still serve the trials that may use it)."""
        found = {}
        for tid in self:
            d = self.demand(tid)
            allowed = [n for n in names if d.rank(n) is not None]
            if any(n not in platform_errors for n in allowed) or (by_hand and names[0] in allowed):
                continue
            found[tid] = "; ".join(f"{n}: {platform_errors[n]}" for n in allowed)
        return found

    def demand(self, trial_id: str) -> Demand:
        return self._entries[trial_id][1]

    def head_of(self, trial_id: str) -> tuple[int, Demand]:
        """A waiting trial's place in the queue, and what it asks for."""
        return self._entries[trial_id]

    def release_due(self, now: float) -> None:
        """Retried trials whose backoff is over join their shape's queue."""
        deferred = self._deferred
        while deferred and deferred[0][0] <= now:
            _, place, tid = heapq.heappop(deferred)
            entry = self._entries.get(tid)
            if entry is None or entry[0] != place or tid not in self._deferred_ids:
                continue
            self._deferred_ids.discard(tid)
            self._add(place, entry[1])

    def next_due(self) -> float | None:
        """When the earliest deferred trial may be placed (None: none is deferred)."""
        while self._deferred and self._deferred[0][2] not in self._deferred_ids:
            heapq.heappop(self._deferred)
        return self._deferred[0][0] if self._deferred else None

    # ---- what a pass walks --------------------------------------------------------------

    def shapes(self) -> Iterable[Shape]:
        return self._sizes.keys()

    def asks_memory(self) -> bool:
        """Whether a trial waiting to be placed asks for GPU memory."""
        return any(s.gpu_memory_bytes for s in self._sizes)

    def all_shapes(self) -> set[Shape]:
        """The shapes of every waiting trial, deferred ones too."""
        return set(self._sizes).union(shape_of(self._entries[t][1]) for t in self._deferred_ids)

    def head(self, shape: Shape) -> tuple[int, Demand] | None:
        """The first trial of ``shape`` in queue order, with its place."""
        heap = self._shapes.get(shape)
        while heap:
            place, tid = heap[0]
            entry = self._entries.get(tid)
            if entry is not None and entry[0] == place and tid not in self._deferred_ids:
                return entry
            heapq.heappop(heap)
        return None

    def members(self, shape: Shape) -> list[str]:
        """The trials of ``shape`` in queue order (deferred ones not counted)."""
        heap = self._shapes.get(shape, [])
        live = [(p, t) for p, t in heap if self._entries.get(t, (None,))[0] == p and t not in self._deferred_ids]
        return [t for _, t in sorted(live)]

    def pending(self, now: float) -> bool:
        """Whether a pass could do anything: place a trial or tell one why it waits."""
        if not self._sizes:
            due = self.next_due()
            return due is not None and due <= now
        if any(self.fresh.values()):
            return True
        if self.capped:
            return False
        if self.changed_envs:
            return True
        if any(s not in self.blocked for s in self._sizes):
            return True
        due = self.next_due()
        return due is not None and due <= now

    def tell(self, reasons: dict[Shape, str]) -> dict[str, str]:
        """The trials whose reason to wait changed, with the new one: every trial of a shape
        whose reason changed, and those new to a shape whose reason did not."""
        out: dict[str, str] = {}
        for shape, reason in reasons.items():
            if self.told.get(shape) != reason:
                self.told[shape] = reason
                out.update(dict.fromkeys(self.members(shape), reason))
            else:
                out.update(
                    (t, reason) for t in self.fresh.get(shape, ()) if t in self._entries and t not in self._deferred_ids
                )
            self.fresh.pop(shape, None)
        return out
