"""The indexed pass (``place_waiting`` over ``WaitingTrials``) against the straightforward
one (``place`` over the whole queue), on seeded random scenarios.

Two copies of the same world see the same events: trials submitted with random shapes
(GPUs, memory, preferred or allowed platforms), retried ones put back at the front after
a backoff, trials ending and freeing their slots and GPUs, foreign programs and measured
memory coming and going, environments closing and opening, trials canceled while they
wait. After each event both copies run a pass; they must place the same trials, in the
same order, on the same environments and GPUs, and tell every waiting trial the same
reason (where ``trialConcurrency`` did not cut the pass short: the indexed pass then keeps
a shape's reason that it does not fit). The indexed copy is told only what changed, as the
engine tells it, so a missed change would show as a trial left waiting.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import pytest
from trialkeeper.coordinator.engine.scheduler import (
    Demand,
    EnvCapacity,
    GpuSlot,
    place,
    place_waiting,
)
from trialkeeper.coordinator.engine.waiting import WaitingTrials

GIB = 2**30
PLATFORMS = ("local", "remote", "slurm")


def make_envs(rng: random.Random) -> list[EnvCapacity]:
    envs = []
    for e in range(rng.randint(1, 5)):
        per_gpu = rng.choice([1, 1, 2])
        gpus = [
            GpuSlot(f"e{e}g{i}", i, per_gpu, memory_total_bytes=rng.choice([0, 16 * GIB, 24 * GIB]))
            for i in range(rng.choice([0, 1, 2, 4]))
        ]
        envs.append(EnvCapacity(
            f"env-{e}", trial_slots=rng.randint(1, 6), gpus=gpus, use_active_gpu=rng.random() < 0.2,
            accepting=rng.random() < 0.85, platform=rng.choice(PLATFORMS),
        ))
    return envs


def random_demand(rng: random.Random, tid: str) -> Demand:
    gpus = rng.choice([0, 0, 1, 1, 2, 3])
    platforms: tuple[str, ...] = ()
    if rng.random() < 0.4:
        platforms = tuple(rng.sample(PLATFORMS, rng.randint(1, 2)))
    return Demand(
        tid, gpus, rng.choice([0, 0, 8 * GIB, 20 * GIB]) if gpus else 0,
        platforms=platforms, only_these=bool(platforms) and rng.random() < 0.5,
    )


class World:
    """The straightforward side: a list in queue order, a full pass every time."""

    def __init__(self, envs: list[EnvCapacity]) -> None:
        self.envs = envs
        self.queue: list[Demand] = []
        self.not_before: dict[str, float] = {}

    def run(self, now: float, max_running: int | None, running: int, policy: str) -> tuple[list, dict[str, str]]:
        due = [d for d in self.queue if self.not_before.get(d.trial_id, 0.0) <= now]
        decision = place(due, self.envs, max_running=max_running, running=running, policy=policy)
        placed = {p.trial_id for p in decision.placements}
        self.queue = [d for d in self.queue if d.trial_id not in placed]
        return decision.placements, decision.waiting


def run_scenario(seed: int, steps: int = 250) -> int:
    rng = random.Random(seed)
    policy = rng.choice(["pack", "spread"])
    max_running = rng.choice([None, None, 6, 12])
    plain = World(make_envs(rng))
    envs = copy.deepcopy(plain.envs)
    by_id = {e.env_id: e for e in envs}
    index = WaitingTrials()
    told: dict[str, str] = {}
    running: dict[str, str] = {}  # trial -> env id
    now, counter, placed_total = 0.0, 0, 0

    def both(fn: Callable[[dict[str, EnvCapacity]], object]) -> None:  # one change, to both copies
        for side in (plain.envs, envs):
            fn({e.env_id: e for e in side})

    for _ in range(steps):
        kind = rng.choices(
            ["submit", "end", "foreign", "memory", "accepting", "cancel", "retry", "time"],
            weights=[6, 4, 1, 1, 1, 1, 1, 2],
        )[0]
        if kind == "submit":
            for _ in range(rng.randint(1, 4)):
                counter += 1
                d = random_demand(rng, f"t{counter}")
                plain.queue.append(d)
                index.append(d)
        elif kind in ("end", "retry") and running:
            tid = rng.choice(sorted(running))
            env_id = running.pop(tid)

            def release(side: dict[str, EnvCapacity], tid: str = tid, env_id: str = env_id) -> None:
                side[env_id].holders.discard(tid)
                for g in side[env_id].gpus:
                    g.release(tid)

            both(release)
            index.changed_envs.add(env_id)
            index.capped = False
            if kind == "retry":
                # Lost with its environment: back to the front, after a backoff.
                d = random_demand(rng, tid)
                delay = rng.choice([0.0, 1.0, 3.0])
                plain.queue.insert(0, d)
                plain.not_before[tid] = now + delay
                index.push_front(d, now + delay)
        elif kind == "foreign":
            e = rng.choice(envs)
            if e.gpus:
                i = rng.randrange(len(e.gpus))
                flag = not e.gpus[i].foreign_busy
                both(lambda side, e=e, i=i, flag=flag: setattr(side[e.env_id].gpus[i], "foreign_busy", flag))
                index.changed_envs.add(e.env_id)
        elif kind == "memory":
            e = rng.choice(envs)
            if e.gpus:
                i, used = rng.randrange(len(e.gpus)), rng.choice([0, 4 * GIB, 12 * GIB])
                both(lambda side, e=e, i=i, used=used: setattr(side[e.env_id].gpus[i], "memory_used_bytes", used))
                index.changed_envs.add(e.env_id)
        elif kind == "accepting":
            e = rng.choice(envs)
            both(lambda side, e=e: setattr(side[e.env_id], "accepting", not side[e.env_id].accepting))
            index.changed_envs.add(e.env_id)
        elif kind == "cancel" and plain.queue:
            d = rng.choice(plain.queue)
            plain.queue.remove(d)
            index.remove(d.trial_id)
            told.pop(d.trial_id, None)
        else:
            now += rng.choice([0.5, 1.0, 2.0])

        in_use = len(running)
        placements, reasons = plain.run(now, max_running, in_use, policy)
        decision = place_waiting(index, by_id, now=now, max_running=max_running, running=in_use, policy=policy)
        assert decision.placements == placements, (seed, kind)
        for p in placements:
            running[p.trial_id] = p.env_id
            told.pop(p.trial_id, None)
        placed_total += len(placements)
        told.update(decision.waiting)
        if not any("trialConcurrency" in r for r in reasons.values()):
            assert {t: told.get(t) for t in reasons} == reasons, (seed, kind)
        assert sorted(index) == sorted(d.trial_id for d in plain.queue)
        # Both copies hold the same: same holders on every environment and GPU.
        for a, b in zip(plain.envs, envs, strict=True):
            assert a.holders == b.holders and [g.holders for g in a.gpus] == [g.holders for g in b.gpus]
    return placed_total


@pytest.mark.parametrize("seed", range(40))
def test_indexed_pass_places_as_the_plain_one(seed: int) -> None:
    assert run_scenario(seed) > 0


def test_a_pass_with_nothing_changed_does_nothing() -> None:
    envs = {"e1": EnvCapacity("e1", trial_slots=1, gpus=[GpuSlot("g0", 0)])}
    index = WaitingTrials()
    for i in range(50):
        index.append(Demand(f"t{i}", 1))
    first = place_waiting(index, envs)
    assert [p.trial_id for p in first.placements] == ["t0"]
    assert len(first.waiting) == 49  # every other trial told why it waits
    # The environment placed on is looked at once more (its reasons), then nothing is pending.
    place_waiting(index, envs)
    assert not index.pending(0.0)
    assert place_waiting(index, envs).waiting == {}
    # The one slot frees: only that environment is looked at, and the next trial in line goes.
    envs["e1"].holders.clear()
    envs["e1"].gpus[0].release("t0")
    index.changed_envs.add("e1")
    assert [p.trial_id for p in place_waiting(index, envs).placements] == ["t1"]


def test_fifo_within_a_shape_and_across_shapes() -> None:
    index = WaitingTrials()
    for d in (Demand("a", 1), Demand("b", 0), Demand("c", 1), Demand("d", 0)):
        index.append(d)
    index.push_front(Demand("r", 1), not_before=5.0)
    envs = {"e1": EnvCapacity("e1", trial_slots=2, gpus=[GpuSlot("g0", 0), GpuSlot("g1", 1)])}
    # Before the retry's backoff is over: queue order a, b (the slots are then full).
    assert [p.trial_id for p in place_waiting(index, envs, now=1.0).placements] == ["a", "b"]
    for tid in ("a", "b"):
        envs["e1"].holders.discard(tid)
        envs["e1"].gpus[0].release(tid)
    index.changed_envs.add("e1")
    # After it: the retried trial first, then the next in line.
    assert [p.trial_id for p in place_waiting(index, envs, now=6.0).placements] == ["r", "c"]
