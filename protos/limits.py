"""What one agent message may carry, and what a metric value may be.

The agent never produces a message over these limits; the coordinator's gRPC edge refuses
one that is (``INVALID_ARGUMENT`` naming the limit, and the stream ends), so that the work
one message costs the coordinator stays bounded. They are generous for real use: a
machine has at most a few dozen GPUs (MIG included), a trial reports a handful of metrics
a second, a metric value is a number or a small dict.

Strings are limited in characters, which ``len()`` gives for free (a character is at most
4 bytes in UTF-8); ``bytes`` fields in bytes. This module imports nothing heavy: the trial
SDK uses it inside every trial process.
"""

from __future__ import annotations

import contextlib
import json
import math

# gRPC's limit on one message, both ways. With the limits below, the largest message the
# coordinator accepts is handled in a few hundred milliseconds (docs/operations.md, "Security";
# scripts/bench/limitsbench.py measures it).
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# Metrics in one MetricBatch (the agent batches what trials report while it writes).
MAX_METRICS_PER_BATCH = 10_000
# One metric's value as JSON; the trial SDK refuses a report over 60 KiB before it leaves the trial.
MAX_VALUE_JSON_CHARS = 64 * 1024
# Environment, agent instance and trial ids, GPU uuids.
MAX_ID_CHARS = 128
# Hostname, GPU names, driver, CUDA and agent versions, platform.
MAX_NAME_CHARS = 256
# Why a trial ended, why an agent has no GPUs.
MAX_REASON_CHARS = 16 * 1024
# The last lines of a trial's stderr sent with its end (the agent sends 4 KiB).
MAX_STDERR_TAIL_CHARS = 64 * 1024
# One LogChunk of a trial's output (the agent sends 256 KiB).
MAX_LOG_CHUNK_BYTES = 1024 * 1024
# GPUs per environment: in Register, in one Heartbeat, in TrialEnded.gpus_still_in_use.
MAX_GPUS = 128
# Processes listed per GPU in one heartbeat sample.
MAX_PROCESSES_PER_GPU = 256
# Trial ids in Register.active_trial_ids.
MAX_TRIAL_IDS = 4096

# Every string, bytes and repeated field an agent sends, and the limit that bounds it. The
# coordinator's checks are written out by hand for speed; a test keeps them and this table
# in step with the proto (a new field without a limit fails it).
# A file's path inside a checkpoint; one piece of a checkpoint in a message (pieces are 1 MiB);
# the files of one checkpoint.
MAX_PATH_CHARS = 4096
MAX_CHECKPOINT_CHUNK_BYTES = 2 * 1024 * 1024
MAX_CHECKPOINT_FILES = 20_000

