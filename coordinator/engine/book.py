"""The trials' book: every trial's lifecycle, the queue of those waiting, retries.

One of the engine's two machines (the other is the fleet of environments, ``fleet.py``).
It knows trials and the environments they are placed on by id only; what an environment
can take, and which agent link reaches it, is the fleet's. The engine (``engine.py``) hands
each its part of an event and passes what one returns on to the other. Every method here
appends its instructions to the book's own list, which the engine takes after each call.
Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import checkpoints as ck
from . import events as ev
from . import results, starts, trialrows
from .model import MetricEvent, StatusEvent, TrialInfo, TrialState
from .policy import Policy
from .rows import MetricRun
from .states import TrialStatus, check_trial
from .waiting import Demand, WaitingTrials

log = logging.getLogger(__name__)

# Retries of a trial wait 1, 2, 4, ... seconds, at most RETRY_BACKOFF_MAX_S.
RETRY_BACKOFF_S = 1.0
RETRY_BACKOFF_MAX_S = 60.0
CANCEL_GRACE_S = 5.0


@dataclass(frozen=True)
class Ended:
    """A trial placed on an environment ended there: the fleet frees what it held."""

    trial_id: str
    env_id: str
    # GPUs on which its agent still sees its processes: held until they leave.
    still_in_use: tuple[str, ...] = ()
    # Gone with its environment's processes: every GPU of it is freed at once.
    processes_gone: bool = False


class TrialBook:
    """The state of one experiment's trials, and every decision on them."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.trials: dict[str, TrialState] = {}
        self.live: dict[str, TrialState] = {}  # the trials not ended: what a pass looks at
        # The waiting trials, by what they need; placed trials leave it.
        self.queue = WaitingTrials()
        self.stopping = False
        # Publish a MetricEvent per stored metric (only while someone listens: it costs).
        self.publish_metrics = False
        self._next_seq = 0
        self._ignored: dict[str, int] = {}  # by environment: messages about trials not there
        self._out: list[ev.Instruction] = []
        self.now = 0.0
        self.wall = 0.0

    def take(self) -> list[ev.Instruction]:
        """The instructions of the calls since the last take."""
        out = self._out
        if out:  # most calls say nothing: no new list for them
            self._out = []
        return out

    # ---- queries -----------------------------------------------------------------------------

    def all_done(self) -> bool:
        return not self.live

    def info(self, trial_id: str) -> TrialInfo:
        return self.trials[trial_id].info()

    def placed_on(self, env_id: str) -> list[str]:
        """The live trials placed on ``env_id``, in submission order."""
        on = [t for t in self.trials.values() if t.env_id == env_id and not t.status.terminal]
        return [t.id for t in sorted(on, key=lambda t: t.seq)]

    def unwanted(self, env_id: str, active: Iterable[str]) -> tuple[str, ...]:
        """Of the trials an agent says it runs, those it should stop: unknown, elsewhere, canceled."""
        trials = self.trials
        return tuple(sorted(
            tid for tid in active
            if tid not in trials or trials[tid].env_id != env_id
            or (trials[tid].cancel_status is not None and not trials[tid].pausing)
        ))

    def pausing_on(self, env_id: str, active: Iterable[str]) -> list[str]:
        """Of the trials an agent says it runs, those placed on ``env_id`` and still pausing:
        to be asked again (the pause may have been lost with a broken stream)."""
        trials = self.trials
        return sorted(tid for tid in active
                      if tid in trials and trials[tid].env_id == env_id and trials[tid].pausing)

    def to_resend(self, env_id: str, held: Iterable[str], active: Iterable[str]) -> list[str]:
        """Trials placed on ``env_id`` its agent does not know (a start lost with its stream): again."""
        missing = [self.trials[tid] for tid in set(held) - set(active)]
        return [t.id for t in sorted(missing, key=lambda t: t.seq)
                if not t.status.terminal and t.cancel_status is None and t.env_id == env_id]

    def demand(self, t: TrialState) -> Demand:
        """What placing ``t`` asks for: its GPUs, and the platforms it may use, most
        preferred first. A trial whose environment was lost tries the other platforms
        first: what lost it may well lose it again."""
        restricted = bool(t.platforms or self.policy.trial_platforms)
        order = t.platforms or self.policy.preference()
        if t.lost_on in order and len(order) > 1:
            order = (*(p for p in order if p != t.lost_on), t.lost_on)
        return Demand(t.id, t.gpu_number, t.gpu_memory, platforms=order, only_these=restricted, nodes=t.nodes)

    def start_message(self, trial_id: str, working_directory: str) -> ev.StartTrial:
        return starts.start_message(self.trials[trial_id], self.policy, working_directory)

    # ---- the embedding API -------------------------------------------------------------------

    def submit(self, e: ev.TrialSubmitted) -> None:
        if e.trial_id in self.trials:
            raise ValueError(f"trial {e.trial_id} was submitted twice")
        t = TrialState(
            id=e.trial_id, seq=self._next_seq, status=TrialStatus.WAITING, parameters=e.parameters,
            command=e.command, gpu_number=e.gpu_number, gpu_memory=e.gpu_memory if e.gpu_number else 0,
            submitted_at=self.wall, env_overrides=dict(e.env_overrides), platforms=tuple(e.platforms),
            nodes=e.nodes, max_duration=e.max_duration,
        )
        if e.checkpoint_from:
            t.forked_from = self.trials[e.checkpoint_from].checkpoint
        fork = (t.forked_from.trial_id, t.forked_from.step) if t.forked_from else None
        self._next_seq += 1
        self._out.append(ev.TrialAdded(
            t.id, t.seq, t.status, t.parameters, t.command, t.gpu_number, t.submitted_at, t.platforms, fork, t.nodes,
            t.max_duration,
        ))
        self.trials[t.id] = self.live[t.id] = t
        self.queue.append(self.demand(t))
        self._out.append(ev.Publish(StatusEvent(t.info(), TrialStatus.WAITING)))

    def cancel(self, trial_id: str, reason: str, status: TrialStatus) -> str | None:
        """Cancel a trial. A waiting one ends now; for a placed one, the environment whose
        agent must stop it is returned (the end comes when the agent confirms)."""
        t = self.trials[trial_id]
        if t.status.terminal:
            return None
        if not t.placed:
            if t.status is TrialStatus.WAITING:
                self.queue.remove(trial_id)
            self._to(t, status, reason)
            return None
        t.cancel_status, t.pausing = status, False
        t.reason = reason
        # Shown while the agent stops it; the end replaces it with the final reason.
        self._out.append(ev.TrialStopping(t.id, reason))
        return t.env_id

    def stop(self, *, pause: bool = False) -> list[tuple[str, str]]:
        """The experiment ends: every trial is canceled (``pause``: those that saved a
        checkpoint, and those waiting, are paused instead, to be continued when it is
        resumed). Returns (environment, trial) for those an agent must stop or pause."""
        self.stopping = True
        stops = []
        for t in sorted(self.trials.values(), key=lambda t: t.seq):
            if pause and t.status is TrialStatus.PAUSED:
                continue
            if pause and (t.checkpoint is not None or not t.placed):
                env_id = self.pause(t.id, "the experiment stopped")
            else:
                env_id = self.cancel(t.id, "the experiment stopped", TrialStatus.SYS_CANCELED)
            if env_id is not None:
                stops.append((env_id, t.id))
        return stops

    def stop_completed(self) -> None:
        for t in sorted(self.trials.values(), key=lambda t: t.seq):
            if t.status.terminal or t.status is TrialStatus.PAUSED:
                continue
            if t.pausing and t.checkpoint is not None and t.status is TrialStatus.RUNNING:
                self._paused(t, "the experiment stopped")
            else:
                self._to(t, TrialStatus.SYS_CANCELED, "the experiment stopped before the agent confirmed")

    # ---- pause and continue ------------------------------------------------------------------

    def pause(self, trial_id: str, reason: str) -> str | None:
        """Pause a trial. A waiting one is paused now; for a placed one, the environment whose
        agent must pause it is returned (it ends at its next checkpoint)."""
        t = self.trials[trial_id]
        if t.status.terminal or t.status is TrialStatus.PAUSED or t.cancel_status is not None:
            return None
        if not t.placed:
            self.queue.remove(trial_id)
            self._to(t, TrialStatus.PAUSED, reason)
            return None
        t.pausing = True
        t.reason = reason
        # Stopped past the grace without a checkpoint to continue from: canceled, as it would be.
        t.cancel_status = TrialStatus.SYS_CANCELED if self.stopping else TrialStatus.USER_CANCELED
        self._out.append(ev.TrialStopping(t.id, f"pausing: {reason}"))
        return t.env_id

    def resume(self, trial_id: str, parameters: Mapping[str, Any] | None, source: str = "") -> bool:
        """Continue a paused trial (with new parameters, and from trial ``source``'s newest checkpoint,
        if given): it waits for a place, ahead of the others. False when it is not paused."""
        t = self.trials[trial_id]
        if t.status is not TrialStatus.PAUSED:
            return False
        forked = self.trials[source].checkpoint if source in self.trials else None
        if forked is not None and forked != t.checkpoint:
            ck.fork(t, forked, ck.held_by(self.trials.values(), t.id), self.wall, self._out)
        if parameters is not None:
            t.parameters = dict(parameters)
            self._out.append(ck.TrialParametersChanged(t.id, t.parameters))
        t.reason = t.waiting_reason = ""
        new = ", with new parameters" if parameters is not None else ""
        self._to(t, TrialStatus.WAITING, f"continued {ck.whence(t.id, t.checkpoint)}{new}")
        self.queue.push_front(self.demand(t), self.now)
        return True

    # ---- what agents report ------------------------------------------------------------------

    def own(self, env_id: str, trial_id: str, what: str) -> TrialState | None:
        t = self.trials.get(trial_id)
        if t is None or t.env_id != env_id:
            n = self._ignored[env_id] = self._ignored.get(env_id, 0) + 1
            # Logged, but not one line per message: a broken or hostile agent may send many.
            if n <= 10 or n % 1000 == 0:
                log.warning(
                    "environment %s reported %s for trial %r, which is not placed there; ignored (%d so far)",
                    env_id, what, trial_id, n,
                )
            return None
        return t

    def started(self, env_id: str, m: ev.TrialStartReported) -> None:
        t = self.own(env_id, m.trial_id, "a start")
        if t is None or t.status is not TrialStatus.WAITING:
            return
        t.started_at = m.started_at or self.wall
        self._out.append(ev.TrialRan(t.id, t.started_at))
        self._to(t, TrialStatus.RUNNING, f"running on {env_id} (pid {m.pid})")

    def metrics(self, env_id: str, runs: Sequence[MetricRun]) -> None:
        # Every metric a trial reports passes here, a run at a time: the edge sends only
        # finite numbers, which the check below finds in C.
        ids = dict.fromkeys(r.trial_id for r in runs)
        owned = {trial_id: self.own(env_id, trial_id, "a metric") for trial_id in ids}
        runs = results.checked(runs, {tid for tid, t in owned.items() if t is not None})
        self._out.append(ev.StoreMetrics(tuple(runs)))
        for r in runs:
            if r.kind == "final" and r.values:
                t = self.trials[r.trial_id]
                t.final_metric, t.final_metric_json = r.values[-1], r.json_of(len(r.values) - 1)
                self._out.append(ev.FinalResultSet(t.id, t.final_metric, t.final_metric_json))
        if self.publish_metrics:
            for r in runs:
                for row in r.rows():
                    event = MetricEvent(row.trial_id, row.kind, row.index, row.value, results.loads(row.value_json))
                    self._out.append(ev.Publish(event))

    def log(self, env_id: str, chunk: ev.LogReported) -> None:
        if self.own(env_id, chunk.trial_id, "log output") is not None:
            self._out.append(ev.WriteLog(chunk.trial_id, chunk.stream, chunk.offset, chunk.data))

    def ended(self, env_id: str, m: ev.TrialEndReported, *, platform: str) -> Ended | None:
        """The agent of ``env_id`` (of ``platform``) says a trial's process ended: its
        status, and what the fleet frees."""
        t = self.own(env_id, m.trial_id, "an end")
        if t is None or t.status.terminal:
            return None
        t.exit_code, t.signal, t.stderr_tail = m.exit_code, m.signal, m.stderr_tail
        t.attempt_ended_at = m.ended_at or self.wall  # the trial's own end only if it ends for good
        self._out.append(ev.TrialExited(t.id, t.exit_code, t.signal, t.stderr_tail))
        if m.outcome is ev.Outcome.LOST:
            # Gone with its environment, like a trial on a lost agent: retried within
            # maxTrialRetries whether or not failed trials are retried.
            self.lose([t.id], m.reason or "its environment was stopped", platform=platform)
            return Ended(t.id, env_id, processes_gone=True)
        if m.outcome is ev.Outcome.PAUSED and t.checkpoint is not None and t.status is TrialStatus.RUNNING:
            self._paused(t, m.reason or (f"paused ({t.reason})" if t.reason else "paused"))
            return Ended(t.id, env_id, still_in_use=m.gpus_still_in_use)
        if m.outcome is ev.Outcome.PAUSED:  # no checkpoint to continue from: canceled
            m = dataclasses.replace(m, outcome=ev.Outcome.CANCELED)
            t.reason = f"{m.reason or 'asked to pause'}; it has no checkpoint to continue from"
        if m.outcome is ev.Outcome.SUCCEEDED:
            new, reason = TrialStatus.SUCCEEDED, ""
        elif m.outcome is ev.Outcome.CANCELED and t.cancel_status is not None:
            new, reason = t.cancel_status, t.reason
        else:
            new, reason = TrialStatus.FAILED, m.reason or "the trial failed"
        if t.status is TrialStatus.WAITING and new not in (
            TrialStatus.FAILED, TrialStatus.USER_CANCELED, TrialStatus.SYS_CANCELED
        ):
            new = TrialStatus.FAILED if new is TrialStatus.SUCCEEDED else TrialStatus.USER_CANCELED
        policy = self.policy
        if (
            new is TrialStatus.FAILED
            and t.cancel_status is None
            and policy.retry_failed_trials
            and t.retries < policy.max_trial_retries
            and not self.stopping
        ):
            self._retry(t, f"it failed ({reason})")
        else:
            self._to(t, new, reason)
        return Ended(t.id, env_id, still_in_use=m.gpus_still_in_use)

    # ---- placing, losing, retrying -----------------------------------------------------------

    def placed(self, trial_id: str, env_id: str, gpu_uuids: tuple[str, ...], gpu_indices: tuple[int, ...]) -> None:
        t = self.trials[trial_id]
        t.env_id, t.gpu_uuids, t.gpu_indices, t.last_env_id = env_id, gpu_uuids, gpu_indices, env_id
        t.lost_on, t.refusals = "", {}
        t.attempts += 1
        self._out.append(ev.TrialPlaced(t.id, env_id, gpu_indices, gpu_uuids, t.attempts))
        if t.checkpoint is not None and t.attempts > 1:
            # What a run reported after the checkpoint it continues from goes to its history.
            self._out.append(ck.MetricsSuperseded(t.id, t.checkpoint.metric_index, self.wall))

    def slot_freed(self) -> None:
        """A placed trial let go of its environment: trialConcurrency may let one more go."""
        self.queue.capped = False

    def tell_waiting(self, reasons: Mapping[str, str]) -> None:
        """Why each of these trials waits, as the pass found it (placed ones included)."""
        changed = {}
        for tid, reason in reasons.items():
            t = self.trials[tid]
            if t.waiting_reason != reason:
                t.waiting_reason = changed[tid] = reason
        if changed:
            self._out.append(ev.WaitingReasonsChanged(changed))

    def lose(self, trial_ids: Iterable[str], reason: str, *, platform: str, heard_at: float | None = None) -> None:
        """These trials are gone with their environment (of ``platform``): retry or fail each.
        A running one's attempt ends when the coordinator last heard of it (``heard_at``, wall)."""
        for tid in sorted(trial_ids, key=lambda i: self.trials[i].seq):
            t = self.trials[tid]
            if t.status.terminal:
                continue
            if heard_at is not None and t.status is TrialStatus.RUNNING and t.attempt_ended_at is None:
                t.attempt_ended_at = min(self.wall, max(heard_at, t.started_at or heard_at))
            t.lost_on = platform
            free = t.progressed and self.policy.progress_resets_retries
            if t.pausing and t.checkpoint is not None and t.status is TrialStatus.RUNNING:
                self._paused(t, f"lost while pausing ({reason})")
            elif t.cancel_status is not None:
                self._to(t, t.cancel_status, t.reason)
            elif free or t.retries < self.policy.max_trial_retries:
                self._retry(t, f"environment lost ({reason})", free=free)
            else:
                self._to(t, TrialStatus.FAILED, f"environment lost: {reason}")

    def _retry(self, t: TrialState, why: str, *, free: bool = False) -> None:
        """Put a trial back at the head of the queue, to be placed after a backoff (``free``:
        it made progress since its last loss, and this retry is not counted)."""
        t.env_id, t.gpu_uuids, t.gpu_indices = None, (), ()
        self._out.append(ev.TrialUnplaced(t.id))
        if not free:
            t.retries += 1
        t.progressed = False
        self._out.append(ck.TrialRetried(t.id, t.retries, False))
        delay = RETRY_BACKOFF_S if free else min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** (t.retries - 1))
        t.not_before = self.now + delay
        retries = self.policy.max_trial_retries
        at = f" from step {t.checkpoint.step}" if t.checkpoint is not None else ""
        what = f"retry {t.retries} of {retries}{at}"
        if free:
            what = f"retry{at}, not counted (a checkpoint since the last loss)"
        t.waiting_reason = f"waiting: {what} after {why}"
        self._out.append(ev.WaitingReasonsChanged({t.id: t.waiting_reason}))
        if t.status is TrialStatus.RUNNING:
            self._to(t, TrialStatus.WAITING, f"{why}; {what} in {delay:g} s")
        t.attempt_ended_at = None  # counted by _to if it ran; one placed but not started waits as it did
        self.queue.push_front(self.demand(t), t.not_before)

    def refuse(self, why_by_shape: Mapping[tuple[int, int], str]) -> None:
        """Fail the waiting trials of the shapes (GPUs, memory per GPU) that can never run."""
        self._fail_queued(self.queue.refused(why_by_shape), "refused: ")

    def fail_unplaceable(self, platform_errors: Mapping[str, str], by_hand: bool) -> None:
        """Fail the waiting trials that may use only platforms given up on (``by_hand``:
        agents an operator started still serve the trials that may use the first platform)."""
        names = [p.name for p in self.policy.platforms]
        unplaceable = self.queue.unplaceable(names, platform_errors, by_hand) if platform_errors else {}
        self._fail_queued(unplaceable, "no environment could be started: ")

    def _fail_queued(self, why_by_trial: Mapping[str, str], lead: str) -> None:
        for tid, why in why_by_trial.items():
            self.queue.remove(tid)
            self._to(self.trials[tid], TrialStatus.FAILED, lead + why)

    def _paused(self, t: TrialState, why: str) -> None:
        """A trial asked to pause ended (or was lost) with a checkpoint to continue from."""
        t.env_id, t.gpu_uuids, t.gpu_indices, t.pausing, t.cancel_status = None, (), (), False, None
        self._out.append(ev.TrialUnplaced(t.id))
        assert t.checkpoint is not None
        self._to(t, TrialStatus.PAUSED, f"{why}; continues {ck.whence(t.id, t.checkpoint)}")

    def _to(self, t: TrialState, new: TrialStatus, reason: str) -> None:
        check_trial(t.status, new)
        old = t.status
        t.status = new
        if new.terminal:  # for good: no transition leaves an ended status
            self.live.pop(t.id, None)
        if new.terminal or reason:
            t.reason = reason
        # Its attempt's end (when known, else now): its time counts; the trial's own end if it ends for good.
        attempt_end, t.attempt_ended_at = t.attempt_ended_at or self.wall, None
        if old is TrialStatus.RUNNING and t.started_at is not None:
            t.ran_s += max(0.0, attempt_end - t.started_at)
        t.ended_at = attempt_end if new.terminal else None
        self._out.append(ev.TrialStatusChanged(t.id, old.value, new, t.reason, reason, t.ended_at, t.ran_s))
        log.info("trial %s: %s -> %s%s", t.id, old.value, new.value, f" ({reason})" if reason else "")
        self._out.append(ev.Publish(StatusEvent(t.info(), old)))

    # ---- after a crash -----------------------------------------------------------------------

    def restore(self, rows: Iterable[Mapping[str, Any]], checkpoint_rows: Iterable[Mapping[str, Any]] = ()) -> None:
        """The trials (and their checkpoints) as the store kept them."""
        restored = trialrows.restore(rows, checkpoint_rows, self.policy.trial_gpu_memory, self.wall, self._out)
        self.trials.update(restored)
        self._next_seq = max([self._next_seq, *(t.seq + 1 for t in restored.values())])
        self.live.update((tid, t) for tid, t in self.trials.items() if not t.status.terminal)

    def restore_placement(self, trial_id: str, gpu_uuids: tuple[str, ...] | None) -> None:
        """After a crash: the environment ``trial_id`` was placed on holds it again, on these
        GPUs, or (None) it ended meanwhile."""
        t = self.trials[trial_id]
        if gpu_uuids is not None:
            t.gpu_uuids = gpu_uuids
            return
        t.env_id, t.gpu_uuids, t.gpu_indices = None, (), ()
        self._out.append(ev.TrialUnplaced(t.id))
        if t.status is not TrialStatus.WAITING:
            self._to(t, TrialStatus.FAILED, "environment lost: it ended while the coordinator was down")

    def requeue_unplaced(self) -> None:
        """After a crash: the live trials placed nowhere wait again, in submission order."""
        for t in sorted(self.trials.values(), key=lambda t: t.seq):
            if t.status is TrialStatus.WAITING and t.env_id is None:
                self.queue.append(self.demand(t))

