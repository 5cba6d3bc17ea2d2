"""protos/limits.py: its table bounds every field an agent sends, the agent keeps within it,
and the metric rule that the trial SDK, the agent and the coordinator share."""

from __future__ import annotations

import math

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from trialkeeper.agent import runner, session
from trialkeeper.coordinator.transport import server
from trialkeeper.protos import limits
from trialkeeper.protos.v1 import coordinator_pb2 as pb


def _bounded_fields(desc: Descriptor, seen: set[str]) -> set[str]:
    """Every string, bytes and repeated field of ``desc`` and the messages in it, as
    FIELD_LIMITS names them ("Type.field", and "Type.field[]" for each string of a list)."""
    out: set[str] = set()
    if desc.name in seen:
        return out
    seen.add(desc.name)
    for f in desc.fields:
        key = f"{desc.name}.{f.name}"
        if f.is_repeated:
            out.add(key)
        if f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            out.add(f"{key}[]" if f.is_repeated else key)
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            out |= _bounded_fields(f.message_type, seen)
    return out


def test_every_field_an_agent_sends_has_a_limit() -> None:
    # A field added to the proto without a limit fails here; the integration test
    # test_edge_limits then checks that the edge refuses every entry over its limit.
    fields = _bounded_fields(pb.AgentMessage.DESCRIPTOR, set())
    assert fields == set(limits.FIELD_LIMITS), (fields ^ set(limits.FIELD_LIMITS))
    for name in limits.FIELD_LIMITS.values():
        assert isinstance(getattr(limits, name), int), name


def test_the_agent_keeps_within_the_limits() -> None:
    assert session.MAX_METRICS_PER_BATCH <= limits.MAX_METRICS_PER_BATCH
    # A batch is cut once it reaches MAX_BATCH_BYTES: the metric that tips it over, its
    # other fields and the framing must still fit.
    assert session.MAX_BATCH_BYTES + 2 * limits.MAX_VALUE_JSON_CHARS < limits.MAX_MESSAGE_BYTES
    assert runner.LOG_CHUNK_BYTES <= limits.MAX_LOG_CHUNK_BYTES
    assert runner.STDERR_TAIL_BYTES <= limits.MAX_STDERR_TAIL_CHARS
    assert server.MAX_MESSAGE_BYTES == limits.MAX_MESSAGE_BYTES


def test_clip_marks_what_it_cut() -> None:
    assert limits.clip("short", 10) == "short"
    cut = limits.clip("x" * 100, 40)
    assert len(cut) == 40 and cut.endswith("[... clipped]")


def test_a_refusal_names_the_field_and_the_limit() -> None:
    assert limits.over("Register.hostname", 300, "MAX_NAME_CHARS") == (
        "Register.hostname has 300 characters; the limit is 256 (MAX_NAME_CHARS)"
    )
    assert "has 129 entries; the limit is 128 (MAX_GPUS)" in limits.over("Register.gpus", 129, "MAX_GPUS")


@pytest.mark.parametrize(
    "value_json,value",
    [
        ("1.5", 1.5),
        ("2", 2.0),
        ("-0.0", 0.0),
        (' {"default": 3, "loss": 0.25} ', 3.0),
        ('{"default": 1e300, "b": 2}', 1e300),
    ],
)
def test_valid_metrics_on_the_wire(value_json: str, value: float) -> None:
    assert limits.metric_json_problem(value_json, value) is None


@pytest.mark.parametrize(
    "value_json,value,words",
    [
        ("}{", 0.0, "is not JSON"),
        ("", 0.0, "is not JSON"),
        ("[" * 100_000, 0.0, "is not JSON"),  # nested too deeply for the parser
        ("1_0", 10.0, "is not JSON"),
        ("[1]", 1.0, "got list"),
        ('"1"', 1.0, "got str"),
        ("true", 1.0, "got bool"),
        ("null", 0.0, "got NoneType"),
        ('{"x": 1}', 1.0, "'default' key"),
        ('{"default": true}', 1.0, "'default' must be a number, got bool"),
        ('{"default": 1, "tag": "a"}', 1.0, "'tag' must be a number, got str"),
        ('{"default": 1, "m": [1]}', 1.0, "'m' must be a number, got list"),
        ('{"default": 1, "m": NaN}', 1.0, "'m' must be a finite number, got nan"),
        ('{"default": 1e308, "m": 1e308}', 1e308, None),  # finite although their sum is not
        ("NaN", math.nan, "finite number, got nan"),
        ("-Infinity", -math.inf, "finite number, got -inf"),
        ("1e999", math.inf, "finite number, got inf"),
        ("9" * 400, 1.0, "too large for a float"),
        ("2.5", 3.5, "its value 3.5 is not the number in its value_json (2.5)"),
        ('{"default": 2}', 3.0, "is not the number"),
    ],
)
def test_invalid_metrics_on_the_wire(value_json: str, value: float, words: str | None) -> None:
    problem = limits.metric_json_problem(value_json, value)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem, problem