FIELD_LIMITS: dict[str, str] = {
    "Register.environment_id": "MAX_ID_CHARS",
    "Register.agent_instance_id": "MAX_ID_CHARS",
    "Register.hostname": "MAX_NAME_CHARS",
    "Register.gpus": "MAX_GPUS",
    "Register.gpu_unavailable_reason": "MAX_REASON_CHARS",
    "Register.driver_version": "MAX_NAME_CHARS",
    "Register.cuda_version": "MAX_NAME_CHARS",
    "Register.agent_version": "MAX_NAME_CHARS",
    "Register.active_trial_ids": "MAX_TRIAL_IDS",
    "Register.active_trial_ids[]": "MAX_ID_CHARS",
    "Register.platform": "MAX_NAME_CHARS",
    "GpuInfo.uuid": "MAX_ID_CHARS",
    "GpuInfo.name": "MAX_NAME_CHARS",
    "Heartbeat.gpus": "MAX_GPUS",
    "GpuSample.uuid": "MAX_ID_CHARS",
    "GpuSample.processes": "MAX_PROCESSES_PER_GPU",
    "GpuProcess.trial_id": "MAX_ID_CHARS",
    "TrialStarted.trial_id": "MAX_ID_CHARS",
    "TrialStarted.rendezvous_address": "MAX_NAME_CHARS",
    "MetricBatch.metrics": "MAX_METRICS_PER_BATCH",
    "Metric.trial_id": "MAX_ID_CHARS",
    "Metric.value_json": "MAX_VALUE_JSON_CHARS",
    # A batch's runs and their values together are within MAX_METRICS_PER_BATCH too.
    "MetricBatch.runs": "MAX_METRICS_PER_BATCH",
    "MetricRun.trial_id": "MAX_ID_CHARS",
    "MetricRun.values": "MAX_METRICS_PER_BATCH",
    "MetricRun.value_json": "MAX_METRICS_PER_BATCH",
    "MetricRun.value_json[]": "MAX_VALUE_JSON_CHARS",
    "MetricRun.reported_at": "MAX_METRICS_PER_BATCH",
    "LogChunk.trial_id": "MAX_ID_CHARS",
    "LogChunk.data": "MAX_LOG_CHUNK_BYTES",
    "TrialEnded.trial_id": "MAX_ID_CHARS",
    "TrialEnded.reason": "MAX_REASON_CHARS",
    "TrialEnded.stderr_tail": "MAX_STDERR_TAIL_CHARS",
    "TrialEnded.gpus_still_in_use": "MAX_GPUS",
    "TrialEnded.gpus_still_in_use[]": "MAX_ID_CHARS",
    "CheckpointChunk.trial_id": "MAX_ID_CHARS",
    "CheckpointChunk.path": "MAX_PATH_CHARS",
    "CheckpointChunk.data": "MAX_CHECKPOINT_CHUNK_BYTES",
    "CheckpointSaved.trial_id": "MAX_ID_CHARS",
    "CheckpointSaved.digest": "MAX_NAME_CHARS",
    "CheckpointSaved.files": "MAX_CHECKPOINT_FILES",
    "CheckpointSaved.location": "MAX_PATH_CHARS",
    "CheckpointFile.path": "MAX_PATH_CHARS",
    "FetchCheckpoint.trial_id": "MAX_ID_CHARS",
    "FetchCheckpoint.path": "MAX_PATH_CHARS",
}


def over(what: str, size: int, limit_name: str) -> str:
    """The refusal for a field over its limit: names the field, the limit and its value."""
    unit = "characters" if limit_name.endswith("_CHARS") else "bytes" if limit_name.endswith("_BYTES") else "entries"
    return f"{what} has {size:,} {unit}; the limit is {globals()[limit_name]:,} ({limit_name})"


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, marked as cut."""
    mark = " [... clipped]"
    return text if len(text) <= limit else text[: limit - len(mark)] + mark


_decode = json.JSONDecoder().decode  # made once: it runs for every metric
_NUMBER_TYPES = frozenset((int, float))  # bool is not one of them


def metric_value_problem(value: object) -> str | None:
    """Why ``value`` is not a valid metric, or None: a metric is a finite number, or a dict
    of finite numbers with a ``default`` key (the number a tuner compares)."""
    if isinstance(value, dict):
        if "default" not in value:
            return "a dict metric needs a 'default' key holding the number the tuner compares"
        # The coordinator checks every metric it receives: ints and floats whose sum is
        # finite are all finite, found in C; the loop below only says what is wrong.
        with contextlib.suppress(OverflowError, ValueError):
            if _NUMBER_TYPES.issuperset(map(type, value.values())) and math.isfinite(math.fsum(value.values())):
                return None
        for key, item in value.items():
            problem = _number_problem(item)
            if problem is not None:
                return f"the metric's {key!r} {problem} (a dict metric holds numbers only)"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return (
            "a metric must be a number or a dict of numbers with a 'default' key, "
            f"got {type(value).__name__}"
        )
    problem = _number_problem(value)
    return None if problem is None else f"a metric {problem}"


def _number_problem(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {type(value).__name__}"
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return "must be a finite number, got an integer too large for a float"
    return None if finite else f"must be a finite number, got {value!r}"


def metric_json_problem(value_json: str, value: float) -> str | None:
    """Why a metric as sent on the wire is invalid, or None: ``value_json`` must parse to a
    valid metric (:func:`metric_value_problem`) whose number is ``value``."""
    try:
        parsed = _decode(value_json)
    except (ValueError, RecursionError):
        return f"its value_json {value_json[:80]!r} is not JSON"
    problem = metric_value_problem(parsed)
    if problem is not None:
        return problem
    number = parsed["default"] if isinstance(parsed, dict) else parsed
    if float(number) != value:
        return f"its value {value!r} is not the number in its value_json ({number!r})"
    return None
