"""A checkpoint interrupted while it is written or sent leaves the previous one whole.

Each case stops one trial's save of step 1 (step 0 is saved before) at one point and kills
the trial, its agent or the coordinator with SIGKILL there. A checkpoint is 48 MiB (three
files of 16 MiB whose bytes follow from the step and the run that wrote them,
tests/checkpoint_fault_trial.py), so that a save takes long enough to be caught part way;
the point is reached by a condition, never by a wait: the trial says where it stands in
files, and the agents reach the coordinator through a proxy (tests/holding_proxy.py) that
holds what goes up after a number of bytes, or holds the coordinator's messages (its acks)
while flow control goes on.

Then: the store's newest kept checkpoint of the trial is the one the interruption leaves
(step 0, or step 1 when the save was already the agent's and it reached the coordinator),
its files in the experiment's checkpoint directory are byte for byte what that step wrote,
the trial continues from it (checkpoint_step() and the files it finds) and ends SUCCEEDED
with one curve. Two checkpoints are kept per trial, so that the end can show the step saved
again after the interruption whole too, with nothing of what the interrupted save left.

Two ways checkpoints travel:

- shared: the local platform; its agents see the experiment's checkpoint directory (its
  marker file) and save by rename into ``<exp>/checkpoints/<trial>/<step>``;
- upload: :class:`OwnDiskAgents` (tests/checkpoint_fault_coordinator.py), local agents that
  each work in a directory of their own and are not told of that directory, so they send
  checkpoints up the stream in chunks (the coordinator gathers them in ``.incoming-<step>``)
  and a trial continued on another agent downloads its checkpoint.

The coordinator's own death is staged with the coordinator in a process of its own
(tests/checkpoint_fault_coordinator.py run as a script), killed with SIGKILL and started
again with Coordinator.resume; the agents it started, and the proxy, outlive it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from checkpoint_fault_coordinator import OwnDiskAgents, agent_log
from checkpoint_fault_trial import BIG, FILE_BYTES, digests, files
from conftest import async_wait_until, build_config, pid_gone, run_async
from holding_proxy import HoldingProxy
from trialkeeper.coordinator.core import Coordinator, TrialHandle
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.store.store import Store

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent.parent
TRIAL = TESTS / "checkpoint_fault_trial.py"
COORDINATOR = TESTS / "checkpoint_fault_coordinator.py"
WAIT_S = 60.0
EPOCHS = 3
STEP = 1  # the save interrupted; step 0 is the previous one
TOTAL = len(BIG) * FILE_BYTES + 3  # bytes of the first run's checkpoint of step 1
PART = 20 << 20  # what goes up of an upload stopped part way: a.bin and some of b.bin
TIMERS = {"heartbeatInterval": 0.2, "agentLostTimeout": 5.0, "trialLostTimeout": 8.0}


# ---- the experiment ----------------------------------------------------------------------------


def _config_data(tmp_path: Path, proxy: HoldingProxy) -> dict[str, Any]:
    shutil.copy(TRIAL, tmp_path / "trial.py")
    return {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trialConcurrency": 1,
        "maxTrialRetries": 2,
        "retryFailedTrials": True,
        "checkpointsPerTrial": 2,
        "trainingService": {"platform": "local"},
        # Uploads go up the stream, through the proxy that holds them: not by the bulk port.
        "coordinator": {**TIMERS, "advertiseAddress": f"127.0.0.1:{proxy.port}", "checkpointPort": False},
    }


def _params(tmp_path: Path, hold: str) -> dict[str, Any]:
    return {"epochs": EPOCHS, "hold": hold, "hold_at": STEP, "out": str(tmp_path / "out")}


class _Experiment:
    """What the checks read of an experiment, wherever its coordinator runs."""

    exp: Path
    out: Path
    trial_id: str

    def kept(self) -> list[int]:
        raise NotImplementedError

    def results(self) -> list[tuple[int, str, float]]:
        raise NotImplementedError

    def logs(self) -> str:
        logs = [*sorted(self.exp.parent.glob("coordinator-*.log")), *sorted(self.exp.glob("envs/*/agent.log"))]
        return "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    @property
    def root(self) -> Path:
        return self.exp / "checkpoints" / self.trial_id

    @property
    def marks(self) -> Path:
        return self.out / self.trial_id

    async def mark(self, name: str) -> None:
        await async_wait_until(lambda: (self.marks / name).exists(), WAIT_S,
                               message=f"the trial never wrote {name}\n{self.logs()}")

    def go(self) -> None:
        (self.marks / "go").write_text("")

    async def upload_stopped_part_way(self, proxy: HoldingProxy) -> None:
        """The proxy holds the rest of step 1's upload; what went up is written."""
        incoming = self.root / f".incoming-{STEP}"
        await async_wait_until(lambda: proxy.holding_up.is_set() and _size(incoming) > 0, WAIT_S,
                               message=f"the upload of step {STEP} never started\n{self.logs()}")
        assert _size(incoming) < TOTAL

    def left(self, kept: list[int]) -> None:
        """What the interruption left: these checkpoints (of the first run), whole."""
        assert self.kept() == kept, (self.kept(), self.logs())
        for step in kept:
            _whole(self.root / str(step), step, 0)

    def ended(self, continued_from: int | None) -> None:
        """The trial ran again from ``continued_from`` (None: never), with that checkpoint's
        files, and ended with one curve and its last two checkpoints whole."""
        runs = _runs(self.marks)
        assert [r["step"] for r in runs] == [None] + ([] if continued_from is None else [continued_from]), runs
        if continued_from is not None:
            assert runs[-1]["files"] == digests(continued_from, _writer(runs, continued_from)), runs
        _one_curve(self.results())
        assert self.kept() == [EPOCHS - 2, EPOCHS - 1], self.kept()
        for step in self.kept():
            _whole(self.root / str(step), step, _writer(runs, step))


