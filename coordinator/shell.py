"""The async shell around the decision core: it feeds the engine events (agent messages,
the monitor's ticks, the platform's answers) and carries the instructions out: store
writes, messages to agents, environment starts and stops, callbacks.

Agent messages that arrive together are applied in one store transaction and acknowledged
after it commits (group commit: store-before-ack holds for each of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from trialkeeper.agent.trialfiles import append_note

from .engine import checkpoints as ck
from .engine import events as ev
from .engine.engine import Engine
from .engine.model import MetricEvent, StatusEvent
from .exitcheck import ExitCheck
from .services.base import EnvironmentRequest, EnvironmentService
from .store.checkpointfiles import CheckpointFiles
from .store.checkpointwork import CheckpointWork
from .store.logfiles import TrialLogs
from .store.store import Store

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the scheduling pass histogram.
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# What apply() carries out inside the transaction: the store's writes, and a trial's streamed
# output, written before the commit that records its message.
_WRITES = (*ev.STORE_WRITES, ev.WriteLog, ck.WriteCheckpointChunk)
# Messages arriving within FLOOD_GAP_S of the last applied batch wait INBOX_LINGER_S for
# the ones behind them (group commit).
FLOOD_GAP_S = 0.002
INBOX_LINGER_S = 0.001


class Link(Protocol):
    """One open agent stream, as the transport gives it to the shell."""

    id: int

    def send(self, message: ev.ToAgent) -> None: ...

    async def send_paced(self, message: ev.ToAgent, *, max_queued: int, timeout: float) -> bool: ...

    def ack(self, seq: int, *, now: bool = False) -> None: ...

    def close(self) -> None: ...

    def fail(self, details: str) -> None: ...


class Shell:
    """Runs one engine: the events in, the instructions out."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        service: EnvironmentService,
        experiment_dir: Path,
        request_for: Callable[[str], EnvironmentRequest],
        *,
        gpu_sharing_for: Callable[[str], tuple[int, bool]] | None = None,
        checkpoints: CheckpointFiles | None = None,
    ) -> None:
        self.engine = engine
        self.checkpoints = checkpoints or CheckpointFiles(experiment_dir / "checkpoints", engine.policy.experiment_id)
        self.store = store
        self.service = service
        self.experiment_dir = experiment_dir
        self._request_for = request_for
        # An environment's GPU sharing, as its platform and section set it, told the engine
        # with the platform's answer to its start.
        self._gpu_sharing_for = gpu_sharing_for
        self.links: dict[int, Link] = {}
        self.metric_callbacks: list[Callable[[Any], Any]] = []  # each told a MetricEvent
        self.status_callbacks: list[Callable[[StatusEvent], Any]] = []
        self.checkpoint_callbacks: list[Callable[[Any], Any]] = []  # each told an ev.CheckpointSaved
        self.subscribers: set[asyncio.Queue[MetricEvent | StatusEvent | None]] = set()
        self.done: dict[str, asyncio.Event] = {}
        self.changed = asyncio.Event()
        # Wakes the monitor before its tick: a stream closed (poll the platform now) or the
        # experiment failed. Not every change: a tick walks every environment, and a burst of
        # trials starting would run one per loop turn.
        self._monitor_wake = asyncio.Event()
        #: Why the experiment cannot go on (a background task failed), or ''.
        self.failure = ""
        self._told: set[str] = set()  # the failures logged
        self.on_failure: Callable[[str], None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # Uploads made whole, digests, checkpoints sent to agents and removed, in the background.
        self._checkpoint_work = CheckpointWork(self.checkpoints, self.spawn, self._tell)
        self._inbox: list[tuple[Link, ev.AgentReported | ev.HeartbeatReceived]] = []
        self._saving_links: set[int] = set()  # links whose messages being handled hold a finished save
        self._inbox_pending = False
        # What joins decided, applied with the next batch (see agent_connected).
        self._joined: list[ev.Instruction] = []
        self.closed = False  # the store is closed: nothing more is applied
        self._drained_at = 0.0
        self._pass_pending = False
        # Scheduling passes run and the time they took (what /metrics shows): count, total,
        # latest, and how many took at most each of PASS_BUCKETS (cumulative).
        self.pass_stats: tuple[int, float, float, tuple[tuple[float, int], ...]] = (
            0, 0.0, 0.0, tuple((b, 0) for b in PASS_BUCKETS)
        )
        self._check_now = False
        self._logs = TrialLogs(experiment_dir)
        self._monitor: asyncio.Task[None] | None = None
        # Polls again soon after a stream's end while the platform still says its agent runs.
        self._exit_check = ExitCheck(horizon_s=0.5)

    # ---- feeding the engine ------------------------------------------------------------------

    def handle(self, event: ev.Event) -> list[ev.Instruction]:
        """Hand one event to the engine and carry out what it decides; returns the instructions."""
        instructions = self.engine.handle(event, now=time.monotonic(), wall=time.time())
        self.apply(instructions)
        return instructions

    def apply(self, instructions: Iterable[ev.Instruction]) -> None:
        """Store writes (and streamed log output) first, in one transaction; then what goes
        out: acks only after the commit.

        The engine has moved on when its instructions arrive here and cannot be taken back:
        a store that refuses them ends the experiment, and nothing of theirs is sent (an
        agent must not drop a message the store does not have).

        The joins waiting for their commit go first: everything is carried out in the order
        the engine decided it."""
        if self._joined:
            instructions, self._joined = [*self._joined, *instructions], []
        writes: list[ev.Instruction | None] = []
        rest: list[ev.Instruction] = []
        last_seq_at: dict[str, int] = {}
        for i in instructions:
            if not isinstance(i, _WRITES):
                rest.append(i)
                continue
            if type(i) is ev.AgentMessagesStored:
                # Each numbered message moves its agent's last sequence number: in one
                # transaction only the batch's last counts (one UPDATE per agent, not per message).
                j = last_seq_at.get(i.env_id)
                if j is not None:
                    writes[j] = None
                last_seq_at[i.env_id] = len(writes)
            writes.append(i)
        if writes:  # most heartbeats write nothing: no empty transaction for them
            try:
                with self.store.transaction():
                    for w in writes:
                        if w is not None:
                            self._write(w)
            except (sqlite3.Error, OSError) as e:
                self.fail(f"the store refused a write: {type(e).__name__}: {e}", exc=e)
                # What stops trials and agents still goes out (it loses nothing), so that the
                # end of the experiment does not wait for their timeouts.
                self._carry_out([i for i in rest if _stops(i)])
                return
            for w in writes:
                if type(w) is ck.CheckpointRecorded:
                    self._checkpoint_work.recorded(w.checkpoint)
        self._carry_out(rest)

    def _write(self, i: ev.Instruction) -> None:
        match i:
            case ev.StoreMetrics():
                if i.runs:
                    self.store.add_runs(i.runs)
            case ev.WriteLog():
                # Before the commit that records the message: a replay after a crash finds
                # its chunk written or writes it again, never a hole.
                self._logs.write(i.trial_id, i.stream, i.offset, i.data)
            case ck.WriteCheckpointChunk():  # the same, for a piece of a checkpoint
                self.checkpoints.write_chunk(i.trial_id, i.step, i.path, i.offset, i.data)
            case _:
                self.store.keep(i)  # a fact: the store knows its columns

    def _carry_out(self, instructions: Iterable[ev.Instruction]) -> None:
        for i in instructions:
            match i:
                case ev.Ack():
                    link = self.links.get(i.link)
                    if link is not None:  # at once where a trial's save waits on it
                        link.ack(i.seq, now=i.link in self._saving_links)
                case ev.Send():
                    link = self.links.get(i.link)
                    if link is not None:
                        message = i.message
                        if isinstance(message, ev.StartTrial) and message.resumes_metrics:
                            message = dataclasses.replace(
                                message, first_metric_index=self.store.next_metric_index(message.trial_id)
                            )
                        link.send(message)
                case ev.Publish():
                    self._publish(i.event)
                case ev.CloseLink():
                    link = self.links.get(i.link)
                    if link is not None:
                        link.close()
                case ev.StartEnvironment():
                    self.spawn(self._start_envs("", (i.env_id,)), f"start {i.env_id}")
                case ev.StartEnvironmentGroup():
                    self.spawn(self._start_envs(i.group, i.env_ids), f"start group {i.group}")
                case ev.StopEnvironment():
                    self.spawn(self.service.stop(i.env_id, i.grace_s), f"stop {i.env_id}")
                case ev.PollSoon():
                    self._check_now = True
                    self.changed.set()
                    self._monitor_wake.set()
                case ev.StoreGpuSamples():
                    try:
                        self.store.add_gpu_samples(i.rows)
                    except (sqlite3.Error, OSError) as e:
                        # Samples only: the monitor goes on, and the next tick's are stored anew.
                        log.warning("could not store %d GPU samples: %s", len(i.rows), e)
                case ev.HeartbeatsRescaled():
                    settings = self.engine.policy
                    log.info(
                        "%d agents connected: heartbeats every %.3g s, lost after %.3g s / %.3g s", i.connected,
                        i.interval_s, settings.agent_lost_timeout_s * self.engine.beat_scale,
                        settings.trial_lost_timeout_s * self.engine.beat_scale,
                    )
                case ev.RefuseAgent():
                    pass  # answered by agent_connected
                case ck.SendCheckpoint():
                    self._checkpoint_work.send(i, self.links)
                case ck.RemoveCheckpoint():
                    self._checkpoint_work.remove(i.checkpoint)
                case _:
                    raise TypeError(f"not an instruction: {i!r}")

    # ---- agent streams (called by the transport) -----------------------------------------------

    def agent_connected(self, registered: ev.AgentRegistered, link: Link) -> ev.RefuseAgent | None:
        if self.closed:
            return ev.RefuseAgent(registered.env_id, ev.Refusal.NOT_NOW, "the experiment has ended")
        if self._inbox:
            self.drain_inbox()  # what the agent's old stream said comes first
        self.links[link.id] = link
        instructions = self.engine.handle(registered, now=time.monotonic(), wall=time.time())
        refusal = next((i for i in instructions if isinstance(i, ev.RefuseAgent)), None)
        if refusal is not None:
            del self.links[link.id]
            self.apply(instructions)
            return refusal
        # Joins arriving together share a commit, as agent messages do (a storm of joins paid
        # a commit each): what the join decided is applied with the next batch, its Welcome
        # and what follows it sent after the commit that records it.
        self._joined += instructions
        self._drain_soon()
        # No pass of its own: the registration already placed what the agent can take, and
        # what else a join may change (environments to start or replace) waits for the
        # monitor's next tick. A pass walks every environment: one per join made a storm of
        # 10,000 joins quadratic.
        return refusal

    def agent_event(self, event: ev.AgentReported | ev.HeartbeatReceived, link: Link) -> None:
        """Queue a message; the queue is applied once the messages arriving now are in.

        A lone message is applied at the loop's next turn. Under a flood (the last batch was
        applied moments ago) the queue lingers for INBOX_LINGER_S so that the messages of
        every stream arriving meanwhile share one commit: one transaction per message would
        cap ingest at what SQLite commits per second."""
        if not self._inbox and not self._joined and type(event) is ev.HeartbeatReceived and not self.closed:
            # Nothing queued ahead of it, and it writes next to nothing: at once, without a
            # turn of the loop of its own (a thousand agents send one a second).
            try:
                self.apply(self.engine.handle(event, now=time.monotonic(), wall=time.time()))
            except Exception:
                log.exception("environment %s: a heartbeat could not be handled; ending its stream", event.env_id)
                link.fail("the coordinator could not handle a message; see its log")
            return
        self._inbox.append((link, event))
        self._drain_soon()

    def _drain_soon(self) -> None:
        if not self._inbox_pending:
            self._inbox_pending = True
            loop = asyncio.get_running_loop()
            if loop.time() - self._drained_at < FLOOD_GAP_S:
                loop.call_later(INBOX_LINGER_S, self.drain_inbox)
            else:
                loop.call_soon(self.drain_inbox)

    def agent_disconnected(self, env_id: str, link: Link) -> None:
        self.links.pop(link.id, None)
        if self.closed:
            return  # a stream that ends after the experiment did: the store is closed
        self.drain_inbox()
        self.handle(ev.AgentDisconnected(env_id, link.id))
        self._exit_check.stream_ended(env_id, time.monotonic())

    def drain_inbox(self) -> None:
        self._inbox_pending = False
        if self.closed or not (self._inbox or self._joined):
            return
        self._drained_at = asyncio.get_running_loop().time()
        if not self._inbox:
            self.apply(())  # joins only
            return
        inbox, self._inbox = self._inbox, []
        now, wall = time.monotonic(), time.time()
        out: list[ev.Instruction] = []
        reported = False
        for link, event in inbox:
            reported = reported or isinstance(event, ev.AgentReported)
            try:
                if type(event) is ev.AgentReported and type(event.report) is ck.CheckpointSavedReported:
                    # Its pieces, decided in this batch, are written first: then its files are looked at.
                    self.apply(out)
                    out = []
                    event = self._checkpoint_work.finished(event, event.report)
                    self._saving_links.add(link.id)
                out += self.engine.handle(event, now=now, wall=wall)
            except Exception:
                # A bug, or input the core did not foresee: this stream ends, the others go on.
                log.exception("environment %s: a message could not be handled; ending its stream", event.env_id)
                link.fail("the coordinator could not handle a message; see its log")
        self.apply(out)
        self._saving_links.clear()
        # Only when the messages changed something a pass acts on (a trial ended, an agent
        # left): a metric or a log line does not. A heartbeat that frees GPUs places trials itself.
        if reported and self.engine.wants_pass():
            self.pass_soon()

    async def sweep_orphans(self) -> None:
        """After a crash: remove what the platform runs for this experiment that the store does not count on."""
        experiment_id = self.engine.policy.experiment_id
        keep = {e.id for e in self.engine.live_envs()}
        try:
            removed = await self.service.sweep(experiment_id, keep=keep)
        except Exception:  # a service must return errors, but resume goes on without the sweep
            log.exception("environment service %s raised on sweep", self.service.platform)
            return
        if removed:
            log.info("experiment %s: removed %d orphaned environment(s): %s", experiment_id, len(removed),
                     ", ".join(removed))

    # ---- checkpoints -----------------------------------------------------------------------------

    def checkpoint_fetch(self, request: ck.CheckpointFetchRequested, link: Link) -> None:
        """An agent asks for the checkpoint of a trial it is to start (not numbered)."""
        if not self.closed:
            self.drain_inbox()
            self.handle(request)

    def _tell(self, event: ev.Event) -> None:
        """What the background work learnt, handed to the engine while the shell is open."""
        if not self.closed:
            self.handle(event)

    def digest_missing(self) -> None:
        """After a crash: the uploaded checkpoints whose digest was not taken yet."""
        self._checkpoint_work.digest_missing(c for t in self.engine.trials.values() for c in t.checkpoints)

    def agent_note(self, env_id: str, trial_id: str, text: str) -> None:
        """A line from the coordinator in the trial's stderr log (the trial must be placed on
        ``env_id``: an agent has a say only about its own trials)."""
        t = self.engine.trials.get(trial_id)
        if t is not None and t.env_id == env_id:
            append_note(self.experiment_dir / "trials" / trial_id / "stderr.log", text)

    # ---- passes, the monitor, background work --------------------------------------------------

    def pass_soon(self) -> None:
        """Place waiting trials and top up environments as soon as the current burst of work
        yields: a burst of submits or agent messages costs one scheduling pass, not one each."""
        if not self._pass_pending:
            self._pass_pending = True
            asyncio.get_running_loop().call_soon(self._scheduling_pass)

    def _scheduling_pass(self) -> None:
        self._pass_pending = False
        if self.closed:
            return
        began = time.perf_counter()
        try:
            self.handle(ev.Ticked())
        except Exception as e:  # noqa: BLE001 - reported by fail()
            self.fail(f"a scheduling pass failed: {type(e).__name__}: {e}", exc=e)
        took = time.perf_counter() - began
        count, total, _, under = self.pass_stats
        self.pass_stats = (count + 1, total + took, took, tuple((b, n + (took <= b)) for b, n in under))

    def start_monitor(self, interval: float) -> None:
        self._exit_check.horizon_s = interval
        self._monitor = self.spawn(self._monitor_loop(interval), "the monitor")

    async def stop_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            # One that died was reported when it did (see spawn).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._monitor

    async def _monitor_loop(self, base_interval: float) -> None:
        checked_at = 0.0
        while True:
            # A fleet told to heartbeat less often is looked over less often too: each tick
            # walks every environment, and the lost timeouts it checks stretch alike.
            interval = base_interval * self.engine.beat_scale
            # Not asyncio.wait_for: before Python 3.12 it swallows a cancel that arrives as the
            # event is set (stop() does both), and stop() would wait on this loop forever.
            woken = asyncio.ensure_future(self._monitor_wake.wait())
            recheck = self._exit_check.due_in(time.monotonic())
            timeout = interval if recheck is None else min(interval, recheck)
            try:
                await asyncio.wait({woken}, timeout=timeout)
            finally:
                woken.cancel()
            self._monitor_wake.clear()
            # A poll asks the platform about every environment: once per tick, or at once when
            # an agent's stream closed, not on every change.
            recheck = self._exit_check.due_in(time.monotonic())
            if self._check_now or recheck == 0.0 or time.monotonic() - checked_at >= interval:
                self._check_now = False
                checked_at = time.monotonic()
                await self._poll()
            self.drain_inbox()
            self.handle(ev.Ticked())

    async def _poll(self) -> None:
        live = self.engine.live_envs()
        if not live:
            self._exit_check.polled({}, time.monotonic(), self._connected)
            return
        try:
            seen = await self.service.poll([e.id for e in live])
        except Exception:  # a service must return errors as data; the timers still run
            log.exception("environment service %s raised on poll; will try again", self.service.platform)
            seen = {}
        self._exit_check.polled(seen, time.monotonic(), self._connected)
        self.drain_inbox()
        self.handle(ev.EnvironmentsPolled(seen))

    def _connected(self, env_id: str) -> bool:
        env = self.engine.envs.get(env_id)
        return env is not None and env.link is not None

    async def _start_envs(self, group: str, env_ids: tuple[str, ...]) -> None:
        """Start one environment (no ``group``), or a group of them as one; each answered."""
        try:
            asks = [self._request_for(env_id) for env_id in env_ids]
            results = await self.service.start_group(group, asks) if group else [await self.service.start(asks[0])]
            answers: list[ev.Event] = [
                ev.EnvironmentStartFailed(env_id, result.error) if result.error else ev.EnvironmentStarted(
                    env_id, result.platform_id,
                    gpu_sharing=self._gpu_sharing_for(env_id) if self._gpu_sharing_for else None)
                for env_id, result in zip(env_ids, results, strict=True)
            ]
        except Exception as e:  # a service must return errors, but one bug must not kill the loop
            log.exception("environment service %s raised on start", self.service.platform)
            answers = [ev.EnvironmentStartFailed(env_id, f"{type(e).__name__}: {e}") for env_id in env_ids]
        for answer in answers:
            self.handle(answer)

    def spawn(self, coro: Any, what: str) -> asyncio.Task[Any]:
        """Run ``coro`` in the background. If it raises, that is logged at once and the
        experiment ends with the reason: a background task that dies must not hang it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                return
            e = t.exception()
            if e is not None:
                self.fail(f"{what} failed: {type(e).__name__}: {e}", exc=e)

        task.add_done_callback(done)
        return task

    def fail(self, reason: str, *, exc: BaseException | None = None) -> None:
        """The experiment cannot go on: say why now, and let its owner end it."""
        # Each reason once (a full disk fails every write after the first), and a store's or
        # the disk's without a traceback: its message says it all.
        if reason in self._told:
            return
        self._told.add(reason)
        exc_info = None if isinstance(exc, (sqlite3.Error, OSError)) else exc
        if self.failure:
            log.error("also: %s", reason, exc_info=exc_info)
            return
        self.failure = reason
        log.error("the experiment cannot go on: %s", reason, exc_info=exc_info)
        for event in self.done.values():
            event.set()
        self.changed.set()
        self._monitor_wake.set()
        if self.on_failure is not None:
            self.on_failure(reason)

    async def close(self) -> None:
        """Cancel what runs in the background; apply nothing from now on."""
        await self._checkpoint_work.digests_taken()  # and stored
        self.closed = True
        self._inbox.clear()
        self._joined.clear()
        await self._checkpoint_work.removals_done()
        for task in list(self._tasks):
            task.cancel()
        for q in self.subscribers:  # ``Coordinator.events()`` ends: nothing more will come
            q.put_nowait(None)

    # ---- publishing ----------------------------------------------------------------------------

    def _publish(self, note: StatusEvent | MetricEvent | ev.CheckpointSaved) -> None:
        if isinstance(note, StatusEvent):
            callbacks: list[Callable[[Any], Any]] = self.status_callbacks  # type: ignore[assignment]
            if note.trial.status.terminal:
                waiting = self.done.pop(note.trial.id, None)  # only trials someone waits on
                if waiting is not None:
                    waiting.set()
            self.changed.set()
        else:  # a stored metric, or a saved checkpoint (heard by its own callbacks only)
            callbacks = self.metric_callbacks if isinstance(note, MetricEvent) else self.checkpoint_callbacks
        for cb in callbacks:
            try:
                result = cb(note)
                if asyncio.iscoroutine(result):
                    self.spawn(_logged(result, type(note).__name__), "a callback")
            except Exception:
                log.exception("a %s callback raised; ignored", type(note).__name__)
        for q in self.subscribers if not isinstance(note, ev.CheckpointSaved) else ():
            q.put_nowait(note)

    async def until(self, predicate: Callable[[], bool], *, or_failure: bool = True) -> None:
        """Wait until ``predicate()`` holds (or, with ``or_failure``, the experiment failed)."""
        while not predicate() and not (or_failure and self.failure):
            self.changed.clear()
            await self.changed.wait()


def _stops(i: ev.Instruction) -> bool:
    """Whether an instruction only stops something: safe to carry out unrecorded."""
    if isinstance(i, ev.Send):
        return isinstance(i.message, (ev.CancelTrial, ev.Shutdown))
    return isinstance(i, (ev.CloseLink, ev.StopEnvironment))


async def _logged(coro: Any, kind: str) -> None:
    """An async callback that raises is logged and ignored, like a plain one."""
    try:
        await coro
    except Exception:
        log.exception("a %s callback raised; ignored", kind)
