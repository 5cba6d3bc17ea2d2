"""The decision core: trial and environment lifecycles, placement, retries, loss, drain.

``Engine.handle(event, now=..., wall=...)`` takes one event and returns the instructions
that carry its consequences out (store writes, messages to agents, environments to start
or stop, events to publish). ``now`` is a monotonic clock for timers, ``wall`` the time of
day for what is stored. Nothing here does I/O or reads a clock, so every scenario is a
unit test in virtual time (tests/unit/test_engine.py); ``shell.py`` runs it for real.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any

from . import events as ev
from . import scheduler
from .envrules import EnvironmentRules
from .model import EnvState, MetricEvent, StatusEvent, TrialInfo, TrialState
from .policy import Policy
from .rows import MetricRun
from .states import EnvStatus, TrialStatus, check_trial
from .waiting import WaitingTrials

log = logging.getLogger(__name__)

# Retries of a trial wait 1, 2, 4, ... seconds, at most RETRY_BACKOFF_MAX_S.
RETRY_BACKOFF_S = 1.0
RETRY_BACKOFF_MAX_S = 60.0
CANCEL_GRACE_S = 5.0

_STARTED_ENV_ID = re.compile(r"env-([0-9]+)")


class Engine(EnvironmentRules):
    """The state of one experiment's trials and environments, and every decision on it."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.trials: dict[str, TrialState] = {}
        # The waiting trials, by what they need; placed trials leave it.
        self.queue = WaitingTrials()
        # What the scheduler sees of each environment, kept between passes and brought up to
        # date for the environments that changed.
        self._views: dict[str, scheduler.EnvCapacity] = {}
        # Something a pass or reconcile may act on happened since the last tick.
        self._dirty = True
        self.envs: dict[str, EnvState] = {}
        self.stopping = False
        self.started = False
        # Publish a MetricEvent per stored metric (only while someone listens: it costs).
        self.publish_metrics = False
        self.env_error = ""
        # Platforms given up on (too many environments in a row failed to start), with why.
        self.platform_errors: dict[str, str] = {
            p.name: f"could not be prepared: {p.unusable}" for p in policy.platforms if p.unusable
        }
        self._unprepared = {p.name for p in policy.platforms if p.unusable}
        self.beat_scale = 1.0
        self._env_counter = 0
        self._failed_starts: dict[str, int] = {}  # by platform, since its last agent registered
        self._next_seq = 0
        self._linked: set[str] = set()
        # Bumped when an environment's status or agent changes: what _gpus_offered() answered
        # holds until then (every submit asks it; a walk over 10,000 environments each time
        # made a burst of submits quadratic).
        self._env_generation = 0
        self._offered: tuple[tuple[int, int], int | None] | None = None
        self._closing: set[int] = set()  # links the core closed, not yet reported disconnected
        self._gpu_rows: list[Any] = []
        self._out: list[ev.Instruction] = []
        self.now = 0.0
        self.wall = 0.0

    # ---- the one entry point ---------------------------------------------------------------

    def handle(self, event: ev.Event, *, now: float, wall: float) -> list[ev.Instruction]:
        self.now, self.wall = now, wall
        out: list[ev.Instruction] = []
        self._out = out
        match event:
            case ev.AgentReported():
                self._reported(event)
            case ev.HeartbeatReceived():
                self._heartbeat(event)
            case ev.AgentRegistered():
                self._registered(event)
            case ev.AgentDisconnected():
                self._disconnected(event)
            case ev.TrialSubmitted():
                self._submitted(event)
            case ev.CancelRequested():
                self._cancel(event.trial_id, event.reason, event.status)
            case ev.EnvironmentStarted() | ev.EnvironmentStartFailed():
                self._env_start_answered(event)
            case ev.EnvironmentsPolled():
                self._polled(event.observations)
            case ev.Ticked():
                self._dirty = False
                self._schedule()
                self._reconcile()
                if self._gpu_rows:
                    rows, self._gpu_rows = tuple(self._gpu_rows), []
                    out.append(ev.StoreGpuSamples(rows))
            case ev.StopRequested():
                self._stop(event.grace_s)
            case ev.StopCompleted():
                self._stop_completed()
            case _:
                raise TypeError(f"not an event: {event!r}")
        self._out = []
        return out

    def start(self, *, now: float, wall: float) -> list[ev.Instruction]:
        """The coordinator is up: environments are asked for."""
        self.started = True
        return self.handle(ev.Ticked(), now=now, wall=wall)

    # ---- queries (the facade's) --------------------------------------------------------------

    @property
    def heartbeat_interval(self) -> float:
        return self.policy.heartbeat_interval_s * self.beat_scale

    def wants_pass(self) -> bool:
        """Whether a scheduling pass could do anything now: place a trial, tell one why it
        waits, or start or replace an environment. Not after a metric, a log line or a
        heartbeat that changed no capacity."""
        return not self.stopping and (self._dirty or self.queue.pending(self.now))

    def all_done(self) -> bool:
        return all(t.status.terminal for t in self.trials.values())

    def never_fits(self, gpus: int, memory: int = 0) -> str:
        """Why a trial asking for ``gpus`` GPUs with ``memory`` bytes each could never run
        here, or '' when it could (or when only agents yet to register can tell)."""
        if gpus == 0:
            return ""
        offered = self._gpus_offered()
        if offered is not None and gpus > offered:
            return (
                f"trial asks for {gpus} GPU{'' if gpus == 1 else 's'} but no environment offers more than {offered}; "
                f"lower trialGpuNumber or add GPUs (gpuIndices/simulatedGpus)"
            )
        if memory:
            registered = [e for e in self.envs.values() if e.instance_id and not e.status.terminal and e.gpus]
            big = [sum(1 for g in e.gpus if not g.memory_total_bytes or g.memory_total_bytes >= memory) for e in registered]
            if registered and max(big) < gpus:
                largest = max(g.memory_total_bytes for e in registered for g in e.gpus)
                return (
                    f"trial asks for {gpus} GPU(s) with {memory / 2**30:.1f} GiB each but no environment has "
                    f"{gpus} GPU(s) that large (the largest has {largest / 2**30:.1f} GiB); lower trialGpuMemory"
                )
        return ""

    def _gpus_offered(self) -> int | None:
        stamp = (len(self.envs), self._env_generation)
        if self._offered is None or self._offered[0] != stamp:
            self._offered = (stamp, self._count_gpus_offered())
        return self._offered[1]

    def _count_gpus_offered(self) -> int | None:
        registered = [len(e.gpus) for e in self.envs.values() if e.instance_id and not e.status.terminal]
        if registered:
            return max(registered)
        simulated = [p.gpus_offered() for p in self.policy.platforms]
        if all(simulated):
            return max(simulated)
        return None

    # ---- the embedding API's events ----------------------------------------------------------

    def _submitted(self, e: ev.TrialSubmitted) -> None:
        if e.trial_id in self.trials:
            raise ValueError(f"trial {e.trial_id} was submitted twice")
        t = TrialState(
            id=e.trial_id, seq=self._next_seq, status=TrialStatus.WAITING, parameters=e.parameters,
            command=e.command, gpu_number=e.gpu_number, gpu_memory=e.gpu_memory if e.gpu_number else 0,
            submitted_at=self.wall, env_overrides=dict(e.env_overrides), platforms=tuple(e.platforms),
        )
        self._next_seq += 1
        self._out.append(ev.InsertTrial({
            "id": t.id, "seq": t.seq, "status": t.status.value, "parameters_json": json.dumps(t.parameters),
            "command": t.command, "gpu_number": t.gpu_number, "submitted_at": t.submitted_at,
            **({"platforms_json": json.dumps(list(t.platforms))} if t.platforms else {}),
        }))
        self.trials[t.id] = t
        self.queue.append(self._demand(t))
        self._dirty = True
        self._out.append(ev.Publish(StatusEvent(t.info(), TrialStatus.WAITING)))
        self._fail_trials_no_platform_takes()  # one that may use only platforms given up on

    def _cancel(self, trial_id: str, reason: str, status: TrialStatus) -> None:
        t = self.trials[trial_id]
        if t.status.terminal:
            return
        if not t.placed:
            self.queue.remove(trial_id)
            self._dirty = True
            self._trial_to(t, status, reason)
            return
        t.cancel_status = status
        t.reason = reason
        # Shown while the agent stops it; the end replaces it with the final reason.
        self._out.append(ev.UpdateTrial(t.id, {"reason": reason, "stopping": 1}))
        env = self.envs.get(t.env_id or "")
        if env is not None and env.link is not None:
            self._out.append(ev.Send(env.link, ev.CancelTrial(trial_id, CANCEL_GRACE_S, reason)))

    def _stop(self, grace_s: float) -> None:
        if self.stopping:
            return
        self.stopping = True
        for t in sorted(self.trials.values(), key=lambda t: t.seq):
            if not t.status.terminal:
                self._cancel(t.id, "the experiment stopped", TrialStatus.SYS_CANCELED)
        for env in self.live_envs():
            self._shutdown_env(env, drain=False, reason="the experiment stopped", grace_s=grace_s)

    def _stop_completed(self) -> None:
        for env in self.live_envs():
            self._env_to(env, EnvStatus.STOPPED, "the experiment stopped")
        for t in sorted(self.trials.values(), key=lambda t: t.seq):
            if not t.status.terminal:
                self._trial_to(t, TrialStatus.SYS_CANCELED, "the experiment stopped before the agent confirmed")
        if self._gpu_rows:
            rows, self._gpu_rows = tuple(self._gpu_rows), []
            self._out.append(ev.StoreGpuSamples(rows))

    # ---- numbered agent messages -------------------------------------------------------------

    def _current(self, env_id: str, link: int) -> EnvState | None:
        env = self.envs.get(env_id)
        if env is None or env.link != link:
            return None  # a stream that was replaced
        env.last_seen = self.now
        if env.status is EnvStatus.LOST:
            self._env_to(env, EnvStatus.BUSY if env.holders else EnvStatus.READY, "its agent is heard from again")
        return env

    def _reported(self, m: ev.AgentReported) -> None:
        env = self._current(m.env_id, m.link)
        if env is None:
            return
        if m.seq == 0:
            log.warning("environment %s sent a message without a sequence number; ignored", env.id)
            return
        if m.seq <= env.last_seq:
            self._out.append(ev.Ack(m.link, env.last_seq))  # a replay of something already stored
            return
        mark = len(self._out)
        try:
            report = m.report
            if isinstance(report, ev.MetricsReported):
                self._metrics(env, report.runs)
            elif isinstance(report, ev.TrialStartReported):
                self._trial_started(env, report)
            elif isinstance(report, ev.TrialEndReported):
                self._trial_ended(env, report)
            elif isinstance(report, ev.LogReported):
                self._log(env, report)
        except Exception:
            # A message we cannot apply must not be replayed forever: skip it, loudly.
            log.exception("environment %s: could not apply message #%d; skipped", env.id, m.seq)
            # Its writes are dropped; its status changes, made in memory, are still told.
            self._out[mark:] = [i for i in self._out[mark:] if isinstance(i, ev.Publish)]
        env.last_seq = m.seq
        self._out.append(ev.UpdateEnvironment(env.id, {"last_seq": m.seq}))
        self._out.append(ev.Ack(m.link, m.seq))

    def _own_trial(self, env: EnvState, trial_id: str, what: str) -> TrialState | None:
        t = self.trials.get(trial_id)
        if t is None or t.env_id != env.id:
            env.ignored_messages += 1
            # Logged, but not one line per message: a broken or hostile agent may send many.
            if env.ignored_messages <= 10 or env.ignored_messages % 1000 == 0:
                log.warning(
                    "environment %s reported %s for trial %r, which is not placed there; ignored (%d so far)",
                    env.id, what, trial_id, env.ignored_messages,
                )
            return None
        return t

    def _trial_started(self, env: EnvState, m: ev.TrialStartReported) -> None:
        t = self._own_trial(env, m.trial_id, "a start")
        if t is None or t.status is not TrialStatus.WAITING:
            return
        t.started_at = m.started_at or self.wall
        self._out.append(ev.UpdateTrial(t.id, {"started_at": t.started_at}))
        self._trial_to(t, TrialStatus.RUNNING, f"running on {env.id} (pid {m.pid})")

    def _metrics(self, env: EnvState, runs: Sequence[MetricRun]) -> None:
        # Every metric a trial reports passes here, a run at a time: the edge sends only
        # finite numbers, which the check below finds in C.
        owned = {trial_id: self._own_trial(env, trial_id, "a metric") for trial_id in dict.fromkeys(r.trial_id for r in runs)}
        if None in owned.values() or not _all_finite(chain.from_iterable(r.values for r in runs)):
            runs = [
                r._replace(first_index=row.index, values=(row.value,), value_jsons=(row.value_json,), reported_at=(row.reported_at,))
                for r in runs if owned[r.trial_id] is not None
                for row in r.rows() if math.isfinite(row.value)
            ]
        self._out.append(ev.StoreMetrics(tuple(runs)))
        for r in runs:
            if r.kind == "final" and r.values:
                t = self.trials[r.trial_id]
                t.final_metric, t.final_metric_json = r.values[-1], r.json_of(len(r.values) - 1)
                self._out.append(ev.UpdateTrial(t.id, {"final_metric": t.final_metric, "final_metric_json": t.final_metric_json}))
        if self.publish_metrics:
            for r in runs:
                for row in r.rows():
                    self._out.append(ev.Publish(MetricEvent(row.trial_id, row.kind, row.index, row.value, _loads(row.value_json))))

    def _log(self, env: EnvState, chunk: ev.LogReported) -> None:
        if self.policy.section(env.platform).shares_filesystem and env.started_here:
            return  # its agent writes the files the coordinator reads
        if self._own_trial(env, chunk.trial_id, "log output") is not None:
            self._out.append(ev.WriteLog(chunk.trial_id, chunk.stream, chunk.offset, chunk.data))

    def _trial_ended(self, env: EnvState, m: ev.TrialEndReported) -> None:
        t = self._own_trial(env, m.trial_id, "an end")
        if t is None or t.status.terminal:
            return
        t.exit_code, t.signal, t.stderr_tail = m.exit_code, m.signal, m.stderr_tail
        t.ended_at = m.ended_at or self.wall
        if m.outcome is ev.Outcome.SUCCEEDED:
            new, reason = TrialStatus.SUCCEEDED, ""
        elif m.outcome is ev.Outcome.CANCELED and t.cancel_status is not None:
            new, reason = t.cancel_status, t.reason
        elif m.outcome is ev.Outcome.LOST and t.cancel_status is None:
            # Gone with its environment, like a trial on a lost agent: retried within
            # maxTrialRetries whether or not failed trials are retried.
            self._out.append(ev.UpdateTrial(t.id, {"exit_code": t.exit_code, "signal": t.signal, "ended_at": t.ended_at}))
            self._lose_trials(env, m.reason or "its environment was stopped", keep=env.holders - {t.id})
            return
        else:
            new, reason = TrialStatus.FAILED, m.reason or "the trial failed"
        if t.status is TrialStatus.WAITING and new not in (
            TrialStatus.FAILED, TrialStatus.USER_CANCELED, TrialStatus.SYS_CANCELED
        ):
            new = TrialStatus.FAILED if new is TrialStatus.SUCCEEDED else TrialStatus.USER_CANCELED
        self._out.append(ev.UpdateTrial(t.id, {
            "exit_code": t.exit_code, "signal": t.signal, "stderr_tail": t.stderr_tail, "ended_at": t.ended_at,
        }))
        self._release(env, t, still_in_use=m.gpus_still_in_use)
        policy = self.policy
        if (
            new is TrialStatus.FAILED
            and t.cancel_status is None
            and policy.retry_failed_trials
            and t.attempts <= policy.max_trial_retries
            and not self.stopping
        ):
            t.ended_at = None
            self._retry(t, f"it failed ({reason})")
        else:
            self._trial_to(t, new, reason)
        if env.single_use:
            self._shutdown_env(env, drain=True, reason="its trial ended (reuse mode is off)")

    # ---- placing trials ----------------------------------------------------------------------

    def _env_changed(self, env: EnvState) -> None:
        """What ``env`` can take may have changed (a slot or GPU freed, its agent came or
        went, its status moved): the next pass looks at it."""
        self.queue.changed_envs.add(env.id)
        self._dirty = True

    def _sync_views(self) -> None:
        views = self._views
        if len(views) != len(self.envs):
            for env in self.envs.values():
                if env.id not in views:
                    views[env.id] = scheduler.EnvCapacity(env.id, env.trial_slots, env.holders, platform=env.platform)
                    self.queue.changed_envs.add(env.id)
        for env_id in self.queue.changed_envs:
            env, view = self.envs[env_id], views[env_id]
            view.holders, view.gpus, view.use_active_gpu = env.holders, env.gpus, env.use_active_gpu
            view.accepting = (
                env.status in (EnvStatus.READY, EnvStatus.BUSY)
                and env.link is not None
                and not env.draining
                and not env.shutdown_sent
                and not (env.single_use and env.used)
                and env.platform not in self._unprepared  # trials there would find no code
            )

    def _schedule(self) -> None:
        if self.stopping or not self.queue.pending(self.now):
            return
        self._sync_views()
        running = sum(len(e.holders) for e in self.envs.values())
        decision = scheduler.place_waiting(
            self.queue, self._views, now=self.now, max_running=self.policy.trial_concurrency, running=running,
            policy=self.policy.placement,
        )
        changed: dict[str, str] = {}  # waiting reasons to store
        for p in decision.placements:
            t = self.trials[p.trial_id]
            env = self.envs[p.env_id]
            t.env_id, t.gpu_uuids, t.gpu_indices = p.env_id, p.gpu_uuids, p.gpu_indices
            t.lost_on = ""
            t.attempts += 1
            t.waiting_reason = changed[t.id] = f"starting on {env.id}"
            if env.single_use:
                env.used = True
            self._out.append(ev.UpdateTrial(t.id, {
                "environment_id": env.id, "gpu_indices_json": json.dumps(list(p.gpu_indices)),
                "gpu_uuids_json": json.dumps(list(p.gpu_uuids)), "attempts": t.attempts,
            }))
            if env.status is EnvStatus.READY:
                self._env_to(env, EnvStatus.BUSY, f"trial {t.id} placed")
            self._send_start(env, t)
        for tid, reason in decision.waiting.items():
            t = self.trials[tid]
            if t.waiting_reason != reason:
                t.waiting_reason = changed[tid] = reason
        if changed:
            self._out.append(ev.StoreWaitingReasons(changed))

    def _demand(self, t: TrialState) -> scheduler.Demand:
        """What placing ``t`` asks for: its GPUs, and the platforms it may use, most
        preferred first. A trial whose environment was lost tries the other platforms
        first: what lost it may well lose it again."""
        restricted = bool(t.platforms or self.policy.trial_platforms)
        order = t.platforms or self.policy.preference()
        if t.lost_on in order and len(order) > 1:
            order = (*(p for p in order if p != t.lost_on), t.lost_on)
        return scheduler.Demand(t.id, t.gpu_number, t.gpu_memory, platforms=order, only_these=restricted)

    def _send_start(self, env: EnvState, t: TrialState) -> None:
        assert env.link is not None
        env_vars = dict(self.policy.trial_env)
        env_vars.update(t.env_overrides)
        self._out.append(ev.Send(env.link, ev.StartTrial(
            trial_id=t.id, sequence_id=t.seq, command=t.command, parameters=t.parameters, env=env_vars,
            gpu_indices=t.gpu_indices, gpu_uuids=t.gpu_uuids, max_duration_s=self.policy.max_trial_duration_s,
            attempt=t.attempts, experiment_id=self.policy.experiment_id,
            working_directory=self.policy.section(env.platform).working_directory, resumes_metrics=t.attempts > 1,
        )))

    def _release(
        self, env: EnvState, t: TrialState, *, processes_gone: bool = False, still_in_use: Iterable[str] = ()
    ) -> None:
        """The trial no longer takes a slot of ``env``. Its GPUs are released too, except
        those on which the agent still sees its processes (``still_in_use``, from its
        TrialEnded): they stay held until a heartbeat shows them gone. ``processes_gone``:
        the whole environment is gone, release everything."""
        env.holders.discard(t.id)
        self.queue.capped = False  # one running trial fewer: trialConcurrency may let one more go
        self._env_changed(env)
        scheduler.trial_ended(env.gpus, t.id, {} if processes_gone else {u: {t.id} for u in still_in_use})
        if env.status is EnvStatus.BUSY and not env.holders:
            self._env_to(env, EnvStatus.READY, f"trial {t.id} ended")

    def _refuse_unfittable(self) -> None:
        """Once every environment has registered, fail queued trials that can never run."""
        if not self.queue:
            return  # nothing to refuse: skip the walk over every environment (one per agent joining)
        if any(e.status in (EnvStatus.REQUESTED, EnvStatus.STARTING) for e in self.envs.values()):
            return
        # Asked once per shape: most registrations find every shape fits and walk no trial.
        refused = {(s.gpus, s.gpu_memory_bytes): "" for s in self.queue.all_shapes()}
        for gpus, memory in refused:
            refused[gpus, memory] = self.never_fits(gpus, memory)
        if not any(refused.values()):
            return
        for tid in list(self.queue):
            d = self.queue.demand(tid)
            why = refused[d.gpus, d.gpu_memory_bytes]
            if why:
                self.queue.remove(tid)
                self._trial_to(self.trials[tid], TrialStatus.FAILED, f"refused: {why}")

    def _lose_trials(self, env: EnvState, reason: str, keep: set[str]) -> None:
        """The trials placed on ``env`` are gone with it: retry or fail each."""
        for tid in sorted(env.holders - keep, key=lambda i: self.trials[i].seq):
            t = self.trials[tid]
            self._release(env, t, processes_gone=True)
            if t.status.terminal:
                continue
            t.lost_on = env.platform
            if t.cancel_status is not None:
                self._trial_to(t, t.cancel_status, t.reason)
            elif t.attempts <= self.policy.max_trial_retries:
                self._retry(t, f"environment lost ({reason})")
            else:
                self._trial_to(t, TrialStatus.FAILED, f"environment lost: {reason}")

    def _retry(self, t: TrialState, why: str) -> None:
        """Put a trial back at the head of the queue, to be placed after a backoff."""
        t.env_id, t.gpu_uuids, t.gpu_indices = None, (), ()
        delay = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** (t.attempts - 1))
        t.not_before = self.now + delay
        retries = self.policy.max_trial_retries
        t.waiting_reason = f"waiting: retry {t.attempts} of {retries} after {why}"
        self._out.append(ev.StoreWaitingReasons({t.id: t.waiting_reason}))
        if t.status is TrialStatus.RUNNING:
            self._trial_to(t, TrialStatus.WAITING, f"{why}; retry {t.attempts} of {retries} in {delay:g} s")
        self.queue.push_front(self._demand(t), t.not_before)
        self._dirty = True

    # ---- state changes -----------------------------------------------------------------------

    def _trial_to(self, t: TrialState, new: TrialStatus, reason: str) -> None:
        check_trial(t.status, new)
        old = t.status
        t.status = new
        if new.terminal or reason:
            t.reason = reason
        fields: dict[str, Any] = {"status": new.value, "reason": t.reason}
        if new.terminal:
            t.ended_at = t.ended_at or self.wall
            fields["ended_at"] = t.ended_at
        self._out.append(ev.UpdateTrial(t.id, fields))
        self._out.append(ev.RecordTransition("trial", t.id, old.value, new.value, reason))
        log.info("trial %s: %s -> %s%s", t.id, old.value, new.value, f" ({reason})" if reason else "")
        self._out.append(ev.Publish(StatusEvent(t.info(), old)))

    def trial_info(self, trial_id: str) -> TrialInfo:
        return self.trials[trial_id].info()

    def _next_env_id(self) -> str:
        # Past every id in use: an agent an operator started by hand may have taken one.
        self._env_counter += 1
        while f"env-{self._env_counter}" in self.envs:
            self._env_counter += 1
        return f"env-{self._env_counter}"

    def _saw_env_id(self, env_id: str) -> None:
        m = _STARTED_ENV_ID.fullmatch(env_id)
        if m:
            self._env_counter = max(self._env_counter, int(m.group(1)))


def _all_finite(numbers: Iterable[float]) -> bool:
    """Whether every number is finite, found in C: a sum of finite numbers is finite
    unless it overflows, and then the numbers are looked at one by one."""
    try:
        return math.isfinite(math.fsum(numbers))
    except OverflowError:
        return False


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw
