"""Checkpoints end to end, through a real coordinator and real agent processes: a trial that
saves checkpoints survives its agent's kill -9 and continues from its last one (through
shared storage, or uploaded up the stream and downloaded by another agent, or through object
storage); a paused trial ends cleanly at its next save and continues where it saved; one
that saves nothing within the pause grace is stopped."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import async_wait_until, build_config, run_async, write_script
from netproxy import CuttingProxy
from s3server import S3Server, s3_server  # noqa: F401 - the fixture
from trialkeeper.coordinator.core import Coordinator, TrialHandle
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.services.base import EnvironmentRequest, EnvironmentService, Observation, StartResult

WAIT_S = 60.0
_ENDED = tuple(s for s in TrialStatus if s.terminal)
TIMERS = {"heartbeatInterval": 0.2, "agentLostTimeout": 2.0, "trialLostTimeout": 4.0}
BLOB = 1_500_000  # a file of two chunks when uploaded

# Trains for `epochs` epochs, saving a checkpoint after each (its state and a blob that says
# which epoch wrote it). Each run notes in <out>/<trial>/runs the step it continued from and
# the files it found. At epoch `gate_at` of its first run, after the save (and, with `extra`,
# one more result that the run will lose), it says so in <out>/<trial>/held and waits for the
# file `gate`.
TRAIN = f"""
import json, os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
ckpt = pathlib.Path(trial.get_checkpoint_dir())
out = pathlib.Path(p["out"]) / trial.get_trial_id()
out.mkdir(parents=True, exist_ok=True)
step = trial.checkpoint_step()
with open(out / "runs", "a") as f:
    f.write(json.dumps({{"step": step, "files": sorted(x.name for x in ckpt.iterdir())}}) + "\\n")
start, total = 0, 0
if step is not None:
    state = json.loads((ckpt / "state.json").read_text())
    assert state["epoch"] == step, state
    assert (ckpt / "blob.bin").read_bytes() == bytes([step]) * p.get("blob", {BLOB})
    start, total = step + 1, state["total"]
for epoch in range(start, p["epochs"]):
    total += epoch
    trial.report_intermediate_result(float(epoch))
    (ckpt / "state.json").write_text(json.dumps({{"epoch": epoch, "total": total}}))
    (ckpt / "blob.bin").write_bytes(bytes([epoch]) * p.get("blob", {BLOB}))
    trial.save_checkpoint(epoch)
    if step is None and epoch == p.get("gate_at"):
        if p.get("extra"):
            trial.report_intermediate_result(99.0)
            trial.flush()
        (out / "held").write_text("")
        gate = pathlib.Path(p["gate"])
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
trial.report_final_result(float(total))
"""


class _OwnDiskAgents(EnvironmentService):
    """Agents that keep their files to themselves, as on other machines: no shared storage,
    so checkpoints go up the stream. Each is a real agent process with a work dir of its own
    and its log in <root>/<env>.log."""

    platform = "own-disk"
    shares_filesystem = False

    def __init__(self, root: Path, code: Path) -> None:
        self.root, self.code = root, code
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    def working_directory(self) -> str:
        return str(self.code)

    async def start(self, request: EnvironmentRequest) -> StartResult:
        if request.env_id not in self.procs:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / f"{request.env_id}.log", "ab") as log:  # noqa: ASYNC230 - a test's small file
                self.procs[request.env_id] = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "trialkeeper.agent", "--coordinator", request.coordinator_address,
                    "--environment-id", request.env_id, "--workdir", str(self.root / request.env_id), "--no-gpu",
                    *request.agent_args,
                    env={**os.environ, "TRIALKEEPER_TOKEN": request.token},
                    stdin=asyncio.subprocess.DEVNULL, stderr=log, start_new_session=True,
                )
        return StartResult(platform_id=f"pid {self.procs[request.env_id].pid}")

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        out = {}
        for env_id in env_ids:
            proc = self.procs.get(env_id)
            state = "unknown" if proc is None else "running" if proc.returncode is None else "exited"
            out[env_id] = Observation(state)  # type: ignore[arg-type]
        return out

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        proc = self.procs.get(env_id)
        if proc is None or proc.returncode is not None:
            return
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()

    def log(self, env_id: str) -> str:
        return (self.root / f"{env_id}.log").read_text(errors="replace")


# Known coordinator bugs these tests find (remove the marks once they are fixed).

def _runs(out: Path, trial_id: str) -> list[dict[str, Any]]:
    path = out / trial_id / "runs"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _results(c: Coordinator, trial_id: str) -> list[tuple[int, str, float]]:
    assert c.store is not None
    return [(m.index, m.kind, m.value) for m in c.store.metrics(trial_id)]


async def _held(c: Coordinator, h: TrialHandle, out: Path, extra: bool) -> None:
    """The trial's first run waits at its gate, its checkpoint recorded (and its extra result)."""
    await async_wait_until(lambda: (out / h.id / "held").exists() or c.trial(h.id).done, WAIT_S)
    assert (out / h.id / "held").exists(), f"it never reached its gate: {c.trial(h.id)}"
    assert c.trial(h.id).checkpoint_step is not None
    if extra:
        await async_wait_until(lambda: any(v == 99.0 for _, _, v in _results(c, h.id)), WAIT_S)


