"""The fleet's arithmetic, as plain functions over :class:`EnvState` values: an environment's
GPUs as its agent registers them and its heartbeats show them, what a fleet offers, how many
environments to start, how often agents should beat, and an environment as its stored row
says. ``fleet.py`` holds the state and decides with these."""

from __future__ import annotations

import logging
import re
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import events as ev
from . import scheduler
from .model import EnvState, enum_or, loads_or
from .policy import PlatformPolicy, Policy
from .rows import GpuSampleRow
from .states import EnvStatus

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


@dataclass(frozen=True)
class Joined:
    """An agent registered: what the engine tells the book, and sends it, next."""

    env_id: str
    platform: str
    link: int
    new_instance: bool
    lost: tuple[str, ...]  # trials the environment held under a previous agent: gone with it
    held: tuple[str, ...]  # trials it holds now


@dataclass(frozen=True)
class Lost:
    """An environment is gone with the trials it held (freed here already)."""

    env_id: str
    trial_ids: tuple[str, ...]
    reason: str
    platform: str
    # Seconds since the coordinator last heard of it: its trials' attempts ended by then, as
    # far as anyone knows (a loss is noticed a timeout later).
    silent_s: float = 0.0


class EnvIds:
    """The ids the coordinator gives environments: env-1, env-2, ..., each past every id
    seen (an agent an operator started by hand may have taken one)."""

    _STARTED = re.compile(r"env-([0-9]+)")

    def __init__(self) -> None:
        self._last = 0

    def saw(self, env_id: str) -> None:
        m = self._STARTED.fullmatch(env_id)
        if m:
            self._last = max(self._last, int(m.group(1)))

    def next(self, taken: Container[str]) -> str:
        self._last += 1
        while f"env-{self._last}" in taken:
            self._last += 1
        return f"env-{self._last}"


def new_env(env_id: str, platform: str, status: EnvStatus, policy: Policy, now: float) -> EnvState:
    section = policy.section(platform)
    return EnvState(
        id=env_id, status=status, single_use=not section.reuse,
        trial_slots=section.trial_slots if section.reuse else 1, requested_at=now, platform=platform,
    )


def refusal(
    env: EnvState | None, reg: ev.AgentRegistered, *, stopping: bool, reuse: bool, closing: set[int]
) -> tuple[ev.Refusal, str] | None:
    """Why an agent's registration for ``env`` (None: not one the coordinator knows) is
    refused, or None when it joins."""
    if env is not None and env.left and env.instance_id == reg.instance_id:
        # Its Leaving was stored, the ack lost on the way: it exits as cleanly as it meant to.
        return ev.Refusal.LEFT, f"environment {env.id} was stopped: {env.reason}; this agent had left it"
    if stopping:
        return ev.Refusal.NOT_NOW, "the experiment is stopping"
    if env is None:
        if reuse:
            return None  # an operator started this agent by hand: it joins as an extra one
        return ev.Refusal.UNKNOWN_ENVIRONMENT, (
            f"unknown environment {reg.env_id!r}; without reuse mode agents join only "
            f"environments the coordinator started"
        )
    if env.status.terminal:
        if reuse and not env.started_here and env.instance_id != reg.instance_id:
            return None  # its operator started its agent again: a fresh start of it
        return ev.Refusal.NOT_NOW, f"environment {env.id} was {env.status.value.lower()}: {env.reason}" + (
            "" if env.started_here else "; start its agent again to join as a fresh start of it")
    if env.link is not None and env.link not in closing and env.instance_id != reg.instance_id:
        return ev.Refusal.ALREADY_CONNECTED, f"environment {env.id} already has a connected agent"
    return None


@dataclass(frozen=True)
class Verdict:
    """What becomes of a live environment, from what its platform says and its timers."""

    status: EnvStatus | None = None  # its new status
    reason: str = ""
    start_failed: bool = False  # it counts as a failed start of its platform
    lose: str | None = None  # its trials are lost, for this reason
    close: bool = False  # its agent's stream is closed
    stop_grace_s: float | None = None  # the platform is asked to stop it, with this grace
    still_queued: bool = False  # it waits on its platform (``reason`` says for what)


