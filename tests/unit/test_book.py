"""The trials' book on its own, in virtual time: calls in, instructions and state checked.

No engine, no fleet: where the engine would pass on what the fleet or the scheduler said
(a placement, an environment lost), the test says it.
"""

from __future__ import annotations

import logging
import math
from typing import Any, TypeVar

import pytest
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.book import Ended, TrialBook
from trialkeeper.coordinator.engine.model import MetricEvent, StatusEvent
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.rows import MetricRun
from trialkeeper.coordinator.engine.states import TrialStatus

K = TypeVar("K")
WALL = 1.7e9  # the time of day at virtual time 0
FAILED, WAITING, RUNNING = TrialStatus.FAILED, TrialStatus.WAITING, TrialStatus.RUNNING


def book(**policy: Any) -> TrialBook:
    """A book of one reuse platform "local" unless ``platforms`` says, at virtual time 100."""
    policy = {"experiment_id": "exp", "trial_concurrency": 2,
              "platforms": (PlatformPolicy("local", True, 2, 1),), **policy}
    b = TrialBook(Policy(**policy))
    at(b, 100.0)
    return b


def at(b: TrialBook, now: float) -> None:
    """Set the book's clocks, as the engine does before each call."""
    b.now, b.wall = now, WALL + now


def of(out: list[ev.Instruction], kind: type[K]) -> list[K]:
    return [i for i in out if isinstance(i, kind)]


def submit(b: TrialBook, tid: str, *, gpus: int = 0, **kw: Any) -> None:
    b.submit(ev.TrialSubmitted(tid, {"lr": 0.1}, "python train.py", gpus, 0, **kw))


def place(b: TrialBook, tid: str, env_id: str = "env-1", uuids: tuple[str, ...] = (),
          indices: tuple[int, ...] = ()) -> None:
    """What a scheduling pass does to the book: retries past their backoff join the queue,
    and the trial leaves it, placed."""
    assert b.trials[tid].not_before <= b.now, "placed before its backoff is over"
    b.queue.release_due(b.now)
    b.queue.remove(tid)
    b.placed(tid, env_id, uuids, indices)


def run(b: TrialBook, tid: str, env_id: str = "env-1") -> None:
    b.started(env_id, ev.TrialStartReported(tid, 42, 0.0))


def end(b: TrialBook, tid: str, outcome: ev.Outcome, env_id: str = "env-1",
        reason: str = "") -> Ended | None:
    code = 0 if outcome is ev.Outcome.SUCCEEDED else 1
    return b.ended(env_id, ev.TrialEndReported(tid, outcome, code, None, reason, "tail", 0.0),
                   platform="local")


def changes(out: list[ev.Instruction]) -> list[tuple[str, str, TrialStatus]]:
    return [(c.trial_id, c.old, c.new) for c in of(out, ev.TrialStatusChanged)]


# ---- submit and cancel ------------------------------------------------------------------------


def test_submit_adds_a_waiting_trial_and_publishes_it() -> None:
    b = book()
    submit(b, "t1", platforms=("local",))
    submit(b, "t2")
    out = b.take()
    assert out[0] == ev.TrialAdded("t1", 0, WAITING, {"lr": 0.1}, "python train.py", 0, WALL + 100,
                                   ("local",))
    assert of(out, ev.TrialAdded)[1].seq == 1
    published = [p.event for p in of(out, ev.Publish)]
    assert [(e.trial.id, e.old, e.trial.status) for e in published if isinstance(e, StatusEvent)] \
        == [("t1", WAITING, WAITING), ("t2", WAITING, WAITING)]
    assert list(b.queue) == ["t1", "t2"]
    assert b.take() == []
    with pytest.raises(ValueError, match="submitted twice"):
        submit(b, "t1")


@pytest.mark.parametrize("status", [TrialStatus.USER_CANCELED, TrialStatus.SYS_CANCELED])
def test_cancel_of_a_waiting_trial_ends_it_now(status: TrialStatus) -> None:
    b = book()
    submit(b, "t1")
    b.take()
    at(b, 105.0)
    assert b.cancel("t1", "not needed", status) is None
    out = b.take()
    assert of(out, ev.TrialStatusChanged) == [
        ev.TrialStatusChanged("t1", "WAITING", status, "not needed", "not needed", WALL + 105)
    ]
    assert "t1" not in b.queue
    assert b.all_done()
    # A second cancel of an ended trial does nothing.
    assert b.cancel("t1", "again", status) is None
    assert b.take() == []


