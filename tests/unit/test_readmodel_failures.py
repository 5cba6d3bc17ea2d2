"""The one line a failure is shown with: the last meaningful line of the trial's stderr tail."""

from __future__ import annotations

from dataclasses import replace

import pytest
from trialkeeper.coordinator.engine.model import TrialInfo
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.read.failures import MAX_LINE, failure_summary, last_meaningful_line

TRACEBACK = """\
Traceback (most recent call last):
  File "/work/train.py", line 40, in <module>
    main()
  File "/work/train.py", line 31, in main
    raise RuntimeError("diverged")
    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: diverged

[trialkeeper] trial ab12cd: no checkpoint saved

"""


@pytest.mark.parametrize(
    ("tail", "line"),
    [
        (TRACEBACK, "RuntimeError: diverged"),
        ("python3: can't open file '/work/trian.py': [Errno 2] No such file or directory\n",
         "python3: can't open file '/work/trian.py': [Errno 2] No such file or directory"),
        ("loading data\nboom: the trial gave up\n\n   \n", "boom: the trial gave up"),
        # Chained exceptions: the last one raised is what ended the trial.
        (("Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'\n\nDuring handling of the "
         "above exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"a.py\", "
         "line 3\nValueError: bad x\n"), "ValueError: bad x"),
        # A tail cut inside a traceback's frames, its exception line still to come: the frame stands.
        ("Traceback (most recent call last):\n  File \"a.py\", line 3, in f\n    g()\n", "g()"),
        # A program's own indented last line, with no traceback, is the last line.
        ("error:\n    disk quota exceeded\n", "disk quota exceeded"),
        ("", ""),
        ("\n[trialkeeper] trial x: killed after 30 s\n", ""),
    ],
)
def test_the_last_meaningful_line(tail: str, line: str) -> None:
    assert last_meaningful_line(tail) == line


def test_a_long_line_is_cut() -> None:
    shown = last_meaningful_line("E" * 5000)
    assert len(shown) == MAX_LINE and shown.endswith("...")


def _trial(status: TrialStatus, reason: str, tail: str) -> TrialInfo:
    return TrialInfo(
        id="t1", sequence_id=0, status=status, parameters={}, environment_id="env-1", gpu_indices=(),
        final_metric=None, final_metric_value=None, exit_code=1, signal=None, reason=reason, stderr_tail=tail,
        submitted_at=None, started_at=None, ended_at=None, attempts=1,
    )


def test_the_summary_of_a_failed_trial() -> None:
    failed = _trial(TrialStatus.FAILED, "exit code 1", TRACEBACK)
    assert failure_summary(failed) == "exit code 1: RuntimeError: diverged"
    # Nothing in stderr: the reason alone; a reason that already says it: not twice.
    assert failure_summary(replace(failed, stderr_tail="")) == "exit code 1"
    assert failure_summary(replace(failed, reason="RuntimeError: diverged")) == "RuntimeError: diverged"
    assert failure_summary(replace(failed, reason="", stderr_tail="")) == "failed"
    assert failure_summary(replace(failed, reason="exit code 1\nmore")) == "exit code 1: RuntimeError: diverged"


@pytest.mark.parametrize("status", [s for s in TrialStatus if s is not TrialStatus.FAILED])
def test_only_a_failed_trial_has_a_failure_summary(status: TrialStatus) -> None:
    assert failure_summary(_trial(status, "canceled", TRACEBACK)) == ""
