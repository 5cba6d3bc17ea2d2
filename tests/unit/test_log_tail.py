"""What an ended agent's log says of why it ended: its last line that is not an INFO or DEBUG
line of its own."""

from __future__ import annotations

from pathlib import Path

from trialkeeper.coordinator.services._launch import log_tail


def test_the_reason_skips_what_went_well(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    warning = "2026-11-27 16:50:49,250 WARNING agent[1] trialkeeper.agent.session: the coordinator is unreachable"
    log.write_text(f"{warning}\n2026-11-27 16:50:49,427 INFO agent[1] x: checkpoint at step 0 taken\n\n")
    assert log_tail(log) == warning
    log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n2026-11-27 16:50:49,427 DEBUG agent[1] x\n")
    assert log_tail(log) == "RuntimeError: boom"
    log.write_text("2026-11-27 16:50:49,427 INFO agent[1] x: all well\n")
    assert log_tail(log) == ""
    assert log_tail(tmp_path / "missing.log") == ""


def test_a_job_logs_last_lines_are_joined(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("prologue ran\n\nsrun: error: node-1: task 0: Exited with exit code 127\n"
                   "2026-11-27 16:50:49,427 INFO agent[1] x: all well\nsrun: error: node-2: task 1: Killed\n")
    assert log_tail(log, lines=2) == (
        "srun: error: node-1: task 0: Exited with exit code 127 | srun: error: node-2: task 1: Killed")
    assert log_tail(log, lines=9).startswith("prologue ran | srun: error: node-1")


def test_a_line_the_tail_cuts_into_is_not_quoted(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    quiet = "2026-11-27 16:50:49,427 INFO agent[1] trialkeeper.agent.checkpoints: trial q29kwu: step 20 taken"
    log.write_text("2026-11-27 16:50:48,000 WARNING agent[1] x: the coordinator is slow\n" + f"{quiet}\n" * 20)
    # The last 600 bytes start inside an INFO line: its end must not pass for a reason.
    assert log_tail(log) == ""
    assert log_tail(log, limit=10_000) == "2026-11-27 16:50:48,000 WARNING agent[1] x: the coordinator is slow"