@dataclass
class Rig(_Experiment):
    """One experiment in this process, its agents behind the proxy."""

    c: Coordinator
    proxy: HoldingProxy
    h: TrialHandle
    out: Path

    def __post_init__(self) -> None:
        self.exp, self.trial_id = self.c.experiment_dir, self.h.id

    def kept(self) -> list[int]:
        return [k.step for k in self.c.checkpoints(self.h.id)]

    def results(self) -> list[tuple[int, str, float]]:
        assert self.c.store is not None
        return [(m.index, m.kind, m.value) for m in self.c.store.metrics(self.h.id)]

    def agent_pid(self) -> int:
        env_id = self.h.info.environment_id
        assert self.c.store is not None and env_id is not None
        row = next(e for e in self.c.store.envs() if e["id"] == env_id)
        return int(json.loads(row["info_json"])["pid"])

    def trial_pid(self) -> int:
        return int((self.marks / "held").read_text())

    async def continues(self, step: int, *, upload: bool) -> None:
        info = await self.h.wait(WAIT_S)
        assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, self.logs())
        self.ended(step)
        logs = "".join(agent_log(self.exp, e.id) for e in self.c.environments())
        assert ("(shared storage)" in logs) is not upload, self.logs()
        # An uploading agent keeps a copy of its own; one on shared storage has nothing there.
        assert any(self.exp.parent.glob(f"agents/*/checkpoint-cache/{self.trial_id}")) is upload


@contextlib.asynccontextmanager
async def _experiment(tmp_path: Path, *, upload: bool, hold: str) -> AsyncIterator[Rig]:
    proxy = await HoldingProxy().start()
    config = build_config(tmp_path, **_config_data(tmp_path, proxy))
    exp = tmp_path / "exp"
    service = OwnDiskAgents(exp, tmp_path, tmp_path / "agents") if upload else None
    out = tmp_path / "out"
    try:
        async with Coordinator(config, experiment_dir=exp, service=service) as c:
            assert c.store is not None
            host, port = str(c.store.meta("bound_address")).rsplit(":", 1)
            proxy.target = (host, int(port))
            h = await c.submit(_params(tmp_path, hold))
            try:
                yield Rig(c, proxy, h, out)
            finally:
                _end_runs(out)
    finally:
        await proxy.close()


