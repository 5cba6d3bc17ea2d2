"""What the gRPC edge refuses of an agent's messages, before the coordinator's core sees them:
a message over a limit of ``protos/limits.py`` (the stream ends), and metrics that are not
metrics (refused one by one; the rest of their batch goes on). These run for every message.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from trialkeeper.protos import limits
from trialkeeper.protos.limits import (
    MAX_ID_CHARS,
)
from trialkeeper.protos.v1 import coordinator_pb2 as pb

# Sequence numbers, metric indexes and byte counts are stored as SQLite integers (signed 64-bit).
MAX_SEQ = 2**63 - 1


def over_limit(msg: pb.AgentMessage) -> str:
    """Why ``msg`` carries more than protos/limits.py allows, or "". Heartbeats and metric
    batches, which come all the time, are checked as they are converted (``wire``), the
    rest by the table here. A test checks each limit of the table on every path."""
    kind = msg.WhichOneof("body")
    if kind == "heartbeat":
        return ""  # checked as it is converted: wire.heartbeat
    if kind == "metrics":
        return ""  # checked as it is converted: wire.metrics_reported
    if kind is None:
        return ""
    body = getattr(msg, kind)
    if kind == "trial_started" and not math.isfinite(body.started_at):
        return "TrialStarted.started_at is not a finite time"
    if kind == "trial_ended" and not math.isfinite(body.ended_at):
        return "TrialEnded.ended_at is not a finite time"
    return _table_over(body, body.DESCRIPTOR.name)


def _table_over(msg: Message, path: str) -> str:
    """:func:`over_limit` for the messages that come once per trial or per connection, driven
    by ``limits.FIELD_LIMITS``."""
    for name, count_limit, each_limit, nested in _limit_plan(msg.DESCRIPTOR):
        value = getattr(msg, name)
        if count_limit and len(value) > getattr(limits, count_limit):
            return limits.over(f"{path}.{name}", len(value), count_limit)
        if each_limit:
            limit = getattr(limits, each_limit)
            for i, item in enumerate(value):
                if len(item) > limit:
                    return limits.over(f"{path}.{name}[{i}]", len(item), each_limit)
        if nested:
            for i, item in enumerate(value):
                inner = _table_over(item, f"{path}.{name}[{i}]")
                if inner:
                    return inner
    return ""


@functools.cache
def _limit_plan(desc: Descriptor) -> tuple[tuple[str, str, str, bool], ...]:
    """Per field of a message type: (name, limit on its length, limit on each item's length,
    whether its items are messages to check in turn)."""
    plan = []
    for f in desc.fields:
        key = f"{desc.name}.{f.name}"
        count_limit = limits.FIELD_LIMITS.get(key, "")
        each_limit = limits.FIELD_LIMITS.get(f"{key}[]", "")
        nested = f.type == f.TYPE_MESSAGE and f.is_repeated
        if count_limit or each_limit or nested:
            plan.append((f.name, count_limit, each_limit, nested))
    return tuple(plan)


@dataclasses.dataclass(frozen=True)
class Refusal:
    index: int  # in the batch
    trial_id: str
    text: str


_KIND_WORDS = {pb.METRIC_KIND_INTERMEDIATE: "an intermediate", pb.METRIC_KIND_FINAL: "a final"}


def metric_refusal(i: int, m: pb.Metric) -> Refusal | None:
    """Why metric ``i`` of a batch must not be stored, or None: a value that is not a valid
    metric (see limits.metric_value_problem) or disagrees with its JSON, an unknown kind,
    an index or time SQLite cannot hold. (``wire.metrics_reported`` lets what every agent of
    ours sends, a finite number whose JSON is its repr, through without asking.)"""
    return result_refusal(i, m.trial_id, m.kind, m.index, m.value, m.value_json, m.reported_at)


def result_refusal(
    i: int, trial_id: str, kind: int, index: int, value: float, value_json: str, reported_at: float
) -> Refusal | None:
    """:func:`metric_refusal` of one result however it came (a Metric, or an entry of a
    MetricRun, whose JSON is "" where it is the repr of its number)."""
    words = _KIND_WORDS.get(kind)
    if words is None:
        problem: str | None = (
            f"its kind {kind} is neither intermediate ({pb.METRIC_KIND_INTERMEDIATE}) "
            f"nor final ({pb.METRIC_KIND_FINAL})"
        )
    elif index > MAX_SEQ:
        problem = f"its index {index} is beyond {MAX_SEQ}"
    elif not math.isfinite(reported_at):
        problem = f"its reported_at {reported_at} is not a finite time"
    elif value_json:
        problem = limits.metric_json_problem(value_json, value)
    else:
        problem = limits.metric_value_problem(value)
    if problem is None:
        return None
    return Refusal(i, trial_id, f"refused {words or 'a'} result from the agent (index {index}): {problem}")


def metric_over_limit(i: int, m: pb.Metric) -> str:
    name, limit = (
        ("trial_id", "MAX_ID_CHARS") if len(m.trial_id) > MAX_ID_CHARS else ("value_json", "MAX_VALUE_JSON_CHARS")
    )
    return limits.over(f"MetricBatch.metrics[{i}].{name}", len(getattr(m, name)), limit)
