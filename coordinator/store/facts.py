"""What each fact the decision core records becomes in the store: its rows, columns and JSON.

The core says what happened in its own words (``engine/facts.py``); this table
is the one place that knows how the store keeps each. :meth:`Store.keep` writes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..engine import checkpoints as ck
from ..engine import events as ev


@dataclass(frozen=True)
class Insert:
    table: str
    row: Mapping[str, Any]
    replace: bool = False  # the row of the same id, if any, goes


@dataclass(frozen=True)
class Update:
    table: str
    row_id: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Transition:
    """A line of an entity's history (the ``events`` table)."""

    entity: str  # "trial" | "environment"
    entity_id: str
    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class WaitingReasons:
    reasons: Mapping[str, str]


@dataclass(frozen=True)
class CheckpointKept:
    checkpoint: ck.Checkpoint


@dataclass(frozen=True)
class CheckpointGone:
    trial_id: str
    step: int
    at: float


@dataclass(frozen=True)
class Superseded:
    """The trial's results from ``from_index`` on move to its history."""

    trial_id: str
    from_index: int
    at: float


@dataclass(frozen=True)
class CheckpointDigest:
    trial_id: str
    step: int
    digest: str


Write = (
    Insert | Update | Transition | WaitingReasons | CheckpointKept | CheckpointGone | Superseded | CheckpointDigest
)


def _trial_added(f: ev.TrialAdded) -> tuple[Write, ...]:
    row = {
        "id": f.trial_id, "seq": f.seq, "status": f.status.value, "parameters_json": json.dumps(f.parameters),
        "command": f.command, "gpu_number": f.gpu_number, "submitted_at": f.submitted_at,
    }
    if f.platforms:
        row["platforms_json"] = json.dumps(list(f.platforms))
    if f.forked_from is not None:
        row["forked_from_json"] = json.dumps(list(f.forked_from))
    if f.nodes > 1:
        row["nodes"] = f.nodes
    if f.max_duration:
        row["max_duration"] = f.max_duration
    return (Insert("trials", row),)


def _trial_status(f: ev.TrialStatusChanged) -> tuple[Write, ...]:
    # Cleared unless the status is terminal: a trial retried or paused has not ended.
    fields: dict[str, Any] = {"status": f.new.value, "reason": f.reason, "ended_at": f.ended_at}
    if f.ran_s:
        fields["ran_s"] = f.ran_s
    return Update("trials", f.trial_id, fields), Transition("trial", f.trial_id, f.old, f.new.value, f.because)


def _env_status(f: ev.EnvironmentStatusChanged) -> tuple[Write, ...]:
    fields = {"status": f.new.value, "reason": f.reason, "ended_at": f.ended_at}
    return Update("environments", f.env_id, fields), Transition("environment", f.env_id, f.old, f.new.value, f.reason)


#: Each fact's writes, by its type.
WRITES: dict[type, Callable[[Any], tuple[Write, ...]]] = {
    ev.TrialAdded: _trial_added,
    ev.TrialStatusChanged: _trial_status,
    ev.TrialPlaced: lambda f: (Update("trials", f.trial_id, {
        "environment_id": f.env_id, "last_environment_id": f.env_id, "attempts": f.attempts,
        "gpu_indices_json": json.dumps(list(f.gpu_indices)), "gpu_uuids_json": json.dumps(list(f.gpu_uuids)),
    }),),
    ev.TrialUnplaced: lambda f: (Update("trials", f.trial_id, {
        "environment_id": None, "gpu_indices_json": "[]", "gpu_uuids_json": "[]",
    }),),
    ev.TrialRanks: lambda f: (Update("trials", f.trial_id, {"ranks_json": json.dumps([
        [r.rank, r.environment_id, list(r.gpu_indices), r.state] for r in f.ranks
    ])}),),
    ev.TrialRan: lambda f: (Update("trials", f.trial_id, {"started_at": f.started_at}),),
    ev.TrialStopping: lambda f: (Update("trials", f.trial_id, {"reason": f.reason, "stopping": 1}),),
    ev.TrialExited: lambda f: (Update("trials", f.trial_id, {
        "exit_code": f.exit_code, "signal": f.signal, "stderr_tail": f.stderr_tail,
    }),),
    ev.FinalResultSet: lambda f: (Update("trials", f.trial_id, {
        "final_metric": f.value, "final_metric_json": f.value_json,
    }),),
    ev.WaitingReasonsChanged: lambda f: (WaitingReasons(f.reasons),),
    ev.EnvironmentAdded: lambda f: (Insert("environments", {
        "id": f.env_id, "platform": f.platform, "status": f.status.value, "created_at": f.created_at,
    }, replace=f.again),),
    ev.EnvironmentStatusChanged: _env_status,
    ev.EnvironmentGrouped: lambda f: (Update("environments", f.env_id, {
        "group_id": f.group, "group_for": f.trial_id,
    }),),
    ev.EnvironmentLaunched: lambda f: (Update("environments", f.env_id, {"platform_id": f.platform_id}),),
    ev.EnvironmentWaits: lambda f: (Update("environments", f.env_id, {"reason": f.reason}),),
    ev.AgentJoined: lambda f: (Update("environments", f.env_id, {
        "hostname": f.hostname, "agent_instance_id": f.instance_id, "last_seq": 0,
        "info_json": json.dumps(dict(f.info)),
    }),),
    ev.AgentConnected: lambda f: (Update("environments", f.env_id, {"connected": int(f.connected)}),),
    ev.AgentMessagesStored: lambda f: (Update("environments", f.env_id, {"last_seq": f.last_seq}),),
    ev.EnvironmentLeft: lambda f: (Update("environments", f.env_id, {"agent_left": 1}),),
    ck.CheckpointRecorded: lambda f: (CheckpointKept(f.checkpoint),),
    ck.CheckpointRemoved: lambda f: (CheckpointGone(f.trial_id, f.step, f.removed_at),),
    ck.MetricsSuperseded: lambda f: (Superseded(f.trial_id, f.from_index, f.at),),
    ck.CheckpointDigestKnown: lambda f: (CheckpointDigest(f.trial_id, f.step, f.digest),),
    ck.TrialRetried: lambda f: (Update("trials", f.trial_id, {"retries": f.retries, "progressed": int(f.progressed)}),),
    ck.TrialForked: lambda f: (Update("trials", f.trial_id, {"forked_from_json": json.dumps(list(f.forked_from))}),),
    ck.TrialParametersChanged: lambda f: (Update("trials", f.trial_id, {
        "parameters_json": json.dumps(dict(f.parameters)),
    }),),
}


def writes_of(fact: ev.Fact) -> tuple[Write, ...]:
    return WRITES[type(fact)](fact)
