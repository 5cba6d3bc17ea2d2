"""When an agent lets metrics wait for others to share their message: only while trials
report in a tight loop, never a metric after a quiet spell, never beside anything else."""

from __future__ import annotations

from trialkeeper.agent.session import MAX_METRICS_PER_BATCH, METRIC_LINGER_S, metrics_may_wait

LAST_BATCH_AT = 100.0


def test_metrics_right_behind_the_last_batch_wait_for_more() -> None:
    assert metrics_may_wait(LAST_BATCH_AT + METRIC_LINGER_S / 10, LAST_BATCH_AT, 120, other_waiting=False)


def test_a_metric_after_a_quiet_spell_goes_at_once() -> None:
    # A trial reporting once an epoch: its result waits for nothing.
    assert not metrics_may_wait(LAST_BATCH_AT + 1.5 * METRIC_LINGER_S, LAST_BATCH_AT, 1, other_waiting=False)
    assert not metrics_may_wait(LAST_BATCH_AT + 60.0, LAST_BATCH_AT, 1, other_waiting=False)
    # The agent's first metric, before any batch was made.
    assert not metrics_may_wait(0.001, -METRIC_LINGER_S, 1, other_waiting=False)


def test_nothing_waits_beside_other_messages_a_full_batch_or_no_metrics() -> None:
    now = LAST_BATCH_AT + METRIC_LINGER_S / 10
    assert not metrics_may_wait(now, LAST_BATCH_AT, 120, other_waiting=True)  # a trial's end, a heartbeat
    assert not metrics_may_wait(now, LAST_BATCH_AT, MAX_METRICS_PER_BATCH, other_waiting=False)
    assert not metrics_may_wait(now, LAST_BATCH_AT, 0, other_waiting=False)