def test_cancel_of_a_placed_trial_names_its_environment_and_ends_when_the_agent_says() -> None:
    b = book()
    submit(b, "t1")
    place(b, "t1")
    run(b, "t1")
    b.take()
    assert b.cancel("t1", "by the user", TrialStatus.USER_CANCELED) == "env-1"
    assert b.take() == [ev.TrialStopping("t1", "by the user")]
    assert b.trials["t1"].status is RUNNING
    assert b.info("t1").stopping
    assert end(b, "t1", ev.Outcome.CANCELED) == Ended("t1", "env-1")
    assert changes(b.take()) == [("t1", "RUNNING", TrialStatus.USER_CANCELED)]
    assert b.trials["t1"].reason == "by the user"


# ---- placing and starting ---------------------------------------------------------------------


def test_placed_records_the_placement_and_start_message_carries_env_and_policy() -> None:
    b = book(trial_env={"A": "1", "B": "2"}, max_trial_duration_s=3600.0)
    submit(b, "t1", gpus=1, env_overrides={"B": "3"})
    b.take()
    place(b, "t1", "env-1", ("GPU-a",), (0,))
    assert b.take() == [ev.TrialPlaced("t1", "env-1", (0,), ("GPU-a",), 1)]
    assert b.start_message("t1", "/work/dir") == ev.StartTrial(
        trial_id="t1", sequence_id=0, command="python train.py", parameters={"lr": 0.1},
        env={"A": "1", "B": "3"}, gpu_indices=(0,), gpu_uuids=("GPU-a",), max_duration_s=3600.0,
        attempt=1, experiment_id="exp", working_directory="/work/dir", resumes_metrics=False,
    )


def test_a_retry_resumes_its_metrics() -> None:
    b = book(max_trial_retries=1)
    submit(b, "t1")
    place(b, "t1")
    b.lose(["t1"], "gone", platform="local")
    at(b, 102.0)
    place(b, "t1", "env-2")
    message = b.start_message("t1", "")
    assert (message.attempt, message.resumes_metrics) == (2, True)


def test_started_from_the_owning_environment_makes_the_trial_run() -> None:
    b = book()
    submit(b, "t1")
    place(b, "t1")
    b.take()
    at(b, 110.0)
    run(b, "t1")
    out = b.take()
    assert of(out, ev.TrialRan) == [ev.TrialRan("t1", WALL + 110)]
    assert of(out, ev.TrialStatusChanged)[0].because == "running on env-1 (pid 42)"
    assert b.trials["t1"].status is RUNNING
    # A second start report changes nothing.
    b.started("env-1", ev.TrialStartReported("t1", 43, 5.0))
    assert b.take() == []


def test_reports_about_trials_not_placed_there_are_ignored_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = book()
    submit(b, "t1")
    place(b, "t1", "env-1")
    b.take()
    caplog.set_level(logging.WARNING)
    run(b, "t1", env_id="env-2")
    assert end(b, "t1", ev.Outcome.SUCCEEDED, env_id="env-2") is None
    b.log("env-2", ev.LogReported("t1", "stdout", 0, b"hi"))
    run(b, "nobody", env_id="env-1")
    assert b.take() == []
    assert b.trials["t1"].status is WAITING
    assert b._ignored == {"env-2": 3, "env-1": 1}
    assert "(3 so far)" in caplog.text


def test_ended_from_the_owning_environment() -> None:
    b = book()
    for tid in ("t1", "t2"):
        submit(b, tid)
        place(b, tid)
        run(b, tid)
    b.take()
    assert list(b.live) == ["t1", "t2"]
    report = ev.TrialEndReported("t1", ev.Outcome.SUCCEEDED, 0, None, "", "", 0.0, ("GPU-a",))
    assert b.ended("env-1", report, platform="local") == Ended("t1", "env-1", ("GPU-a",))
    out = b.take()
    assert of(out, ev.TrialExited) == [ev.TrialExited("t1", 0, None, "")]
    assert changes(out) == [("t1", "RUNNING", TrialStatus.SUCCEEDED)]
    assert of(out, ev.TrialStatusChanged)[0].ended_at == b.trials["t1"].ended_at == WALL + 100
    assert list(b.live) == ["t2"]  # an ended trial leaves the live ones
    assert end(b, "t2", ev.Outcome.FAILED, reason="exit code 1") == Ended("t2", "env-1")
    assert changes(b.take()) == [("t2", "RUNNING", FAILED)]
    assert b.trials["t2"].reason == "exit code 1"
    assert b.live == {} and b.all_done()
    # An end reported twice is not applied again.
    assert end(b, "t2", ev.Outcome.FAILED) is None


