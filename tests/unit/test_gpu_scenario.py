"""A seeded randomized scenario for the GPU ledger: 3 environments x 4 GPUs, 300 trials.

Virtual time, no network, no sleeps. Trials need 0-4 GPUs and run for random durations;
some are canceled while waiting or running; an ended trial's processes stay on its GPUs
for a random while after its process tree is gone (as NVML shows them); foreign programs
come and go on random GPUs. The scenario drives the scheduler exactly as the coordinator
does (``place``, ``trial_ended`` at the end of a tree, ``gpu_sampled`` at each heartbeat;
or, as the coordinator does now, ``place_waiting`` over the index of waiting trials, told
which environments changed) and checks the promises after every event:

* no GPU ever holds more than ``maxTrialNumberPerGpu`` trials, counting the processes
  really on it;
* no GPU is handed out while a previous holder's processes are still on it beyond its
  capacity, and none while a foreign program uses it (``useActiveGpu: false``);
* no trial that fits waits while capacity for it is free (backfill);
* every trial reaches a terminal state.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest
from trialkeeper.coordinator.engine.scheduler import (
    Demand,
    EnvCapacity,
    GpuSlot,
    gpu_sampled,
    place,
    place_waiting,
    trial_ended,
)
from trialkeeper.coordinator.engine.waiting import WaitingTrials

ENVS, GPUS_PER_ENV, TRIALS = 3, 4, 300
HEARTBEAT = 1.0


@dataclass(order=True)
class _Event:
    at: float
    order: int
    kind: str = field(compare=False)
    subject: str = field(compare=False, default="")
    extra: object = field(compare=False, default=None)


class Scenario:
    def __init__(self, seed: int, per_gpu: int, indexed: bool = False) -> None:
        self.rng = random.Random(seed)
        self.per_gpu = per_gpu
        self.envs = [
            EnvCapacity(
                f"env-{e}",
                trial_slots=GPUS_PER_ENV * per_gpu + 2,
                gpus=[GpuSlot(f"e{e}g{i}", i, per_gpu) for i in range(GPUS_PER_ENV)],
                use_active_gpu=False,
            )
            for e in range(ENVS)
        ]
        self.gpu_by_uuid = {g.uuid: (env, g) for env in self.envs for g in env.gpus}
        # The truth NVML would show: uuid -> trials with processes on it; foreign programs.
        self.on_gpu: dict[str, set[str]] = {u: set() for u in self.gpu_by_uuid}
        self.foreign: set[str] = set()
        self.need = {f"t{i:03d}": self.rng.choice([0, 0, 1, 1, 1, 2, 2, 3, 4]) for i in range(TRIALS)}
        self.queue: list[str] = list(self.need)
        self.index: WaitingTrials | None = None
        if indexed:
            self.index = WaitingTrials()
            for t in self.queue:
                self.index.append(Demand(t, self.need[t]))
        self.where: dict[str, tuple[EnvCapacity, tuple[str, ...]]] = {}
        self.status = dict.fromkeys(self.need, "WAITING")
        self.events: list[_Event] = []
        self.order = 0
        self.now = 0.0
        self.handouts = 0

    def at(self, delay: float, kind: str, subject: str = "", extra: object = None) -> None:
        self.order += 1
        heapq.heappush(self.events, _Event(self.now + delay, self.order, kind, subject, extra))

    # ---- what the coordinator does ---------------------------------------------------

    def seen(self, env: EnvCapacity) -> dict[str, set[str]]:
        return {g.uuid: set(self.on_gpu[g.uuid]) for g in env.gpus}

    def heartbeat(self, env: EnvCapacity) -> None:
        was_foreign = [g.foreign_busy for g in env.gpus]
        released = gpu_sampled(env.gpus, self.seen(env), foreign=[g.uuid for g in env.gpus if g.uuid in self.foreign])
        if released or was_foreign != [g.foreign_busy for g in env.gpus]:
            self.changed(env)

    def changed(self, env: EnvCapacity) -> None:
        if self.index is not None:
            self.index.changed_envs.add(env.env_id)

    def schedule(self) -> None:
        if self.index is not None:
            placements = place_waiting(self.index, {e.env_id: e for e in self.envs}).placements
        else:
            placements = place([Demand(t, self.need[t]) for t in self.queue], self.envs).placements
        for p in placements:
            env = next(e for e in self.envs if e.env_id == p.env_id)
            for uuid in p.gpu_uuids:
                # The promise: a GPU is handed out only with room for one more process on
                # it, counting processes of ended trials that NVML still lists, and never
                # one a foreign program is using.
                assert len(self.on_gpu[uuid]) < self.per_gpu, (
                    f"{uuid} handed to {p.trial_id} while {self.on_gpu[uuid]} still on it"
                )
                # As far as the last heartbeat could tell.
                _, g = self.gpu_by_uuid[uuid]
                assert not g.foreign_busy, f"{uuid} handed to {p.trial_id} while a foreign program uses it"
                self.handouts += 1
            assert len(p.gpu_uuids) == self.need[p.trial_id] == len(set(p.gpu_uuids))
            self.queue.remove(p.trial_id)
            self.where[p.trial_id] = (env, p.gpu_uuids)
            self.status[p.trial_id] = "RUNNING"
            for uuid in p.gpu_uuids:
                self.on_gpu[uuid].add(p.trial_id)
            self.at(self.rng.uniform(0.5, 30.0), "tree_gone", p.trial_id, "SUCCEEDED")
        self.check_backfill()

    def tree_gone(self, tid: str, outcome: str) -> None:
        if self.status[tid] != "RUNNING":
            return  # already ended (a cancel raced the natural end)
        env, uuids = self.where[tid]
        # TrialEnded carries the GPUs NVML still lists the trial's processes on.
        trial_ended(env.gpus, tid, self.seen(env))
        env.holders.discard(tid)
        self.changed(env)
        self.status[tid] = outcome
        for uuid in uuids:
            self.at(self.rng.choice([0.0, 0.0, self.rng.uniform(0.1, 6.0)]), "gpu_process_gone", tid, uuid)

    # ---- checks ------------------------------------------------------------------------

    def check_capacity(self) -> None:
        for uuid, (_, g) in self.gpu_by_uuid.items():
            assert len(g.holders) <= self.per_gpu, f"{uuid} holds {g.holders}"
            assert len(self.on_gpu[uuid]) <= self.per_gpu, f"{uuid} runs {self.on_gpu[uuid]}"
            # Every process on the GPU is accounted for by a holder.
            assert self.on_gpu[uuid] <= g.holders, f"{uuid}: {self.on_gpu[uuid] - g.holders} on the GPU but not held"

    def check_backfill(self) -> None:
        # Computed from the ledger directly, not through the scheduler: the most GPUs with
        # room that any environment with a free trial slot has.
        with_slot = [e for e in self.envs if e.free_slots() > 0]
        room = max(
            (sum(1 for g in e.gpus if len(g.holders) < g.capacity and not g.foreign_busy) for e in with_slot),
            default=-1,
        )
        for tid in self.queue:
            n = self.need[tid]
            assert n > room, f"{tid} (needs {n} GPUs) waits while an environment has {room} with room"

    # ---- the run -----------------------------------------------------------------------

    def run(self) -> None:
        for env in self.envs:
            self.at(HEARTBEAT, "heartbeat", env.env_id)
        for tid in self.rng.sample(list(self.need), 40):
            self.at(self.rng.uniform(0.0, 200.0), "cancel", tid)
        for _ in range(12):
            self.at(self.rng.uniform(0.0, 150.0), "foreign_on", self.rng.choice(list(self.gpu_by_uuid)))
        self.schedule()
        steps = 0
        while self.events and any(s in ("WAITING", "RUNNING") for s in self.status.values()) or self.lingering():
            steps += 1
            assert steps < 100_000, "the scenario did not converge"
            ev = heapq.heappop(self.events)
            self.now = ev.at
            if ev.kind == "heartbeat":
                env = next(e for e in self.envs if e.env_id == ev.subject)
                self.heartbeat(env)
                self.at(HEARTBEAT, "heartbeat", env.env_id)
            elif ev.kind == "tree_gone":
                self.tree_gone(ev.subject, str(ev.extra))
            elif ev.kind == "gpu_process_gone":
                self.on_gpu[str(ev.extra)].discard(ev.subject)
            elif ev.kind == "cancel":
                if self.status[ev.subject] == "WAITING":
                    self.queue.remove(ev.subject)
                    if self.index is not None:
                        self.index.remove(ev.subject)
                    self.status[ev.subject] = "USER_CANCELED"
                elif self.status[ev.subject] == "RUNNING":
                    # SIGTERM now, the tree is gone after a grace period.
                    self.at(self.rng.uniform(0.0, 3.0), "tree_gone", ev.subject, "USER_CANCELED")
            elif ev.kind == "foreign_on":
                self.foreign.add(str(ev.subject))
                self.at(self.rng.uniform(1.0, 20.0), "foreign_off", ev.subject)
            elif ev.kind == "foreign_off":
                self.foreign.discard(str(ev.subject))
            self.check_capacity()
            self.schedule()

    def lingering(self) -> bool:
        return any(g.lingering for _, g in self.gpu_by_uuid.values())


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("per_gpu", [1, 2])
@pytest.mark.parametrize("indexed", [False, True], ids=["plain", "indexed"])
def test_randomized_three_environments_four_gpus(seed: int, per_gpu: int, indexed: bool) -> None:
    s = Scenario(seed, per_gpu, indexed)
    s.run()
    assert all(v in ("SUCCEEDED", "USER_CANCELED") for v in s.status.values()), {
        k: v for k, v in s.status.items() if v not in ("SUCCEEDED", "USER_CANCELED")
    }
    assert sum(v == "SUCCEEDED" for v in s.status.values()) >= TRIALS - 40
    # The scenario exercised what it claims to: GPUs were handed out many times over and
    # released only after their processes left; nothing is held at the end.
    assert s.handouts > 200
    assert all(not g.holders and not g.lingering for _, g in s.gpu_by_uuid.values())
