"""scheduler.place: FIFO with backfill, the concurrency cap, GPU packing and sharing."""

from __future__ import annotations

from trialkeeper.coordinator.engine.scheduler import (
    Demand,
    EnvCapacity,
    GpuSlot,
    Placement,
    gpu_sampled,
    max_gpus_offered,
    place,
    trial_ended,
)

GIB = 2**30


def gpus(n: int, capacity: int = 1, prefix: str = "g") -> list[GpuSlot]:
    return [GpuSlot(f"{prefix}{i}", i, capacity) for i in range(n)]


def env(env_id: str, slots: int = 4, n_gpus: int = 0, **kw: object) -> EnvCapacity:
    return EnvCapacity(env_id=env_id, trial_slots=slots, gpus=gpus(n_gpus, prefix=f"{env_id}-g"), **kw)  # type: ignore[arg-type]


def where(decision_placements: list[Placement]) -> dict[str, str]:
    return {p.trial_id: p.env_id for p in decision_placements}


def test_fifo_in_submission_order() -> None:
    d = place([Demand("a"), Demand("b"), Demand("c")], [env("e1", slots=2)])
    assert [p.trial_id for p in d.placements] == ["a", "b"]
    assert set(d.waiting) == {"c"}
    assert d.waiting["c"] == "waiting: every environment is running as many trials as it takes"


def test_backfill_a_big_trial_does_not_block_a_small_one() -> None:
    e = env("env-x", slots=4, n_gpus=1)
    d = place([Demand("big", gpus=2), Demand("small", gpus=1), Demand("cpu")], [e])
    assert where(d.placements) == {"small": "env-x", "cpu": "env-x"}
    assert d.waiting == {"big": "waiting: no environment has 2 free GPUs; env-x has 1 free"}
    small = next(p for p in d.placements if p.trial_id == "small")
    assert small.gpu_uuids == ("env-x-g0",) and small.gpu_indices == (0,)


def test_waiting_reason_counts_free_gpus_after_placements() -> None:
    e = env("env-x", slots=4, n_gpus=2)
    d = place([Demand("one", gpus=1), Demand("two", gpus=2)], [e])
    assert where(d.placements) == {"one": "env-x"}
    assert d.waiting["two"] == "waiting: no environment has 2 free GPUs; env-x has 1 free"


def test_waiting_reason_singular_and_no_env() -> None:
    busy = env("e1", n_gpus=1)
    busy.gpus[0].holders.add("other")
    d = place([Demand("t", gpus=1)], [busy])
    assert d.waiting["t"] == "waiting: no environment has 1 free GPU; e1 has 0 free"
    d = place([Demand("t")], [env("e1", accepting=False)])
    assert d.waiting["t"] == "waiting: no environment is ready yet"
    d = place([Demand("t")], [])
    assert d.waiting["t"] == "waiting: no environment is ready yet"


def test_max_running_cap() -> None:
    envs = [env("e1", slots=10)]
    d = place([Demand(t) for t in "abcde"], envs, max_running=3, running=1)
    assert [p.trial_id for p in d.placements] == ["a", "b"]
    assert set(d.waiting) == {"c", "d", "e"}
    assert all("3 trials are running (trialConcurrency)" in r for r in d.waiting.values())
    d = place([Demand("z")], [env("e2")], max_running=2, running=2)
    assert d.placements == [] and "trialConcurrency" in d.waiting["z"]


def test_place_mutates_holders_and_respects_existing_ones() -> None:
    e = env("e1", slots=2, n_gpus=2)
    e.holders.add("old")
    e.gpus[0].holders.add("old")
    d = place([Demand("new", gpus=1), Demand("third")], [e])
    assert where(d.placements) == {"new": "e1"}
    assert d.placements[0].gpu_indices == (1,)
    assert e.holders == {"old", "new"}
    assert e.gpus[1].holders == {"new"}
    assert "third" in d.waiting


def test_not_accepting_env_is_skipped() -> None:
    d = place([Demand("a")], [env("closed", accepting=False), env("open")])
    assert where(d.placements) == {"a": "open"}


def test_pack_fills_the_busiest_env_spread_the_emptiest() -> None:
    def fresh() -> list[EnvCapacity]:
        e1, e2 = env("e1", slots=4), env("e2", slots=4)
        e1.holders.add("x")
        return [e1, e2]

    assert where(place([Demand("a")], fresh(), policy="pack").placements) == {"a": "e1"}
    assert where(place([Demand("a")], fresh(), policy="spread").placements) == {"a": "e2"}
    # spread alternates as environments fill
    d = place([Demand(t) for t in "abcd"], [env("e1"), env("e2")], policy="spread")
    counts = {"e1": 0, "e2": 0}
    for p in d.placements:
        counts[p.env_id] += 1
    assert counts == {"e1": 2, "e2": 2}
    d = place([Demand(t) for t in "ab"], [env("e1"), env("e2")], policy="pack")
    assert set(where(d.placements).values()) == {"e1"} or set(where(d.placements).values()) == {"e2"}