def _end_runs(out: Path) -> None:
    """Runs orphaned by a killed agent may still wait for their save's answer: they go."""
    for runs in out.glob("*/runs"):
        for line in runs.read_text().splitlines():
            pid = json.loads(line)["pid"]
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.environ().get("TRIALKEEPER_TRIAL_ID") == runs.parent.name:
                    p.kill()


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


def _runs(marks: Path) -> list[dict[str, Any]]:
    path = marks / "runs"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _writer(runs: list[dict[str, Any]], step: int) -> int:
    """The run that wrote the checkpoint of ``step``: the last one started before it."""
    return max(i for i, r in enumerate(runs) if r["step"] is None or r["step"] < step)


def _whole(directory: Path, step: int, run: int) -> None:
    """``directory`` holds the checkpoint of ``step`` that run ``run`` wrote, byte for byte,
    and nothing else."""
    want = files(step, run)
    found = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    assert found == sorted(want), (directory, found, sorted(want))
    for name, data in want.items():
        got = (directory / name).read_bytes()
        assert got == data, f"{directory / name}: {len(got)} bytes, not those run {run} wrote at step {step}"


async def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    await async_wait_until(lambda: pid_gone(pid), WAIT_S, message=f"pid {pid} outlived SIGKILL")


def _one_curve(results: list[tuple[int, str, float]]) -> None:
    """One curve, 0..EPOCHS-1 at indices 0..EPOCHS-1, then the final result."""
    assert [(i, v) for i, k, v in results if k == "intermediate"] == [(i, float(i)) for i in range(EPOCHS)], results
    assert [v for _, k, v in results if k == "final"] == [float(sum(range(EPOCHS)))], results


# ---- the trial is killed -------------------------------------------------------------------------

KINDS = pytest.mark.parametrize("upload", [False, True], ids=["shared", "upload"])


@KINDS
def test_a_trial_killed_while_writing_its_files_continues_from_its_previous_checkpoint(
    tmp_path: Path, upload: bool
) -> None:
    async def body() -> None:
        async with _experiment(tmp_path, upload=upload, hold="mid-write") as rig:
            await rig.mark("mid-write")  # some files whole, one half written, no save asked
            await _kill(rig.trial_pid())
            rig.left([0])
            await rig.continues(0, upload=upload)

    run_async(body)


@KINDS
def test_a_save_taken_before_its_trial_is_killed_is_recorded_whole(tmp_path: Path, upload: bool) -> None:
    """The agent took the files (renamed them away) and is saving them when the trial dies,
    its save_checkpoint unanswered: the save goes on to be recorded, and the trial is retried
    from it."""

    async def body() -> None:
        async with _experiment(tmp_path, upload=upload, hold="ready") as rig:
            await rig.mark("ready")
            await _save_until_held(rig, rig.proxy, upload)
            assert rig.kept() == [0] and not (rig.marks / f"saved-{STEP}").exists()
            await _kill(rig.trial_pid())
            rig.proxy.release()
            await rig.continues(STEP, upload=upload)

    run_async(body)


async def _save_until_held(x: _Experiment, proxy: HoldingProxy, upload: bool) -> None:
    """Let the trial save step 1 and hold the save in the proxy: part way up (upload), or
    its CheckpointSaved on the way, the files in place (shared)."""
    if upload:
        proxy.hold_up_after(PART)
        x.go()
        await x.upload_stopped_part_way(proxy)
    else:
        proxy.hold_up()
        x.go()
        await async_wait_until(lambda: (x.root / str(STEP)).is_dir(), WAIT_S, message=x.logs())


# ---- its agent is killed ------------------------------------------------------------------------