def observed(
    env: EnvState, obs: ev.Observation | None, now: float, policy: Policy, beat_scale: float
) -> Verdict | None:
    """What ``obs`` (None: the platform said nothing of it) and the timers make of ``env``;
    None: nothing changes."""
    ended = obs is not None and obs.state in ("exited", "failed")
    if env.status in (EnvStatus.REQUESTED, EnvStatus.STARTING):
        if ended:
            assert obs is not None
            # What the platform still holds for it (a pod that cannot pull its image keeps its
            # node's GPUs) goes now, not when the experiment ends.
            return Verdict(EnvStatus.FAILED, f"agent did not register: {obs.detail}", start_failed=True,
                           stop_grace_s=5.0)
        if env.status is EnvStatus.STARTING and obs is not None and obs.state == "starting":
            # Still queued on the platform (a pending Slurm job, an unscheduled pod).
            return Verdict(reason=obs.detail or env.reason, still_queued=True)
        if env.status is EnvStatus.STARTING and now - env.requested_at > policy.agent_start_timeout_s:
            return Verdict(EnvStatus.FAILED, f"agent did not register within {policy.agent_start_timeout_s:.0f} s",
                           start_failed=True, stop_grace_s=5.0)
        return None
    if ended and env.link is None:
        assert obs is not None
        # Asked to stop, or drained by an operator: stopped. A platform that says the job
        # failed (preempted, say: its agent may have been draining on the platform's own
        # signal) gets the last word.
        stopped = env.shutdown_sent or (env.status is EnvStatus.DRAINING and obs.state != "failed")
        return Verdict(EnvStatus.STOPPED if stopped else EnvStatus.FAILED, obs.detail or "agent exited",
                       lose=obs.detail)
    silent = now - env.last_seen
    if env.status is not EnvStatus.LOST and silent > policy.agent_lost_timeout_s * beat_scale:
        # First timer: the agent is unreachable. Nothing new goes to it, but its trials may
        # well be running still; it can come back and carry on.
        return Verdict(EnvStatus.LOST, f"agent unreachable: no heartbeat for {silent:.1f} s")
    if env.status is EnvStatus.LOST and silent > policy.trial_lost_timeout_s * beat_scale:
        # Second timer: give its trials up (retry or fail) and replace it.
        reason = f"no heartbeat for {silent:.1f} s"
        return Verdict(EnvStatus.FAILED, f"agent lost: {reason}", lose=reason, close=True, stop_grace_s=0.0)
    return None


def back_from_lost(env: EnvState) -> EnvStatus:
    """The status of a LOST environment whose agent is back: draining as it was, else busy
    or ready as its trials say."""
    if env.draining or env.shutdown_sent:
        return EnvStatus.DRAINING
    return EnvStatus.BUSY if env.holders else EnvStatus.READY


def registered_gpus(env: EnvState, reg: ev.AgentRegistered, section: PlatformPolicy) -> None:
    """A new agent's GPUs, shared as its platform (or else its section) says."""
    per_gpu, env.use_active_gpu = env.gpu_sharing or section.gpu_sharing
    env.gpus = [
        scheduler.GpuSlot(g.uuid, g.index, per_gpu, memory_total_bytes=g.memory_total_bytes) for g in reg.gpus
    ]
    env.gpu_names = {
        g.uuid: g.name + (" (MIG)" if g.mig else "") + (" (simulated)" if g.simulated else "") for g in reg.gpus
    }
    env.gpu_reason = reg.gpu_unavailable_reason


def gpus_offered(envs: Iterable[EnvState], policy: Policy) -> int | None:
    """The most GPUs one environment offers, once the environments that will exist are known:
    the simulated GPUs every platform declares (and any agent's by hand), else what the
    registered agents have once none is on its way; None while an agent yet to register may
    have more. The same answer however registrations and submissions interleave."""
    envs = list(envs)
    registered = [len(e.gpus) for e in envs if e.instance_id and not e.status.terminal]
    simulated = [p.gpus_offered() for p in policy.platforms]
    if all(simulated):
        return max(simulated + registered)
    return max(registered) if registered and not on_their_way(envs) else None


def on_their_way(envs: Iterable[EnvState]) -> bool:
    """Whether an environment is still starting: its agent, yet to register, may offer more."""
    return any(e.status in (EnvStatus.REQUESTED, EnvStatus.STARTING) for e in envs)