def test_pack_and_spread_choose_gpus_within_an_env() -> None:
    def shared() -> EnvCapacity:
        e = EnvCapacity("e1", trial_slots=8, gpus=gpus(2, capacity=2))
        e.gpus[1].holders.add("x")  # GPU 1 half full, GPU 0 empty
        return e

    pack = place([Demand("a", gpus=1)], [shared()], policy="pack").placements[0]
    spread = place([Demand("a", gpus=1)], [shared()], policy="spread").placements[0]
    assert pack.gpu_indices == (1,)  # fills the GPU that already holds a trial
    assert spread.gpu_indices == (0,)  # prefers the emptiest


def test_max_trial_number_per_gpu_sharing() -> None:
    e = EnvCapacity("e1", trial_slots=10, gpus=gpus(2, capacity=2))
    d = place([Demand(t, gpus=1) for t in "abcde"], [e])
    placed = {p.trial_id: p.gpu_indices for p in d.placements}
    assert set(placed) == {"a", "b", "c", "d"}
    per_gpu = {0: 0, 1: 0}
    for indices in placed.values():
        for i in indices:
            per_gpu[i] += 1
    assert per_gpu == {0: 2, 1: 2}
    assert d.waiting["e"] == "waiting: no environment has 1 free GPU; e1 has 0 free"
    # without sharing, two GPUs take two trials
    d = place([Demand(t, gpus=1) for t in "abc"], [EnvCapacity("e1", trial_slots=10, gpus=gpus(2))])
    assert len(d.placements) == 2


def test_multi_gpu_trial_gets_distinct_gpus_on_one_env() -> None:
    d = place([Demand("t", gpus=3)], [env("small", n_gpus=2), env("big", n_gpus=4)])
    (p,) = d.placements
    assert p.env_id == "big"
    assert len(set(p.gpu_uuids)) == 3 and len(set(p.gpu_indices)) == 3


def test_foreign_busy_gpu_is_avoided_unless_use_active_gpu() -> None:
    def with_foreign(use_active: bool) -> EnvCapacity:
        e = EnvCapacity("e1", trial_slots=4, gpus=gpus(2), use_active_gpu=use_active)
        e.gpus[0].foreign_busy = True
        return e

    d = place([Demand("a", gpus=1), Demand("b", gpus=1)], [with_foreign(False)])
    assert [p.gpu_indices for p in d.placements] == [(1,)]
    assert d.waiting["b"] == (
        "waiting: no environment has 1 free GPU; e1 has 0 free (1 in use by other programs; useActiveGpu is off)"
    )
    d = place([Demand("a", gpus=2)], [with_foreign(False)])
    assert d.placements == [] and "e1 has 1 free" in d.waiting["a"]

    d = place([Demand("a", gpus=1), Demand("b", gpus=1)], [with_foreign(True)])
    assert sorted(p.gpu_indices for p in d.placements) == [(0,), (1,)]
    assert d.waiting == {}


def test_cpu_trials_ignore_gpus() -> None:
    e = env("e1", slots=3, n_gpus=1)
    e.gpus[0].holders.add("x")
    d = place([Demand("a"), Demand("b")], [e])
    assert len(d.placements) == 2 and all(p.gpu_uuids == () for p in d.placements)


def test_max_gpus_offered() -> None:
    assert max_gpus_offered([]) == 0
    assert max_gpus_offered([env("a", n_gpus=1), env("b", n_gpus=3)]) == 3


def test_memory_request_is_checked_against_measured_free_memory() -> None:
    e = EnvCapacity("e1", trial_slots=4, gpus=gpus(2, capacity=2))
    for g in e.gpus:
        g.memory_total_bytes = 16 * GIB
    e.gpus[0].memory_used_bytes = 12 * GIB  # a foreign process holds 12 GiB of GPU 0
    d = place([Demand("a", gpus=1, gpu_memory_bytes=8 * GIB), Demand("b", gpus=1, gpu_memory_bytes=9 * GIB)], [e])
    # Only GPU 1 has 8 GiB free; after "a" reserves them it has 8 left, "b" fits nowhere.
    assert [(p.trial_id, p.gpu_indices) for p in d.placements] == [("a", (1,))]
    assert d.waiting["b"] == "waiting: no environment has 1 free GPU with 9.0 GiB free memory; e1 has 0 free"
    # The reservation counts until the trial's own use is measured, then the larger of the two.
    g1 = e.gpus[1]
    assert g1.free_memory() == 8 * GIB
    gpu_sampled(e.gpus, {g1.uuid: ["a"]}, memory_used={g1.uuid: 10 * GIB}, usage={g1.uuid: {"a": 10 * GIB}})
    assert g1.free_memory() == 6 * GIB