@KINDS
def test_an_agent_killed_before_its_checkpoint_saved_arrives_leaves_the_previous_one(
    tmp_path: Path, upload: bool
) -> None:
    """Upload: some chunks went up, the rest and CheckpointSaved never do. Shared: the agent
    placed <trial>/1 by rename, its CheckpointSaved never arrives. The trial continues on
    another agent from step 0 and saves step 1 again over what the first save left."""

    async def body() -> None:
        async with _experiment(tmp_path, upload=upload, hold="ready") as rig:
            await rig.mark("ready")
            await _save_until_held(rig, rig.proxy, upload)
            first_env = rig.h.info.environment_id
            await _kill(rig.agent_pid())
            rig.proxy.cut()  # what it sent after that is lost with it
            rig.left([0])
            if upload:
                assert 0 < _size(rig.root / f".incoming-{STEP}") < TOTAL
            else:
                assert (rig.root / str(STEP)).is_dir()  # there, and not a checkpoint
            await rig.continues(0, upload=upload)
            assert rig.h.info.environment_id != first_env
            if upload:
                assert "continues from step 0, downloaded" in rig.logs(), rig.logs()

    run_async(body)


@KINDS
def test_an_agent_killed_after_its_checkpoint_is_recorded_but_before_the_ack_continues_from_it(
    tmp_path: Path, upload: bool
) -> None:
    async def body() -> None:
        async with _experiment(tmp_path, upload=upload, hold="ready") as rig:
            await rig.mark("ready")
            rig.proxy.hold_down_messages()  # the coordinator's acks stay in the proxy
            rig.go()
            await async_wait_until(lambda: rig.kept() == [0, STEP], WAIT_S, message=f"{rig.kept()} {rig.logs()}")
            assert not (rig.marks / f"saved-{STEP}").exists()  # its save_checkpoint still waits
            first_env = rig.h.info.environment_id
            await _kill(rig.agent_pid())
            rig.proxy.cut()
            rig.left([0, STEP])
            await rig.continues(STEP, upload=upload)
            assert rig.h.info.environment_id != first_env
            if upload:
                assert f"continues from step {STEP}, downloaded" in rig.logs(), rig.logs()

    run_async(body)


# ---- the coordinator is killed ------------------------------------------------------------------