# ---- retries ----------------------------------------------------------------------------------


def test_a_failed_trial_is_retried_with_backoff_at_the_front_of_the_queue() -> None:
    b = book(retry_failed_trials=True, max_trial_retries=3)
    submit(b, "t1")
    submit(b, "t2")
    now = 100.0
    for attempt, backoff in ((1, 1.0), (2, 2.0), (3, 4.0)):
        place(b, "t1")
        run(b, "t1")
        now += 10
        at(b, now)
        b.take()
        assert end(b, "t1", ev.Outcome.FAILED, reason="exit code 1") == Ended("t1", "env-1")
        out = b.take()
        t = b.trials["t1"]
        assert (t.status, t.env_id, t.not_before) == (WAITING, None, now + backoff)
        assert changes(out) == [("t1", "RUNNING", WAITING)]
        assert of(out, ev.TrialStatusChanged)[0].because == (
            f"it failed (exit code 1); retry {attempt} of 3 in {backoff:g} s"
        )
        assert of(out, ev.WaitingReasonsChanged) == [ev.WaitingReasonsChanged(
            {"t1": f"waiting: retry {attempt} of 3 after it failed (exit code 1)"}
        )]
        assert list(b.queue) == ["t1", "t2"]
        assert b.queue.next_due() == now + backoff
        now += backoff
        at(b, now)
    # The fourth attempt is the last.
    place(b, "t1")
    run(b, "t1")
    end(b, "t1", ev.Outcome.FAILED, reason="exit code 1")
    assert b.trials["t1"].status is FAILED
    assert b.trials["t1"].attempts == 4
    assert list(b.queue) == ["t2"]


def test_a_failed_trial_is_not_retried_unless_asked() -> None:
    b = book(max_trial_retries=3)
    submit(b, "t1")
    place(b, "t1")
    run(b, "t1")
    end(b, "t1", ev.Outcome.FAILED)
    assert b.trials["t1"].status is FAILED
    assert b.trials["t1"].reason == "the trial failed"


def test_lose_retries_within_max_trial_retries_then_fails() -> None:
    b = book(max_trial_retries=1)
    submit(b, "t1")
    place(b, "t1")
    run(b, "t1")
    b.take()
    b.lose(["t1"], "no heartbeat for 31.0 s", platform="local")
    out = b.take()
    t = b.trials["t1"]
    assert (t.status, t.env_id, t.not_before, t.lost_on) == (WAITING, None, 101.0, "local")
    assert of(out, ev.TrialStatusChanged)[0].because == (
        "environment lost (no heartbeat for 31.0 s); retry 1 of 1 in 1 s"
    )
    assert "t1" in b.queue
    at(b, 101.0)
    place(b, "t1", "env-2")
    b.lose(["t1"], "agent exited", platform="local")
    assert changes(b.take())[-1] == ("t1", "WAITING", FAILED)
    assert t.reason == "environment lost: agent exited"


def test_a_trial_lost_tries_the_other_platforms_first() -> None:
    b = book(platforms=(PlatformPolicy("a", True, 1, 1), PlatformPolicy("b", True, 1, 1)),
             max_trial_retries=1)
    submit(b, "t1")
    assert b.queue.demand("t1").platforms == ("a", "b")
    place(b, "t1")
    b.lose(["t1"], "preempted", platform="a")
    assert b.queue.demand("t1").platforms == ("b", "a")


def test_a_canceled_trial_lost_ends_canceled_and_a_lost_end_is_a_loss() -> None:
    b = book(max_trial_retries=2)
    for tid in ("t1", "t2"):
        submit(b, tid)
        place(b, tid)
        run(b, tid)
    b.cancel("t1", "by the user", TrialStatus.USER_CANCELED)
    b.lose(["t1"], "gone", platform="local")
    assert b.trials["t1"].status is TrialStatus.USER_CANCELED
    # An agent's report that the process went with its environment: retried like a loss.
    assert end(b, "t2", ev.Outcome.LOST) == Ended("t2", "env-1", processes_gone=True)
    assert b.trials["t2"].status is WAITING
    assert "t2" in b.queue


# ---- metrics ----------------------------------------------------------------------------------


