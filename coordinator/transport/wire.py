"""Protobuf at the edge: agent messages become the core's events, the core's messages to
agents become protobuf. Only this module and ``server.py`` touch generated code."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from trialkeeper.protos import limits
from trialkeeper.protos.limits import (
    MAX_GPUS,
    MAX_ID_CHARS,
    MAX_METRICS_PER_BATCH,
    MAX_PROCESSES_PER_GPU,
    MAX_VALUE_JSON_CHARS,
)
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.wire import PROTOCOL_VERSION

from ..engine import checkpoints as ck
from ..engine import events as ev
from ..engine.rows import MetricRun
from . import checks
from .checks import MAX_SEQ

_KIND_NAMES = {pb.METRIC_KIND_INTERMEDIATE: "intermediate", pb.METRIC_KIND_FINAL: "final"}
_STREAM_NAMES = {pb.LOG_STREAM_STDOUT: "stdout", pb.LOG_STREAM_STDERR: "stderr"}
_OUTCOMES = {
    pb.TRIAL_OUTCOME_SUCCEEDED: ev.Outcome.SUCCEEDED,
    pb.TRIAL_OUTCOME_CANCELED: ev.Outcome.CANCELED,
    pb.TRIAL_OUTCOME_LOST: ev.Outcome.LOST,
    pb.TRIAL_OUTCOME_PAUSED: ev.Outcome.PAUSED,
}


def registered(reg: pb.Register, link: int) -> ev.AgentRegistered:
    gpus = tuple(
        ev.GpuInfo(g.uuid, g.index, g.name, g.memory_total_bytes, simulated=g.simulated, mig=g.mig) for g in reg.gpus
    )
    info = {
        "pid": reg.pid, "cpu_count": reg.cpu_count, "memory_total_bytes": reg.memory_total_bytes,
        "agent_version": reg.agent_version, "driver_version": reg.driver_version,
        "cuda_version": reg.cuda_version, "gpu_unavailable_reason": reg.gpu_unavailable_reason,
        "gpus": [
            {
                "index": g.index, "uuid": g.uuid, "name": g.name, "memory_total_bytes": g.memory_total_bytes,
                "simulated": g.simulated, "mig": g.mig,
            }
            for g in gpus
        ],
    }
    return ev.AgentRegistered(
        env_id=reg.environment_id, link=link, instance_id=reg.agent_instance_id, hostname=reg.hostname, pid=reg.pid,
        platform=reg.platform, gpus=gpus, gpu_unavailable_reason=reg.gpu_unavailable_reason,
        active_trial_ids=frozenset(reg.active_trial_ids), info=info,
    )


AgentEvent = ev.AgentReported | ev.HeartbeatReceived


def agent_event(env_id: str, link: int, msg: pb.AgentMessage) -> ev.AgentReported | None:
    """The core's event for a numbered message (heartbeats: :func:`heartbeat`); None for a
    message that is not one an agent sends after it registered (logged by the caller)."""
    kind = msg.WhichOneof("body")
    report: ev.Report | None
    if kind == "trial_started":
        m = msg.trial_started
        report = ev.TrialStartReported(m.trial_id, m.pid, m.started_at, m.rendezvous_address, m.rendezvous_port)
    elif kind == "trial_ended":
        e = msg.trial_ended
        report = ev.TrialEndReported(
            trial_id=e.trial_id, outcome=_OUTCOMES.get(e.outcome, ev.Outcome.FAILED),
            exit_code=e.exit_code if e.has_exit_code else None, signal=e.signal or None, reason=e.reason,
            stderr_tail=e.stderr_tail, ended_at=e.ended_at, gpus_still_in_use=tuple(e.gpus_still_in_use),
        )
    elif kind == "log":
        chunk = msg.log
        stream = _STREAM_NAMES.get(chunk.stream)
        report = None if stream is None else ev.LogReported(chunk.trial_id, stream, chunk.offset, chunk.data)
    elif kind == "checkpoint_chunk":
        c = msg.checkpoint_chunk
        report = ck.CheckpointChunkReported(c.trial_id, c.step, c.path, c.offset, c.data)
    elif kind == "checkpoint_saved":
        c = msg.checkpoint_saved
        report = ck.CheckpointSavedReported(
            c.trial_id, c.step, c.metric_index, c.size_bytes, c.digest, _files(c.files), c.location,
            c.saved_at if math.isfinite(c.saved_at) else 0.0,
        )
    elif kind == "leaving":
        report = ev.AgentLeft(msg.leaving.drained)
    else:
        return None
    return ev.AgentReported(env_id, link, msg.seq, report)


def fetch_requested(env_id: str, link: int, f: pb.FetchCheckpoint) -> ck.CheckpointFetchRequested:
    return ck.CheckpointFetchRequested(env_id, link, f.trial_id, f.step, f.path, f.offset)


def _files(files: Iterable[pb.CheckpointFile]) -> tuple[ck.CheckpointFile, ...]:
    return tuple(ck.CheckpointFile(f.path, f.size, f.mode) for f in files)


def _ref(c: ck.Checkpoint) -> pb.CheckpointRef:
    return pb.CheckpointRef(
        step=c.step, metric_index=c.metric_index, location=c.location, digest=c.digest, size_bytes=c.size_bytes,
        trial_id=c.trial_id, files=[pb.CheckpointFile(path=f.path, size=f.size, mode=f.mode) for f in c.files],
    )


def metrics_reported(
    env_id: str, link: int, seq: int, batch: pb.MetricBatch
) -> tuple[ev.AgentReported, list[checks.Refusal]] | str:
    """The event for a metric batch and the metrics refused from it (each noted in its
    trial's log), or why the whole message is refused (a limit of protos/limits.py). Checked
    as it is converted, each field read once: every metric a trial reports passes here."""
    metrics, runs = batch.metrics, batch.runs
    if len(metrics) > MAX_METRICS_PER_BATCH:
        return limits.over("MetricBatch.metrics", len(metrics), "MAX_METRICS_PER_BATCH")
    out: list[MetricRun] = []
    refused: list[checks.Refusal] = []
    isfinite, kinds = math.isfinite, _KIND_NAMES
    for i, m in enumerate(metrics):  # as agents of protocol version 1 sent them
        trial_id, value_json = m.trial_id, m.value_json
        if len(trial_id) > MAX_ID_CHARS or len(value_json) > MAX_VALUE_JSON_CHARS:
            return checks.metric_over_limit(i, m)
        value, kind, index, at = m.value, kinds.get(m.kind), m.index, m.reported_at
        plain = value_json == repr(value)
        # A finite number whose JSON is its repr is valid as it is; anything else is looked
        # at closely.
        if not (kind and isfinite(value) and plain and index <= MAX_SEQ and isfinite(at)):
            refusal = checks.metric_refusal(i, m)
            if refusal is not None:
                refused.append(refusal)
                continue
        out.append(_new(MetricRun, (trial_id, kind, index, (value,), None if plain else (value_json,), (at,))))
    if runs:
        if len(runs) > MAX_METRICS_PER_BATCH:
            return limits.over("MetricBatch.runs", len(runs), "MAX_METRICS_PER_BATCH")
        done = len(metrics)
        for r, run in enumerate(runs):
            problem = _run(run, f"MetricBatch.runs[{r}]", done, out, refused)
            if problem:
                return problem
            done += len(run.values)
            if done > MAX_METRICS_PER_BATCH:
                return (
                    f"MetricBatch holds more than {MAX_METRICS_PER_BATCH:,} results in its metrics and runs "
                    "(MAX_METRICS_PER_BATCH)"
                )
    return ev.AgentReported(env_id, link, seq, ev.MetricsReported(tuple(out))), refused


def _run(run: pb.MetricRun, path: str, done: int, out: list[MetricRun], refused: list[checks.Refusal]) -> str:
    """Add a run to ``out`` (less its refused results, which go to ``refused``; ``done``: the
    results of the batch before it), or say why the message is refused. What every agent of
    ours sends, finite numbers whose JSON is their repr, is checked a column at a time, in C."""
    trial_id, values, ats, jsons = run.trial_id, run.values, run.reported_at, run.value_json
    n = len(values)
    if len(trial_id) > MAX_ID_CHARS:
        return limits.over(f"{path}.trial_id", len(trial_id), "MAX_ID_CHARS")
    for name, field in (("values", values), ("value_json", jsons), ("reported_at", ats)):
        if len(field) > MAX_METRICS_PER_BATCH:
            return limits.over(f"{path}.{name}", len(field), "MAX_METRICS_PER_BATCH")
    if len(ats) != n:
        return f"{path}.reported_at has {len(ats)} entries for {n} values (one per value)"
    if jsons:
        if len(jsons) != n:
            return f"{path}.value_json has {len(jsons)} entries for {n} values (one per value, or none)"
        longest = max(map(len, jsons))
        if longest > MAX_VALUE_JSON_CHARS:
            i = next(i for i, j in enumerate(jsons) if len(j) == longest)
            return limits.over(f"{path}.value_json[{i}]", longest, "MAX_VALUE_JSON_CHARS")
    if not n:
        return ""
    kind, first = _KIND_NAMES.get(run.kind), run.first_index
    try:
        plain = not jsons and kind is not None and first + n - 1 <= MAX_SEQ and _finite(values) and _finite(ats)
    except OverflowError:  # finite numbers whose sum is not
        plain = False
    if plain:
        out.append(_new(MetricRun, (trial_id, kind, first, list(values), None, list(ats))))
        return ""
    # The slow way, one result at a time, for what is not plain; what is left of the run is
    # kept in stretches of consecutive results.
    kept: list[tuple[float, str, float]] = []
    start = first
    for k in range(n + 1):
        refusal = None
        if k < n:
            refusal = checks.result_refusal(
                done + k, trial_id, run.kind, first + k, values[k], jsons[k] if jsons else "", ats[k]
            )
            if refusal is None:
                kept.append((values[k], jsons[k] if jsons else "", ats[k]))
                continue
            refused.append(refusal)
        if kept:
            given = [j for _, j, _ in kept]
            out.append(
                MetricRun(
                    trial_id,
                    str(kind),
                    start,
                    [v for v, _, _ in kept],
                    given if any(given) else None,
                    [a for _, _, a in kept],
                )
            )
            kept = []
        start = first + k + 1
    return ""


def _finite(numbers: Iterable[float]) -> bool:
    """Whether every number is finite, found in C (raises OverflowError where their sum
    overflows)."""
    return math.isfinite(math.fsum(numbers))


def heartbeat(env_id: str, link: int, hb: pb.Heartbeat) -> ev.HeartbeatReceived | str:
    """The event for a heartbeat, or why it is refused: a limit of protos/limits.py passed,
    or a number SQLite cannot hold. Checked as it is converted, each field read once: a
    thousand agents send one a second (a test keeps the checks in step with the proto)."""
    if hb.memory_used_bytes > MAX_SEQ:
        return "Heartbeat.memory_used_bytes is out of range"
    gpus = hb.gpus
    if not gpus:
        # Samples, when given, are what counts; "unchanged" only without them.
        return ev.HeartbeatReceived(env_id, link, hb.draining, (), hb.gpus_unchanged)
    if len(gpus) > MAX_GPUS:
        return limits.over("Heartbeat.gpus", len(gpus), "MAX_GPUS")
    samples = []
    for i, g in enumerate(gpus):
        uuid, used, procs = g.uuid, g.memory_used_bytes, g.processes
        if len(uuid) > MAX_ID_CHARS:
            return limits.over(f"Heartbeat.gpus[{i}].uuid", len(uuid), "MAX_ID_CHARS")
        if used > MAX_SEQ:
            return f"Heartbeat.gpus[{i}].memory_used_bytes is out of range"
        processes: tuple[ev.GpuProcess, ...] = ()
        if procs:
            if len(procs) > MAX_PROCESSES_PER_GPU:
                return limits.over(f"Heartbeat.gpus[{i}].processes", len(procs), "MAX_PROCESSES_PER_GPU")
            listed = []
            for j, p in enumerate(procs):
                trial_id, memory = p.trial_id, p.used_memory_bytes
                if len(trial_id) > MAX_ID_CHARS:
                    return limits.over(f"Heartbeat.gpus[{i}].processes[{j}].trial_id", len(trial_id), "MAX_ID_CHARS")
                if memory > MAX_SEQ:
                    return f"Heartbeat.gpus[{i}].processes[{j}].used_memory_bytes is out of range"
                listed.append(_new(ev.GpuProcess, (trial_id, memory)))
            processes = tuple(listed)
        samples.append(_new(ev.GpuSample, (uuid, g.utilization_percent, used, processes)))
    return ev.HeartbeatReceived(env_id, link, hb.draining, tuple(samples))


# NamedTuple's own constructor is a Python function; this is the same tuple, made in C.
_new = tuple.__new__


def to_agent(message: ev.ToAgent) -> pb.CoordinatorMessage:
    match message:
        case ev.StartTrial():
            return pb.CoordinatorMessage(start_trial=pb.StartTrial(
                trial_id=message.trial_id, sequence_id=message.sequence_id, command=message.command,
                parameters_json=json.dumps(message.parameters), env=dict(message.env),
                gpu_indices=list(message.gpu_indices), gpu_uuids=list(message.gpu_uuids),
                working_directory=message.working_directory, max_duration_s=message.max_duration_s,
                experiment_id=message.experiment_id, attempt=message.attempt,
                first_metric_index=message.first_metric_index,
                checkpoint=_ref(message.checkpoint) if message.checkpoint is not None else None,
                node_rank=message.node_rank, nodes=message.nodes if message.nodes > 1 else 0,
                master_addr=message.master_addr, master_port=message.master_port,
            ))
        case ev.Welcome():
            return pb.CoordinatorMessage(welcome=pb.Welcome(
                experiment_id=message.experiment_id, acked_seq=message.acked_seq,
                heartbeat_interval_s=message.heartbeat_interval_s, protocol_version=PROTOCOL_VERSION,
                cancel_trial_ids=list(message.cancel_trial_ids),
                gpu_sample_interval_s=message.gpu_sample_interval_s, checkpoint_dir=message.checkpoint_dir,
                checkpoint_storage=message.checkpoint_storage, max_checkpoint_bytes=message.max_checkpoint_bytes,
                checkpoint_data_port=message.checkpoint_data_port,
                checkpoint_refusals=[
                    pb.CheckpointRefused(trial_id=r.trial_id, step=r.step, reason=r.reason)
                    for r in message.checkpoint_refusals
                ],
            ))
        case ev.CancelTrial():
            return pb.CoordinatorMessage(cancel_trial=pb.CancelTrial(
                trial_id=message.trial_id, grace_s=message.grace_s, reason=message.reason
            ))
        case ev.Shutdown():
            return pb.CoordinatorMessage(shutdown=pb.Shutdown(
                drain=message.drain, grace_s=message.grace_s, reason=message.reason
            ))
        case ck.PauseTrial():
            return pb.CoordinatorMessage(pause_trial=pb.PauseTrial(
                trial_id=message.trial_id, grace_s=message.grace_s, reason=message.reason
            ))
        case ck.CheckpointRefused():
            return pb.CoordinatorMessage(checkpoint_refused=pb.CheckpointRefused(
                trial_id=message.trial_id, step=message.step, reason=message.reason
            ))
        case ck.CheckpointData():
            return pb.CoordinatorMessage(checkpoint_chunk=pb.CheckpointChunk(
                trial_id=message.trial_id, step=message.step, path=message.path, offset=message.offset,
                data=message.data, last=message.last,
            ))
        case ev.Settings():
            return pb.CoordinatorMessage(settings=pb.Settings(
                heartbeat_interval_s=message.heartbeat_interval_s, gpu_sample_interval_s=message.gpu_sample_interval_s
            ))
    raise TypeError(f"not a message to an agent: {message!r}")
