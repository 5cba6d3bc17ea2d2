"""The search: a tuner that proposes trials and an assessor that stops hopeless ones, fed
the experiment's events and returning what to do. No I/O: the experiment loop carries out
the instructions (``experiment.py``).

Every intermediate result reaches the tuner and the assessor as it is stored; an assessor's
"stop" becomes a StopTrial instruction (the loop ends the trial EARLY_STOPPED), its "pause"
a PauseTrial (the trial saves a checkpoint and frees its slot). A tuner or an assessor may
also ask to pause, continue or stop trials (``requests.Requesting``) and a tuner to start a
new trial from another's checkpoint (``Tuner.checkpoint_from``). A trial stopped early
teaches the tuner its last intermediate result, as NNI does. An algorithm that raises is
logged with its traceback and the search fails: it proposes nothing more (the loop ends the
experiment once the running trials are done) and results are still stored as always.

Each intermediate result carries its stored index: a trial continued from a checkpoint
after its environment was lost reports again from the checkpoint's index on, and those
results replace the lost run's from that index on, so the tuner and the assessor see one
curve.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .. import TrialStatus  # the public API
from ..config.objectives import Objectives
from .assessors import Assessor, Verdict
from .requests import Request, RequestKind
from .tuners import NoMoreTrials, PastTrial, TryLater, Tuner

log = logging.getLogger(__name__)


# ---- events: what happened -------------------------------------------------------------------


@dataclass(frozen=True)
class TrialSubmitted:
    trial_id: str
    parameter_id: int
    parameters: dict[str, Any]
    checkpoint_from: str | None = None  # the trial whose checkpoint it starts from


@dataclass(frozen=True)
class IntermediateStored:
    trial_id: str
    value: float
    index: int | None = None  # the result's stored index; None: after the last one
    checkpointed: bool = False  # the trial had saved a checkpoint when it reported it
    result: Any = None  # the result as reported (a number, or a dict with more keys)


@dataclass(frozen=True)
class TrialPaused:
    trial_id: str
    reason: str = ""


@dataclass(frozen=True)
class TrialContinued:
    trial_id: str
    parameters: dict[str, Any] | None = None  # None: its own


@dataclass(frozen=True)
class TrialEnded:
    trial_id: str
    status: TrialStatus
    final: float | None
    result: Any = None  # the final result as reported (a number, or a dict with more keys)


@dataclass(frozen=True)
class TrialCheckpointed:
    """The trial has saved a checkpoint (heard once; also with its next result)."""

    trial_id: str


SearchEvent = TrialSubmitted | IntermediateStored | TrialPaused | TrialContinued | TrialEnded | TrialCheckpointed


# ---- instructions: what to do -----------------------------------------------------------------


@dataclass(frozen=True)
class StopTrial:
    """End the trial now as EARLY_STOPPED."""

    trial_id: str
    reason: str


@dataclass(frozen=True)
class PauseTrial:
    """Ask the trial to save a checkpoint and end its process, PAUSED."""

    trial_id: str
    reason: str


@dataclass(frozen=True)
class ContinueTrial:
    """Continue the paused trial from its last checkpoint, with new parameters if given; from
    the newest checkpoint of trial ``checkpoint_from`` instead, when given (an exploit: the
    better trial's state copied into this one)."""

    trial_id: str
    parameters: dict[str, Any] | None = None
    checkpoint_from: str | None = None


@dataclass(frozen=True)
class SubmitTrial:
    """Submit a new trial (what ``propose_trial`` returns), from the latest checkpoint of
    ``checkpoint_from`` when given."""

    parameter_id: int
    parameters: dict[str, Any]
    checkpoint_from: str | None = None
    promotes: bool = False  # it trains further the configuration of an earlier trial


Instruction = StopTrial | PauseTrial | ContinueTrial


class Mirror(Protocol):
    """Keeps a copy of the search elsewhere (an Optuna study): told each trial as the
    tuner proposed it, its intermediate results and its end."""

    def adopt(self, parameter_id: int, parameters: dict[str, Any]) -> None: ...
    def receive_intermediate_result(self, parameter_id: int, step: int, value: float) -> None: ...
    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None: ...
    def trial_end(self, parameter_id: int, success: bool) -> None: ...
    def resume(self, history: Sequence[PastTrial]) -> None: ...


@dataclass
class _Tracked:
    """A trial of this search that has not ended."""

    parameter_id: int
    parameters: dict[str, Any]
    history: list[float] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)  # the stored index of each result in history
    last_result: Any = None  # its latest intermediate result as reported
    stopping: bool = False
    checkpointed: bool = False  # it saved a checkpoint (the assessor was told)
    pausing: bool = False  # the search asked it to pause; not paused yet
    paused: bool = False
    held: bool = False  # paused because the search asked
    continuing: bool = False  # continue asked, not heard yet
    # A continue asked while the pause was on its way, carried out once paused.
    continue_after_pause: ContinueTrial | None = None

    @property
    def active(self) -> bool:
        """Whether it runs or waits to (a paused trial holds no slot)."""
        return not self.paused or self.continuing


