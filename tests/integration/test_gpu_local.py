"""GPU-aware placement end to end: real agents with simulated GPUs, real trial processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import async_wait_until, build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import run_experiment

WAIT_S = 30.0

# Each trial writes what it was given, then waits until the test lets it go (a file), so
# the test can see two trials run at the same time without timing guesses.
GPU_SCRIPT = """
import json, os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
out = pathlib.Path(os.environ["TRIALKEEPER_OUTPUT_DIR"])
(out / "gpu.json").write_text(json.dumps({"cuda": os.environ["CUDA_VISIBLE_DEVICES"], "pid": os.getpid()}))
go = pathlib.Path(p["go"])
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(1.0)
"""


def _seen(c: Coordinator, trial_id: str) -> dict[str, object] | None:
    path = c.experiment_dir / "trials" / trial_id / "output" / "gpu.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_two_one_gpu_trials_share_a_two_gpu_environment(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", GPU_SCRIPT)
    config = build_config(
        tmp_path,
        trialGpuNumber=1,
        trialConcurrency=2,
        trainingService={"environmentCount": 1, "trialsPerEnvironment": 2, "simulatedGpus": 2},
    )
    go = tmp_path / "go"

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            a = await c.submit({"go": str(go)})
            b = await c.submit({"go": str(go)})
            both = await async_wait_until(
                lambda: (_seen(c, a.id), _seen(c, b.id)) if _seen(c, a.id) and _seen(c, b.id) else None,
                WAIT_S,
                message="the two trials did not run at the same time",
            )
            # Both run at once, on the same environment, each with its own GPU.
            assert a.info.status is b.info.status is TrialStatus.RUNNING
            assert a.info.environment_id == b.info.environment_id
            assert {both[0]["cuda"], both[1]["cuda"]} == {"0", "1"}, both
            # The environment view shows who holds which GPU, labelled simulated.
            env = c.environments()[0]
            assert sorted(sorted(g.held_by) for g in env.gpus) == sorted([[a.id], [b.id]])
            # The store keeps each trial's GPUs by UUID too, for a resumed coordinator.
            assert c.store is not None
            for h in (a, b):
                row = c.store.trial(h.id)
                assert row is not None
                assert json.loads(row["gpu_uuids_json"]) == [g.uuid for g in env.gpus if h.id in g.held_by], row
            assert all(g.simulated for g in env.gpus), env.gpus
            go.write_text("")
            infos = [await h.wait(WAIT_S) for h in (a, b)]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 2
            # Released in the core's GPU ledger once the trees were gone.
            assert c._engine is not None
            ledger = c._engine.envs[env.id].gpus
            await async_wait_until(lambda: all(not g.holders for g in ledger), WAIT_S)

    run_async(body)


def test_a_third_one_gpu_trial_waits_with_a_reason_and_then_runs(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", GPU_SCRIPT)
    config = build_config(
        tmp_path,
        trialGpuNumber=1,
        trialConcurrency=3,
        trainingService={"environmentCount": 1, "trialsPerEnvironment": 3, "simulatedGpus": 2},
    )
    go = tmp_path / "go"

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            handles = [await c.submit({"go": str(go)}) for _ in range(3)]
            await async_wait_until(lambda: _seen(c, handles[0].id) and _seen(c, handles[1].id), WAIT_S)
            third = handles[2].info
            assert third.status is TrialStatus.WAITING
            assert third.reason == "waiting: no environment has 1 free GPU; env-1 has 0 free", third.reason
            go.write_text("")
            infos = [await h.wait(WAIT_S) for h in handles]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 3

    run_async(body)


def test_gpu_indices_restrict_what_trials_get(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", GPU_SCRIPT)
    config = build_config(
        tmp_path,
        trialGpuNumber=1,
        trialConcurrency=2,
        trainingService={"environmentCount": 1, "trialsPerEnvironment": 2, "simulatedGpus": 4, "gpuIndices": [1, 3]},
    )
    go = tmp_path / "go"
    go.write_text("")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            handles = [await c.submit({"go": str(go)}) for _ in range(4)]
            infos = [await h.wait(WAIT_S) for h in handles]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 4
            given = {_seen(c, h.id)["cuda"] for h in handles}  # type: ignore[index]
            assert given == {"1", "3"}, given
            assert sorted(g.index for g in c.environments()[0].gpus) == [1, 3]

    run_async(body)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_trial_asking_for_more_gpus_than_offered_fails_at_submit_and_others_run(tmp_path: Path, reuse: bool) -> None:
    write_script(tmp_path, "trial.py", GPU_SCRIPT)
    config = build_config(
        tmp_path, trialConcurrency=1, trainingService={"simulatedGpus": 2, "reuseMode": reuse}
    )
    go = tmp_path / "go"
    go.write_text("")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            big = await c.submit({"go": str(go)}, gpu_number=3)
            small = await c.submit({"go": str(go)}, gpu_number=2)
            info = await big.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED
            assert "refused: trial asks for 3 GPUs but no environment offers more than 2" in info.reason, info.reason
            assert _seen(c, big.id) is None  # it never ran
            assert (await small.wait(WAIT_S)).status is TrialStatus.SUCCEEDED

    run_async(body)


def test_a_search_whose_trials_need_more_gpus_than_declared_fails_them_and_goes_on(tmp_path: Path) -> None:
    # The platform declares its GPUs (simulatedGpus): each trial is known too large at once. Each
    # fails with the reason; the search is not ended by it, and runs up to maxTrialNumber.
    write_script(tmp_path, "trial.py", GPU_SCRIPT)
    config = build_config(
        tmp_path, trialConcurrency=1, maxTrialNumber=3, trialGpuNumber=2,
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}},  # no trial runs: it reads no "go"
        trainingService={"environmentCount": 1, "simulatedGpus": 1},
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=4 * WAIT_S)
    assert (result.ok, result.reason) == (True, ""), result.reason  # ended by maxTrialNumber, as any search
    assert [t.status for t in result.trials] == [TrialStatus.FAILED] * 3
    for t in result.trials:
        assert t.reason == ("refused: trial asks for 2 GPUs but no environment offers more than 1; "
                            "lower trialGpuNumber or add GPUs (gpuIndices/simulatedGpus)"), t.reason


def test_queued_trials_that_can_never_fit_fail_once_environments_register(tmp_path: Path) -> None:
    # Agents declare their GPUs only when they register; a trial submitted before then
    # and too large for every one of them is failed with the reason, not left WAITING.
    write_script(tmp_path, "trial.py", GPU_SCRIPT)
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"environmentCount": 1})
    go = tmp_path / "go"
    go.write_text("")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            big = await c.submit({"go": str(go)}, gpu_number=1)
            small = await c.submit({"go": str(go)})
            info = await big.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED
            assert "asks for 1 GPU but no environment offers more than 0" in info.reason, info.reason
            assert (await small.wait(WAIT_S)).status is TrialStatus.SUCCEEDED

    run_async(body)


def test_gpu_samples_are_stored_per_tick_and_a_failing_store_does_not_stop_the_monitor(tmp_path: Path) -> None:
    import sqlite3

    write_script(tmp_path, "trial.py", GPU_SCRIPT)
    config = build_config(
        tmp_path, trialGpuNumber=1, trialConcurrency=1,
        trainingService={"environmentCount": 1, "simulatedGpus": 1},
        coordinator={"heartbeatInterval": 0.2},
    )
    go = tmp_path / "go"

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            assert c.store is not None
            store = c.store
            a = await c.submit({"go": str(go)})
            await async_wait_until(lambda: _seen(c, a.id), WAIT_S, message="trial never ran")
            # Samples reach the store, a tick's worth at a time, naming the trial on the GPU.
            await async_wait_until(lambda: store.gpu_samples(trial_id=a.id), WAIT_S, message="no GPU sample stored")
            # The store fails for a while: the samples of those ticks are dropped, loudly,
            # and the coordinator goes on placing trials.
            real, failures = store.add_gpu_samples, []

            def failing(rows: object) -> None:
                failures.append(rows)
                raise sqlite3.OperationalError("disk I/O error")

            store.add_gpu_samples = failing  # type: ignore[method-assign]
            go.write_text("")
            assert (await a.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            b = await c.submit({"go": str(go)})
            await async_wait_until(lambda: failures, WAIT_S, message="no samples were offered to the store")
            store.add_gpu_samples = real  # type: ignore[method-assign]
            assert (await b.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            # The monitor is still running: a background task that died would fail the experiment.
            assert c._shell is not None and c._shell._monitor is not None and not c._shell._monitor.done()
            assert not c.failure

    run_async(body)
