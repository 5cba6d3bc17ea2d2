"""Things break on purpose while experiments run; nothing reported is lost or doubled.

The agents reach the coordinator through a proxy that cuts every connection at random
moments (seeded); in the chaos run, agents are also killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from pathlib import Path

import pytest
from conftest import build_config, run_async, write_script
from netproxy import CuttingProxy
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus

# Each trial reports N intermediate results in quick bursts, then its final result, and
# writes down every value it reported (one file per process, so attempts stay apart).
TRIAL = """
import json, os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
out = pathlib.Path(os.environ["TRIALKEEPER_OUTPUT_DIR"]) / f"reported-{os.getpid()}.jsonl"
with out.open("a") as f:
    for i in range(p["n"]):
        value = p["x"] * 1000 + i
        if trial.report_intermediate_result(value):
            f.write(json.dumps(["intermediate", value]) + "\\n")
            f.flush()
        if i % 50 == 49:
            time.sleep(p["pause"])
    trial.report_final_result(float(p["x"]))
    f.write(json.dumps(["final", float(p["x"])]) + "\\n")
"""

FAST = {"heartbeatInterval": 0.2, "agentLostTimeout": 1.5, "trialLostTimeout": 3.0, "reconnectWindow": 30}


def _reported(c: Coordinator, trial_id: str) -> list[list[tuple[str, float]]]:
    """What each attempt of a trial reported, in the order the attempts ran."""
    out = c.experiment_dir / "trials" / trial_id / "output"
    files = sorted(out.glob("reported-*.jsonl"), key=lambda f: f.stat().st_mtime)
    return [[(k, float(v)) for k, v in map(json.loads, f.read_text().splitlines())] for f in files]


def _prefixes_of(stored: list[tuple[str, float]], attempts: list[list[tuple[str, float]]]) -> bool:
    """Whether ``stored`` is a prefix of the first attempt's reports, then of the second's,
    and so on: each lost attempt got some of its results stored, in order (possibly all,
    its final one included, when its agent died before reporting the end)."""
    rest = stored
    for reported in attempts:
        n = 0
        while n < len(rest) and n < len(reported) and rest[n] == reported[n]:
            n += 1
        rest = rest[n:]
    return not rest


async def _cut_now_and_then(proxy: CuttingProxy, rng: random.Random, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(0.1, 0.5))
        except asyncio.TimeoutError:
            proxy.cut()


async def _kill_now_and_then(c: Coordinator, rng: random.Random, stop: asyncio.Event, kills: list[int]) -> None:
    while not stop.is_set():
        try:
            # Often enough that a run of short trials on a fast machine still sees kills.
            await asyncio.wait_for(stop.wait(), rng.uniform(0.3, 1.0))
        except asyncio.TimeoutError:
            busy = [e for e in c.environments() if e.running_trials and e.connected]
            if busy and c.store is not None:
                env = rng.choice(sorted(busy, key=lambda e: e.id))
                row = next(r for r in c.store.envs() if r["id"] == env.id)
                pid = json.loads(row["info_json"]).get("pid")
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills.append(pid)
                    except ProcessLookupError:
                        pass


async def _experiment(
    tmp_path: Path, *, seed: int, trials: int, n: int, kill: bool
) -> tuple[Coordinator, CuttingProxy, list[int]]:
    write_script(tmp_path, "trial.py", TRIAL)
    proxy = await CuttingProxy().start()
    config = build_config(
        tmp_path,
        trialConcurrency=4,
        maxTrialRetries=5,
        trainingService={"environmentCount": 4},
        coordinator={**FAST, "advertiseAddress": f"127.0.0.1:{proxy.port}"},
    )
    rng = random.Random(seed)
    stop = asyncio.Event()
    kills: list[int] = []
    c = Coordinator(config, experiment_dir=tmp_path / "exp")
    try:
        await c.start()
        assert c.store is not None
        host, port = str(c.store.meta("bound_address")).rsplit(":", 1)
        proxy.target = (host, int(port))
        chaos = [asyncio.ensure_future(_cut_now_and_then(proxy, rng, stop))]
        if kill:
            chaos.append(asyncio.ensure_future(_kill_now_and_then(c, rng, stop, kills)))
        handles = [await c.submit({"x": x, "n": n, "pause": 0.01}) for x in range(trials)]
        try:
            await c.wait_all(timeout=100)
        finally:
            stop.set()
            await asyncio.gather(*chaos)
        for h in handles:
            assert h.info.done, (h.id, h.info.status, h.info.reason)
        return c, proxy, kills
    finally:
        await c.stop()
        await proxy.close()


def test_connections_cut_at_random_lose_and_double_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        c, proxy, _ = await _experiment(tmp_path, seed=7, trials=12, n=2000, kill=False)
        assert proxy.cuts >= 3, f"only {proxy.cuts} cuts: the test did not test anything"
        assert c.store is not None
        store = type(c.store).in_dir(c.experiment_dir, readonly=True)
        try:
            for t in c.trials():
                assert t.status is TrialStatus.SUCCEEDED, (t.id, t.reason)
                attempts = _reported(c, t.id)
                assert len(attempts) == 1 and t.attempts == 1
                stored = [(m.kind, m.value) for m in store.metrics(t.id)]
                # Exactly once, in order, as reported.
                assert stored == attempts[0]
                assert [m.index for m in store.metrics(t.id)] == list(range(len(stored)))
        finally:
            store.close()

    run_async(body, timeout=150)


@pytest.mark.parametrize("seed", [11])
def test_chaos_run_sixty_trials_with_agents_killed_and_connections_cut(tmp_path: Path, seed: int) -> None:
    async def body() -> None:
        c, proxy, kills = await _experiment(tmp_path, seed=seed, trials=60, n=100, kill=True)
        assert kills and proxy.cuts >= 3, (kills, proxy.cuts)
        assert c.store is not None
        store = type(c.store).in_dir(c.experiment_dir, readonly=True)
        try:
            assert store.integrity_check() == "ok"
            total_reported = total_stored = 0
            for t in c.trials():
                assert t.status.terminal
                stored = [(m.kind, m.value) for m in store.metrics(t.id)]
                assert [m.index for m in store.metrics(t.id)] == list(range(len(stored)))
                attempts = _reported(c, t.id)
                if t.status is TrialStatus.SUCCEEDED:
                    # The attempt that succeeded is stored whole, after what earlier
                    # attempts got stored before their agents died.
                    last = attempts[-1]
                    assert stored[-len(last):] == last, t.id
                    earlier = stored[: len(stored) - len(last)]
                    assert _prefixes_of(earlier, attempts[:-1]), (t.id, earlier, attempts[:-1])
                    assert t.final_metric == last[-1][1]
                else:
                    assert t.reason.startswith("environment lost"), (t.id, t.status, t.reason)
                total_reported += sum(map(len, attempts))
                total_stored += len(stored)
            # Only what an agent held unacknowledged when it was killed can be missing.
            assert total_stored <= total_reported
            assert sum(t.status is TrialStatus.SUCCEEDED for t in c.trials()) >= 50
        finally:
            store.close()

    run_async(body, timeout=150)
