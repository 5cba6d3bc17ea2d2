"""The fleet: environments and their agents. Environments started and replaced, agents
joining and leaving, heartbeats and GPU samples, what the platform observes, drain.

One of the engine's three machines (with the trials' book and the supply). It knows the
trials each environment holds by id; the capacity the scheduler places on is kept in
``capacity.py``, the plain arithmetic is in ``environments.py``. Its instructions gather in its own list, which the
engine takes after each call. Nothing here does I/O or reads a clock."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from . import checkpoints as ck
from . import environments, scheduler
from . import events as ev
from .capacity import Capacity
from .environments import Joined, Lost, heartbeat_scale
from .model import EnvState
from .policy import PlatformPolicy, Policy
from .states import EnvStatus, check_env

__all__ = ["Fleet", "Joined", "Lost", "heartbeat_scale"]

log = logging.getLogger(__name__)

class Fleet:
    """The state of one experiment's environments, and every decision on them."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.envs: dict[str, EnvState] = {}
        self.stopping = False
        self.beat_scale = 1.0
        self.capacity = Capacity(self.envs, policy)  # what the scheduler places on
        self._ids = environments.EnvIds()
        self._start_failures: list[str] = []  # the platforms of starts that failed, in order
        self._linked: set[str] = set()
        self._closing: set[int] = set()  # links closed here, not yet reported disconnected
        # link -> (the ack held, until when, the last seq acknowledged before the hold)
        self._held: dict[int, tuple[int, float, int]] = {}
        self._gpu_rows: list[Any] = []
        self._out: list[ev.Instruction] = []
        self.now = self.wall = 0.0

    # The takes run after every event, and most find nothing: no new container for those.

    def take(self) -> list[ev.Instruction]:
        """The instructions of the calls since the last take."""
        out = self._out
        if out:
            self._out = []
        return out

    def take_start_failures(self) -> list[str]:
        """The platforms of the environments that failed to start, since the last take."""
        failed = self._start_failures
        if failed:
            self._start_failures = []
        return failed

    def store_gpu_rows(self) -> None:
        """The GPU samples kept since the last tick, stored in one go."""
        if self._gpu_rows:
            self._out.append(ev.StoreGpuSamples(tuple(self._gpu_rows)))
            self._gpu_rows = []

    # ---- queries -----------------------------------------------------------------------------

    @property
    def heartbeat_interval(self) -> float:
        return self.policy.heartbeat_interval_s * self.beat_scale

    @property
    def gpu_sample_interval(self) -> float:
        """How often GPU samples are kept, and sent at least (agent/beats.py): stretched with
        the heartbeats, so that a fleet of any size sends and stores as many per second."""
        return environments.GPU_SAMPLE_INTERVAL_S * self.beat_scale

    def live_envs(self) -> list[EnvState]:
        return [e for e in self.envs.values() if not e.status.terminal]

    def section(self, env_id: str) -> PlatformPolicy:
        return self.policy.section(self.envs[env_id].platform)

    def writes_own_logs(self, env_id: str) -> bool:
        """Its agent writes the trial log files the coordinator reads (a shared file system)."""
        return self.section(env_id).shares_filesystem and self.envs[env_id].started_here

    def by_hand(self) -> bool:
        """Whether agents an operator started (of no configured platform) are live."""
        names = {p.name for p in self.policy.platforms}
        return any(e.platform not in names for e in self.live_envs())

    def never_fits(self, gpus: int, memory: int = 0) -> str:
        """Why a trial asking for ``gpus`` GPUs with ``memory`` bytes each could never run
        here, or '' when it could (or while agents yet to register may have them)."""
        if gpus == 0:
            return ""
        return environments.never_fits(self.envs.values(), self.capacity.gpus_offered(), gpus, memory)

    # ---- capacity ----------------------------------------------------------------------------

    def running(self) -> int:
        return sum(len(e.holders) for e in self.envs.values())

    def occupied(self, env_id: str, trial_id: str) -> None:
        """The scheduler placed ``trial_id`` on ``env_id`` (its slot and GPUs are taken)."""
        env = self.envs[env_id]
        if env.single_use:
            env.used = True
        if env.status is EnvStatus.READY:
            self._to(env, EnvStatus.BUSY, f"trial {trial_id} placed")

    def release(self, env_id: str, trial_id: str, *, processes_gone: bool = False,
                still_in_use: Iterable[str] = ()) -> None:
        """The trial no longer takes a slot of ``env_id``. Its GPUs are released too, except
        those on which the agent still sees its processes (``still_in_use``, from its
        TrialEnded): they stay held until a heartbeat shows them gone. ``processes_gone``:
        the whole environment is gone, release everything."""
        env = self.envs[env_id]
        env.holders.discard(trial_id)
        self.capacity.changed(env.id)
        in_use = {} if processes_gone else {u: {trial_id} for u in still_in_use}
        scheduler.trial_ended(env.gpus, trial_id, in_use)
        if env.status is EnvStatus.BUSY and not env.holders:
            self._to(env, EnvStatus.READY, f"trial {trial_id} ended")

    def trial_done(self, env_id: str) -> None:
        """A trial of ``env_id`` ended: an environment without reuse goes with it."""
        env = self.envs[env_id]
        if env.single_use:
            self.shutdown(env, drain=True, reason="its trial ended (reuse mode is off)")

    def _drop_holders(self, env: EnvState) -> tuple[str, ...]:
        held = tuple(env.holders)
        for tid in held:
            self.release(env.id, tid, processes_gone=True)
        return held

    # ---- agents ------------------------------------------------------------------------------

    def send(self, env_id: str, message: ev.ToAgent) -> None:
        env = self.envs.get(env_id)
        if env is not None and env.link is not None:
            self._out.append(ev.Send(env.link, message))

    def register(self, reg: ev.AgentRegistered) -> Joined | None:
        """An agent registered: None when it is refused."""
        env = self.envs.get(reg.env_id)
        refused = environments.refusal(env, reg, stopping=self.stopping, reuse=self.policy.reuse,
                                       closing=self._closing)
        if refused is not None:
            return self._out.append(ev.RefuseAgent(reg.env_id, *refused))
        if env is None or env.status.terminal:
            # Started by hand: an extra environment, or a fresh start of an ended one (refusal() let it).
            self._ids.saw(reg.env_id)
            env = self._new_env(reg.env_id, platform=reg.platform or "manual", status=EnvStatus.STARTING,
                                again=env is not None)
            env.started_here = False
        if env.link is not None:
            self._keep_hold(env, env.link)
            if env.link not in self._closing:
                self._close(env.link)  # the same agent reconnected before its old stream was noticed dead
        new_instance = env.instance_id != reg.instance_id
        lost: tuple[str, ...] = ()
        if new_instance:
            if env.instance_id:
                lost = self._drop_holders(env)  # its agent restarted: its trials are gone
            env.instance_id = reg.instance_id
            self.capacity.status_changed(env.id)
            env.last_seq = 0
            env.held_over = None
            environments.registered_gpus(env, reg, self.policy.section(env.platform))
            self._out.append(ev.AgentJoined(env.id, reg.hostname, env.instance_id, dict(reg.info)))
        env.hostname = reg.hostname
        env.link = reg.link
        if env.held_over is not None:  # a save's held ack: held on the new stream too, while its time lasts
            acked, until = env.held_over
            env.held_over = None
            if until > self.now:
                self._held[reg.link] = (env.last_seq, until, acked)
        self.capacity.changed(env.id)
        self._out.append(ev.AgentConnected(env.id, True))
        self._linked.add(env.id)
        env.last_seen = self.now
        registered = f"agent registered from {reg.hostname} (pid {reg.pid})"
        if env.status is EnvStatus.LOST and environments.back_from_lost(env) is EnvStatus.DRAINING:
            self._to(env, EnvStatus.DRAINING, registered)
        elif env.status in (EnvStatus.STARTING, EnvStatus.LOST):
            self._to(env, EnvStatus.READY, registered)
            if env.holders:
                self._to(env, EnvStatus.BUSY, f"it runs {len(env.holders)} trial(s)")
        return Joined(env.id, env.platform, reg.link, new_instance, lost, tuple(env.holders))

    def welcome(self, joined: Joined, unwanted: tuple[str, ...],
                refusals: tuple[ck.CheckpointRefused, ...] = ()) -> None:
        """The agent's first message: what it must stop, how often to beat."""
        env = self.envs[joined.env_id]
        policy = self.policy
        held = self._held.get(joined.link)
        # While a save's ack is held, the agent hears of nothing past what it heard before: it
        # sends the save again, and its answer waits for the search, as on the old stream.
        acked = env.last_seq if held is None else held[2]
        self._out.append(ev.Send(joined.link, ev.Welcome(
            policy.experiment_id, acked, self.heartbeat_interval, unwanted, self.gpu_sample_interval,
            policy.section(env.platform).checkpoint_dir, policy.checkpoint_storage, policy.max_checkpoint_bytes,
            refusals, policy.checkpoint_data_port,
        )))

    def disconnected(self, d: ev.AgentDisconnected) -> None:
        self._closing.discard(d.link)
        env = self.envs.get(d.env_id)
        if env is None or env.link != d.link:
            self._held.pop(d.link, None)
            return
        self._keep_hold(env, d.link)
        env.link = None
        self.capacity.changed(env.id)
        self._out.append(ev.AgentConnected(env.id, False))
        self._linked.discard(env.id)
        log.info("environment %s: agent stream closed", env.id)
        self.rescale_heartbeats()
        self._out.append(ev.PollSoon())  # did its process exit? Ask the platform now

    def _keep_hold(self, env: EnvState, link: int) -> None:
        """The stream ``link`` of ``env`` ends: a hold on its acks is kept for the next one."""
        held = self._held.pop(link, None)
        if held is not None:
            env.held_over = (held[2], held[1])

    def _close(self, link: int) -> None:
        self._closing.add(link)
        self._out.append(ev.CloseLink(link))

    def rescale_heartbeats(self) -> None:
        """Stretch (or shrink back) the heartbeat interval to the number of connected agents,
        with headroom so that a growing fleet changes it a few times, not on every join;
        connected agents are told at once."""
        policy, connected = self.policy, len(self._linked)
        scale = heartbeat_scale(self.beat_scale, connected, policy.heartbeat_interval_s,
                                policy.max_heartbeats_per_second)
        if scale is None:
            return
        self.beat_scale = scale
        self._out.append(ev.HeartbeatsRescaled(self.heartbeat_interval, connected))
        message = ev.Settings(self.heartbeat_interval, self.gpu_sample_interval)
        for e in self.envs.values():
            if e.link is not None and e.link not in self._closing:
                self._out.append(ev.Send(e.link, message))

    def heard(self, env_id: str, link: int) -> EnvState | None:
        """The agent on ``link`` spoke: alive. None for a stream that was replaced."""
        env = self.envs.get(env_id)
        if env is None or env.link != link:
            return None
        env.last_seen = self.now
        if env.status is EnvStatus.LOST:
            self._to(env, environments.back_from_lost(env), "its agent is heard from again")
        return env

    def numbered(self, m: ev.AgentReported) -> bool:
        """Whether a numbered message is new (to be applied); a replay is acknowledged."""
        env = self.heard(m.env_id, m.link)
        if env is None:
            return False
        if m.seq == 0:
            log.warning("environment %s sent a message without a sequence number; ignored", env.id)
            return False
        if m.seq <= env.last_seq:
            if m.link not in self._held:  # (else the held ack covers it)
                self._out.append(ev.Ack(m.link, env.last_seq))  # a replay of something already stored
            return False
        return True

    def stored(self, m: ev.AgentReported) -> None:
        """A numbered message was applied: acknowledged once stored (or later, while its stream's acks are held)."""
        self.envs[m.env_id].last_seq = m.seq
        self._out.append(ev.AgentMessagesStored(m.env_id, m.seq))
        held = self._held.get(m.link) if self._held else None
        if held is None:
            self._out.append(ev.Ack(m.link, m.seq))
        else:  # acks are cumulative: none goes past the save held
            self._held[m.link] = (m.seq, held[1], held[2])

    def hold_acks(self, env_id: str, until: float) -> None:
        """Hold the acks of the agent's stream from the message being applied on (a save the
        search judges: the ack answers the trial's save_checkpoint, so a pause decided on it
        must reach the agent first), until ``release_acks``; ``until`` at the latest."""
        env = self.envs[env_id]
        if env.link is not None and env.link not in self._held:
            self._held[env.link] = (0, until, env.last_seq)

    def release_acks(self, *, due_only: bool) -> None:
        """The held acks go out: all of them, or (``due_only``) those whose time is up."""
        for link, (seq, until, _) in list(self._held.items()):
            if not due_only or until <= self.now:
                del self._held[link]
                if seq:
                    self._out.append(ev.Ack(link, seq))

    def heartbeat(self, hb: ev.HeartbeatReceived, *, watch_memory: bool) -> bool:
        """A heartbeat: whether what the environment can take changed (``watch_memory``:
        a waiting trial asks for GPU memory, so free memory counts)."""
        env = self.heard(hb.env_id, hb.link)
        if env is None:
            return False
        changed = False
        # An agent that says its GPUs are unchanged sent them earlier on this stream (its
        # first heartbeat carries them): nothing to look at, only that it is alive.
        if not hb.gpus_unchanged and (hb.gpus or env.gpus):
            changed = environments.sampled(env, hb.gpus, watch_memory=watch_memory)
            if changed:
                self.capacity.changed(env.id)
            if hb.gpus:
                self._gpu_rows.extend(environments.rows_to_keep(env, hb.gpus, self.now, self.wall,
                                                              self.gpu_sample_interval))
        if hb.draining and not env.draining:
            env.draining = True
            self.capacity.changed(env.id)
            if env.status in (EnvStatus.READY, EnvStatus.BUSY):
                self._to(env, EnvStatus.DRAINING, "the agent is draining (an operator stopped it)")
        return changed

    # ---- environments ------------------------------------------------------------------------

    def _new_env(self, env_id: str, *, platform: str, status: EnvStatus, again: bool = False) -> EnvState:
        self.envs[env_id] = env = environments.new_env(env_id, platform, status, self.policy, self.now)
        self._out.append(ev.EnvironmentAdded(env_id, platform, status, self.wall, again))
        return env

    def request(self, platform: str, size: int = 1, for_trial: str = "") -> None:
        """Ask ``platform`` for ``size`` more environments: for a trial (``for_trial``), as
        one group that is held for it while it waits (see supply.py); else one."""
        envs = [self._new_env(self._ids.next(self.envs), platform=platform, status=EnvStatus.REQUESTED)
                for _ in range(size if for_trial else 1)]
        for env in envs if for_trial else ():
            env.group, env.group_for = envs[0].id, for_trial
            self._out.append(ev.EnvironmentGrouped(env.id, env.group, for_trial))
        self._out.append(ev.StartEnvironmentGroup(envs[0].id, tuple(e.id for e in envs), for_trial) if for_trial
                         else ev.StartEnvironment(envs[0].id))

    def start_answered(self, answer: ev.EnvironmentStarted | ev.EnvironmentStartFailed) -> None:
        env = self.envs.get(answer.env_id)
        if env is None or env.status is not EnvStatus.REQUESTED:
            return
        if isinstance(answer, ev.EnvironmentStartFailed):
            self._start_failures.append(env.platform)
            self._to(env, EnvStatus.FAILED, answer.error)
        else:
            env.platform_id = answer.platform_id
            env.gpu_sharing = answer.gpu_sharing
            self._out.append(ev.EnvironmentLaunched(env.id, answer.platform_id))
            self._to(env, EnvStatus.STARTING, f"started ({answer.platform_id})")

    def shutdown(self, env: EnvState, *, drain: bool, reason: str, grace_s: float = 5.0) -> None:
        if env.shutdown_sent:
            return
        env.shutdown_sent = True
        self.capacity.changed(env.id)
        if env.link is not None:
            self._out.append(ev.Send(env.link, ev.Shutdown(drain, grace_s, reason)))
        if env.status in (EnvStatus.READY, EnvStatus.BUSY):
            self._to(env, EnvStatus.DRAINING, reason)
        self._out.append(ev.PollSoon())

    def stop(self, grace_s: float, *, drain: bool = False) -> None:
        """Shut every environment down (``drain``: once its trials have ended, which they do
        themselves when they were asked to pause)."""
        self.stopping = True
        for env in self.live_envs():
            self.shutdown(env, drain=drain, reason="the experiment stopped", grace_s=grace_s)

    def stop_completed(self) -> None:
        for env in self.live_envs():
            self._to(env, EnvStatus.STOPPED, "the experiment stopped")
        self.store_gpu_rows()

    def left(self, env_id: str, drained: bool) -> list[Lost]:
        """Its agent left of its own accord (an operator stopped it): stopped, if no platform says."""
        env = self.envs[env_id]
        reason = environments.left(env, drained)
        if reason is None:
            return []
        held, env.left = self._drop_holders(env), True
        self._to(env, EnvStatus.STOPPED, reason)
        self._out.append(ev.EnvironmentLeft(env.id))
        return [Lost(env.id, held, reason, env.platform)] if held else []

    def polled(self, observations: Mapping[str, ev.Observation]) -> list[Lost]:
        """What the platform says of each environment, and the lost-agent timers."""
        gone: list[Lost] = []
        for env in self.live_envs():
            v = environments.observed(env, observations.get(env.id), self.now, self.policy, self.beat_scale)
            if v is None:
                continue
            if v.still_queued:
                # Waiting on the platform is the platform's business: the agent's start
                # clock runs from when the platform runs it.
                env.requested_at = self.now
                if v.reason != env.reason:
                    env.reason = v.reason
                    self._out.append(ev.EnvironmentWaits(env.id, v.reason))
                continue
            if v.start_failed:
                self._start_failures.append(env.platform)
            if v.lose is not None:
                gone.append(Lost(env.id, self._drop_holders(env), v.lose, env.platform, self.now - env.last_seen))
            if v.status is not None:
                self._to(env, v.status, v.reason)
            if v.close and env.link is not None:
                self._close(env.link)
            if v.stop_grace_s is not None:
                self._out.append(ev.StopEnvironment(env.id, v.stop_grace_s))
        return gone

    def _to(self, env: EnvState, new: EnvStatus, reason: str) -> None:
        check_env(env.status, new)
        old = env.status
        env.status = new
        self.capacity.status_changed(env.id)
        env.reason = reason
        ended_at = self.wall if new.terminal else None
        self._out.append(ev.EnvironmentStatusChanged(env.id, old.value, new, reason, ended_at))
        log.info("environment %s: %s -> %s (%s)", env.id, old.value, new.value, reason)

    # ---- after a crash -----------------------------------------------------------------------

    def restore(self, rows: Iterable[Mapping[str, Any]], gpu_sharing: Mapping[str, tuple[int, bool]]) -> None:
        """The environments as the store kept them (``gpu_sharing``: what their platforms
        set for them). Those that were up are taken as unreachable until their agents
        reconnect; the usual timers apply from now."""
        for r in rows:
            self._ids.saw(r["id"])
            env = environments.restored_env(r, self.policy, gpu_sharing.get(r["id"]), self.now)
            self.envs[env.id] = env
            status = env.status
            if status is EnvStatus.REQUESTED:
                # Asked for, the platform's answer never recorded: no answer will come now.
                # Failed, so that it is replaced and the sweep removes what the platform made.
                self._to(env, EnvStatus.FAILED, "the coordinator restarted before the platform accepted it")
            elif status in (EnvStatus.READY, EnvStatus.BUSY, EnvStatus.DRAINING):
                env.draining, env.status = status is EnvStatus.DRAINING, EnvStatus.LOST
                env.reason = "the coordinator restarted"
                self._out.append(ev.EnvironmentStatusChanged(env.id, status.value, env.status, env.reason))
