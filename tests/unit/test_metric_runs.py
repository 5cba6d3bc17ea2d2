"""The coordinator's edge converts an agent's metric runs into the core's runs: what every agent
sends passes whole, anything else is checked result by result and the run is split around
what is refused; a malformed run refuses its message."""

from __future__ import annotations

import math

from trialkeeper.coordinator.engine.rows import MetricRow, MetricRun
from trialkeeper.coordinator.transport import wire
from trialkeeper.protos.v1 import coordinator_pb2 as pb

INTERMEDIATE = pb.METRIC_KIND_INTERMEDIATE


def _convert(*runs: pb.MetricRun, metrics: tuple[pb.Metric, ...] = ()) -> tuple[list[MetricRun], list[str]] | str:
    out = wire.metrics_reported("env-1", 1, 7, pb.MetricBatch(metrics=metrics, runs=runs))
    if isinstance(out, str):
        return out
    event, refused = out
    assert event.seq == 7 and event.env_id == "env-1"
    return list(event.report.runs), [r.text for r in refused]


def test_a_run_of_plain_floats_passes_whole() -> None:
    run = pb.MetricRun(
        trial_id="t1", kind=INTERMEDIATE, first_index=5, values=[0.5, 1e308, -2.0], reported_at=[1.0, 2.0, 3.0]
    )
    assert _convert(run) == ([MetricRun("t1", "intermediate", 5, [0.5, 1e308, -2.0], None, [1.0, 2.0, 3.0])], [])


def test_what_is_refused_splits_the_run_and_the_rest_keeps_its_indexes() -> None:
    run = pb.MetricRun(
        trial_id="t1", kind=INTERMEDIATE, first_index=10,
        values=[1.0, math.nan, 2.0, 3.0, 1e308, 4.0],
        value_json=["", "", "", '{"default": 3.0, "loss": 0.5}', '{"default": 2.0}', ""],
        reported_at=[1.0, 1.0, 1.0, math.inf, 1.0, 1.0],
    )
    converted = _convert(run)
    assert not isinstance(converted, str)
    runs, refused = converted
    rows = [row for r in runs for row in r.rows()]
    assert rows == [
        MetricRow("t1", 10, "intermediate", 1.0, "1.0", 1.0),
        MetricRow("t1", 12, "intermediate", 2.0, "2.0", 1.0),
        MetricRow("t1", 15, "intermediate", 4.0, "4.0", 1.0),
    ]
    assert [r.first_index for r in runs] == [10, 12, 15]
    assert len(refused) == 3
    assert "(index 11): a metric must be a finite number, got nan" in refused[0]
    assert "(index 13): its reported_at inf is not a finite time" in refused[1]
    assert "(index 14)" in refused[2] and "1e+308" in refused[2]  # its JSON disagrees with its value


def test_runs_follow_the_single_metrics_of_a_batch_and_count_against_its_limit() -> None:
    single = pb.Metric(
        trial_id="t0", kind=pb.METRIC_KIND_FINAL, index=3, value=2.0, value_json='{"default":2.0}', reported_at=1.0
    )
    run = pb.MetricRun(trial_id="t1", kind=INTERMEDIATE, first_index=0, values=[1.0, 2.0], reported_at=[1.0, 1.0])
    converted = _convert(run, metrics=(single,))
    assert not isinstance(converted, str)
    runs, _ = converted
    assert runs[0] == MetricRun("t0", "final", 3, (2.0,), ('{"default":2.0}',), (1.0,))
    assert runs[1].trial_id == "t1"
    too_many = pb.MetricRun(trial_id="t1", kind=INTERMEDIATE, values=[1.0] * 6000, reported_at=[1.0] * 6000)
    problem = _convert(too_many, too_many)
    assert isinstance(problem, str) and "MAX_METRICS_PER_BATCH" in problem


def test_a_malformed_run_refuses_its_message_naming_the_field() -> None:
    short_times = pb.MetricRun(trial_id="t1", kind=INTERMEDIATE, values=[1.0, 2.0], reported_at=[1.0])
    assert _convert(short_times) == "MetricBatch.runs[0].reported_at has 1 entries for 2 values (one per value)"
    short_json = pb.MetricRun(
        trial_id="t1", kind=INTERMEDIATE, values=[1.0, 2.0], value_json=["1.0"], reported_at=[1.0, 1.0]
    )
    problem = _convert(short_json)
    assert isinstance(problem, str) and problem.startswith("MetricBatch.runs[0].value_json has 1 entries for 2 values")
    long_id = pb.MetricRun(trial_id="t" * 129, kind=INTERMEDIATE, values=[1.0], reported_at=[1.0])
    problem = _convert(long_id)
    assert isinstance(problem, str) and "MetricBatch.runs[0].trial_id" in problem and "MAX_ID_CHARS" in problem


def test_an_unknown_kind_or_an_index_beyond_sqlite_refuses_each_result() -> None:
    unknown = pb.MetricRun(trial_id="t1", kind=7, values=[1.0, 2.0], reported_at=[1.0, 1.0])
    converted = _convert(unknown)
    assert not isinstance(converted, str) and converted[0] == [] and len(converted[1]) == 2
    beyond = pb.MetricRun(
        trial_id="t1", kind=INTERMEDIATE, first_index=2**63 - 2, values=[1.0, 2.0, 3.0], reported_at=[1.0] * 3
    )
    converted = _convert(beyond)
    assert not isinstance(converted, str)
    runs, refused = converted
    assert [r.first_index for r in runs] == [2**63 - 2] and len(runs[0].values) == 2
    assert len(refused) == 1 and "is beyond" in refused[0]