class Search:
    """Drives one tuner and an optional assessor from the experiment's events."""

    def __init__(
        self, tuner: Tuner, assessor: Assessor | None = None, mirror: Mirror | None = None,
        objectives: Objectives | None = None,
    ) -> None:
        self.tuner = tuner
        self.assessor = assessor
        self.mirror = mirror
        self.exhausted = False
        #: Why the search cannot go on (a tuner raised), or ''; whether the log holds its traceback.
        self.failure, self.traceback_logged = "", False
        self._trials: dict[str, _Tracked] = {}
        self._trial_of: dict[int, str] = {}  # parameter id -> trial id, ended trials too
        self._orders: list[Instruction] = []
        # A tuner that sets takes_reported hears results as reported (dicts of keys too: several objectives).
        self._reported = getattr(tuner, "takes_reported", False) is True
        # The config's objectives: another tuner hears each result's ranking (objectives.rank).
        self.objectives = objectives
        #: Configurations submitted (what maxTrialNumber counts): a promotion is none.
        self.configurations = 0
        self._promotions: set[int] = set()  # proposed parameter ids that train an earlier configuration
        self.promotions_only = False  # the tuner proposes nothing new, only promotions

    @property
    def hears_intermediate(self) -> bool:
        """Whether anything in this search uses intermediate results: without an assessor,
        a mirror or a tuner that learns from them, the loop need not be told each metric."""
        learns = type(self.tuner).receive_intermediate_result is not Tuner.receive_intermediate_result
        return self.assessor is not None or self.mirror is not None or learns

    @property
    def hears_reported(self) -> bool:
        """Whether the assessor, or the tuner (``takes_reported``), reads intermediate results as
        reported (a dict's other keys): a resume then hands it the stored ones."""
        a = self.assessor
        return self._reported or (a is not None and type(a).result_reported is not Assessor.result_reported)

    def holds(self, trial_id: str) -> bool:
        """Whether the trial is paused because this search asked, and not continued."""
        t = self._trials.get(trial_id)
        return t is not None and t.held and not t.continuing

    def propose(self, parameter_id: int) -> dict[str, Any] | None:
        """The next trial's parameters; None when the tuner is exhausted or failed."""
        proposal = self.propose_trial(parameter_id)
        return None if proposal is None else proposal.parameters

    def propose_trial(self, parameter_id: int) -> SubmitTrial | None:
        """The next trial to submit, with the trial whose checkpoint it starts from, if
        any; None when the tuner is exhausted or failed. What the tuner asked meanwhile
        is in ``take_orders``."""
        if self.exhausted or self.failure:
            return None
        try:
            parameters = self.tuner.generate_parameters(parameter_id)
        except NoMoreTrials as e:
            log.info("the tuner has nothing more to propose: %s", e)
            self.exhausted = True
            return None
        except TryLater as e:
            self._take_requests()
            if not self._trials and not self._orders:  # nothing left to wait for
                log.info("the tuner has nothing more to propose: %s", e)
                self.exhausted = True
            return None
        except Exception as e:  # noqa: BLE001 - any tuner error ends the search, not the loop
            self._fail("tuner", "generate_parameters", e)
            return None
        source = self._tuner_call("checkpoint_from", parameter_id)
        promotes = self._tuner_call("configuration_of", parameter_id) is not None
        if promotes:
            self._promotions.add(parameter_id)
        self._take_requests()
        source_trial = None
        if source is not None:
            source_trial = self._trial_of.get(source) if isinstance(source, int) else None
            if source_trial is None:
                log.warning("the tuner asked trial %d to start from the checkpoint of parameter id %r, which no "
                            "trial of this search ran; it starts afresh", parameter_id, source)
        return SubmitTrial(parameter_id, parameters, source_trial, promotes)

    def ending(self) -> list[Instruction]:
        """Nothing runs and the tuner proposes nothing more: what the assessor continues of the
        trials the search holds paused (the others are then stopped)."""
        self._assessor_call("search_ending")
        return self.take_orders()

    def no_more_configurations(self) -> bool:
        """``maxTrialNumber`` configurations are submitted: whether the tuner still proposes
        promotions of those (asked once)."""
        if not self.promotions_only and not self.failure:
            self.promotions_only = bool(self._tuner_call("only_promotions"))
        return self.promotions_only

    def refused(self, parameters: dict[str, Any], error: Exception) -> None:
        """The tuner's proposal cannot be submitted: the search fails with the reason."""
        log.error("the tuner proposed %.200r, which cannot be submitted: %s", parameters, error)
        if not self.failure:  # not JSON: the tuner's fault; otherwise no environment could run it
            tuners = isinstance(error, TypeError)
            what = "the tuner proposed parameters that cannot be" if tuners else "a trial cannot be"
            self.failure = f"{what} submitted: {' '.join(str(error).split())}"

    def take_orders(self) -> list[Instruction]:
        """The instructions the tuner and the assessor asked for and not yet returned."""
        self._take_requests()
        orders, self._orders = self._orders, []
        return orders

    def handle(self, event: SearchEvent) -> list[Instruction]:
        """Tell the search what happened; the instructions it gives in return (and any
        still pending from proposing)."""
        self._handle(event)
        return self.take_orders()

    def _handle(self, event: SearchEvent) -> None:
        if isinstance(event, TrialSubmitted):
            if event.parameter_id not in self._promotions:
                self.configurations += 1
            self._trials[event.trial_id] = _Tracked(event.parameter_id, event.parameters)
            self._trial_of[event.parameter_id] = event.trial_id
            self._assessor_call("trial_started", event.trial_id, event.parameter_id, event.parameters)
            self._mirror_call("adopt", event.parameter_id, event.parameters)
            return
        t = self._trials.get(event.trial_id)
        if t is None:
            return  # not one of this search's trials (submitted through the embedding API)
        if isinstance(event, IntermediateStored):
            self._intermediate(event, t)
        elif isinstance(event, TrialPaused):
            self._paused(event, t)
        elif isinstance(event, TrialContinued):
            self._continued(event, t)
        elif isinstance(event, TrialCheckpointed):
            self._checkpointed(event.trial_id, t)
        else:
            self._ended(event, t)

    def _intermediate(self, event: IntermediateStored, t: _Tracked) -> None:
        index = event.index
        if index is None:
            index = t.indexes[-1] + 1 if t.indexes else 0
        elif t.indexes and index <= t.indexes[-1]:
            # A run continued from a checkpoint reports again from there: it replaces the lost run's results.
            keep = bisect.bisect_left(t.indexes, index)
            log.info("trial %s: result %d replaces the %d results from there on", event.trial_id, index,
                     len(t.indexes) - keep)
            del t.history[keep:], t.indexes[keep:]
        t.history.append(event.value)
        t.indexes.append(index)
        step = len(t.history) - 1
        t.last_result = event.result
        heard = self._heard(event.result, event.value)
        if heard is not None:
            self._tuner_call("receive_intermediate_result", t.parameter_id, step, heard)
        self._mirror_call("receive_intermediate_result", t.parameter_id, step, event.value)
        if event.checkpointed:
            self._checkpointed(event.trial_id, t)
        if event.result is not None:
            self._assessor_call("result_reported", event.trial_id, event.result)
        if t.stopping or t.pausing or t.paused or self.assessor is None:
            return
        verdict = self._assessor_call("decide", event.trial_id, list(t.history))
        n = len(t.history)
        if verdict is Verdict.STOP or verdict is False:
            t.stopping = True
            log.info("trial %s: the assessor stops it after %d results", event.trial_id, n)
            reason = f"stopped early by the assessor after {n} intermediate results"
            self._orders.append(StopTrial(event.trial_id, reason))
        elif verdict is Verdict.PAUSE:
            log.info("trial %s: the assessor pauses it after %d results", event.trial_id, n)
            self._pause(event.trial_id, t, f"paused by the assessor after {n} intermediate results")

    def _checkpointed(self, trial_id: str, t: _Tracked) -> None:
        if not t.checkpointed:
            t.checkpointed = True
            self._assessor_call("trial_checkpointed", trial_id)

    def _paused(self, event: TrialPaused, t: _Tracked) -> None:
        t.held, t.paused, t.pausing, t.continuing = t.pausing, True, False, False
        self._tuner_call("trial_paused", t.parameter_id)
        self._assessor_call("trial_paused", event.trial_id)
        if t.continue_after_pause is not None:
            order, t.continue_after_pause = t.continue_after_pause, None
            t.continuing = True
            self._orders.append(order)

    def _continued(self, event: TrialContinued, t: _Tracked) -> None:
        t.paused = t.held = t.continuing = False
        if event.parameters is not None:
            t.parameters = dict(event.parameters)
        self._tuner_call("trial_continued", t.parameter_id, t.parameters)
        self._assessor_call("trial_continued", event.trial_id, t.parameters)

    def _ended(self, event: TrialEnded, t: _Tracked) -> None:
        del self._trials[event.trial_id]
        success = event.status is TrialStatus.SUCCEEDED
        past = PastTrial(event.trial_id, t.parameter_id, t.parameters, tuple(t.history), event.final, event.status)
        if past.result is not None:
            early = event.status is TrialStatus.EARLY_STOPPED and event.result is None  # its last result counts
            heard = self._heard(t.last_result if early else event.result, past.result)
            if heard is not None:
                self._tuner_call("receive_trial_result", t.parameter_id, t.parameters, heard)
            self._mirror_call("receive_trial_result", t.parameter_id, t.parameters, past.result)
        self._tuner_call("trial_end", t.parameter_id, success)
        self._mirror_call("trial_end", t.parameter_id, success)
        self._assessor_call("trial_end", event.trial_id, success)

    def _heard(self, result: Any, value: float | None) -> Any:
        """What the tuner hears of a result: as reported, by a tuner that takes them so; with
        objectives, the result's ranking in the tuner's optimize_mode (None, and nothing heard,
        when it ranks nothing: a key missing, a constraint broken); else the number."""
        if result is None or self._reported:
            return value if result is None else result
        if self.objectives is None:
            return value
        score = self.objectives.score(result)
        return None if score is None else -score if self.tuner.optimize_mode == "minimize" else score

    def _pause(self, trial_id: str, t: _Tracked, reason: str) -> None:
        t.pausing = True
        self._orders.append(PauseTrial(trial_id, reason))

    def _take_requests(self) -> None:
        """Turn what the tuner (by parameter id) and the assessor (by trial id) asked into
        instructions, checked against what each trial is doing."""
        if not self.failure:
            for request in self._guarded("tuner", "take_requests", self.tuner.take_requests) or ():
                trial_id = self._trial_of.get(request.target) if isinstance(request.target, int) else None
                self._request("tuner", request, trial_id)
        if self.assessor is not None:
            for request in self._guarded("assessor", "take_requests", self.assessor.take_requests) or ():
                self._request("assessor", request, request.target if isinstance(request.target, str) else None)

    def _request(self, who: str, request: Request, trial_id: str | None) -> None:
        t = self._trials.get(trial_id) if trial_id is not None else None
        kind = request.kind.value
        if t is None:
            log.warning("the %s asked to %s %r, which is no trial of this search still going", who, kind,
                        request.target)
            return
        assert trial_id is not None
        if t.stopping:
            return  # it is ending: nothing more to do with it
        if request.kind is RequestKind.STOP:
            t.stopping = True
            self._orders.append(StopTrial(trial_id, request.reason or f"stopped early by the {who}"))
        elif request.kind is RequestKind.PAUSE:
            if t.paused and not t.continuing:
                t.held = True  # paused already (after a resume, say): now the search's to continue or end
            elif not (t.pausing or t.paused) or t.continuing:
                self._pause(trial_id, t, request.reason or f"paused by the {who}")
        elif t.paused and not t.continuing:
            t.continuing = True
            self._orders.append(self._continue_order(who, request, trial_id))
        elif t.pausing:
            t.continue_after_pause = self._continue_order(who, request, trial_id)
        elif request.parameters is not None and request.parameters != t.parameters:
            log.warning("the %s asked to continue trial %s with new parameters, but it is not paused: it goes on "
                        "with its own", who, trial_id)

    def _continue_order(self, who: str, request: Request, trial_id: str) -> ContinueTrial:
        """The continue asked, its checkpoint's trial named as the asker names trials."""
        source = request.checkpoint_from
        source_trial = self._trial_of.get(source) if who == "tuner" and isinstance(source, int) else source
        if source is not None and not isinstance(source_trial, str):
            log.warning("the %s asked to continue trial %s from the checkpoint of %r, which no trial of this search "
                        "ran; it continues from its own", who, trial_id, source)
            source_trial = None
        return ContinueTrial(trial_id, request.parameters, source_trial)

    def resume(self, history: Sequence[PastTrial]) -> None:
        """Tell the tuner and the assessor what an earlier run did; track what has not ended.
        With objectives, a tuner that learns one value hears each final result's ranking."""
        heard = history
        if self.objectives is not None and not self._reported:
            heard = [replace(t, final=self._heard(t.reported, t.final)) if t.reported is not None else t
                     for t in history]
        self._guarded("tuner", "resume", lambda: self.tuner.resume(heard))
        self._assessor_call("resume", history)
        self._mirror_call("resume", history)
        budget = getattr(self.tuner, "budget_parameter", None)
        if budget is None:
            self.configurations += len(history)
        else:  # trials that differ only in their budget ran one configuration
            self.configurations += len({
                json.dumps({k: v for k, v in t.parameters.items() if k != budget}, sort_keys=True, default=repr)
                for t in history
            })
        for t in history:
            self._trial_of[t.parameter_id] = t.trial_id
            if t.status is None:
                indexes = list(t.intermediate_indexes) or list(range(len(t.intermediate)))
                self._trials[t.trial_id] = _Tracked(
                    t.parameter_id, t.parameters, list(t.intermediate), indexes, paused=t.paused
                )
        # What they asked while hearing the past (keep a paused trial paused, continue it) is for now.
        self._take_requests()

    def _tuner_call(self, method: str, *args: Any) -> Any:
        if self.failure:
            return None
        return self._guarded("tuner", method, lambda: getattr(self.tuner, method)(*args))

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
        self.traceback_logged = True
        if not self.failure:
            self.failure = f"the {who} raised in {method}: {type(e).__name__}: {' '.join(str(e).split())}"