def test_metrics_with_non_finite_values_are_dropped_and_a_final_result_is_set() -> None:
    b = book()
    submit(b, "t1")
    place(b, "t1")
    run(b, "t1")
    b.take()
    b.publish_metrics = True
    runs = (
        MetricRun("t1", "intermediate", 0, [0.1, math.nan, 0.3, math.inf], None, [1.0] * 4),
        MetricRun("t1", "final", 4, [0.9], ['{"default": 0.9}'], [2.0]),
    )
    b.metrics("env-1", runs)
    out = b.take()
    (stored,) = of(out, ev.StoreMetrics)
    assert [(r.kind, r.first_index, list(r.values)) for r in stored.runs] == [
        ("intermediate", 0, [0.1]), ("intermediate", 2, [0.3]), ("final", 4, [0.9]),
    ]
    assert of(out, ev.FinalResultSet) == [ev.FinalResultSet("t1", 0.9, '{"default": 0.9}')]
    assert b.info("t1").final_metric_value == {"default": 0.9}
    assert [p.event for p in of(out, ev.Publish)] == [
        MetricEvent("t1", "intermediate", 0, 0.1, 0.1),
        MetricEvent("t1", "intermediate", 2, 0.3, 0.3),
        MetricEvent("t1", "final", 4, 0.9, {"default": 0.9}),
    ]


def test_metrics_of_trials_not_placed_there_are_dropped() -> None:
    b = book()
    for tid, env_id in (("t1", "env-1"), ("t2", "env-2")):
        submit(b, tid)
        place(b, tid, env_id)
    b.take()
    b.metrics("env-1", (
        MetricRun("t1", "intermediate", 0, [1.0, 2.0], None, [1.0, 1.0]),
        MetricRun("t2", "final", 0, [5.0], None, [1.0]),
    ))
    out = b.take()
    (stored,) = of(out, ev.StoreMetrics)
    assert [(r.trial_id, list(r.values)) for r in stored.runs] == [("t1", [1.0]), ("t1", [2.0])]
    assert of(out, ev.FinalResultSet) == []
    assert b.trials["t2"].final_metric is None


# ---- trials that cannot run -------------------------------------------------------------------


def test_refuse_fails_the_waiting_trials_of_shapes_that_never_fit() -> None:
    b = book()
    submit(b, "big", gpus=8)
    submit(b, "small", gpus=1)
    b.take()
    b.refuse({(8, 0): "no environment offers more than 4", (1, 0): ""})
    assert changes(b.take()) == [("big", "WAITING", FAILED)]
    assert b.trials["big"].reason == "refused: no environment offers more than 4"
    assert list(b.queue) == ["small"]


def test_fail_unplaceable_fails_trials_whose_every_platform_was_given_up() -> None:
    b = book(platforms=(PlatformPolicy("a", True, 1, 1), PlatformPolicy("b", True, 1, 1)))
    submit(b, "only-a", platforms=("a",))
    submit(b, "any")
    b.take()
    b.fail_unplaceable({}, by_hand=False)
    assert b.take() == []
    b.fail_unplaceable({"a": "no quota"}, by_hand=False)
    assert changes(b.take()) == [("only-a", "WAITING", FAILED)]
    assert b.trials["only-a"].reason == "no environment could be started: a: no quota"
    both = {"a": "no quota", "b": "bad image"}
    b.fail_unplaceable(both, by_hand=True)  # an operator's agent can still take it
    assert b.take() == []
    b.fail_unplaceable(both, by_hand=False)
    assert changes(b.take()) == [("any", "WAITING", FAILED)]
    assert b.trials["any"].reason == "no environment could be started: a: no quota; b: bad image"


def test_agents_started_by_hand_keep_the_trials_that_may_use_the_first_platform_waiting() -> None:
    # They count as the first platform's ("a"): a trial that may use it waits for them.
    b = book(platforms=(PlatformPolicy("a", True, 1, 1), PlatformPolicy("b", True, 1, 1)))
    submit(b, "only-a", platforms=("a",))
    submit(b, "only-b", platforms=("b",))
    b.take()
    b.fail_unplaceable({"a": "no quota", "b": "bad image"}, by_hand=True)
    assert changes(b.take()) == [("only-b", "WAITING", FAILED)]
    assert list(b.queue) == ["only-a"]


# ---- after a crash ----------------------------------------------------------------------------


