"""The decision core's environment half: agents joining and leaving, heartbeats and GPU
samples, starting and replacing environments, what the platform observes, drain.

A part of :class:`~trialkeeper.coordinator.engine.engine.Engine` (which mixes it in); like the
rest of the core it does no I/O and reads no clock.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import events as ev
from . import scheduler
from .model import EnvState, TrialState
from .policy import PlatformPolicy, Policy
from .rows import GpuSampleRow
from .states import EnvStatus, TrialStatus, check_env
from .waiting import WaitingTrials

log = logging.getLogger(__name__)

# How often a GPU sample of each environment is kept (and on every change of holders), and
# sent at least; longer for a fleet whose heartbeats are stretched (gpu_sample_interval).
GPU_SAMPLE_INTERVAL_S = 5.0


def heartbeat_scale(scale: float, connected: int, interval_s: float, max_per_s: float) -> float | None:
    """How much longer than ``interval_s`` agents should heartbeat with ``connected`` of them
    so that at most ``max_per_s`` heartbeats a second arrive, or None to keep ``scale``: with
    headroom, so that a growing fleet changes it a few times, not on every join."""
    needed = max(1.0, connected / (interval_s * max_per_s))
    if scale >= needed and (scale <= 1.0 or needed * 2 > scale):
        return None
    return 1.0 if needed <= 1.0 else needed * 1.25


class EnvironmentRules:
    # Kept by Engine; declared here for the type checker.
    policy: Policy
    trials: dict[str, TrialState]
    queue: WaitingTrials
    envs: dict[str, EnvState]
    stopping: bool
    started: bool
    env_error: str
    platform_errors: dict[str, str]
    beat_scale: float
    _env_generation: int
    now: float
    wall: float
    _failed_starts: dict[str, int]
    _linked: set[str]
    _closing: set[int]
    _gpu_rows: list[Any]
    _out: list[ev.Instruction]

    if TYPE_CHECKING:
        def _schedule(self) -> None: ...
        def _env_changed(self, env: EnvState) -> None: ...
        def _send_start(self, env: EnvState, t: TrialState) -> None: ...
        def _lose_trials(self, env: EnvState, reason: str, keep: set[str]) -> None: ...
        def _refuse_unfittable(self) -> None: ...
        def _trial_to(self, t: TrialState, new: TrialStatus, reason: str) -> None: ...
        def _next_env_id(self) -> str: ...
        def _demand(self, t: TrialState) -> scheduler.Demand: ...
        def _saw_env_id(self, env_id: str) -> None: ...
        @property
        def heartbeat_interval(self) -> float: ...

    @property
    def gpu_sample_interval(self) -> float:
        """How often GPU samples are kept, and sent at least (agent/beats.py): stretched with
        the heartbeats, so that a fleet of any size sends and stores as many per second."""
        return GPU_SAMPLE_INTERVAL_S * self.beat_scale

    def live_envs(self) -> list[EnvState]:
        return [e for e in self.envs.values() if not e.status.terminal]

    # ---- agents ------------------------------------------------------------------------------

    def _refuse(self, env_id: str, why: ev.Refusal, message: str) -> None:
        self._out.append(ev.RefuseAgent(env_id, why, message))

    def _registered(self, reg: ev.AgentRegistered) -> None:
        env = self.envs.get(reg.env_id)
        if self.stopping:
            return self._refuse(reg.env_id, ev.Refusal.NOT_NOW, "the experiment is stopping")
        if env is None:
            if not self.policy.reuse:
                return self._refuse(
                    reg.env_id, ev.Refusal.UNKNOWN_ENVIRONMENT,
                    f"unknown environment {reg.env_id!r}; without reuse mode agents join only environments the coordinator started",
                )
            # An operator started this agent by hand: it joins as an extra environment.
            self._saw_env_id(reg.env_id)
            env = self._new_env(reg.env_id, platform=reg.platform or "manual", status=EnvStatus.STARTING)
            env.started_here = False
        if env.status.terminal:
            return self._refuse(reg.env_id, ev.Refusal.NOT_NOW, f"environment {env.id} was {env.status.value.lower()}: {env.reason}")
        if env.link is not None and env.link not in self._closing:
            if env.instance_id != reg.instance_id:
                return self._refuse(reg.env_id, ev.Refusal.ALREADY_CONNECTED, f"environment {env.id} already has a connected agent")
            self._close(env.link)  # the same agent reconnected before its old stream was noticed dead
        new_instance = env.instance_id != reg.instance_id
        if new_instance:
            if env.instance_id:
                self._lose_trials(env, "its agent restarted", keep=set())
            env.instance_id = reg.instance_id
            self._env_generation += 1
            env.last_seq = 0
            per_gpu, env.use_active_gpu = self.policy.section(env.platform).gpu_policy(env.id)
            env.gpus = [scheduler.GpuSlot(g.uuid, g.index, per_gpu, memory_total_bytes=g.memory_total_bytes) for g in reg.gpus]
            env.gpu_names = {
                g.uuid: g.name + (" (MIG)" if g.mig else "") + (" (simulated)" if g.simulated else "") for g in reg.gpus
            }
            env.gpu_reason = reg.gpu_unavailable_reason
            self._out.append(ev.UpdateEnvironment(env.id, {
                "hostname": reg.hostname, "agent_instance_id": env.instance_id, "last_seq": 0,
                "info_json": json.dumps(dict(reg.info)),
            }))
        env.hostname = reg.hostname
        env.link = reg.link
        self._env_changed(env)
        self._out.append(ev.UpdateEnvironment(env.id, {"connected": 1}))
        self._linked.add(env.id)
        env.last_seen = self.now
        self._failed_starts[env.platform] = 0
        if env.status in (EnvStatus.STARTING, EnvStatus.LOST):
            self._env_to(env, EnvStatus.READY, f"agent registered from {reg.hostname} (pid {reg.pid})")
            if env.holders:
                self._env_to(env, EnvStatus.BUSY, f"it runs {len(env.holders)} trial(s)")
        if new_instance:
            self._refuse_unfittable()
        active = reg.active_trial_ids
        unwanted = tuple(sorted(
            tid for tid in active
            if tid not in self.trials or self.trials[tid].env_id != env.id or self.trials[tid].cancel_status is not None
        ))
        self._out.append(ev.Send(reg.link, ev.Welcome(
            self.policy.experiment_id, env.last_seq, self.heartbeat_interval, unwanted, self.gpu_sample_interval
        )))
        # A StartTrial lost in a broken stream: the agent does not know the trial, send it again.
        for tid in sorted(env.holders - active, key=lambda i: self.trials[i].seq):
            t = self.trials[tid]
            if not t.status.terminal and t.cancel_status is None:
                self._send_start(env, t)
        self._rescale_heartbeats()  # after the Welcome: it must be the agent's first message
        self._schedule()

    def _disconnected(self, d: ev.AgentDisconnected) -> None:
        self._closing.discard(d.link)
        env = self.envs.get(d.env_id)
        if env is None or env.link != d.link:
            return
        env.link = None
        self._env_changed(env)
        self._out.append(ev.UpdateEnvironment(env.id, {"connected": 0}))
        self._linked.discard(env.id)
        log.info("environment %s: agent stream closed", env.id)
        self._rescale_heartbeats()
        self._out.append(ev.PollSoon())  # did its process exit? Ask the platform now

    def _close(self, link: int) -> None:
        self._closing.add(link)
        self._out.append(ev.CloseLink(link))

    def _rescale_heartbeats(self) -> None:
        """Stretch (or shrink back) the heartbeat interval to the number of connected agents,
        with headroom so that a growing fleet changes it a few times, not on every join;
        connected agents are told at once."""
        policy = self.policy
        connected = len(self._linked)
        scale = heartbeat_scale(self.beat_scale, connected, policy.heartbeat_interval_s, policy.max_heartbeats_per_second)
        if scale is None:
            return
        self.beat_scale = scale
        self._out.append(ev.HeartbeatsRescaled(self.heartbeat_interval, connected))
        message = ev.Settings(self.heartbeat_interval, self.gpu_sample_interval)
        for e in self.envs.values():
            if e.link is not None and e.link not in self._closing:
                self._out.append(ev.Send(e.link, message))

    def _heartbeat(self, hb: ev.HeartbeatReceived) -> None:
        env = self._current(hb.env_id, hb.link)
        if env is None:
            return
        # An agent that says its GPUs are unchanged sent them earlier on this stream (its
        # first heartbeat carries them): nothing to look at, only that it is alive.
        if not hb.gpus_unchanged and (hb.gpus or env.gpus):
            self._gpus_sampled(env, hb.gpus)
        if hb.draining and not env.draining:
            env.draining = True
            self._env_changed(env)
            if env.status in (EnvStatus.READY, EnvStatus.BUSY):
                self._env_to(env, EnvStatus.DRAINING, "the agent is draining (an operator stopped it)")

    if TYPE_CHECKING:
        def _current(self, env_id: str, link: int) -> EnvState | None: ...

    def _gpus_sampled(self, env: EnvState, samples: tuple[ev.GpuSample, ...]) -> None:
        totals = {g.uuid: g.memory_total_bytes for g in env.gpus}
        env.gpu_usage = gpu_usage = {}
        seen: dict[str, set[str]] = {}
        usage: dict[str, dict[str, int]] = {}
        memory_used: dict[str, int] = {}
        foreign = set()
        for s in samples:
            uuid, used = s.uuid, s.memory_used_bytes
            memory_used[uuid] = used
            gpu_usage[uuid] = (s.utilization_percent, used, totals.get(uuid, 0))
            for p in s.processes:
                if p.trial_id:
                    seen.setdefault(uuid, set()).add(p.trial_id)
                    per = usage.setdefault(uuid, {})
                    per[p.trial_id] = per.get(p.trial_id, 0) + p.used_memory_bytes
                else:
                    foreign.add(uuid)
        env.gpu_seen = seen
        was_foreign = {g.uuid for g in env.gpus if g.foreign_busy}
        # Free memory matters only to trials that ask for some (trialGpuMemory): looked at
        # only while one waits, so that a plain heartbeat stays cheap.
        watch = self.queue.asks_memory()
        had_memory = [g.free_memory() for g in env.gpus] if watch else None
        released = scheduler.gpu_sampled(env.gpus, seen, foreign=foreign, memory_used=memory_used, usage=usage)
        changed = bool(released) or was_foreign != foreign or (watch and had_memory != [g.free_memory() for g in env.gpus])
        if changed:
            self._env_changed(env)
        for uuid, tid in released:
            log.info("environment %s: GPU %s released by ended trial %s (its processes left the GPU)", env.id, uuid, tid)
        if samples:
            self._record_gpu_samples(env, samples)
        if changed:  # what it changed is all the pass looks at
            self._schedule()

    def _record_gpu_samples(self, env: EnvState, samples: tuple[ev.GpuSample, ...]) -> None:
        """Keep a GPU sample of ``env`` every gpu_sample_interval, and whenever the set of
        trials on its GPUs changed, so short trials have samples too."""
        holders_now = [g.holders for g in env.gpus]
        if self.now - env.gpu_recorded_at < self.gpu_sample_interval and holders_now == env.gpu_recorded_holders:
            return
        env.gpu_recorded_at, env.gpu_recorded_holders = self.now, [set(h) for h in holders_now]
        holders = {g.uuid: g.holders for g in env.gpus}
        # Stored at the next tick: a tick's samples of every environment in one transaction.
        self._gpu_rows.extend(
            GpuSampleRow(
                self.wall, env.id, s.uuid, s.utilization_percent, s.memory_used_bytes, env.gpu_usage[s.uuid][2],
                tuple(sorted(holders.get(s.uuid, set()) | env.gpu_seen.get(s.uuid, set()))),
            )
            for s in samples
        )

    # ---- environments ------------------------------------------------------------------------

    def _new_env(self, env_id: str, *, platform: str, status: EnvStatus) -> EnvState:
        reuse = self.policy.section(platform).reuse
        env = EnvState(
            id=env_id, status=status, single_use=not reuse,
            trial_slots=self.policy.section(platform).trial_slots if reuse else 1, requested_at=self.now,
            platform=platform,
        )
        self.envs[env_id] = env
        self._out.append(ev.InsertEnvironment(env_id, platform, status.value))
        return env

    def _wanted_new_envs(self, p: PlatformPolicy) -> int:
        """How many more environments platform ``p`` should start now."""
        names = {q.name for q in self.policy.platforms}
        first = self.policy.platforms[0].name
        # Agents an operator started by hand count as the first platform's.
        live = [e for e in self.live_envs() if e.platform == p.name or (p.name == first and e.platform not in names)]
        if p.reuse:
            return max(1, p.environment_count) - len(live)
        # One environment per trial: as many as waiting trials need, within trialConcurrency,
        # on the most preferred platform that takes more (another once it is given up).
        single = [q for q in self.policy.platforms if not q.reuse and q.name not in self.platform_errors]
        order = [n for n in self.policy.preference() if any(q.name == n for q in single)]
        order += [q.name for q in single if q.name not in order]
        fresh = [e for e in self.live_envs() if e.single_use and not e.used and not e.shutdown_sent]
        # Those ending after their trial (drained, not yet gone) hold no place.
        busy = [e for e in self.live_envs() if e.single_use and e.used and e.holders]
        room = self.policy.trial_concurrency - len(busy) - len(fresh)
        wanted = min(len(self.queue) - len(fresh), room)
        for name in order:
            held = sum(1 for e in (*fresh, *busy) if e.platform == name)
            take = min(wanted, self.policy.section(name).environment_count - held)
            if name == p.name:
                return take
            wanted -= max(0, take)
        return 0

    def _reconcile(self) -> None:
        if self.stopping or not self.started or self.env_error:
            return
        limit = max(3, 2 * self.policy.trial_concurrency)
        for p in self.policy.platforms:
            if p.name in self.platform_errors:
                continue
            for _ in range(max(0, self._wanted_new_envs(p))):
                if self._failed_starts.get(p.name, 0) >= limit:
                    self._give_up_platform(p.name, limit)
                    # The others take over now, those before it in this pass too.
                    return self._reconcile()
                env = self._new_env(self._next_env_id(), platform=p.name, status=EnvStatus.REQUESTED)
                self._out.append(ev.StartEnvironment(env.id))

    def _give_up_platform(self, platform: str, limit: int) -> None:
        """Too many of ``platform``'s environments in a row failed to start: it starts no
        more. Trials that may use no other platform fail; the experiment goes on with the
        others, and ends its trials only when every platform is given up."""
        last = next(
            (e.reason for e in reversed(list(self.envs.values())) if e.platform == platform and e.status is EnvStatus.FAILED),
            "",
        )
        self.platform_errors[platform] = f"{limit} environments in a row failed to start; last: {last}"
        names = [p.name for p in self.policy.platforms]
        alive = [n for n in names if n not in self.platform_errors]
        if len(names) == 1:
            self.env_error = self.platform_errors[platform]
        elif not alive:
            self.env_error = "every platform failed: " + "; ".join(f"{n}: {self.platform_errors[n]}" for n in names)
        log.error("platform %s: %s", platform, self.platform_errors[platform])
        self._fail_trials_no_platform_takes()

    def _fail_trials_no_platform_takes(self) -> None:
        """Fail the waiting trials that may use only platforms given up on."""
        if not self.platform_errors:
            return
        names = [p.name for p in self.policy.platforms]
        by_hand = {e.platform for e in self.live_envs()} - set(names)
        for tid in list(self.queue):
            t = self.trials[tid]
            demand = self._demand(t)
            allowed = [n for n in names if demand.rank(n) is not None]
            # Agents started by hand (another platform name) still serve unrestricted trials.
            if any(n not in self.platform_errors for n in allowed) or (not demand.only_these and by_hand):
                continue
            self.queue.remove(tid)
            why = "; ".join(f"{n}: {self.platform_errors[n]}" for n in allowed)
            self._trial_to(t, TrialStatus.FAILED, f"no environment could be started: {why}")

    def _env_start_answered(self, answer: ev.EnvironmentStarted | ev.EnvironmentStartFailed) -> None:
        env = self.envs.get(answer.env_id)
        if env is None or env.status is not EnvStatus.REQUESTED:
            return
        if isinstance(answer, ev.EnvironmentStartFailed):
            self._start_failed(env)
            self._env_to(env, EnvStatus.FAILED, answer.error)
        else:
            env.platform_id = answer.platform_id
            self._out.append(ev.UpdateEnvironment(env.id, {"platform_id": answer.platform_id}))
            self._env_to(env, EnvStatus.STARTING, f"started ({answer.platform_id})")
        self._reconcile()

    def _start_failed(self, env: EnvState) -> None:
        self._failed_starts[env.platform] = self._failed_starts.get(env.platform, 0) + 1

    def _shutdown_env(self, env: EnvState, *, drain: bool, reason: str, grace_s: float = 5.0) -> None:
        if env.shutdown_sent:
            return
        env.shutdown_sent = True
        self._env_changed(env)
        if env.link is not None:
            self._out.append(ev.Send(env.link, ev.Shutdown(drain, grace_s, reason)))
        if env.status in (EnvStatus.READY, EnvStatus.BUSY):
            self._env_to(env, EnvStatus.DRAINING, reason)
        self._out.append(ev.PollSoon())

    def _polled(self, observations: Mapping[str, ev.Observation]) -> None:
        policy = self.policy
        now = self.now
        lost_after = policy.agent_lost_timeout_s * self.beat_scale
        for env in self.live_envs():
            obs = observations.get(env.id)
            ended = obs is not None and obs.state in ("exited", "failed")
            if env.status in (EnvStatus.REQUESTED, EnvStatus.STARTING):
                if ended:
                    assert obs is not None
                    self._start_failed(env)
                    self._env_to(env, EnvStatus.FAILED, f"agent did not register: {obs.detail}")
                    # What the platform still holds for it (a pod that cannot pull its image
                    # keeps its node's GPUs) goes now, not when the experiment ends.
                    self._out.append(ev.StopEnvironment(env.id, 5.0))
                elif env.status is EnvStatus.STARTING and obs is not None and obs.state == "starting":
                    # Still queued on the platform (a pending Slurm job, an unscheduled pod):
                    # waiting there is the platform's business, so the agent's start clock
                    # runs from when the platform runs it.
                    env.requested_at = now
                    if obs.detail and obs.detail != env.reason:
                        env.reason = obs.detail
                        self._out.append(ev.UpdateEnvironment(env.id, {"reason": obs.detail}))
                elif env.status is EnvStatus.STARTING and now - env.requested_at > policy.agent_start_timeout_s:
                    self._start_failed(env)
                    self._env_to(env, EnvStatus.FAILED, f"agent did not register within {policy.agent_start_timeout_s:.0f} s")
                    self._out.append(ev.StopEnvironment(env.id, 5.0))
                continue
            if ended and env.link is None:
                assert obs is not None
                self._lose_trials(env, obs.detail, keep=set())
                # Asked to stop, or drained by an operator: stopped. A platform that says the
                # job failed (preempted, say: its agent may have been draining on the
                # platform's own signal) gets the last word.
                if env.shutdown_sent or (env.status is EnvStatus.DRAINING and obs.state != "failed"):
                    self._env_to(env, EnvStatus.STOPPED, obs.detail or "agent exited")
                else:
                    self._env_to(env, EnvStatus.FAILED, obs.detail or "agent exited")
            elif env.status is not EnvStatus.LOST and now - env.last_seen > lost_after:
                # First timer: the agent is unreachable. Nothing new goes to it, but its
                # trials may well be running still; it can come back and carry on.
                self._env_to(env, EnvStatus.LOST, f"agent unreachable: no heartbeat for {now - env.last_seen:.1f} s")
            elif env.status is EnvStatus.LOST and now - env.last_seen > policy.trial_lost_timeout_s * self.beat_scale:
                # Second timer: give its trials up (retry or fail) and replace it.
                reason = f"no heartbeat for {now - env.last_seen:.1f} s"
                self._lose_trials(env, reason, keep=set())
                self._env_to(env, EnvStatus.FAILED, f"agent lost: {reason}")
                if env.link is not None:
                    self._close(env.link)
                self._out.append(ev.StopEnvironment(env.id, 0.0))

    def _env_to(self, env: EnvState, new: EnvStatus, reason: str) -> None:
        check_env(env.status, new)
        old = env.status
        env.status = new
        self._env_generation += 1
        self._env_changed(env)
        env.reason = reason
        self._out.append(ev.UpdateEnvironment(env.id, {
            "status": new.value, "reason": reason, "ended_at": self.wall if new.terminal else None,
        }))
        self._out.append(ev.RecordTransition("environment", env.id, old.value, new.value, reason))
        log.info("environment %s: %s -> %s (%s)", env.id, old.value, new.value, reason)
