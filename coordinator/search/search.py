"""The search: a tuner that proposes trials and an assessor that stops hopeless ones, fed
the experiment's events and returning what to do. No I/O: the experiment loop carries out
the instructions (``experiment.py``).

Every intermediate result reaches the tuner and the assessor as it is stored; an assessor's
"stop" becomes a StopTrial instruction (the loop ends the trial EARLY_STOPPED). A trial
stopped early teaches the tuner its last intermediate result, as NNI does. An algorithm
that raises is logged with its traceback and the search fails: it proposes nothing more
(the loop ends the experiment once the running trials are done) and results are still
stored as always.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import TrialStatus  # the public API
from .assessors import Assessor
from .tuners import NoMoreTrials, PastTrial, TryLater, Tuner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialSubmitted:
    trial_id: str
    parameter_id: int
    parameters: dict[str, Any]


@dataclass(frozen=True)
class IntermediateStored:
    trial_id: str
    value: float


@dataclass(frozen=True)
class TrialEnded:
    trial_id: str
    status: TrialStatus
    final: float | None


SearchEvent = TrialSubmitted | IntermediateStored | TrialEnded


@dataclass(frozen=True)
class StopTrial:
    """End the trial now as EARLY_STOPPED."""

    trial_id: str
    reason: str


class Mirror(Protocol):
    """Keeps a copy of the search elsewhere (an Optuna study): told each trial as the
    tuner proposed it, its intermediate results and its end."""

    def adopt(self, parameter_id: int, parameters: dict[str, Any]) -> None: ...
    def receive_intermediate_result(self, parameter_id: int, step: int, value: float) -> None: ...
    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None: ...
    def trial_end(self, parameter_id: int, success: bool) -> None: ...
    def resume(self, history: Sequence[PastTrial]) -> None: ...


@dataclass
class _Running:
    parameter_id: int
    parameters: dict[str, Any]
    history: list[float] = field(default_factory=list)
    stopping: bool = False


class Search:
    """Drives one tuner and an optional assessor from the experiment's events."""

    def __init__(self, tuner: Tuner, assessor: Assessor | None = None, mirror: Mirror | None = None) -> None:
        self.tuner = tuner
        self.assessor = assessor
        self.mirror = mirror
        self.exhausted = False
        #: Why the search cannot go on (a tuner raised), or ''.
        self.failure = ""
        self._running: dict[str, _Running] = {}

    @property
    def hears_intermediate(self) -> bool:
        """Whether anything in this search uses intermediate results: without an assessor,
        a mirror or a tuner that learns from them, the loop need not be told each metric."""
        learns = type(self.tuner).receive_intermediate_result is not Tuner.receive_intermediate_result
        return self.assessor is not None or self.mirror is not None or learns

    def propose(self, parameter_id: int) -> dict[str, Any] | None:
        """The next trial's parameters; None when the tuner is exhausted or failed."""
        if self.exhausted or self.failure:
            return None
        try:
            return self.tuner.generate_parameters(parameter_id)
        except NoMoreTrials as e:
            log.info("the tuner has nothing more to propose: %s", e)
            self.exhausted = True
        except TryLater as e:
            if not self._running:  # nothing left to wait for
                log.info("the tuner has nothing more to propose: %s", e)
                self.exhausted = True
        except Exception as e:  # noqa: BLE001 - any tuner error ends the search, not the loop
            self._fail("tuner", "generate_parameters", e)
        return None

    def refused(self, parameters: dict[str, Any], error: Exception) -> None:
        """The tuner's proposal cannot be submitted: the search fails with the reason."""
        log.error("the tuner proposed %.200r, which cannot be submitted: %s", parameters, error)
        if not self.failure:
            self.failure = f"the tuner proposed parameters that cannot be submitted: {' '.join(str(error).split())}"

    def handle(self, event: SearchEvent) -> list[StopTrial]:
        if isinstance(event, TrialSubmitted):
            self._running[event.trial_id] = _Running(event.parameter_id, event.parameters)
            self._assessor_call("trial_started", event.trial_id, event.parameter_id, event.parameters)
            self._mirror_call("adopt", event.parameter_id, event.parameters)
            return []
        t = self._running.get(event.trial_id)
        if t is None:
            return []  # not one of this search's trials (submitted through the embedding API)
        if isinstance(event, IntermediateStored):
            return self._intermediate(event, t)
        del self._running[event.trial_id]
        success = event.status is TrialStatus.SUCCEEDED
        past = PastTrial(event.trial_id, t.parameter_id, t.parameters, tuple(t.history), event.final, event.status)
        if past.result is not None:
            self._tuner_call("receive_trial_result", t.parameter_id, t.parameters, past.result)
            self._mirror_call("receive_trial_result", t.parameter_id, t.parameters, past.result)
        self._tuner_call("trial_end", t.parameter_id, success)
        self._mirror_call("trial_end", t.parameter_id, success)
        self._assessor_call("trial_end", event.trial_id, success)
        return []

    def _intermediate(self, event: IntermediateStored, t: _Running) -> list[StopTrial]:
        t.history.append(event.value)
        self._tuner_call("receive_intermediate_result", t.parameter_id, len(t.history) - 1, event.value)
        self._mirror_call("receive_intermediate_result", t.parameter_id, len(t.history) - 1, event.value)
        if t.stopping or self.assessor is None:
            return []
        keep = self._assessor_call("assess_trial", event.trial_id, list(t.history))
        if keep is False:
            t.stopping = True
            log.info("trial %s: the assessor stops it after %d results", event.trial_id, len(t.history))
            return [
                StopTrial(event.trial_id, f"stopped early by the assessor after {len(t.history)} intermediate results")
            ]
        return []

    def resume(self, history: Sequence[PastTrial]) -> None:
        """Tell the tuner and the assessor what an earlier run did; track what still runs."""
        self._guarded("tuner", "resume", lambda: self.tuner.resume(history))
        self._assessor_call("resume", history)
        self._mirror_call("resume", history)
        for t in history:
            if t.status is None:
                self._running[t.trial_id] = _Running(t.parameter_id, t.parameters, list(t.intermediate))

    def _tuner_call(self, method: str, *args: Any) -> None:
        if not self.failure:
            self._guarded("tuner", method, lambda: getattr(self.tuner, method)(*args))

    def _assessor_call(self, method: str, *args: Any) -> Any:
        if self.assessor is None:
            return None
        assessor = self.assessor
        return self._guarded("assessor", method, lambda: getattr(assessor, method)(*args))

    def _mirror_call(self, method: str, *args: Any) -> None:
        if self.mirror is not None:
            mirror = self.mirror
            self._guarded("mirror", method, lambda: getattr(mirror, method)(*args))

    def _guarded(self, who: str, method: str, call: Any) -> Any:
        try:
            return call()
        except Exception as e:  # an algorithm's error must not kill the loop
            if who == "tuner":
                self._fail(who, method, e)
            elif who == "assessor":
                # Without its assessor the experiment still finds good trials: go on, say so.
                log.exception("the assessor raised in %s; trials now run to their end", method)
                self.assessor = None
            else:  # the experiment's own store keeps everything: the copy is what stops
                log.exception("the Optuna study mirroring the experiment raised in %s; it is no longer updated", method)
                self.mirror = None
            return None

    def _fail(self, who: str, method: str, e: Exception) -> None:
        log.exception("the %s raised in %s; no more trials are proposed", who, method)
        if not self.failure:
            self.failure = f"the {who} raised in {method}: {type(e).__name__}: {' '.join(str(e).split())}"
