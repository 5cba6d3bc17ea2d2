"""Assessors: what decides, from a running trial's intermediate results, whether it is worth
finishing. The interface and the median rule here, ASHA in ``asha``; NNI's (``nnialgos``)
and Optuna's pruners (``optunasearch``) behind the same interface.

An assessor follows NNI's interface, so an NNI user's assessor ports with few changes::

    class MyAssessor(Assessor):
        def assess_trial(self, trial_id, history) -> bool: ...   # False: stop it
        def trial_end(self, trial_id, success) -> None: ...

and is named in the experiment config as ``assessor: {className: my_pkg.mod:MyAssessor}``.
One that may also pause a trial (to continue it later, as a multi-fidelity search does at
its rungs) implements ``decide`` instead, answering a Verdict.
"""

from __future__ import annotations

import abc
import bisect
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .requests import Requesting
from .tuners import TunerError, check_class_args

if TYPE_CHECKING:
    from .tuners import PastTrial

__all__ = ["Assessor", "AssessorError", "MedianStopAssessor", "Verdict", "construct"]


class AssessorError(TunerError):
    """An assessor that cannot be created: unknown name, failed import, bad classArgs."""


class Verdict(enum.Enum):
    """What an assessor decides for a trial after one of its intermediate results."""

    CONTINUE = "continue"  # let it go on
    STOP = "stop"  # end it now, EARLY_STOPPED
    PAUSE = "pause"  # it saves a checkpoint and frees its slot until continued


class Assessor(Requesting, abc.ABC):
    """Judges running trials by their intermediate results.

    Called from one thread: ``trial_started`` when a trial is submitted, ``decide`` after
    each intermediate result is stored with every intermediate result of the trial so far,
    ``trial_end`` when the trial ends. A subclass implements ``decide`` or, as in NNI,
    ``assess_trial`` (True: go on, False: stop it), which ``decide`` calls by default.

    A trial an assessor paused is told by ``trial_paused``; the assessor continues it with
    ``request_continue(trial_id)`` from any of its methods (or ends it with
    ``request_stop``), and then hears ``trial_continued``.
    """

    def trial_started(self, trial_id: str, parameter_id: int, parameters: dict[str, Any]) -> None:
        """Learn that trial ``trial_id`` runs ``parameters`` (the tuner's ``parameter_id``)."""

    def decide(self, trial_id: str, history: Sequence[float]) -> Verdict:
        """Whether the trial goes on, stops or pauses, given every intermediate result it
        reported so far. The default asks ``assess_trial``."""
        if type(self).assess_trial is Assessor.assess_trial:
            raise NotImplementedError(f"{type(self).__name__} implements neither decide nor assess_trial")
        return Verdict.CONTINUE if self.assess_trial(trial_id, history) else Verdict.STOP

    def assess_trial(self, trial_id: str, history: Sequence[float]) -> bool:
        """True: let the trial go on; False: stop it now. The default asks ``decide`` (a
        pause counts as going on)."""
        if type(self).decide is Assessor.decide:
            raise NotImplementedError(f"{type(self).__name__} implements neither decide nor assess_trial")
        return self.decide(trial_id, history) is not Verdict.STOP

    def trial_checkpointed(self, trial_id: str) -> None:
        """Learn that the trial saved a checkpoint (so it can be paused), told once, before
        the verdict on the result it reports next."""

    def result_reported(self, trial_id: str, result: Any) -> None:
        """See an intermediate result as the trial reported it (a number, or a dict with more
        keys), before the verdict on it."""

    def trial_paused(self, trial_id: str) -> None:
        """Learn that the trial saved a checkpoint and ended its process, paused."""

    def trial_continued(self, trial_id: str, parameters: dict[str, Any]) -> None:
        """Learn that the paused trial was continued from its checkpoint with ``parameters``."""

    def trial_end(self, trial_id: str, success: bool) -> None:
        """Learn that the trial ended; ``success`` is False for a failed or stopped one."""

    def search_ending(self) -> None:
        """Nothing runs and the tuner proposes nothing more: the last chance to continue
        trials the search holds paused (``request_continue``); those it does not continue
        are stopped. Asked again once what it continued has ended."""

    def resume(self, history: Sequence[PastTrial]) -> None:
        """Hear what an earlier run of this experiment saw, before judging anything new.

        The default tells each stored trial as it happened (its verdicts ignored), which
        rebuilds any assessor that learns only through this interface."""
        for t in history:
            self.trial_started(t.trial_id, t.parameter_id, t.parameters)
            if t.intermediate:
                self.decide(t.trial_id, list(t.intermediate))
            if t.paused:
                self.trial_paused(t.trial_id)
            if t.status is not None:
                self.trial_end(t.trial_id, t.succeeded)
        self.take_requests()  # what it asks while hearing the past was decided then


def implements_a_verdict(cls: type[Assessor]) -> bool:
    """Whether an Assessor subclass implements decide or assess_trial."""
    return cls.decide is not Assessor.decide or cls.assess_trial is not Assessor.assess_trial


class MedianStopAssessor(Assessor):
    """Stops a trial whose best result so far is worse than the median, at the same step,
    of the running averages of the trials that completed (NNI's median-stop rule).

    ``start_step``: results a trial reports before it can be stopped.
    """

    def __init__(self, *, optimize_mode: str = "maximize", start_step: int = 0) -> None:
        if optimize_mode not in ("maximize", "minimize"):
            raise AssessorError(f"optimize_mode must be 'maximize' or 'minimize', got {optimize_mode!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise AssessorError(f"start_step must be an integer >= 0, got {start_step!r}")
        self.maximize = optimize_mode == "maximize"
        self.start_step = start_step
        self._running: dict[str, list[float]] = {}
        # At each step, the running averages there of the trials that completed, sorted.
        self._at_step: list[list[float]] = []

    def assess_trial(self, trial_id: str, history: Sequence[float]) -> bool:
        self._running[trial_id] = list(history)
        step = len(history)
        if step == 0 or step < self.start_step:
            return True
        if step > len(self._at_step):
            return True
        at_step = self._at_step[step - 1]
        if self.maximize:
            return max(history) >= at_step[(len(at_step) - 1) // 2]
        return min(history) <= at_step[len(at_step) // 2]

    def trial_end(self, trial_id: str, success: bool) -> None:
        history = self._running.pop(trial_id, None)
        if success and history:
            total = 0.0
            for i, value in enumerate(history, 1):
                total += value
                if i > len(self._at_step):
                    self._at_step.append([])
                bisect.insort(self._at_step[i - 1], total / i)



def construct(label: str, cls: type[Assessor], args: dict[str, Any]) -> Assessor:
    if not implements_a_verdict(cls):
        raise AssessorError(f"assessor {label!r} implements neither decide nor assess_trial")
    try:
        args = check_class_args(label, cls, args, "assessor", skip_first=False)
    except AssessorError:
        raise
    except TunerError as e:
        raise AssessorError(str(e)) from None
    try:
        return cls(**args)
    except AssessorError:
        raise
    except Exception as e:
        raise AssessorError(f"assessor {label!r} failed to start: {type(e).__name__}: {e}") from e
