"""The agent's session with its coordinator: register, stream, replay, reconnect.

Messages that matter get a sequence number and stay in ``_unacked`` until the coordinator
acknowledges them; after a reconnect they are sent again, and the coordinator drops the
ones it already stored. Metrics are batched: whatever the trials reported while the last
message was being written goes out as one MetricBatch. The messages themselves are made
in :mod:`.messages`. Checkpoints travel as numbered
chunks and CheckpointSaved, answered by the Ack that covers them (:mod:`.checkpoint_link`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from trialkeeper.protos import limits
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc
from trialkeeper.protos.wire import TOKEN_METADATA_KEY

from . import bulk, messages, rendezvous
from .beats import GpuReport
from .checkpoint_files import FileEntry
from .checkpoint_link import CheckpointWire, with_file_data
from .checkpoints import SavedCheckpoint
from .dial import AgentRefused, open_channel, pin_certificate, refuse_if_tls, refused
from .gpu import GpuProbe
from .metric_socket import socket_name
from .runner import RunnerEvents, TrialResult, TrialRunner

log = logging.getLogger(__name__)

MAX_METRICS_PER_BATCH = 5000  # within limits.MAX_METRICS_PER_BATCH (a test checks)
# Metric values may be up to 64 KiB each: batches are cut by size too, far below the
# 16 MiB message limit, or one batch of large values would be refused and replayed forever.
MAX_BATCH_BYTES = 4 * 1024 * 1024
# How long metrics may wait for others to share their message while trials report in a
# tight loop (again within this long of the last metrics message): far below what a user
# watching a live table notices, and each message saved is a gRPC write, an ack and a
# store transaction. A metric after a quiet spell goes at once.
METRIC_LINGER_S = 0.02
_STREAMS = {"stdout": pb.LOG_STREAM_STDOUT, "stderr": pb.LOG_STREAM_STDERR}
_KINDS = {"intermediate": pb.METRIC_KIND_INTERMEDIATE, "final": pb.METRIC_KIND_FINAL}
# Status codes that mean "this agent is not wanted", not "try again".
_REFUSALS = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


@dataclass
class AgentOptions:
    coordinator: str
    environment_id: str
    token: str
    workdir: Path
    platform: str = "local"
    reconnect_window_s: float = 60.0
    # Run each trial in a copy of its working directory (for code uploaded once per machine).
    copy_working_directory: bool = False
    connect_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    probe: GpuProbe = field(default_factory=GpuProbe)
    # PEM bytes of the coordinator certificate to trust; None = plain text.
    tls_root_cert: bytes | None = None
    tls_server_name: str | None = None
    # SHA-256 of the coordinator's certificate: fetched, checked and trusted on first connect.
    tls_fingerprint: str | None = None
    # False where the coordinator reads the trials' log files in place (--logs-shared).
    stream_logs: bool = True
    # Modules the warm trial template imports (trialPreload); empty: every trial starts cold.
    preload: tuple[str, ...] = ()


def metrics_may_wait(now: float, last_batch_at: float, pending: int, other_waiting: bool) -> bool:
    """Whether the ``pending`` metrics may wait up to METRIC_LINGER_S for more to share their
    message: only when nothing else waits to be sent, their batch is not full, and the last
    batch was made less than METRIC_LINGER_S ago (trials are reporting in a tight loop). A
    metric after a quiet spell goes at once, so a trial reporting once an epoch sees no
    added latency."""
    return not other_waiting and 0 < pending < MAX_METRICS_PER_BATCH and now - last_batch_at < METRIC_LINGER_S


class AgentSession(RunnerEvents):
    """One agent process's connection to its coordinator, across reconnects."""

    def __init__(self, options: AgentOptions) -> None:
        self.o = options
        self.instance_id = uuid.uuid4().hex
        self._seq = 0
        self._unacked: deque[pb.AgentMessage] = deque()
        self._pending_runs: list[pb.MetricRun] = []
        self._pending_count = 0  # results in _pending_runs
        self._pending_bytes = 0
        self._wakeup = asyncio.Event()
        self._drain_told = asyncio.Event()  # a heartbeat saying it drains went out
        # Cuts a linger short: something other than metrics to send, or a full batch.
        self._urgent = asyncio.Event()
        self._metrics_flushed_at = -METRIC_LINGER_S  # time.monotonic() of the last MetricBatch made
        self._sent = 0  # how many of _unacked went out on the current stream
        self._heartbeat_s = options.heartbeat_interval_s
        self._heartbeat_due: pb.Heartbeat | None = None
        self._gpu_report = GpuReport()
        self._stop_requested = False
        self._draining = False
        self._left = False  # Leaving is on its way: the last numbered message
        self._acked_all = asyncio.Event()
        self._acked_all.set()
        self._ended_trials: set[tuple[str, int]] = set()  # (trial id, attempt)
        # LogChunks and CheckpointChunks wait in _unacked without their bytes: seq -> (file,
        # length) to read them from when they are sent, and again after a reconnect.
        self._file_ranges: dict[int, tuple[Path, int]] = {}
        self._checkpoints = CheckpointWire(self._enqueue, self._file_ranges, self._wakeup.set)
        self._bulk_port = 0  # the coordinator's port for uploads' bytes (Welcome), 0: by the stream
        self.runner = TrialRunner(
            options.workdir,
            self,
            socket_name=socket_name(options.workdir, options.environment_id),
            copy_working_directory=options.copy_working_directory,
            stream_logs=options.stream_logs,
            preload=options.preload,
            node_address=rendezvous.node_address(options.coordinator),
        )
        self._inventory = options.probe.inventory()
        self._mig_uuids = frozenset(g.uuid for g in self._inventory.gpus if g.mig)
        self._shutdown: asyncio.Future[pb.Shutdown] | None = None

    # ---- RunnerEvents: what the trials did ---------------------------------------------

    def trial_started(self, trial_id: str, pid: int, started_at: float, address: str = "", port: int = 0) -> None:
        self._enqueue(pb.AgentMessage(trial_started=pb.TrialStarted(
            trial_id=trial_id, pid=pid, started_at=started_at, rendezvous_address=address, rendezvous_port=port,
        )))

    def metrics(
        self, trial_id: str, kind: str, first_index: int, values: list[float], value_jsons: list[str] | None
    ) -> None:
        # Results that follow the last run's (same trial, same kind, next index) extend it:
        # a flood of them becomes a few long runs, copied a column at a time.
        now = time.time()
        while values:
            room = MAX_METRICS_PER_BATCH - self._pending_count
            if room <= 0 or self._pending_bytes >= MAX_BATCH_BYTES:
                self._flush_metrics()
                continue
            part, values = values[:room], values[room:]
            jsons, value_jsons = (value_jsons[:room], value_jsons[room:]) if value_jsons is not None else (None, None)
            run = self._pending_runs[-1] if self._pending_runs else None
            if (run is None or run.trial_id != trial_id or run.kind != _KINDS[kind]
                    or run.first_index + len(run.values) != first_index):
                run = pb.MetricRun(trial_id=trial_id, kind=_KINDS[kind], first_index=first_index)
                self._pending_runs.append(run)
                self._pending_bytes += len(trial_id) + 16
            if jsons is not None or run.value_json:
                # One JSON per value from here on: "" where it is the number's repr.
                if not run.value_json:
                    run.value_json.extend([""] * len(run.values))
                run.value_json.extend(jsons if jsons is not None else [""] * len(part))
                self._pending_bytes += sum(map(len, jsons)) if jsons is not None else 0
            run.values.extend(part)
            run.reported_at.extend([now] * len(part))
            self._pending_count += len(part)
            self._pending_bytes += 20 * len(part)
            first_index += len(part)
        if self._pending_count >= MAX_METRICS_PER_BATCH or self._pending_bytes >= MAX_BATCH_BYTES:
            self._flush_metrics()
        if kind == "final" or self._sent < len(self._unacked):
            # A full batch waits for nothing, nor does a final result: the trial's last,
            # which the tuner waits on.
            self._urgent.set()
        self._wakeup.set()

    def log(self, trial_id: str, stream: str, path: Path, offset: int, length: int) -> None:
        msg = pb.AgentMessage(log=pb.LogChunk(trial_id=trial_id, stream=_STREAMS[stream], offset=offset))
        self._enqueue(msg)
        self._file_ranges[msg.seq] = (path, length)

    def trial_ended(self, result: TrialResult) -> None:
        self._ended_trials.add((result.trial_id, result.attempt))
        self._enqueue(messages.trial_ended(result, self._gpus_in_use_by(result.trial_id)))

    def checkpoint_upload(self, trial_id: str, step: int, directory: Path, files: Sequence[FileEntry]) -> None:
        self._checkpoints.upload(trial_id, step, directory, files)

    def checkpoint_saved(self, saved: SavedCheckpoint) -> asyncio.Future[str | None]:
        return self._checkpoints.saved(saved)

    async def checkpoint_send_direct(
        self, trial_id: str, step: int, directory: Path, files: Sequence[FileEntry]
    ) -> set[str]:
        port = self._bulk_port
        if not port or not files:
            return set()
        address = (self.o.coordinator.rsplit(":", 1)[0].strip("[]"), port)
        token, env_id = self.o.token, self.o.environment_id
        sent, why = await asyncio.to_thread(bulk.send_files, address, token, env_id, trial_id, step, directory, files)
        if why:  # the stream takes the rest, and the next saves, until the next Welcome
            log.info("checkpoint %d of trial %s: the rest goes by the stream: %s", step, trial_id, why)
            self._bulk_port = 0
        return sent

    def fetch_checkpoint(self, trial_id: str, step: int, path: str, offset: int) -> None:
        self._checkpoints.fetch(trial_id, step, path, offset)

    def _gpus_in_use_by(self, trial_id: str) -> list[str]:
        if not self.o.probe.inventory().gpus:
            return []
        samples = self.o.probe.sample()
        owners = self.runner.attribute(p.pid for s in samples for p in s.processes)
        return [s.uuid for s in samples if any(owners.get(p.pid) == trial_id for p in s.processes)]

    # ---- outbound queue --------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _flush_metrics(self) -> None:
        if self._pending_runs:
            runs, self._pending_runs = self._pending_runs, []
            self._pending_bytes = self._pending_count = 0
            self._unacked.append(pb.AgentMessage(seq=self._next_seq(), metrics=pb.MetricBatch(runs=runs)))
            self._acked_all.clear()
            self._metrics_flushed_at = time.monotonic()

    def _enqueue(self, msg: pb.AgentMessage) -> None:
        # Metrics reported before this message must reach the coordinator before it.
        self._flush_metrics()
        msg.seq = self._next_seq()
        self._unacked.append(msg)
        self._acked_all.clear()
        self._wakeup.set()
        self._urgent.set()

    def _on_ack(self, seq: int) -> None:
        while self._unacked and self._unacked[0].seq <= seq:
            self._file_ranges.pop(self._unacked.popleft().seq, None)
            self._sent = max(0, self._sent - 1)
        self._checkpoints.acked(seq)
        if not self._unacked and not self._pending_runs:
            self._acked_all.set()

    # ---- the session -----------------------------------------------------------------

    def request_stop(self, drain: bool) -> None:
        """First signal drains (running trials finish), a second one stops them: they end
        lost with their environment, as on any platform that takes one away, and the
        coordinator continues them elsewhere (from their checkpoints) rather than failing them."""
        self.runner.host_stopping.set()
        if drain and not self._draining:
            log.info("draining: running trials finish, no new ones are taken")
            self._draining = True
            self._wakeup.set()
            asyncio.get_running_loop().create_task(self._exit_when_idle())
        else:
            log.info("stopping: ending running trials")
            self._stop_requested = True
            task = self._cancel_and_exit(5.0, "its agent was stopped by a second signal", "lost")
            asyncio.get_running_loop().create_task(task)

    async def run(self) -> int:
        """Serve until told to shut down. Returns the process exit status."""
        await self.runner.open()
        self._shutdown = asyncio.get_running_loop().create_future()
        try:
            return await self._serve()
        finally:
            await self.runner.close(grace_s=5.0)
            self._checkpoints.close()
            self.o.probe.close()

    async def _serve(self) -> int:
        last_connected = time.monotonic()
        attempt = 0
        while True:
            try:
                await self._connect_once()
                # A stream that ran normally and ended means: shut down.
                return 0
            except AgentRefused as e:
                if e.left and self._left:  # Leaving's ack was lost with the connection; the rest is done
                    log.info("environment %s ended as this agent left it (its ack was lost): exiting",
                             self.o.environment_id)
                    return 0
                log.error("coordinator refused this agent: %s", e)
                return 2
            except _Connected:
                last_connected = time.monotonic()
                attempt = 0
            except (grpc.RpcError, ConnectionError, asyncio.TimeoutError) as e:
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e) or type(e).__name__
                log.warning("connection to coordinator %s lost: %s", self.o.coordinator, detail)
            if self._shutdown is not None and self._shutdown.done():
                return 0
            waited = time.monotonic() - last_connected
            if waited > self.o.reconnect_window_s:
                log.error(
                    "coordinator %s unreachable for %.0f s (reconnect window %.0f s): stopping trials and exiting",
                    self.o.coordinator, waited, self.o.reconnect_window_s,
                )
                await self.runner.cancel_all("coordinator unreachable", 5.0)
                return 3
            attempt += 1
            # Jittered exponential backoff, capped so a returning coordinator is found fast.
            delay = min(5.0, 0.05 * 2 ** min(attempt, 7)) * random.uniform(0.5, 1.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._shutdown), delay) if self._shutdown else None
            if self._shutdown is not None and self._shutdown.done():
                return 0

    def _register(self) -> pb.AgentMessage:
        return messages.register(
            self._inventory, environment_id=self.o.environment_id, instance_id=self.instance_id,
            active_trial_ids=sorted(set(self.runner.running_ids) | self._unacked_ended()), last_seq=self._seq,
            platform=self.o.platform,
        )

    def _unacked_ended(self) -> set[str]:
        return {m.trial_ended.trial_id for m in self._unacked if m.HasField("trial_ended")}

    async def _connect_once(self) -> None:
        if self.o.tls_fingerprint and self.o.tls_root_cert is None:
            self.o.tls_root_cert = await pin_certificate(
                self.o.coordinator, self.o.tls_fingerprint, self.o.connect_timeout_s
            )
        async with open_channel(self.o.coordinator, self.o.tls_root_cert, self.o.tls_server_name) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            call = stub.Session(metadata=((TOKEN_METADATA_KEY, self.o.token),))
            try:
                await asyncio.wait_for(call.write(self._register()), self.o.connect_timeout_s)
                first = await asyncio.wait_for(call.read(), self.o.connect_timeout_s)
            except grpc.aio.AioRpcError as e:
                # A stream the coordinator ended with an error status raises on read/write
                # rather than reading EOF: a refusal is final, anything else is retried.
                if e.code() in _REFUSALS:
                    raise refused(e.code(), e.details(), e.trailing_metadata()) from e
                if e.code() is grpc.StatusCode.UNAVAILABLE:
                    await refuse_if_tls(self.o.coordinator, self.o.tls_root_cert, self.o.connect_timeout_s)
                raise
            if first is grpc.aio.EOF:
                await self._raise_refusal(call)
            if not first.HasField("welcome"):
                raise AgentRefused(f"coordinator answered {first.WhichOneof('body')} instead of welcome")
            self._on_welcome(first.welcome)
            log.info("registered with coordinator %s as environment %s", self.o.coordinator, self.o.environment_id)
            assert self._shutdown is not None
            writer = asyncio.create_task(self._write_loop(call))
            heartbeat = asyncio.create_task(self._heartbeat_loop())
            reader = asyncio.create_task(self._read_loop(call))
            try:
                done, _ = await asyncio.wait(
                    {reader, writer, heartbeat, self._shutdown}, return_when=asyncio.FIRST_COMPLETED
                )
                for task in (reader, writer, heartbeat):
                    if task in done:
                        task.result()  # a broken stream raises here
            except grpc.aio.AioRpcError as e:
                if e.code() in _REFUSALS:
                    raise AgentRefused(e.details()) from e
                raise _Connected() from e
            except (asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                # A write on a stream that the other side has just ended.
                raise _Connected() from e
            finally:
                for task in (writer, heartbeat, reader):
                    task.cancel()
                    # Whatever a task died of, the stream is gone; the error that matters
                    # (if any) was raised above. A writer racing the end of the stream
                    # fails with InvalidStateError ("RPC already finished").
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if self._shutdown.done():
                with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                    await asyncio.wait_for(call.done_writing(), 2.0)
                return
            # The coordinator closed the stream without telling us to stop: reconnect.
            raise _Connected()

    async def _raise_refusal(self, call: grpc.aio.StreamStreamCall) -> None:
        code = await call.code()
        details = await call.details()
        if code in _REFUSALS:
            raise refused(code, details, await call.trailing_metadata())
        if code is grpc.StatusCode.UNAVAILABLE:
            await refuse_if_tls(self.o.coordinator, self.o.tls_root_cert, self.o.connect_timeout_s)
        raise ConnectionError(f"stream closed before welcome: {code.name}: {details}")

    def _on_welcome(self, welcome: pb.Welcome) -> None:
        if welcome.heartbeat_interval_s > 0:
            self._heartbeat_s = welcome.heartbeat_interval_s
        self._gpu_report.new_stream(welcome.gpu_sample_interval_s)
        # Not over TLS: the coordinator offers the port only when it does not serve TLS.
        self._bulk_port = welcome.checkpoint_data_port if self.o.tls_root_cert is None else 0
        for r in welcome.checkpoint_refusals:  # before the ack that covers those saves
            self._checkpoints.refused(r.trial_id, r.step, r.reason)
        self._on_ack(welcome.acked_seq)
        self._sent = 0
        for trial_id in welcome.cancel_trial_ids:
            self.runner.cancel(trial_id, 5.0, "the coordinator no longer wants this trial")
        keeper = self.runner.checkpoints
        keeper.configure(experiment_id=welcome.experiment_id, checkpoint_dir=welcome.checkpoint_dir,
                         checkpoint_storage=welcome.checkpoint_storage, max_bytes=welcome.max_checkpoint_bytes)
        self._checkpoints.new_stream()
        keeper.on_reconnect()  # downloads under way go on where they stopped
        self._wakeup.set()

    async def _write_loop(self, call: grpc.aio.StreamStreamCall) -> None:
        # The only task that writes on the stream: gRPC allows one write at a time.
        while True:
            await self._wakeup.wait()
            if metrics_may_wait(
                time.monotonic(),
                self._metrics_flushed_at,
                self._pending_count,
                other_waiting=self._sent < len(self._unacked) or self._heartbeat_due is not None,
            ):
                # Only metrics to send, and more were sent moments ago: let the flood gather
                # into one message (one gRPC write, one ack, one store transaction) rather
                # than send each on its own; anything else to send cuts the wait short.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), METRIC_LINGER_S)
            self._wakeup.clear()
            self._urgent.clear()  # all that waits goes now
            await self._write_heartbeat(call)
            for once in self._checkpoints.take_once():
                await call.write(once)
            self._flush_metrics()
            while self._sent < len(self._unacked):
                msg = self._unacked[self._sent]
                self._sent += 1
                # Metrics reported meanwhile come round again, to go at once or gather more.
                await call.write(with_file_data(msg, self._file_ranges))
                await self._write_heartbeat(call)  # a long upload must not look like silence

    async def _write_heartbeat(self, call: grpc.aio.StreamStreamCall) -> None:
        if self._heartbeat_due is not None:
            hb, self._heartbeat_due = self._heartbeat_due, None
            if hb.draining:
                self._drain_told.set()
            # Decided here, by the stream's one writer: a new stream's first carries the GPUs.
            await call.write(pb.AgentMessage(heartbeat=self._gpu_report.outgoing(hb, time.monotonic())))

    async def _heartbeat_loop(self) -> None:
        while True:
            self._heartbeat_due = await asyncio.to_thread(self._heartbeat)
            self._wakeup.set()
            await asyncio.sleep(self._heartbeat_s)

    def _heartbeat(self) -> pb.Heartbeat:
        gpu_samples = self.o.probe.sample()[: limits.MAX_GPUS]  # as many as Register gives
        owners = self.runner.attribute(p.pid for s in gpu_samples for p in s.processes)
        return messages.heartbeat(gpu_samples, owners, self._draining)

    async def _read_loop(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            kind = msg.WhichOneof("body")
            if kind == "ack":
                self._on_ack(msg.ack.seq)
            elif kind == "start_trial":
                self._on_start(msg.start_trial)
            elif kind == "cancel_trial":
                c = msg.cancel_trial
                self.runner.cancel(c.trial_id, c.grace_s, c.reason or "canceled by the coordinator")
            elif kind == "settings":
                if msg.settings.heartbeat_interval_s > 0:
                    log.info("heartbeat interval now %.3g s", msg.settings.heartbeat_interval_s)
                    self._heartbeat_s = msg.settings.heartbeat_interval_s
                if msg.settings.gpu_sample_interval_s > 0:
                    self._gpu_report.interval_s = msg.settings.gpu_sample_interval_s
            elif kind == "pause_trial":
                p = msg.pause_trial
                self.runner.pause(p.trial_id, p.grace_s, p.reason or "paused by the coordinator")
            elif kind == "checkpoint_chunk":
                c = msg.checkpoint_chunk
                self.runner.checkpoints.on_chunk(c.trial_id, c.step, c.path, c.offset, c.data, c.last)
            elif kind == "checkpoint_refused":
                r = msg.checkpoint_refused
                self._checkpoints.refused(r.trial_id, r.step, r.reason)
                self.runner.checkpoints.on_refused(r.trial_id, r.step, r.reason)
            elif kind == "shutdown":
                # Handled aside: acks must still be read while the trials wind down.
                asyncio.get_running_loop().create_task(self._on_shutdown(msg.shutdown))
            else:
                log.warning("ignoring unknown coordinator message %r", kind)

    def _on_start(self, st: pb.StartTrial) -> None:
        if self.runner.knows(st.trial_id) or (st.trial_id, st.attempt) in self._ended_trials:
            return  # a resend after a reconnect: the trial (this attempt of it) is already ours
        self.runner.start(messages.trial_spec(st, self._mig_uuids))

    async def _on_shutdown(self, sd: pb.Shutdown) -> None:
        log.info("coordinator asked to %s: %s", "drain" if sd.drain else "shut down", sd.reason)
        if sd.drain:
            self._draining = True
            await self.runner.wait_idle(None)
        else:
            await self.runner.cancel_all(sd.reason or "environment shut down", sd.grace_s or 5.0)
        # Give the coordinator what the trials' ends produced before going away.
        self._wakeup.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._acked_all.wait(), 10.0)
        if self._shutdown is not None and not self._shutdown.done():
            self._shutdown.set_result(sd)

    async def _exit_when_idle(self) -> None:
        # A trial the coordinator placed before it heard of the drain (its next heartbeat says
        # so) still arrives: it runs to its end too, rather than being canceled on the way out.
        while True:
            await self.runner.wait_idle(None)
            self._wakeup.set()  # the trials' ends
            with contextlib.suppress(asyncio.TimeoutError):  # the heartbeat that says it drains
                await asyncio.wait_for(self._drain_told.wait(), 3 * self._heartbeat_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._acked_all.wait(), 5.0)
            if self.runner.idle.is_set():
                break
        await self._finish_and_exit(drained=True)

    async def _cancel_and_exit(self, grace_s: float, reason: str, outcome: str) -> None:
        await self.runner.cancel_all(reason, grace_s, outcome)
        await self._finish_and_exit(drained=False)

    async def _finish_and_exit(self, *, drained: bool) -> None:
        # The last numbered message, after the trials' ends: the coordinator stops an
        # environment it did not start on it, rather than wait for it to go silent.
        self._left = True
        self._enqueue(pb.AgentMessage(leaving=pb.Leaving(drained=drained)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._acked_all.wait(), 5.0)
        if self._shutdown is not None and not self._shutdown.done():
            self._shutdown.set_result(pb.Shutdown(reason="agent stopped"))


class _Connected(Exception):
    """The stream had been established and then broke: reset the reconnect window."""