def _agent_pid(c: Coordinator, env_id: str) -> int:
    assert c.store is not None
    row = next(e for e in c.store.envs() if e["id"] == env_id)
    return int(json.loads(row["info_json"])["pid"])


def _one_curve(c: Coordinator, trial_id: str, epochs: int) -> None:
    """Its results are one curve, 0..epochs-1 at indices 0..epochs-1, then the final."""
    results = _results(c, trial_id)
    assert [(i, v) for i, k, v in results if k == "intermediate"] == [(i, float(i)) for i in range(epochs)], results
    assert [v for _, k, v in results if k == "final"] == [float(sum(range(epochs)))]


def test_a_killed_agents_trial_continues_from_its_checkpoint_on_shared_storage(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRAIN)
    out, gate = tmp_path / "out", tmp_path / "gate"
    config = build_config(tmp_path, trialConcurrency=1, coordinator=TIMERS)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({"epochs": 5, "gate_at": 2, "extra": True, "gate": str(gate), "out": str(out)})
            await _held(c, h, out, extra=True)
            shared = c.experiment_dir / "checkpoints" / h.id
            assert (shared / "2" / "blob.bin").stat().st_size == BLOB  # renamed there by the agent
            first_env = h.info.environment_id
            assert first_env is not None
            os.kill(_agent_pid(c, first_env), signal.SIGKILL)
            await async_wait_until(lambda: len(_runs(out, h.id)) == 2, WAIT_S, message="it was not continued")
            gate.write_text("")  # the orphaned first run goes on, finds no agent, and ends
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
            assert info.environment_id != first_env
            assert _runs(out, h.id) == [{"step": None, "files": []}, {"step": 2, "files": ["blob.bin", "state.json"]}]
            _one_curve(c, h.id, 5)
            assert c.store is not None
            assert [r["value"] for r in c.store.metric_history(h.id)] == [99.0]  # the lost run's
            [kept] = c.checkpoints(h.id)
            assert (kept.step, kept.metric_index, kept.location) == (4, 5, "")
            assert (shared / "4" / "state.json").exists()
            # A new trial starts from its checkpoint (a search's promotion), on its own live directory.
            fork = await c.submit({"epochs": 6, "out": str(out)}, checkpoint_from=h.id)
            forked = await fork.wait(WAIT_S)
            assert forked.status is TrialStatus.SUCCEEDED, (forked.status, forked.reason)
            assert _runs(out, fork.id) == [{"step": 4, "files": ["blob.bin", "state.json"]}]
            assert forked.final_metric == float(sum(range(6)))
            assert [k.step for k in c.checkpoints(fork.id)] == [5]
            assert (shared / "4" / "blob.bin").read_bytes() == bytes([4]) * BLOB  # its source untouched

    run_async(body)


