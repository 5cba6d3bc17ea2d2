"""The decision core: one experiment's trials and environments, and every decision on them.

``Engine.handle(event, now=..., wall=...)`` takes one event and returns the instructions
that carry its consequences out (facts to store, messages to agents, environments to
start or stop, events to publish). ``now`` is a monotonic clock for timers, ``wall`` the
time of day for what is stored. Nothing here does I/O or reads a clock, so every scenario
is a unit test in virtual time (tests/unit/test_engine.py); ``shell.py`` runs it for real.

The engine is three machines and what passes between them: the trials' book (``book.py``:
trials, the waiting queue, retries), the fleet (``fleet.py``: environments, agents,
heartbeats, GPUs) and the supply (``supply.py``: how many environments of each platform to
ask for, and when to give a platform up). None reads another; each event goes to the one it
concerns, and what that one returns (an environment lost with its trials, an agent joined,
a trial ended) goes on to the others, here, in the order the consequences happen. The
scheduling pass places the book's waiting trials on the fleet's capacity (``scheduler.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from . import checkpoints as ck
from . import events as ev
from . import scheduler
from .book import CANCEL_GRACE_S, TrialBook
from .environments import hold_restored, last_failure
from .fleet import Fleet, Joined, Lost
from .model import EnvState, TrialInfo, TrialState
from .multinode import GangRoom
from .policy import Policy
from .states import TrialStatus
from .supply import Supply
from .waiting import WaitingTrials

__all__ = ["CANCEL_GRACE_S", "Engine"]

log = logging.getLogger(__name__)


class Engine:
    """The trials' book and the fleet of one experiment, driven by events."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.book = TrialBook(policy)
        self.fleet = Fleet(policy)
        self.supply = Supply(policy)
        self.gangs = GangRoom()  # multi-node trials: their pass and their ranks
        # Something a pass or reconcile may act on happened since the last tick.
        self._dirty = True
        self._pausing = False  # the experiment stops to be resumed: its trials pause
        self._out: list[ev.Instruction] = []
        self.publish_checkpoints = False  # publish a CheckpointSaved per checkpoint recorded
        self.save_hold_s = 0.0  # and hold the ack of its save until SavesHeard (this long at most)
        self.now = 0.0
        self.wall = 0.0

    # ---- what the facade and the shell read ----------------------------------------------------

    @property
    def trials(self) -> Mapping[str, TrialState]:
        return self.book.trials

    @property
    def live_trials(self) -> Mapping[str, TrialState]:  # the trials not ended (waiting, running, paused)
        return self.book.live

    @property
    def envs(self) -> Mapping[str, EnvState]:
        return self.fleet.envs

    @property
    def queue(self) -> WaitingTrials:
        return self.book.queue

    @property
    def started(self) -> bool:
        return self.supply.started

    @started.setter
    def started(self, on: bool) -> None:
        self.supply.started = on

    @property
    def stopping(self) -> bool:
        return self.fleet.stopping

    @property
    def env_error(self) -> str:
        return self.supply.env_error

    @property
    def platform_errors(self) -> Mapping[str, str]:
        return self.supply.platform_errors

    @property
    def beat_scale(self) -> float:
        return self.fleet.beat_scale

    @property
    def heartbeat_interval(self) -> float:
        return self.fleet.heartbeat_interval

    @property
    def publish_metrics(self) -> bool:
        return self.book.publish_metrics

    @publish_metrics.setter
    def publish_metrics(self, on: bool) -> None:
        self.book.publish_metrics = on

    def live_envs(self) -> list[EnvState]:
        return self.fleet.live_envs()

    def trial_info(self, trial_id: str) -> TrialInfo:
        return self.book.info(trial_id)

    def all_done(self) -> bool:
        return self.book.all_done()

    def wants_pass(self) -> bool:
        """Whether a scheduling pass could do anything now: place a trial, tell one why it
        waits, or start or replace an environment. Not after a metric, a log line or a
        heartbeat that changed no capacity."""
        return not self.fleet.stopping and (self._dirty or self.book.queue.pending(self.now))

    # ---- the one entry point -----------------------------------------------------------------

    def handle(self, event: ev.Event, *, now: float, wall: float) -> list[ev.Instruction]:
        self._at(now, wall)
        match event:
            case ev.AgentReported():
                self._reported(event)
            case ev.HeartbeatReceived():
                if self.fleet.heartbeat(event, watch_memory=self.book.queue.asks_memory()):
                    self._schedule()
            case ev.AgentRegistered():
                self._registered(event)
            case ev.AgentDisconnected():
                self.fleet.disconnected(event)
            case ev.TrialSubmitted():
                self.book.submit(event)
                self._dirty = True
                self._fail_hopeless()  # too large for every environment, or only for platforms given up on
            case ev.CancelRequested():
                self._cancel(event.trial_id, event.reason, event.status)
            case ck.PauseRequested():
                self._pause(event.trial_id, event.reason)
            case ck.ContinueRequested():
                self._dirty = self.book.resume(event.trial_id, event.parameters, event.checkpoint_from) or self._dirty
            case ck.CheckpointFetchRequested():
                self._fetch(event)
            case ck.SavesHeard():
                self.fleet.release_acks(due_only=False)
            case ck.CheckpointDigested():
                ck.digested(self.book.trials.values(), event, self._out)
            case ev.EnvironmentStarted() | ev.EnvironmentStartFailed():
                self.fleet.start_answered(event)
                self._starts_failed()
                self._reconcile()
            case ev.EnvironmentsPolled():
                self._lost(self.fleet.polled(event.observations))
            case ev.Ticked():
                self._dirty = False
                self._schedule()
                self._reconcile()
                self.fleet.release_acks(due_only=True)
                self.fleet.store_gpu_rows()
            case ev.UpdateRequested():  # each machine decides with the new limits from now on
                self.policy = self.book.policy = self.fleet.policy = self.supply.policy = event.policy
                self.book.slot_freed()  # a higher trialConcurrency may let waiting trials go
                self._schedule()
                self._reconcile()
            case ev.StopRequested():
                self._stop(event.grace_s, pause=event.pause)
            case ev.StopCompleted():
                self.fleet.stop_completed()
                self.book.stop_completed()
                if not self._pausing:  # finished: what checkpointsAfterEnd does not keep goes
                    self._take()
                    ck.after_end(self.book.trials.values(), self.policy.checkpoints_after_end, self.wall, self._out)
            case _:
                raise TypeError(f"not an event: {event!r}")
        return self._flush()

    def start(self, *, now: float, wall: float) -> list[ev.Instruction]:
        """The coordinator is up: environments are asked for."""
        self.supply.started = True
        return self.handle(ev.Ticked(), now=now, wall=wall)

    def restore(
        self,
        trial_rows: Iterable[Mapping[str, Any]],
        env_rows: Iterable[Mapping[str, Any]],
        gpu_sharing: Mapping[str, tuple[int, bool]],
        checkpoint_rows: Iterable[Mapping[str, Any]] = (),
        *, now: float, wall: float,
    ) -> list[ev.Instruction]:
        """Trials, queue and environments as the store kept them, after a crash
        (``gpu_sharing``: what the platforms set for their environments).

        Environments that were up are taken as unreachable until their agents reconnect;
        the usual timers apply from now. Trials keep their placements: a running trial
        whose agent comes back goes on, one whose agent does not is lost like any other.
        """
        self._at(now, wall)
        book, fleet = self.book, self.fleet
        book.restore(trial_rows, checkpoint_rows)
        fleet.restore(env_rows, gpu_sharing)
        for t in sorted(book.trials.values(), key=lambda t: t.seq):
            if t.status.terminal or t.env_id is None:
                continue
            book.restore_placement(t.id, hold_restored(fleet.envs, t.env_id, t.id, t.gpu_uuids, t.gpu_indices))
        self.gangs.restored(book, fleet)
        book.requeue_unplaced()
        log.info(
            "experiment %s resumed: %d trials (%d not finished), %d environments waiting for their agents",
            self.policy.experiment_id, len(book.trials), sum(1 for t in book.trials.values() if not t.status.terminal),
            len(fleet.live_envs()),
        )
        return self._flush()

    def _at(self, now: float, wall: float) -> None:
        self.now = self.book.now = self.fleet.now = now
        self.wall = self.book.wall = self.fleet.wall = wall

    def _take(self) -> None:
        """Gather what the two machines (and the gangs between them) said, in that order."""
        self._out += self.book.take() + self.fleet.take() + self.gangs.take()

    def _flush(self) -> list[ev.Instruction]:
        self._starts_failed()
        self._take()
        self._hand_changed()
        out, self._out = self._out, []
        return out

    def _hand_changed(self) -> None:
        """The environments whose capacity changed go to the waiting trials' index: the next
        pass looks at them."""
        changed = self.fleet.capacity.take_changed()
        if changed:
            self.book.queue.changed_envs |= changed
            self._dirty = True

    # ---- flows between the two machines --------------------------------------------------------

    def _registered(self, reg: ev.AgentRegistered) -> None:
        fleet, book = self.fleet, self.book
        joined = fleet.register(reg)
        self._take()
        if joined is None:
            return
        self.supply.joined(joined.platform)
        if joined.lost:
            self._lost([Lost(joined.env_id, joined.lost, "its agent restarted", joined.platform)])
        if joined.new_instance and book.queue:  # what it offers may tell that some can never run
            self._fail_hopeless()
        refusals = tuple(ck.CheckpointRefused(tid, step, why)
                         for tid in joined.held for step, why in book.trials[tid].refusals.items())
        unwanted = self.gangs.ranks.keep(joined.env_id, book.unwanted(joined.env_id, reg.active_trial_ids))
        fleet.welcome(joined, unwanted, refusals)
        self._take()
        # A StartTrial lost in a broken stream: the agent does not know the trial, send it again.
        resend = book.to_resend(joined.env_id, joined.held, reg.active_trial_ids)
        self._send_starts(joined, self.gangs.rejoined(book, fleet, joined.env_id, resend, reg.active_trial_ids))
        # A pause sent on the stream that broke, or decided while none was open, goes again.
        for tid in book.pausing_on(joined.env_id, reg.active_trial_ids):
            fleet.send(joined.env_id, ck.PauseTrial(tid, self.policy.pause_grace_s, book.trials[tid].reason))
        fleet.rescale_heartbeats()  # after the Welcome: it must be the agent's first message
        self._take()
        self._schedule()

    def _send_starts(self, joined: Joined, trial_ids: Iterable[str]) -> None:
        directory = self.fleet.section(joined.env_id).working_directory
        for tid in trial_ids:
            self.fleet.send(joined.env_id, self.book.start_message(tid, directory))

    def _reported(self, m: ev.AgentReported) -> None:
        fleet, book = self.fleet, self.book
        if not fleet.numbered(m):
            return
        self._take()
        mark = len(self._out)
        env = fleet.envs[m.env_id]
        report = m.report
        try:
            if self.gangs.reported(book, fleet, env.id, report):
                pass  # a multi-node trial's start, end, or another rank's log
            elif isinstance(report, ev.MetricsReported):
                book.metrics(env.id, report.runs)
            elif isinstance(report, ev.TrialStartReported):
                book.started(env.id, report)
            elif isinstance(report, ev.TrialEndReported):
                self._ended(env, report)
            elif isinstance(report, ev.LogReported) and not fleet.writes_own_logs(env.id):
                book.log(env.id, report)  # (else its agent writes the files we read)
            elif isinstance(report, ck.CheckpointChunkReported):
                t = book.own(env.id, report.trial_id, "a checkpoint")
                if t is not None:
                    ck.take_chunk(t, report, self.policy.max_checkpoint_bytes, self._out)
            elif isinstance(report, ck.CheckpointSavedReported):
                self._saved(env.id, report)
            elif isinstance(report, ev.AgentLeft):  # an operator stopped it: a stop, not a loss
                self._lost(fleet.left(env.id, report.drained))
            self._take()
        except Exception:
            # A message we cannot apply must not be replayed forever: skip it, loudly.
            log.exception("environment %s: could not apply message #%d; skipped", env.id, m.seq)
            # Its writes are dropped; its status changes, made in memory, are still told.
            self._take()
            self._out[mark:] = [i for i in self._out[mark:] if isinstance(i, ev.Publish)]
        fleet.stored(m)

    def _ended(self, env: EnvState, report: ev.TrialEndReported) -> None:
        ended = self.book.ended(env.id, report, platform=env.platform)
        if ended is None:
            return
        self._take()
        self.fleet.release(env.id, ended.trial_id, processes_gone=ended.processes_gone,
                           still_in_use=ended.still_in_use)
        self.book.slot_freed()
        if not ended.processes_gone:
            self.fleet.trial_done(env.id)
        self._dirty = True

    def _lost(self, lost: Iterable[Lost]) -> None:
        """Environments gone with their trials: the book retries or fails each."""
        self._take()
        for gone in lost:
            trial_ids = self.gangs.lost(self.book, self.fleet, gone)
            if trial_ids:
                self.book.slot_freed()
                self.book.lose(trial_ids, gone.reason, platform=gone.platform, heard_at=self.wall - gone.silent_s)
                self._dirty = True
        self._take()

    def _cancel(self, trial_id: str, reason: str, status: TrialStatus) -> None:
        env_id = self.book.cancel(trial_id, reason, status)
        if env_id is None:
            self._dirty = True  # a waiting trial left the queue
        else:
            self.fleet.send(env_id, ev.CancelTrial(trial_id, CANCEL_GRACE_S, reason))
            self.gangs.cancel_others(self.fleet, trial_id, reason)  # a multi-node trial's other ranks

    def _stop(self, grace_s: float, *, pause: bool) -> None:
        if self.fleet.stopping:
            return
        why = "the experiment stopped"
        self._pausing = pause
        for env_id, trial_id in self.book.stop(pause=pause):
            pausing = self.book.trials[trial_id].pausing
            stop = ck.PauseTrial(trial_id, self.policy.pause_grace_s, why) if pausing else None
            self.fleet.send(env_id, stop or ev.CancelTrial(trial_id, CANCEL_GRACE_S, why))
            self.gangs.cancel_others(self.fleet, trial_id, why, pausing=stop is not None)
        self.fleet.stop(grace_s, drain=pause)

    # ---- checkpoints ---------------------------------------------------------------------------

    def _pause(self, trial_id: str, reason: str) -> None:
        env_id = self.book.pause(trial_id, reason)
        if env_id is None:
            self._dirty = True  # a waiting trial left the queue
        else:
            self.fleet.send(env_id, ck.PauseTrial(trial_id, self.policy.pause_grace_s, reason))

    def _saved(self, env_id: str, report: ck.CheckpointSavedReported) -> None:
        """Recorded, or refused: the refusal goes out before the ack that covers the save."""
        book = self.book
        t = book.own(env_id, report.trial_id, "a checkpoint")
        why = self.gangs.not_saved(report.trial_id, env_id) or "the trial is not placed on this environment"
        if t is not None:
            held = ck.held_by(book.trials.values(), t.id)
            saved, why = ck.record(t, report, env_id, self.policy, self.wall, held, self._out)
            if saved is not None:
                if self.publish_checkpoints:  # the search judges a trial at its rung once it can pause it
                    self._out.append(ev.Publish(ev.CheckpointSaved(t.id, saved.step, saved.metric_index)))
                    if self.save_hold_s:  # a pause it decides lands at this save
                        self.fleet.hold_acks(env_id, self.now + self.save_hold_s)
                return
            t.refusals[report.step] = why
            log.warning("trial %s: checkpoint at step %d refused: %s", t.id, report.step, why)
        self.fleet.send(env_id, ck.CheckpointRefused(report.trial_id, report.step, why))
        ck.refused_files(t, report, env_id, self._out)

    def _fetch(self, f: ck.CheckpointFetchRequested) -> None:
        t = self.gangs.rank_trial(self.book, f.env_id, f.trial_id) or self.book.own(f.env_id, f.trial_id, "a fetch")
        self._take()
        answer = ck.fetch_answer(t.checkpoint if t is not None else None, f)
        self._out.append(answer if isinstance(answer, ck.SendCheckpoint) else ev.Send(f.link, answer))

    def _starts_failed(self) -> None:
        for platform in self.fleet.take_start_failures():
            self.supply.start_failed(platform)

    def _reconcile(self) -> None:
        """Ask for the environments wanted; a platform whose starts keep failing is given up,
        and the others take over (those before it too, asked again)."""
        supply, fleet = self.supply, self.fleet
        if fleet.stopping:
            return
        gave_up = False
        while True:
            plan = supply.plan(fleet.live_envs(), waiting=len(self.book.queue), queue=self.book.queue)
            for platform, size, trial_id in plan.requests():
                fleet.request(platform, size, trial_id)
            if not plan.give_up:
                break
            supply.give_up(plan.give_up, last_failure(fleet.envs.values(), plan.give_up))
            gave_up = True
        if gave_up:
            self._fail_hopeless()
        self._take()

    def _fail_hopeless(self) -> None:
        """Fail the waiting trials no environment will run: too large for every one that will exist
        (known once none is on its way, or declared), or only for platforms given up on."""
        self.book.refuse(self.book.queue.never_fit(self.fleet.never_fits))
        self.book.fail_unplaceable(self.supply.platform_errors, self.fleet.by_hand())

    # ---- the scheduling pass -------------------------------------------------------------------

    def _schedule(self) -> None:
        book, fleet = self.book, self.fleet
        self._hand_changed()
        if fleet.stopping or not book.queue.pending(self.now):
            return
        views = fleet.capacity.views()
        # Environments new to the scheduler: this pass looks at them, no other is wanted.
        book.queue.changed_envs |= fleet.capacity.take_changed()
        book.queue.release_due(self.now)
        told = self.gangs.place(book, fleet, self.policy, views, wall=self.wall)  # multi-node trials first
        decision = scheduler.place_waiting(
            book.queue, views, now=self.now, max_running=self.policy.trial_concurrency,
            running=fleet.running() - self.gangs.ranks.extra_holders(), policy=self.policy.placement,
        )
        self.gangs.reopen(views)
        for p in decision.placements:
            book.placed(p.trial_id, p.env_id, p.gpu_uuids, p.gpu_indices)
            told[p.trial_id] = f"starting on {p.env_id}"
            fleet.occupied(p.env_id, p.trial_id)
            directory = fleet.section(p.env_id).working_directory
            fleet.send(p.env_id, book.start_message(p.trial_id, directory))
            self._take()
        told.update(decision.waiting)
        book.tell_waiting(told)
        self._take()
