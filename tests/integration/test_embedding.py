"""The embedding API: a tuner drives the Coordinator (asyncio) or SyncCoordinator (threads)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from conftest import async_wait_until, build_config, run_async, wait_until, write_script
from trialkeeper.coordinator import (
    Coordinator,
    CoordinatorError,
    MetricEvent,
    StatusEvent,
    SyncCoordinator,
    TrialStatus,
)
from trialkeeper.coordinator.engine.events import CheckpointSaved
from trialkeeper.coordinator.store.store import Store

WAIT_S = 30.0
S = TrialStatus

REPORTING_TRIAL = """
from trialkeeper.agent import trial

x = trial.get_next_parameter()["x"]
for i in range(3):
    assert trial.report_intermediate_result(x + i / 10)
assert trial.report_final_result({"default": x * 10.0, "x": x})
"""

# Reports one result, says so in a file, then runs until it is stopped.
SLOW_TRIAL = """
import os, time
from trialkeeper.agent import trial

assert trial.report_intermediate_result(0.5)
path = os.path.join(os.environ["TRIALKEEPER_TRIAL_DIR"], "reported")
open(path, "w").close()
time.sleep(300)
"""

# Reports a result, then saves a checkpoint of one file, twice.
CHECKPOINTING_TRIAL = """
import os
from trialkeeper.agent import trial

for step in (1, 2):
    assert trial.report_intermediate_result(step / 10)
    with open(os.path.join(trial.get_checkpoint_dir(), "state"), "w") as f:
        f.write(str(step))
    trial.save_checkpoint(step)
"""

SHOW_TRIAL = """
import json, os
from trialkeeper.agent import trial