def test_without_shared_storage_checkpoints_go_up_the_stream_and_down_to_another_agent(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRAIN)
    out, gate = tmp_path / "out", tmp_path / "gate"
    config = build_config(tmp_path, trialConcurrency=1, coordinator=TIMERS)
    service = _OwnDiskAgents(tmp_path / "agents", tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
            h = await c.submit({"epochs": 4, "gate_at": 1, "gate": str(gate), "out": str(out)})
            await _held(c, h, out, extra=False)
            first_env = h.info.environment_id
            assert first_env is not None
            # Uploaded: the coordinator has its copy, the agent keeps its own.
            uploaded = c.experiment_dir / "checkpoints" / h.id / "1"
            assert (uploaded / "blob.bin").read_bytes() == bytes([1]) * BLOB
            cached = tmp_path / "agents" / first_env / "checkpoint-cache" / h.id / "1"
            assert (cached / "blob.bin").stat().st_size == BLOB
            # Its bytes went by the coordinator's bulk port, none by the stream.
            assert "goes by the stream" not in service.log(first_env)
            service.procs[first_env].kill()
            await async_wait_until(lambda: len(_runs(out, h.id)) == 2, WAIT_S, message="it was not continued")
            gate.write_text("")
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
            second_env = info.environment_id
            assert second_env not in (None, first_env)
            assert _runs(out, h.id)[1] == {"step": 1, "files": ["blob.bin", "state.json"]}
            assert "downloaded" in service.log(second_env)  # nothing of it was on that agent's disk
            _one_curve(c, h.id, 4)
            assert [k.step for k in c.checkpoints(h.id)] == [3]
            # Uploaded, its digest is taken by the coordinator from the files it got.
            await async_wait_until(lambda: c.checkpoints(h.id)[0].digest.startswith("sha256:"), WAIT_S)

    run_async(body)


def test_uploads_and_downloads_go_on_across_cut_connections(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRAIN)
    out, gate = tmp_path / "out", tmp_path / "gate"
    service = _OwnDiskAgents(tmp_path / "agents", tmp_path)

    async def body() -> None:
        proxy = await CuttingProxy().start()
        config = build_config(tmp_path, trialConcurrency=1, coordinator={
            **TIMERS, "advertiseAddress": f"127.0.0.1:{proxy.port}", "reconnectWindow": 30,
            "checkpointPort": False,  # by the stream, through the proxy that cuts it
        })
        stop = asyncio.Event()

        async def cut_now_and_then() -> None:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 0.1)
                except asyncio.TimeoutError:
                    proxy.cut()

        try:
            async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
                assert c.store is not None
                host, port = str(c.store.meta("bound_address")).rsplit(":", 1)
                proxy.target = (host, int(port))
                cutter = asyncio.ensure_future(cut_now_and_then())
                try:
                    blob = 12 << 20
                    h = await c.submit({"epochs": 4, "gate_at": 1, "gate": str(gate), "out": str(out), "blob": blob})
                    await _held(c, h, out, extra=False)
                    first_env = h.info.environment_id
                    assert first_env is not None
                    service.procs[first_env].kill()
                    await async_wait_until(lambda: len(_runs(out, h.id)) == 2 or c.trial(h.id).done, WAIT_S)
                    gate.write_text("")
                    info = await h.wait(WAIT_S)
                finally:
                    stop.set()
                    await cutter
                assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
                assert proxy.cuts >= 3, f"only {proxy.cuts} cuts: the test did not test anything"
                # The continued run checked the blob it found: the one epoch 1 wrote, whole.
                assert _runs(out, h.id)[1] == {"step": 1, "files": ["blob.bin", "state.json"]}
                _one_curve(c, h.id, 4)
        finally:
            await proxy.close()

    run_async(body)


def _cli(*argv: str) -> str:
    """What ``trialkeeper ARGV`` prints, run here: it reads the store the coordinator writes."""
    from trialkeeper.coordinator import cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(list(argv)) == 0
    return printed.getvalue()


