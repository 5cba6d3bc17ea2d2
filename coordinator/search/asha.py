"""ASHA (asynchronous successive halving) and asynchronous Hyperband, built in, as an
assessor beside any tuner: the tuner proposes configurations, this decides how far each
trains.

Each bracket has rungs at ``min_resource * eta**(b + i)`` (below ``max_resource``), where
``b`` is the bracket's number (bracket 0 starts at ``min_resource``; several brackets make
asynchronous Hyperband, the last possible one without rungs, as Hyperband's last bracket
trains its configurations to the end) and ``eta`` the reduction factor. With ``brackets:
adaptive`` there is every bracket, and each new configuration goes to the bracket furthest
behind a share that learns which bracket pays: Hyperband's share, times how often the
bracket's configurations ended among the best quarter of all results at ``max_resource``
(``_Pay``). A trial's resource is the number
of intermediate results it reported (an epoch each) or, with ``resource: <key>``, the value
of that key in its latest result. When a trial reaches a rung, its result there is
recorded, and:

- a trial that checkpoints (promotion form) goes on when it is among the best
  ``floor(n / eta)`` of the ``n`` trials that reached the rung, not yet promoted from it;
  otherwise it is paused, and continued from its checkpoint once the rung's population has
  grown so that it is among them;
- a trial that does not (stopping form) goes on when it is among the best ``ceil(n / eta)``
  of what reached the rung so far, and is stopped otherwise.

A trial checkpoints once it saved a checkpoint, or when another trial of the experiment
did (they run the same code). A trial at a rung before any trial of the experiment saved
one is judged one result later, once it is known whether it saves checkpoints. A trial
that goes past ``max_resource`` is stopped.

No I/O: decisions are made from the events the search hands it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config.objectives import Objectives
from .assessors import Assessor, AssessorError, Verdict

if TYPE_CHECKING:
    from .tuners import PastTrial

__all__ = ["Asha", "bracket_rungs"]

EPOCH = "epoch"
ADAPTIVE = "adaptive"


@dataclass
class _Rung:
    resource: float
    results: dict[str, float] = field(default_factory=dict)  # trial -> its result on reaching the rung
    promoted: set[str] = field(default_factory=set)


@dataclass
class _Trial:
    bracket: int
    checkpoints: bool | None = None  # None: not known yet
    waiting: int | None = None  # the rung it waits at, paused (or being paused) for a promotion
    deferred: int | None = None  # the rung it is judged at once it is known whether it checkpoints
    resource: float = 0.0
    ended: bool = False
    last: Any = None  # its latest result as reported
    final: float | None = None  # its result on reaching max_resource


def bracket_rungs(min_resource: float, max_resource: float, eta: int, bracket: int) -> list[float]:
    """The resources of a bracket's rungs, smallest first: ``min_resource * eta**(bracket+i)``
    below ``max_resource``."""
    rungs: list[float] = []
    r = min_resource * eta**bracket
    while r < max_resource:
        rungs.append(r)
        r *= eta
    return rungs


class Asha(Assessor):
    """ASHA in the promotion form (``brackets: 1``), or asynchronous Hyperband
    (``brackets`` > 1), stopping instead of pausing trials that do not checkpoint."""

    def __init__(
        self, *, max_resource: float, min_resource: float = 1, reduction_factor: int = 3, brackets: int | str = 1,
        resource: str = EPOCH, optimize_mode: str = "maximize",
    ) -> None:
        for name, value in (("min_resource", min_resource), ("max_resource", max_resource)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise AssessorError(f"assessor 'asha': classArgs.{name} must be a number > 0, got {value!r}")
        if max_resource <= min_resource:
            raise AssessorError(
                f"assessor 'asha': classArgs.max_resource ({max_resource:g}) must be larger than min_resource "
                f"({min_resource:g})"
            )
        eta = reduction_factor
        if isinstance(eta, bool) or not isinstance(eta, int) or eta < 2:
            raise AssessorError(f"assessor 'asha': classArgs.reduction_factor must be an integer >= 2, got {eta!r}")
        most = len(bracket_rungs(min_resource, max_resource, eta, 0)) + 1  # the last one stops nothing
        self.pay: _Pay | None = None
        if brackets == ADAPTIVE:
            brackets, self.pay = most, _Pay()
        if isinstance(brackets, bool) or not isinstance(brackets, int) or not 1 <= brackets <= most:
            raise AssessorError(
                f"assessor 'asha': classArgs.brackets must be an integer from 1 to {most} (one a rung between "
                f"min_resource {min_resource:g} and max_resource {max_resource:g} with reduction_factor {eta}, "
                f"and one without rungs) or '{ADAPTIVE}' (all of them, shared by what each pays), got {brackets!r}"
            )
        if not isinstance(resource, str) or not resource.strip():
            raise AssessorError(
                f"assessor 'asha': classArgs.resource must be 'epoch' (one per intermediate result) or the key of a "
                f"dict result that holds the resource, got {resource!r}"
            )
        if optimize_mode not in ("maximize", "minimize"):
            raise AssessorError(
                f"assessor 'asha': classArgs.optimize_mode must be 'maximize' or 'minimize', got {optimize_mode!r}"
            )
        self.eta, self.max_resource, self.resource_key = eta, float(max_resource), resource
        self.maximize = optimize_mode == "maximize"
        self.rungs = [[_Rung(r) for r in bracket_rungs(min_resource, max_resource, eta, b)] for b in range(brackets)]
        # Hyperband's share of configurations per bracket: eta**s / (s + 1), s its halvings.
        self._weights = [eta ** len(rungs) / (len(rungs) + 1) for rungs in self.rungs]
        self._assigned = [0] * brackets
        self._trials: dict[str, _Trial] = {}
        self._any_checkpoint = False  # some trial saved a checkpoint: the others can too
        self._no_checkpoint = False  # some trial reported past a rung without saving one
        self.objectives: Objectives | None = None  # ranked by objectives.rank when the experiment declares them

    def use_objectives(self, objectives: Objectives) -> None:
        """Rank the results at each rung by the experiment's objectives (``rank``): bigger
        scores first, a result missing a key or breaking a constraint last."""
        self.objectives, self.maximize = objectives, True

    # ---- what the search tells it ---------------------------------------------------------

    def trial_started(self, trial_id: str, parameter_id: int, parameters: dict[str, Any]) -> None:
        self._trial(trial_id)

    def trial_checkpointed(self, trial_id: str) -> None:
        t = self._trial(trial_id)
        t.checkpoints = self._any_checkpoint = True
        if t.deferred is not None and not t.ended:  # it waited for this to be judged at its rung
            i = t.deferred
            if self._judge(trial_id, t, i) is Verdict.PAUSE:
                self.request_pause(trial_id, f"waits at rung {self.rungs[t.bracket][i].resource:g} for a promotion")

    def result_reported(self, trial_id: str, result: Any) -> None:
        self._trial(trial_id).last = result
        if self.resource_key != EPOCH and isinstance(result, dict):
            value = result.get(self.resource_key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._trial(trial_id).resource = float(value)

    def trial_paused(self, trial_id: str) -> None:
        self._trial(trial_id).checkpoints = True

    def trial_continued(self, trial_id: str, parameters: dict[str, Any]) -> None:
        t = self._trial(trial_id)
        if t.waiting is not None:  # continued by someone else (trialkeeper continue): it passed its rung
            self.rungs[t.bracket][t.waiting].promoted.add(trial_id)
            t.waiting = None

    def trial_end(self, trial_id: str, success: bool) -> None:
        t = self._trial(trial_id)
        t.ended, t.waiting, t.deferred = True, None, None

    def decide(self, trial_id: str, history: Sequence[float]) -> Verdict:
        t = self._trial(trial_id)
        resource = float(len(history)) if self.resource_key == EPOCH else t.resource
        if resource >= self.max_resource and t.final is None and history:  # its result at max_resource
            self._finished(t, self._value(t.last, history[-1]))
        if resource > self.max_resource:
            return Verdict.STOP
        if t.deferred is not None:
            return self._judge(trial_id, t, t.deferred)
        i = self._rung_at(t, resource)
        if i is None:
            return Verdict.CONTINUE
        rung = self.rungs[t.bracket][i]
        if trial_id in rung.promoted:
            return Verdict.CONTINUE  # it goes on from there (continued, or rerun after a loss)
        if t.waiting == i:
            return Verdict.PAUSE  # judged already: its pause is on its way
        rung.results[trial_id] = self._value(t.last, history[-1])  # its result on reaching the rung
        if self._knows_checkpoints(t) is None:
            t.deferred = i  # judged at its next result, when it is known whether it saves checkpoints
            return Verdict.CONTINUE
        return self._judge(trial_id, t, i)

    def search_ending(self) -> None:
        """No new configuration comes: each rung's population is final, and promotes its best
        ceil(n / eta) (as the stopping form does), from the highest rung with any waiting."""
        for b, rungs in enumerate(self.rungs):
            for i in reversed(range(len(rungs))):
                rung = rungs[i]
                best = self._best(rung, math.ceil(len(rung.results) / self.eta))
                promoted = [tid for tid in best if self._waits(tid, b, i) and tid not in rung.promoted]
                for trial_id in promoted:
                    rung.promoted.add(trial_id)
                    self._trials[trial_id].waiting = None
                    self.request_continue(trial_id)
                if promoted:
                    break

    # ---- the rules ------------------------------------------------------------------------

    def _judge(self, trial_id: str, t: _Trial, i: int) -> Verdict:
        rung = self.rungs[t.bracket][i]
        checkpoints = self._knows_checkpoints(t)
        t.deferred = None
        if not checkpoints:
            t.checkpoints = False
            self._no_checkpoint = True
            keep = self._best(rung, math.ceil(len(rung.results) / self.eta))
            verdict = Verdict.CONTINUE if trial_id in keep else Verdict.STOP
            if verdict is Verdict.CONTINUE:
                rung.promoted.add(trial_id)
        else:
            t.waiting = i
            verdict = Verdict.PAUSE
        self._promote(t.bracket, i, trial_id)
        if t.waiting is None and verdict is Verdict.PAUSE:
            verdict = Verdict.CONTINUE  # promoted at once
        return verdict

    def _promote(self, bracket: int, i: int, judged: str | None = None) -> None:
        """Promote what waits at the rung and is now among its best ``floor(n / eta)``."""
        rung = self.rungs[bracket][i]
        for trial_id in self._best(rung, len(rung.results) // self.eta):
            if trial_id in rung.promoted or not self._waits(trial_id, bracket, i):
                continue
            rung.promoted.add(trial_id)
            self._trials[trial_id].waiting = None
            if trial_id != judged:
                self.request_continue(trial_id)

    def _waits(self, trial_id: str, bracket: int, i: int) -> bool:
        t = self._trials.get(trial_id)
        return t is not None and t.bracket == bracket and t.waiting == i and not t.ended

    def _best(self, rung: _Rung, k: int) -> list[str]:
        ranked = sorted(rung.results.items(), key=lambda kv: -kv[1] if self.maximize else kv[1])
        return [trial_id for trial_id, _ in ranked[:k]]

    def _value(self, result: Any, number: float) -> float:
        """What a result (as reported) counts for at a rung: the number, or its score by the objectives."""
        if self.objectives is None:
            return number
        score = self.objectives.score(result if result is not None else number)
        return -math.inf if score is None else score

    def _knows_checkpoints(self, t: _Trial) -> bool | None:
        if t.checkpoints is not None:
            return t.checkpoints
        if t.deferred is not None:
            return False  # it reported again without saving one since its rung
        if self._any_checkpoint:
            return True
        return False if self._no_checkpoint else None

    def _rung_at(self, t: _Trial, resource: float) -> int | None:
        """The highest rung of the trial's bracket at or below ``resource``."""
        at = None
        for i, rung in enumerate(self.rungs[t.bracket]):
            if rung.resource <= resource:
                at = i
        return at

    def _finished(self, t: _Trial, final: float) -> None:
        """``t`` reached max_resource with ``final``: what its bracket pays learns of it."""
        t.final = final
        if self.pay is not None:
            self.pay.finished(t.bracket, final if self.maximize else -final)

    def _trial(self, trial_id: str) -> _Trial:
        t = self._trials.get(trial_id)
        if t is None:
            # The bracket furthest behind its share of configurations (Hyperband's n_s, or what it pays).
            weights = self._weights if self.pay is None else self.pay.weights(self._weights, self._assigned)
            b = min(range(len(self.rungs)), key=lambda b: (self._assigned[b] / weights[b], b))
            self._assigned[b] += 1
            t = self._trials[trial_id] = _Trial(b)
        return t

    # ---- after a resume -------------------------------------------------------------------

    def _resources(self, past: PastTrial) -> list[float]:
        """The trial's resource at each of its stored results."""
        if self.resource_key == EPOCH:
            return [float(n) for n in range(1, len(past.intermediate) + 1)]
        resources, last = [], 0.0
        for result in past.intermediate_reported:
            value = result.get(self.resource_key) if isinstance(result, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                last = float(value)
            resources.append(last)
        return resources

    def resume(self, history: Sequence[PastTrial]) -> None:
        """Rebuild the rungs from the stored curves: every trial recorded at each rung it
        reached, promoted from those it went past. A paused trial is judged again at the last
        rung it reached: continued when promotable now, kept paused (the search's to continue
        or end) otherwise."""
        standing: list[tuple[str, int, bool]] = []
        for past in sorted(history, key=lambda p: p.parameter_id):
            t = self._trial(past.trial_id)
            curve = past.intermediate
            resources = self._resources(past)
            t.resource = resources[-1] if resources else 0.0
            if past.paused:
                t.checkpoints = self._any_checkpoint = True
            if resources and resources[-1] >= self.max_resource:
                at_max = next(j for j, r in enumerate(resources) if r >= self.max_resource)
                reported = past.intermediate_reported
                self._finished(t, self._value(reported[at_max] if at_max < len(reported) else curve[at_max],
                                              curve[at_max]))
            # Each rung reached: the result that reached it.
            at = {i: next(j for j, r in enumerate(resources) if r >= rung.resource)
                  for i, rung in enumerate(self.rungs[t.bracket]) if resources and resources[-1] >= rung.resource}
            reached = sorted(at)
            for i in reached:
                rung = self.rungs[t.bracket][i]
                reported = past.intermediate_reported
                rung.results[past.trial_id] = self._value(reported[at[i]] if at[i] < len(reported) else curve[at[i]],
                                                          curve[at[i]])
                # A paused trial is judged again at the last rung it reached (it may wait there).
                if at[i] < len(curve) - 1 and not (past.paused and i == reached[-1]):
                    rung.promoted.add(past.trial_id)
                elif past.status is None and i == reached[-1]:
                    standing.append((past.trial_id, i, past.paused))
            t.ended = past.status is not None
        for trial_id, i, paused in standing:
            t = self._trials[trial_id]
            t.waiting = i
            rung = self.rungs[t.bracket][i]
            self._promote(t.bracket, i, trial_id if not paused else None)
            if t.waiting is not None:
                self.request_pause(trial_id, f"waits at rung {rung.resource:g} for a promotion")


class _Pay:
    """What each bracket pays, for ``brackets: adaptive``: a bracket's share of new
    configurations is Hyperband's times its hit rate, the fraction of its configurations
    whose result at ``max_resource`` is among the best quarter of all such results so far
    (smoothed toward a quarter by PRIOR configurations, so a bracket with few results keeps
    about Hyperband's share). Where early results rank configurations as their final ones,
    a bracket's finishers are the best of more configurations and every bracket hits about
    as often; where they mislead, the brackets that judge early stop the configurations that
    end best and hit less, and the later brackets get more of the new configurations."""

    TOP = 0.25  # the best quarter
    PRIOR = 4  # configurations' worth of prior hit rate (TOP)

    def __init__(self) -> None:
        self.finals: list[tuple[float, int]] = []  # (result at max_resource, bigger is better; bracket)

    def finished(self, bracket: int, score: float) -> None:
        self.finals.append((score, bracket))

    def weights(self, base: list[float], assigned: list[int]) -> list[float]:
        hits = [0] * len(base)
        for _, b in sorted(self.finals, reverse=True)[: math.ceil(len(self.finals) * self.TOP)]:
            hits[b] += 1
        return [w * (h + self.TOP * self.PRIOR) / (n + self.PRIOR) for w, h, n in zip(base, hits, assigned)]