print(json.dumps({
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "my_var": os.environ.get("MY_VAR"),
    "params": trial.get_next_parameter(),
}), flush=True)
assert trial.report_final_result(2.0)
"""


def _expected_metrics(trial_id: str, x: int) -> list[tuple[str, str, int, float]]:
    return [(trial_id, "intermediate", i, x + i / 10) for i in range(3)] + [(trial_id, "final", 3, x * 10.0)]


def _metric_tuple(e: MetricEvent) -> tuple[str, str, int, float]:
    return (e.trial_id, e.kind, e.index, e.value)


def _reported(c: Coordinator | SyncCoordinator, trial_id: str) -> bool:
    return (c.experiment_dir / "trials" / trial_id / "reported").exists()


# ---- asyncio: an ask/tell loop ---------------------------------------------------------------


def test_ask_tell_loop_hears_every_metric_and_status(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", REPORTING_TRIAL)
    config = build_config(tmp_path, trialConcurrency=2)
    xs = list(range(1, 7))

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            heard: list[MetricEvent] = []
            changes: list[StatusEvent] = []
            c.on_metric(heard.append)
            c.on_status(changes.append)

            streamed: list[MetricEvent | StatusEvent] = []

            async def consume() -> None:
                async for event in c.events():
                    streamed.append(event)

            consumer = asyncio.create_task(consume())
            # events() subscribes when iteration begins: wait for that before submitting.
            await async_wait_until(lambda: c._subscribers, WAIT_S, message="events() never subscribed")

            # The tuner: two trials in flight; each result told back asks for the next.
            todo = iter(xs)
            inflight: dict[asyncio.Future[object], tuple[str, int]] = {}
            told: dict[int, float | None] = {}

            async def ask() -> None:
                x = next(todo, None)
                if x is not None:
                    handle = await c.submit({"x": x})
                    inflight[asyncio.ensure_future(handle.wait(WAIT_S))] = (handle.id, x)

            await ask()
            await ask()
            ids: dict[int, str] = {}
            while inflight:
                done, _ = await asyncio.wait(inflight, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
                assert done, f"no trial ended within {WAIT_S} s: {c.trials()}"
                for fut in done:
                    trial_id, x = inflight.pop(fut)
                    info = fut.result()
                    assert info.status is S.SUCCEEDED, (info.status, info.reason, info.stderr_tail)  # type: ignore[attr-defined]
                    told[x] = info.final_metric  # type: ignore[attr-defined]
                    ids[x] = trial_id
                    await ask()

            assert told == {x: x * 10.0 for x in xs}
            infos = c.trials()
            assert [i.id for i in infos] == [ids[x] for x in sorted(ids, key=lambda x: c.trial(ids[x]).sequence_id)]
            assert [i.sequence_id for i in infos] == list(range(len(xs)))
            assert sorted(i.parameters["x"] for i in infos) == xs
            for info in infos:
                x = info.parameters["x"]
                assert info.final_metric_value == {"default": x * 10.0, "x": x}
                assert info.started_at is not None and info.ended_at is not None
                assert info.submitted_at <= info.started_at <= info.ended_at

            # Callbacks ran before each wait() returned; the iterator catches up on its own.
            expected = [m for x in xs for m in _expected_metrics(ids[x], x)]
            assert sorted(map(_metric_tuple, heard)) == sorted(expected)
            for x in xs:
                mine = [_metric_tuple(e) for e in heard if e.trial_id == ids[x]]
                assert mine == _expected_metrics(ids[x], x)  # in order, once each
                stored = c.store.metrics(ids[x])  # type: ignore[union-attr]
                assert [(r.trial_id, r.kind, r.index, r.value) for r in stored] == mine
            final_raw = {e.trial_id: e.raw for e in heard if e.kind == "final"}
            assert final_raw == {ids[x]: {"default": x * 10.0, "x": x} for x in xs}

            n_status = 3 * len(xs)  # WAITING (on submit), RUNNING, SUCCEEDED
            await async_wait_until(lambda: len(streamed) >= len(expected) + n_status, WAIT_S)
            streamed_metrics = [_metric_tuple(e) for e in streamed if isinstance(e, MetricEvent)]
            assert streamed_metrics == [_metric_tuple(e) for e in heard]
            streamed_status = [(e.trial.id, e.old, e.trial.status) for e in streamed if isinstance(e, StatusEvent)]
            assert streamed_status == [(e.trial.id, e.old, e.trial.status) for e in changes]
            for x in xs:
                path = [(old, new) for tid, old, new in streamed_status if tid == ids[x]]
                assert path == [(S.WAITING, S.WAITING), (S.WAITING, S.RUNNING), (S.RUNNING, S.SUCCEEDED)]
                # The first is the submission, and says so; the others are changes.
                assert [e.submitted for e in changes if e.trial.id == ids[x]] == [True, False, False]
                # Everything a trial reported is heard before its end.
                positions = [i for i, e in enumerate(streamed) if getattr(e, "trial_id", None) == ids[x]]
                end = next(
                    i for i, e in enumerate(streamed)
                    if isinstance(e, StatusEvent) and e.trial.id == ids[x] and e.trial.status.terminal
                )
                assert max(positions) < end
            # The end's snapshot already carries the final metric.
            ends = [e.trial for e in changes if e.trial.status is S.SUCCEEDED]
            assert all(t.final_metric == t.parameters["x"] * 10.0 for t in ends)

            # trialConcurrency 2: never more than two running at once.
            running: set[str] = set()
            for e in changes:
                if e.trial.status is S.RUNNING:
                    running.add(e.trial.id)
                    assert len(running) <= 2
                elif e.trial.status.terminal:
                    running.discard(e.trial.id)

            consumer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await consumer
            await async_wait_until(lambda: not c._subscribers, WAIT_S)  # unsubscribed on cancel

    run_async(body)


def test_the_event_iterator_ends_when_the_coordinator_stops(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", REPORTING_TRIAL)
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        c = Coordinator(config, experiment_dir=tmp_path / "exp")
        await c.start()
        streamed: list[MetricEvent | StatusEvent] = []

        async def consume() -> None:  # as docs/embedding.md writes it: no way out but the stop
            async for event in c.events():
                streamed.append(event)

        consumer = asyncio.create_task(consume())
        try:
            await async_wait_until(lambda: c._subscribers, WAIT_S, message="events() never subscribed")
            handle = await c.submit({"x": 1})
            assert (await handle.wait(WAIT_S)).status is S.SUCCEEDED
        finally:
            await c.stop()
        await asyncio.wait_for(consumer, WAIT_S)  # it ended by itself, not cancelled
        assert [e.trial.status for e in streamed if isinstance(e, StatusEvent)] == [S.WAITING, S.RUNNING, S.SUCCEEDED]
        assert not c._subscribers

    run_async(body)


def test_cancel_early_stop_and_wait_timeout(tmp_path: Path) -> None:
    write_script(tmp_path, "slow.py", SLOW_TRIAL)
    write_script(tmp_path, "trial.py", REPORTING_TRIAL)
    config = build_config(tmp_path, trialConcurrency=1, trialCommand="python slow.py")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            heard: list[MetricEvent] = []
            c.on_metric(heard.append)
            running = await c.submit({"n": 1})
            queued = await c.submit({"n": 2})
            await async_wait_until(
                lambda: c.trial(running.id).status is S.RUNNING and _reported(c, running.id), WAIT_S
            )
            await async_wait_until(lambda: any(e.trial_id == running.id for e in heard), WAIT_S)
            assert c.trial(queued.id).status is S.WAITING  # trialConcurrency 1

            with pytest.raises(asyncio.TimeoutError):
                await running.wait(0.05)
            assert c.trial(running.id).status is S.RUNNING  # a timed-out wait does not touch it

            # A queued trial is canceled at once: it never reaches an agent.
            await queued.cancel()
            info = c.trial(queued.id)
            assert info.status is S.USER_CANCELED and info.reason == "canceled by the user"
            assert info.started_at is None and info.environment_id is None

            await c.early_stop(running.id, "not promising")
            info = await running.wait(WAIT_S)
            assert info.status is S.EARLY_STOPPED, (info.status, info.reason)
            assert info.reason == "not promising"
            assert [(e.kind, e.index, e.value) for e in heard] == [("intermediate", 0, 0.5)]
            assert [(r.index, r.value) for r in c.store.metrics(running.id)] == [(0, 0.5)]  # type: ignore[union-attr]

            # The environment is free again; ending an ended trial changes nothing.
            after = await c.submit({"x": 4}, command="python trial.py")
            assert (await after.wait(WAIT_S)).status is S.SUCCEEDED
            await c.cancel(after.id)
            await c.early_stop(running.id)
            assert c.trial(after.id).status is S.SUCCEEDED
            assert c.trial(running.id).status is S.EARLY_STOPPED
            with pytest.raises(KeyError, match="no-such-trial"):
                await c.cancel("no-such-trial")
            with pytest.raises(KeyError):
                c.trial("no-such-trial")

            history = {t["id"]: t["status"] for t in c.store.trials()}  # type: ignore[union-attr]
            assert history == {running.id: "EARLY_STOPPED", queued.id: "USER_CANCELED", after.id: "SUCCEEDED"}
            events = [(e["old"], e["new"]) for e in c.store.events(queued.id)]  # type: ignore[union-attr]
            assert events == [("WAITING", "USER_CANCELED")]

    run_async(body)


def test_early_stop_of_a_queued_trial_ends_it(tmp_path: Path) -> None:
    write_script(tmp_path, "slow.py", SLOW_TRIAL)
    config = build_config(tmp_path, trialConcurrency=1, trialCommand="python slow.py")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            first = await c.submit({})
            queued = await c.submit({})
            await async_wait_until(lambda: c.trial(first.id).status is S.RUNNING, WAIT_S)
            await c.early_stop(queued.id)
            assert c.trial(queued.id).status is S.EARLY_STOPPED

    run_async(body)


def test_submit_overrides_and_refusals(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", REPORTING_TRIAL)
    write_script(tmp_path, "show.py", SHOW_TRIAL)
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"simulatedGpus": 1})

    async def body() -> None:
        exp = tmp_path / "exp"
        c = Coordinator(config, experiment_dir=exp)
        with pytest.raises(CoordinatorError, match="not running"):
            await c.submit({"x": 1})
        async with c:
            # Too large, from the config alone (the agent may not have registered yet) and from what
            # the registered agent offers alike: the trial fails, saying so.
            early = await c.submit({"x": 1}, gpu_number=2)
            await async_wait_until(lambda: any(e.instance_id for e in c.environments()), WAIT_S)
            late = await c.submit({"x": 1}, gpu_number=2)
            for h in (early, late):
                info = await h.wait(WAIT_S)
                assert (info.status, info.reason) == (S.FAILED, (
                    "refused: trial asks for 2 GPUs but no environment offers more than 1; lower trialGpuNumber "
                    "or add GPUs (gpuIndices/simulatedGpus)")), info
                assert info.started_at is None
            too_large = {early.id, late.id}

            with pytest.raises(ValueError, match="gpu_number"):
                await c.submit({"x": 1}, gpu_number=-1)
            with pytest.raises(TypeError, match="dict"):
                await c.submit([1, 2])  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="JSON"):
                await c.submit({"x": object()})
            with pytest.raises(TypeError, match="JSON"):  # NaN is no JSON: no trial could read it back
                await c.submit({"x": float("nan")})
            # A wrongly typed override is refused here, not by the scheduling pass (which it failed).
            with pytest.raises(TypeError, match="command must be a string"):
                await c.submit({"x": 1}, command=5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="env must be a mapping of variable names to strings"):
                await c.submit({"x": 1}, env={"A": 1})  # type: ignore[dict-item]
            assert {t.id for t in c.trials()} == too_large

            default = await c.submit({"x": 3})
            gpu = await c.submit({"y": 1}, command="python show.py", gpu_number=1, env={"MY_VAR": "hello"})
            no_gpu = await c.submit({"y": 2}, command="python show.py")
            infos = {h.id: await h.wait(WAIT_S) for h in (default, gpu, no_gpu)}
            assert [i.status for i in infos.values()] == [S.SUCCEEDED] * 3, [
                (i.status, i.reason) for i in infos.values()
            ]

            assert infos[default.id].final_metric == 30.0  # the config's trialCommand ran
            assert infos[gpu.id].final_metric == infos[no_gpu.id].final_metric == 2.0
            assert infos[gpu.id].gpu_indices == (0,)
            assert infos[no_gpu.id].gpu_indices == ()

            def shown(trial_id: str) -> dict[str, object]:
                return json.loads((exp / "trials" / trial_id / "stdout.log").read_text().splitlines()[-1])

            assert shown(gpu.id) == {"cuda": "0", "my_var": "hello", "params": {"y": 1}}
            assert shown(no_gpu.id) == {"cuda": "", "my_var": None, "params": {"y": 2}}
            rows = {r["id"]: r for r in c.store.trials()}  # type: ignore[union-attr]
            assert rows[gpu.id]["command"] == "python show.py" and rows[gpu.id]["gpu_number"] == 1
            assert json.loads(rows[gpu.id]["gpu_indices_json"]) == [0]
            assert rows[default.id]["command"] == "python trial.py" and rows[default.id]["gpu_number"] == 0
        with pytest.raises(CoordinatorError, match="not running"):
            await c.submit({"x": 1})
        assert len(c.trials()) == 5  # snapshots stay readable after stop

    run_async(body)


# ---- the synchronous wrapper -----------------------------------------------------------------


def _coordinator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trialkeeper-coordinator" and t.is_alive()]


def test_sync_coordinator_from_plain_code(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", REPORTING_TRIAL)
    write_script(tmp_path, "slow.py", SLOW_TRIAL)
    config = build_config(tmp_path, trialConcurrency=2)
    threads_before = _coordinator_threads()
    heard: list[tuple[str, str, int, float]] = []
    changes: list[tuple[str, TrialStatus, TrialStatus]] = []
    callback_threads: set[int] = set()

    def on_metric(e: MetricEvent) -> None:
        callback_threads.add(threading.get_ident())
        heard.append(_metric_tuple(e))

    def on_status(e: StatusEvent) -> None:
        callback_threads.add(threading.get_ident())
        changes.append((e.trial.id, e.old, e.trial.status))

    with SyncCoordinator(config, experiment_dir=tmp_path / "exp") as c:
        assert c.address.startswith("127.0.0.1:")
        c.on_metric(on_metric)
        c.on_status(on_status)
        handles = [c.submit({"x": x}) for x in range(4)]
        infos = [h.wait(WAIT_S) for h in handles]
        assert [i.status for i in infos] == [S.SUCCEEDED] * 4, [(i.status, i.reason) for i in infos]
        assert [i.final_metric for i in infos] == [0.0, 10.0, 20.0, 30.0]
        for x, h in enumerate(handles):
            # The callbacks for a trial have all run by the time wait() returns.
            assert [m for m in heard if m[0] == h.id] == _expected_metrics(h.id, x)
            assert [(old, new) for tid, old, new in changes if tid == h.id] == [
                (S.WAITING, S.WAITING), (S.WAITING, S.RUNNING), (S.RUNNING, S.SUCCEEDED)
            ]
        assert [t.id for t in c.trials()] == [h.id for h in handles]
        assert handles[0].info.status is S.SUCCEEDED

        slow = [c.submit({}, command="python slow.py") for _ in range(2)]
        wait_until(lambda: all(h.info.status is S.RUNNING and _reported(c, h.id) for h in slow), WAIT_S)
        with pytest.raises(TimeoutError):
            slow[0].wait(0.05)
        slow[0].cancel()
        c.early_stop(slow[1].id, "enough")
        ended = c.wait_all(WAIT_S)
        assert [t.status for t in ended] == [S.SUCCEEDED] * 4 + [S.USER_CANCELED, S.EARLY_STOPPED]
        assert ended[-1].reason == "enough"
        envs = c.environments()
        assert len(envs) == 2 and all(e.status.value in ("READY", "BUSY") for e in envs)
        exp_dir = c.experiment_dir

    assert callback_threads and threading.get_ident() not in callback_threads
    assert _coordinator_threads() == threads_before, "the background loop thread still runs"
    with pytest.raises(CoordinatorError, match="not running"):
        c.submit({"x": 9})
    # What happened stays readable: in memory and in the store.
    assert [t.status for t in c.trials()] == [t.status for t in ended]
    store = Store.in_dir(exp_dir, readonly=True)
    try:
        assert [r["status"] for r in store.trials()] == [t.status.value for t in ended]
        assert store.metric_count() == 4 * 4 + 2
        assert store.experiment()["status"] == "DONE"  # type: ignore[index]
    finally:
        store.close()
    c.stop()  # a second stop is harmless


def test_sync_coordinator_hears_each_checkpoint_a_trial_saves_on_its_background_thread(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", CHECKPOINTING_TRIAL)
    config = build_config(tmp_path, trialConcurrency=2)
    heard: list[tuple[str, int, int]] = []
    callback_threads: set[int] = set()

    def on_checkpoint(e: CheckpointSaved) -> None:
        callback_threads.add(threading.get_ident())
        heard.append((e.trial_id, e.step, e.metric_index))

    with SyncCoordinator(config, experiment_dir=tmp_path / "exp") as c:
        c.on_checkpoint(on_checkpoint)
        handles = [c.submit({}) for _ in range(2)]
        infos = [h.wait(WAIT_S) for h in handles]
        assert [i.status for i in infos] == [S.SUCCEEDED] * 2, [(i.status, i.reason) for i in infos]
        wait_until(lambda: len(heard) == 4, WAIT_S)
        for h in handles:
            # Each save heard once, in the order it was made (the results reported before it).
            assert [e for e in heard if e[0] == h.id] == [(h.id, 1, 1), (h.id, 2, 2)]
            # As the store records them (it keeps the newest).
            assert [(h.id, k.step, k.metric_index) for k in c.checkpoints(h.id)] == [(h.id, 2, 2)]
    assert callback_threads and threading.get_ident() not in callback_threads


def test_sync_coordinator_that_cannot_start_leaves_no_thread(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", REPORTING_TRIAL)
    config = build_config(tmp_path, trialConcurrency=1)
    exp = tmp_path / "exp"
    threads_before = _coordinator_threads()
    with SyncCoordinator(config, experiment_dir=exp) as first:
        assert first.submit({"x": 1}).wait(WAIT_S).status is S.SUCCEEDED
    with (
        pytest.raises(CoordinatorError, match="already holds an experiment"),
        SyncCoordinator(config, experiment_dir=exp),
    ):
        pytest.fail("started on a directory that holds an experiment")
    assert _coordinator_threads() == threads_before