class _Coordinator(_Experiment):
    """The coordinator in a process of its own (tests/checkpoint_fault_coordinator.py), its
    agents behind ``proxy``; its log is <tmp>/coordinator-<run|resume>.log."""

    def __init__(self, tmp_path: Path, proxy: HoldingProxy, *, upload: bool) -> None:
        self.tmp, self.proxy = tmp_path, proxy
        self.exp, self.out = tmp_path / "exp", tmp_path / "out"
        self.spec, self.result = tmp_path / "spec.json", tmp_path / "result.json"
        self.spec.write_text(json.dumps({
            "config": _config_data(tmp_path, proxy), "code": str(tmp_path), "exp": str(self.exp),
            "agents": str(tmp_path / "agents") if upload else "", "params": _params(tmp_path, "ready"),
            "result": str(self.result),
        }))
        self.proc: subprocess.Popen[bytes] | None = None
        self.trial_id = ""

    async def start(self) -> None:
        self._spawn("run")
        await async_wait_until(lambda: self._result().get("trial"), WAIT_S, message=self.logs())
        self.trial_id = self._result()["trial"]
        host, port = str(self._read(lambda s: s.meta("bound_address"))).rsplit(":", 1)
        self.proxy.target = (host, int(port))

    def _spawn(self, mode: str) -> None:
        with open(self.tmp / f"coordinator-{mode}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(COORDINATOR), mode, str(self.spec)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=30)

    async def resume_to_the_end(self) -> None:
        self._spawn("resume")
        await async_wait_until(lambda: self.proc is not None and self.proc.poll() is not None, WAIT_S * 2,
                               message=self.logs())
        assert self.proc is not None and self.proc.returncode == 0, self.logs()
        assert self._result()["status"] == "SUCCEEDED", (self._result(), self.logs())

    def _result(self) -> dict[str, Any]:
        return json.loads(self.result.read_text()) if self.result.exists() else {}

    def _read(self, what: Any) -> Any:
        store = Store.in_dir(self.exp, readonly=True)
        try:
            return what(store)
        finally:
            store.close()

    def kept(self) -> list[int]:
        return [int(r["step"]) for r in self._read(lambda s: s.checkpoints(self.trial_id))]

    def results(self) -> list[tuple[int, str, float]]:
        return list(self._read(lambda s: [(m.index, m.kind, m.value) for m in s.metrics(self.trial_id)]))

    def recorded(self, step: int) -> list[str]:
        """The digest of each checkpoint of ``step`` the store ever recorded."""
        rows = self._read(lambda s: s.checkpoints(self.trial_id, kept=False))
        return [r["digest"] for r in rows if r["step"] == step]

    def agent_pid(self) -> int:
        [row] = [e for e in self._read(lambda s: s.envs()) if e["info_json"] != "{}"]
        return int(json.loads(row["info_json"])["pid"])


@contextlib.asynccontextmanager
async def _coordinator(tmp_path: Path, *, upload: bool) -> AsyncIterator[tuple[_Coordinator, HoldingProxy]]:
    proxy = await HoldingProxy().start()
    co = _Coordinator(tmp_path, proxy, upload=upload)
    try:
        await co.start()
        await co.mark("ready")
        yield co, proxy
    finally:
        co.kill()
        _end_runs(co.out)
        await proxy.close()


@pytest.mark.parametrize(
    ("upload", "point"),
    [(True, "mid-upload"), (False, "saved-unsent"), (True, "ack-unsent"), (False, "ack-unsent")],
    ids=["upload-mid-upload", "shared-before-saved-arrives", "upload-before-the-ack", "shared-before-the-ack"],
)
def test_a_coordinator_killed_mid_save_is_resumed_and_the_save_completes(
    tmp_path: Path, upload: bool, point: str
) -> None:
    """The coordinator dies with the save of step 1 part way up (upload), with its
    CheckpointSaved on the way (shared), or with it recorded and its ack on the way: the
    store says step 0 (and step 1 when it recorded it), whole. The resumed coordinator gets
    the rest from the agent's journal (or tells it in Welcome what it had stored), and the
    trial goes on, not restarted, with step 1 recorded once."""

    async def body() -> None:
        async with _coordinator(tmp_path, upload=upload) as (co, proxy):
            if point == "ack-unsent":
                proxy.hold_down_messages()
                co.go()
                await async_wait_until(lambda: co.kept() == [0, STEP], WAIT_S, message=co.logs())
            else:
                await _save_until_held(co, proxy, upload)
            co.kill()
            proxy.cut()
            co.left([0, STEP] if point == "ack-unsent" else [0])
            if point == "mid-upload":
                assert 0 < _size(co.root / f".incoming-{STEP}") < TOTAL
            assert not (co.marks / f"saved-{STEP}").exists()
            await co.resume_to_the_end()
            assert (co.marks / f"saved-{STEP}").exists()
            co.ended(None)
            assert co.recorded(STEP) == [_digest(STEP, 0)]

    run_async(body, timeout=240)


def test_a_coordinator_killed_mid_upload_whose_agent_dies_meanwhile_continues_the_trial_from_before(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with _coordinator(tmp_path, upload=True) as (co, proxy):
            await _save_until_held(co, proxy, True)
            agent = co.agent_pid()
            co.kill()
            proxy.cut()
            await _kill(agent)
            co.left([0])
            await co.resume_to_the_end()
            co.ended(0)
            assert "continues from step 0, downloaded" in co.logs(), co.logs()
            assert co.recorded(STEP) == [_digest(STEP, 1)]

    run_async(body, timeout=240)


def _digest(step: int, run: int) -> str:
    """The checkpoint digest of what run ``run`` saved at ``step`` (agent/checkpoint_files.py's rule)."""
    h = hashlib.sha256()
    for name, data in sorted(files(step, run).items()):
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return "sha256:" + h.hexdigest()