def test_ended_trial_holds_its_gpu_until_its_processes_leave_it() -> None:
    e = EnvCapacity("e1", trial_slots=2, gpus=gpus(1))
    g = e.gpus[0]
    d = place([Demand("a", gpus=1)], [e])
    assert d.placements
    # The tree is gone but NVML still lists a's process on the GPU: the slot stays held.
    assert trial_ended(e.gpus, "a", {g.uuid: ["a"]}) == [g.uuid]
    e.holders.discard("a")
    d = place([Demand("b", gpus=1)], [e])
    assert d.placements == []
    assert "held by ended trials" in d.waiting["b"]
    # A sample that still shows it changes nothing; one without it releases the GPU.
    assert gpu_sampled(e.gpus, {g.uuid: ["a"]}) == []
    assert gpu_sampled(e.gpus, {}) == [(g.uuid, "a")]
    d = place([Demand("b", gpus=1)], [e])
    assert [p.trial_id for p in d.placements] == ["b"]


def test_trial_ended_without_processes_on_the_gpu_releases_at_once() -> None:
    e = EnvCapacity("e1", trial_slots=2, gpus=gpus(2))
    place([Demand("a", gpus=2)], [e])
    assert trial_ended(e.gpus, "a", {}) == []
    assert all(not g.holders for g in e.gpus)


def test_a_more_preferred_platform_wins_over_packing_and_spreading() -> None:
    for policy in ("pack", "spread"):
        envs = [env("busy-slurm", slots=4, platform="slurm"), env("local", slots=1, platform="local")]
        envs[0].holders.update({"x", "y"})  # pack alone would fill it first
        d = place(
            [Demand("t1", platforms=("local", "slurm")), Demand("t2", platforms=("local", "slurm"))],
            envs,
            policy=policy,
        )
        assert where(d.placements) == {"t1": "local", "t2": "busy-slurm"}, policy


def test_a_trial_restricted_to_platforms_waits_for_them_and_does_not_block_the_others() -> None:
    envs = [env("local", slots=2, platform="local")]
    only = Demand("only-slurm", platforms=("slurm",), only_these=True)
    d = place([only, Demand("any", platforms=("slurm",))], envs)
    # Same shape, other platforms: what did not fit the first is not taken as not fitting.
    assert where(d.placements) == {"any": "local"}
    assert d.waiting["only-slurm"] == "waiting: no environment of slurm is ready yet"


def _linear_place(demands: list[Demand], envs: list[EnvCapacity], policy: str) -> list[Placement]:
    """Placement as it was written before environments were kept in heaps: every trial
    walks every environment. The heaps must choose exactly as this does."""
    sign = 1 if policy != "spread" else -1
    placed = []
    for d in demands:
        best, best_key = None, None
        for e in envs:
            rank = d.rank(e.platform)
            if rank is None or not e.accepting or e.free_slots() <= 0:
                continue
            if d.gpus and len(e.usable_gpus(d.gpu_memory_bytes)) < d.gpus:
                continue
            key = (rank, sign * e.free_slots(), sign * len(e.usable_gpus(0)))
            if best_key is None or key < best_key:
                best, best_key = e, key
        if best is None:
            continue
        chosen = sorted(
            best.usable_gpus(d.gpu_memory_bytes), key=lambda g: (g.free() if policy == "pack" else -g.free(), g.index)
        )[: d.gpus]
        best.holders.add(d.trial_id)
        for g in chosen:
            g.take(d.trial_id, d.gpu_memory_bytes)
        placed.append(Placement(d.trial_id, best.env_id, tuple(g.uuid for g in chosen), tuple(g.index for g in chosen)))
    return placed


def test_the_heaps_place_exactly_as_a_walk_over_every_environment() -> None:
    import copy
    import random

    for seed in range(40):
        rng = random.Random(seed)
        envs = []
        for i in range(rng.randint(1, 30)):
            e = EnvCapacity(
                env_id=f"e{i}", trial_slots=rng.randint(1, 6),
                gpus=[GpuSlot(f"e{i}-g{k}", k, rng.randint(1, 2), memory_total_bytes=rng.choice([0, 16 * GIB]))
                      for k in range(rng.randint(0, 4))],
                accepting=rng.random() > 0.1, platform=rng.choice(["a", "b"]),
            )
            for k in range(rng.randint(0, 2)):  # some already hold trials
                e.holders.add(f"old-{i}-{k}")
            envs.append(e)
        demands = [
            Demand(f"t{j}", gpus=rng.choice([0, 1, 1, 2]), gpu_memory_bytes=rng.choice([0, 0, 8 * GIB]),
                   platforms=rng.choice([(), ("a",), ("b", "a")]), only_these=rng.random() < 0.3)
            for j in range(rng.randint(1, 80))
        ]
        policy = rng.choice(["pack", "spread"])
        expected = _linear_place(demands, copy.deepcopy(envs), policy)
        got = place(demands, envs, policy=policy).placements
        assert got == expected, seed