def never_fits(envs: Iterable[EnvState], offered: int | None, gpus: int, memory: int) -> str:
    """Why a trial asking for ``gpus`` GPUs (``gpus`` > 0) with ``memory`` bytes each could
    never run on these environments, or '' (also while one still starting may have them)."""
    if offered is not None and gpus > offered:
        return (
            f"trial asks for {gpus} GPU{'' if gpus == 1 else 's'} but no environment offers more "
            f"than {offered}; lower trialGpuNumber or add GPUs (gpuIndices/simulatedGpus)"
        )
    if memory and not on_their_way(envs := list(envs)):
        registered = [e for e in envs if e.instance_id and not e.status.terminal and e.gpus]
        big = [sum(1 for g in e.gpus if not g.memory_total_bytes or g.memory_total_bytes >= memory)
               for e in registered]
        if registered and max(big) < gpus:
            largest = max(g.memory_total_bytes for e in registered for g in e.gpus)
            return (
                f"trial asks for {gpus} GPU(s) with {memory / 2**30:.1f} GiB each but no environment "
                f"has {gpus} GPU(s) that large (the largest has {largest / 2**30:.1f} GiB); "
                f"lower trialGpuMemory"
            )
    return ""


def wanted_new(
    policy: Policy, p: PlatformPolicy, live: Sequence[EnvState], platform_errors: Mapping[str, str],
    waiting: int,
) -> int:
    """How many more environments platform ``p`` should start now, with ``live`` ones up and
    ``waiting`` trials waiting."""
    names = {q.name for q in policy.platforms}
    first = policy.platforms[0].name
    # Agents an operator started by hand count as the first platform's.
    mine = [e for e in live if e.platform == p.name or (p.name == first and e.platform not in names)]
    if p.reuse:
        return p.environment_count - len(mine)  # 0: only agents started by hand
    # One environment per trial: as many as waiting trials need, within trialConcurrency, on
    # the most preferred platform that takes more (another once it is given up).
    single = [q for q in policy.platforms if not q.reuse and q.name not in platform_errors]
    order = [n for n in policy.preference() if any(q.name == n for q in single)]
    order += [q.name for q in single if q.name not in order]
    fresh = [e for e in live if e.single_use and not e.used and not e.shutdown_sent]
    # Those ending after their trial (drained, not yet gone) hold no place.
    busy = [e for e in live if e.single_use and e.used and e.holders]
    room = policy.trial_concurrency - len(busy) - len(fresh)
    wanted = min(waiting - len(fresh), room)
    for name in order:
        held = sum(1 for e in (*fresh, *busy) if e.platform == name)
        take = min(wanted, policy.section(name).environment_count - held)
        if name == p.name:
            return take
        wanted -= max(0, take)
    return 0


def sampled(env: EnvState, samples: tuple[ev.GpuSample, ...], *, watch_memory: bool) -> bool:
    """Take a heartbeat's GPU samples: which trials' processes are on which GPU, foreign
    processes, memory. Returns whether what the environment can take changed (a GPU freed
    by an ended trial, a foreign process came or went, or, with ``watch_memory``, free
    memory moved)."""
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
    # Free memory matters only to trials that ask for some (trialGpuMemory): looked at only
    # while one waits, so that a plain heartbeat stays cheap.
    had_memory = [g.free_memory() for g in env.gpus] if watch_memory else None
    released = scheduler.gpu_sampled(env.gpus, seen, foreign=foreign, memory_used=memory_used, usage=usage)
    for uuid, tid in released:
        log.info("environment %s: GPU %s released by ended trial %s (its processes left the GPU)",
                 env.id, uuid, tid)
    return (
        bool(released) or was_foreign != foreign
        or (watch_memory and had_memory != [g.free_memory() for g in env.gpus])
    )