def test_a_paused_trial_ends_at_its_next_save_and_continues_there(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRAIN)
    out, gate = tmp_path / "out", tmp_path / "gate"
    config = build_config(tmp_path, trialConcurrency=1, coordinator=TIMERS)
    service = _OwnDiskAgents(tmp_path / "agents", tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
            h = await c.submit({"epochs": 5, "gate_at": 1, "gate": str(gate), "out": str(out)})
            await _held(c, h, out, extra=False)
            ran_on = c.trial(h.id).environment_id
            await c.pause(h.id)
            gate.write_text("")  # epoch 2 is saved, and the save answers "pause"
            await async_wait_until(lambda: c.trial(h.id).status in (TrialStatus.PAUSED, *_ENDED), WAIT_S)
            paused = c.trial(h.id)
            assert paused.checkpoint_step == 2, paused
            # Placed nowhere now, it says where it last ran, live and in the CLI's views.
            assert (paused.environment_id, paused.last_environment_id) == (None, ran_on), paused
            shown = _cli("trial", str(c.experiment_dir), h.id)
            assert f"environment: none now, last on {ran_on}; attempts: 1" in shown, shown
            assert f"in {c.experiment_dir / 'checkpoints' / h.id / '2'}" in shown, shown
            assert f"({ran_on})" in _cli("trials", str(c.experiment_dir))
            assert c.store is not None
            ended = [e for e in c.store.events(h.id) if e["new"] == "PAUSED"]
            assert ended and "paused after its checkpoint of step 2" in ended[-1]["reason"], ended
            await c.resume_trial(h.id)
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
            assert _runs(out, h.id)[1] == {"step": 2, "files": ["blob.bin", "state.json"]}
            _one_curve(c, h.id, 5)
            # The one agent continued it from its own copy.
            logs = "".join(service.log(e) for e in service.procs)
            assert "continues from step 2, copied from this machine's" in logs, logs[-3000:]

    run_async(body)


SILENT = """
import time
time.sleep(120)
"""


def test_a_trial_that_saves_nothing_within_the_pause_grace_is_stopped_and_canceled(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", SILENT)
    config = build_config(tmp_path, trialConcurrency=1, pauseGracePeriod=1, coordinator=TIMERS)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({})
            await async_wait_until(lambda: c.trial(h.id).status is TrialStatus.RUNNING, WAIT_S)
            await async_wait_until(lambda: _results_started(c, h.id), WAIT_S)
            await c.pause(h.id)
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.USER_CANCELED, (info.status, info.reason)
            assert "saved no checkpoint within 1 s of being asked to pause" in info.reason, info.reason
            assert "no checkpoint to continue from" in info.reason

    run_async(body)


def _results_started(c: Coordinator, trial_id: str) -> bool:
    """The trial's process runs (the agent said so)."""
    return c.trial(trial_id).started_at is not None


def test_checkpoints_in_object_storage_are_uploaded_and_downloaded_by_the_agents(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - the fixture
) -> None:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)  # agents and the coordinator reach the server through boto3's chain
    bucket = s3_server.new_bucket()
    write_script(tmp_path, "trial.py", TRAIN)
    out, gate = tmp_path / "out", tmp_path / "gate"
    config = build_config(tmp_path, trialConcurrency=1, checkpointStorage=f"s3://{bucket}/runs",
                          coordinator=TIMERS)
    service = _OwnDiskAgents(tmp_path / "agents", tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp", service=service) as c:
            h = await c.submit({"epochs": 3, "gate_at": 1, "gate": str(gate), "out": str(out)})
            await _held(c, h, out, extra=False)
            [kept] = c.checkpoints(h.id)
            assert kept.location.startswith(f"s3://{bucket}/runs/") and kept.location.endswith(f"/{h.id}/1")
            prefix = kept.location.removeprefix(f"s3://{bucket}/")
            assert s3_server.keys(bucket, prefix)[f"{prefix}/blob.bin"] == BLOB
            assert not (c.experiment_dir / "checkpoints" / h.id / "1").exists()
            first_env = h.info.environment_id
            assert first_env is not None
            service.procs[first_env].kill()
            await async_wait_until(lambda: len(_runs(out, h.id)) == 2, WAIT_S, message="it was not continued")
            gate.write_text("")
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
            assert info.environment_id is not None
            assert f"downloaded from {kept.location}" in service.log(info.environment_id)
            _one_curve(c, h.id, 3)

    run_async(body)
