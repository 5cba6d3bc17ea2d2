"""Rebuilding the decision core's state from what the store kept, after a crash.

Pure: it takes the store's rows as plain mappings and returns the instructions (records to
write) that the rebuild implies. A row an older or broken version wrote badly is taken as
far as it can be read; it never stops a resume.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from . import events as ev
from . import scheduler
from .engine import Engine
from .model import EnvState, TrialState
from .states import EnvStatus, TrialStatus

log = logging.getLogger(__name__)


def restore(
    engine: Engine, trial_rows: Iterable[Mapping[str, Any]], env_rows: Iterable[Mapping[str, Any]], *, now: float, wall: float
) -> list[ev.Instruction]:
    """Trials, queue and environments as the store has them.

    Environments that were up are taken as unreachable until their agents reconnect; the
    usual timers apply from now. Trials keep their placements: a running trial whose agent
    comes back goes on, one whose agent does not is lost like any other.
    """
    engine.now, engine.wall = now, wall
    out: list[ev.Instruction] = []
    engine._out = out
    policy = engine.policy
    requeued: list[TrialState] = []  # waiting, back to the queue in submission order
    for r in trial_rows:
        status = _status(TrialStatus, r["status"], None)
        parameters = _json(r["parameters_json"], None)
        unreadable = [
            what for what, bad in (("status", status is None), ("parameters", not isinstance(parameters, dict))) if bad
        ]
        gpu_number = int(r["gpu_number"] or 0)
        t = TrialState(
            id=r["id"], seq=r["seq"], status=status or TrialStatus.FAILED,
            parameters=parameters if isinstance(parameters, dict) else {}, command=r["command"],
            gpu_number=gpu_number, submitted_at=r["submitted_at"],
            gpu_memory=policy.trial_gpu_memory if gpu_number else 0, env_id=r["environment_id"],
            gpu_indices=tuple(_json(r["gpu_indices_json"], [])), gpu_uuids=tuple(_json(r["gpu_uuids_json"], [])),
            exit_code=r["exit_code"], signal=r["signal"], reason=r["reason"], stderr_tail=r["stderr_tail"],
            final_metric=r["final_metric"], final_metric_json=r["final_metric_json"], attempts=r["attempts"],
            started_at=r["started_at"], ended_at=r["ended_at"], platforms=_platforms(r.get("platforms_json")),
        )
        if unreadable and (status is None or not status.terminal):
            # Not run again with what cannot be read: failed, and the store says why.
            t.status, t.env_id = TrialStatus.FAILED, None
            t.reason = f"its stored {' and '.join(unreadable)} cannot be read; not resumed"
            t.ended_at = t.ended_at or wall
            out.append(ev.UpdateTrial(t.id, {"status": t.status.value, "reason": t.reason, "ended_at": t.ended_at}))
            out.append(ev.RecordTransition("trial", t.id, str(r["status"]), t.status.value, t.reason))
            log.warning("trial %s: %s", t.id, t.reason)
        if not t.status.terminal and t.env_id is None:
            requeued.append(t)
        engine.trials[t.id] = t
        engine._next_seq = max(engine._next_seq, t.seq + 1)
    for r in env_rows:
        engine._saw_env_id(r["id"])
        status = _status(EnvStatus, r["status"], EnvStatus.FAILED)
        info = _json(r["info_json"] or "{}", {})
        # Each platform takes back its own environments, with its own section's settings.
        platform = str(r.get("platform") or "")
        section = policy.section(platform)
        reuse = section.reuse
        env = EnvState(
            id=r["id"], status=status, single_use=not reuse, trial_slots=section.trial_slots if reuse else 1,
            platform=platform,
            platform_id=r["platform_id"], reason=r["reason"], hostname=r["hostname"],
            instance_id=r["agent_instance_id"], last_seq=r["last_seq"], last_seen=now, requested_at=now,
            # Only what the coordinator started has a platform id (what its platform answered).
            started_here=bool(r["platform_id"]),
        )
        per_gpu, env.use_active_gpu = section.gpu_policy(env.id)
        gpus = [g for g in info.get("gpus", []) if isinstance(g, dict)] if isinstance(info, dict) else []
        env.gpus = [
            scheduler.GpuSlot(g["uuid"], g["index"], per_gpu, memory_total_bytes=g.get("memory_total_bytes", 0)) for g in gpus
        ]
        env.gpu_names = {g["uuid"]: g["name"] + (" (simulated)" if g.get("simulated") else "") for g in gpus}
        engine.envs[env.id] = env
        if status is EnvStatus.REQUESTED:
            # Asked for, the platform's answer never recorded: no answer will come now. Failed,
            # so that it is replaced and the sweep removes whatever the platform made of it.
            reason = "the coordinator restarted before the platform accepted it"
            env.status, env.reason = EnvStatus.FAILED, reason
            out.append(ev.UpdateEnvironment(env.id, {"status": EnvStatus.FAILED.value, "reason": reason, "ended_at": wall}))
            out.append(ev.RecordTransition("environment", env.id, status.value, EnvStatus.FAILED.value, reason))
        if status in (EnvStatus.READY, EnvStatus.BUSY, EnvStatus.DRAINING):
            env.status = EnvStatus.LOST
            env.draining = status is EnvStatus.DRAINING
            out.append(ev.UpdateEnvironment(env.id, {"status": EnvStatus.LOST.value, "reason": "the coordinator restarted"}))
            out.append(ev.RecordTransition(
                "environment", env.id, status.value, EnvStatus.LOST.value, "the coordinator restarted; waiting for its agent"
            ))
    for t in engine.trials.values():
        if t.status.terminal or t.env_id is None:
            continue
        host = engine.envs.get(t.env_id)
        if host is None or host.status.terminal:
            # Placed on an environment that is gone: back to the queue, or lost.
            t.env_id, t.gpu_indices = None, ()
            if t.status is TrialStatus.WAITING:
                requeued.append(t)
            else:
                engine._trial_to(t, TrialStatus.FAILED, "environment lost: it ended while the coordinator was down")
            continue
        host.holders.add(t.id)
        # By UUID: MIG devices share their parent's index. (A store from before UUIDs were
        # kept has indices only.)
        if not t.gpu_uuids:
            t.gpu_uuids = tuple(g.uuid for g in host.gpus if g.index in t.gpu_indices)
        for g in host.gpus:
            if g.uuid in t.gpu_uuids:
                g.take(t.id)
    for t in sorted(requeued, key=lambda t: t.seq):
        engine.queue.append(engine._demand(t))
    log.info(
        "experiment %s resumed: %d trials (%d not finished), %d environments waiting for their agents",
        policy.experiment_id, len(engine.trials), sum(1 for t in engine.trials.values() if not t.status.terminal),
        len(engine.live_envs()),
    )
    engine._out = []
    return out


def _platforms(raw: Any) -> tuple[str, ...]:
    found = _json(raw, [])
    return tuple(p for p in found if isinstance(p, str)) if isinstance(found, list) else ()


def _json(raw: Any, default: Any) -> Any:
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return default


def _status(enum: Any, raw: Any, default: Any) -> Any:
    try:
        return enum(raw)
    except ValueError:
        return default