def rows_to_keep(
    env: EnvState, samples: tuple[ev.GpuSample, ...], now: float, wall: float, interval_s: float
) -> list[GpuSampleRow]:
    """A GPU sample of ``env`` to keep every ``interval_s``, and whenever the set of trials on
    its GPUs changed, so that short trials have samples too."""
    holders_now = [g.holders for g in env.gpus]
    if now - env.gpu_recorded_at < interval_s and holders_now == env.gpu_recorded_holders:
        return []
    env.gpu_recorded_at, env.gpu_recorded_holders = now, [set(h) for h in holders_now]
    holders = {g.uuid: g.holders for g in env.gpus}
    return [
        GpuSampleRow(
            wall, env.id, s.uuid, s.utilization_percent, s.memory_used_bytes, env.gpu_usage[s.uuid][2],
            tuple(sorted(holders.get(s.uuid, set()) | env.gpu_seen.get(s.uuid, set()))),
        )
        for s in samples
    ]


def restored_env(
    row: Mapping[str, Any], policy: Policy, sharing: tuple[int, bool] | None, now: float
) -> EnvState:
    """An environment from its stored row, taken as far as it can be read, with the GPUs
    its agent registered."""
    status = enum_or(EnvStatus, row["status"], EnvStatus.FAILED)
    info = loads_or(row["info_json"] or "{}", {})
    # Each platform takes back its own environments, with its own section's settings.
    platform = str(row.get("platform") or "")
    section = policy.section(platform)
    env = EnvState(
        id=row["id"], status=status, single_use=not section.reuse,
        trial_slots=section.trial_slots if section.reuse else 1, platform=platform,
        platform_id=row["platform_id"], reason=row["reason"], hostname=row["hostname"],
        instance_id=row["agent_instance_id"], last_seq=row["last_seq"], last_seen=now, requested_at=now,
        # Only what the coordinator started has a platform id (what its platform answered).
        started_here=bool(row["platform_id"]), gpu_sharing=sharing,
        # A member of a group started for a trial stays one: held for it while it waits.
        group=str(row.get("group_id") or ""), group_for=str(row.get("group_for") or ""),
        # Its agent left it (Leaving) and may dial again, its ack lost: it is told so.
        left=bool(row.get("agent_left") or 0),
    )
    per_gpu, env.use_active_gpu = sharing or section.gpu_sharing
    gpus = [g for g in info.get("gpus", []) if isinstance(g, dict)] if isinstance(info, dict) else []
    env.gpus = [
        scheduler.GpuSlot(g["uuid"], g["index"], per_gpu, memory_total_bytes=g.get("memory_total_bytes", 0))
        for g in gpus
    ]
    env.gpu_names = {g["uuid"]: g["name"] + (" (simulated)" if g.get("simulated") else "") for g in gpus}
    return env


def left(env: EnvState, drained: bool) -> str | None:
    """Why ``env`` is stopped now that its agent said it leaves of its own accord, or None
    when its platform, which started it, says what became of it once the agent is gone (a
    job its scheduler preempted is failed, not stopped)."""
    if env.started_here or env.status.terminal:
        return None
    return ("its agent drained and left (its operator stopped it)" if drained
            else "its agent left, its trials stopped (its operator stopped it twice)")


def hold_restored(envs: Mapping[str, EnvState], env_id: str | None, trial_id: str, gpu_uuids: tuple[str, ...],
                  gpu_indices: tuple[int, ...]) -> tuple[str, ...] | None:
    """After a crash: ``trial_id`` was placed on ``env_id``, which holds it again (its GPUs'
    UUIDs returned), or None when that environment is gone."""
    host = envs.get(env_id or "")
    if host is None or host.status.terminal:
        return None
    return hold(host, trial_id, gpu_uuids, gpu_indices)


def hold(env: EnvState, trial_id: str, gpu_uuids: tuple[str, ...], gpu_indices: tuple[int, ...]) -> tuple[str, ...]:
    """After a crash: ``env`` holds ``trial_id`` again, with its GPUs (their UUIDs returned)."""
    env.holders.add(trial_id)
    # By UUID: MIG devices share their parent's index. (A store from before UUIDs were kept
    # has indices only.)
    uuids = gpu_uuids or tuple(g.uuid for g in env.gpus if g.index in gpu_indices)
    for g in env.gpus:
        if g.uuid in uuids:
            g.take(trial_id)
    return uuids


def last_failure(envs: Iterable[EnvState], platform: str) -> str:
    """Why the last environment of ``platform`` that failed did."""
    failed = (e for e in reversed(list(envs)) if e.platform == platform and e.status is EnvStatus.FAILED)
    return next((e.reason for e in failed), "")