def row(tid: str, seq: int, status: str, **columns: Any) -> dict[str, Any]:
    """A trial's row as the store keeps it."""
    r = {
        "id": tid, "seq": seq, "status": status, "parameters_json": '{"lr": 0.1}',
        "command": "python train.py", "gpu_number": 0, "submitted_at": WALL, "environment_id": None,
        "gpu_indices_json": "[]", "gpu_uuids_json": "[]", "exit_code": None, "signal": None,
        "reason": "", "stderr_tail": "", "final_metric": None, "final_metric_json": None,
        "attempts": 0, "started_at": None, "ended_at": None, "platforms_json": "[]",
    }
    r.update(columns)
    return r


def test_restore_takes_rows_as_far_as_they_can_be_read() -> None:
    b = book()
    b.restore([
        row("done", 0, "SUCCEEDED", final_metric=0.5, final_metric_json="0.5", ended_at=WALL + 1),
        row("running", 1, "RUNNING", environment_id="env-1", gpu_indices_json="[0]",
            gpu_uuids_json='["GPU-a"]', attempts=1, platforms_json='["local", 7]'),
        # Retried: an older version kept the end of its attempt as its own.
        row("waiting", 2, "WAITING", started_at=WALL - 9, ended_at=WALL - 5),
        row("future", 3, "HIBERNATING", environment_id="env-1"),
        row("garbled", 4, "WAITING", parameters_json="{not json"),
        row("old-garbled", 5, "FAILED", parameters_json="[1]", ended_at=WALL + 2),
    ])
    out = b.take()
    t = b.trials
    assert (t["done"].status, t["done"].final_metric) == (TrialStatus.SUCCEEDED, 0.5)
    assert (t["done"].ended_at, t["waiting"].ended_at) == (WALL + 1, None)  # it has not ended
    assert (t["running"].status, t["running"].env_id, t["running"].gpu_uuids) == (
        RUNNING, "env-1", ("GPU-a",))
    assert t["running"].platforms == ("local",)
    assert (t["future"].status, t["future"].env_id) == (FAILED, None)
    assert t["future"].reason == "its stored status cannot be read; not resumed"
    assert (t["garbled"].status, t["garbled"].parameters) == (FAILED, {})
    assert t["garbled"].reason == "its stored parameters cannot be read; not resumed"
    assert t["old-garbled"].reason == ""  # ended before: kept as it was, no fact
    assert sorted(b.live) == ["running", "waiting"]  # those that had not ended, and could be read
    assert of(out, ev.TrialStatusChanged) == [
        ev.TrialStatusChanged("future", "HIBERNATING", FAILED, t["future"].reason, t["future"].reason,
                              WALL + 100),
        ev.TrialStatusChanged("garbled", "WAITING", FAILED, t["garbled"].reason,
                              t["garbled"].reason, WALL + 100),
    ]
    # The live trials placed nowhere wait again; a new trial comes after the stored ones.
    b.requeue_unplaced()
    assert list(b.queue) == ["waiting"]
    submit(b, "new")
    assert b.trials["new"].seq == 6


def test_a_restored_trial_whose_environment_ended_is_lost() -> None:
    b = book()
    b.restore([row("running", 0, "RUNNING", environment_id="env-1", attempts=1),
               row("placed", 1, "WAITING", environment_id="env-1", attempts=1)])
    b.take()
    b.restore_placement("running", None)
    b.restore_placement("placed", None)
    assert changes(b.take()) == [("running", "RUNNING", FAILED)]
    assert b.trials["running"].reason == "environment lost: it ended while the coordinator was down"
    b.requeue_unplaced()
    assert list(b.queue) == ["placed"]


# ---- what a reconnecting agent is told --------------------------------------------------------


def test_unwanted_and_to_resend_for_a_reconnecting_agent() -> None:
    b = book()
    for tid, env_id in (("here", "env-1"), ("elsewhere", "env-2"), ("canceled", "env-1"),
                        ("missing", "env-1"), ("ended", "env-1")):
        submit(b, tid)
        place(b, tid, env_id)
    b.cancel("canceled", "by the user", TrialStatus.USER_CANCELED)
    end(b, "ended", ev.Outcome.FAILED)
    active = {"here", "elsewhere", "canceled", "stranger"}
    assert b.unwanted("env-1", active) == ("canceled", "elsewhere", "stranger")
    held = ("here", "canceled", "missing", "ended")
    assert b.to_resend("env-1", held, active) == ["missing"]
    assert b.placed_on("env-1") == ["here", "canceled", "missing"]
