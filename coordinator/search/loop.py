"""The experiment loop's pass: what the engine's events and the limits make the search do.

Plain code, no clock and no I/O: a shell tells the loop what the engine published (results
stored, status changes, checkpoints saved) and reads what to do in return, pass by pass.
Two shells drive it: the experiment (``experiment.py``: a real coordinator, the real clock)
and replay (``replay/driver.py``: the engine in virtual time). A pass goes:

1. ``begin()``, then ``next_order()`` until None: stop, pause and continue trials as the
   search asked (what carrying them out makes the engine publish is heard meanwhile); the
   experiment then answers the saves heard (``Coordinator.saves_heard``): a pause decided on
   a save, or on the results before it, reaches the trial ahead of that save's answer;
2. ``spent(elapsed, paused)``: the budget (``maxExperimentDuration``, ``maxTrialResource``) is
   spent: the search ends, its paused trials given up (an ``End``);
3. ``propose(active)`` until None, each proposal submitted and told back (``submitted``)
   or refused (``refused``): new trials fill the free slots;
4. ``settle(settled, paused)`` once nothing runs by itself: the search's last chance for
   what it holds, the paused trials it gives up (a ``GiveUp``), or the end (an ``End``).

``changed`` says a pass is due at once (orders wait, or the budget may be spent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import MetricEvent, StatusEvent, TrialStatus  # the public API
from .search import (
    Instruction,
    IntermediateStored,
    Search,
    SubmitTrial,
    TrialCheckpointed,
    TrialContinued,
    TrialEnded,
    TrialPaused,
    TrialSubmitted,
)
from .steering import Limits

__all__ = ["End", "GiveUp", "Loop"]


@dataclass(frozen=True)
class GiveUp:
    """End EARLY_STOPPED these paused trials the search holds and will not continue."""

    trial_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class End:
    """The search ends. ``kind``: spent (the budget), failed (the tuner), paused (trials are
    paused that the search does not hold: a resume continues them) or done."""

    kind: str
    reason: str
    paused: tuple[str, ...] = ()  # with kind paused: the paused trials
    give_up: GiveUp | None = None  # with kind spent: what the search held paused


class Loop:
    """One search and its limits, driven pass by pass (see the module's doc)."""

    def __init__(self, search: Search, limits: Limits, *, submitted: int = 0, trained: int = 0) -> None:
        self.search, self.limits = search, limits
        self.submitted = submitted  # trials submitted: the next proposal's parameter id
        self.trained = trained  # intermediate results reported, every trial's: maxTrialResource
        self.to_do: list[Instruction] = []  # what the search asked, carried out at the next pass
        self.changed = True
        self._given_up: set[str] = set()
        self._limit_reached = False
        self._idle = False

    # ---- what the engine published ------------------------------------------------------------

    def metric(self, event: MetricEvent, checkpointed: bool) -> None:
        """A result stored; ``checkpointed``: its trial had saved a checkpoint by then."""
        if event.kind != "intermediate":
            return
        self.trained += 1
        self._tell(IntermediateStored(event.trial_id, event.value, event.index, checkpointed, event.raw))
        if self.limits.max_trial_resource is not None and self.trained >= self.limits.max_trial_resource:
            self.changed = True

    def status(self, event: StatusEvent) -> None:
        t = event.trial
        if t.status.terminal:
            self._tell(TrialEnded(t.id, t.status, t.final_metric, t.final_metric_value))
        elif t.status is TrialStatus.PAUSED:
            self._tell(TrialPaused(t.id, t.reason))
        elif event.old is TrialStatus.PAUSED:
            self._tell(TrialContinued(t.id, t.parameters))
        self.changed = True

    def checkpointed(self, trial_id: str) -> None:
        """The trial saved a checkpoint (an assessor may judge it at its rung now)."""
        self._tell(TrialCheckpointed(trial_id))

    def _tell(self, event: IntermediateStored | TrialEnded | TrialPaused | TrialContinued | TrialCheckpointed) -> None:
        orders = self.search.handle(event)
        if orders:
            self.to_do.extend(orders)
            self.changed = True

    # ---- a pass ------------------------------------------------------------------------------

    def begin(self) -> None:
        """A pass begins: a change heard from now on asks for another."""
        self.changed = False

    def next_order(self) -> Instruction | None:
        """What the search asked, to carry out now, in order; None when nothing is left."""
        return self.to_do.pop(0) if self.to_do else None

    def spent(self, elapsed: float, paused: Sequence[str]) -> End | None:
        """After the orders: the end, when the budget is spent (``elapsed`` seconds since the
        start); the paused trials (``paused``) the search holds are given up."""
        self._limit_reached = self._configurations_done()
        self._idle = self._limit_reached and not self.search.promotions_only  # nothing more to submit, for now
        why = self._budget_spent(elapsed)
        if not why:
            return None
        return End("spent", why, give_up=GiveUp(tuple(self._held(paused)), f"paused by the search when {why}"))

    def propose(self, active: int) -> SubmitTrial | None:
        """The next trial to submit while fewer than trialConcurrency hold a slot (``active``);
        None when no more now. Each one is told back with ``submitted`` or ``refused``."""
        if (self._limit_reached and not self.search.promotions_only) or active >= self.limits.trial_concurrency:
            return None
        proposal = self.search.propose_trial(self.submitted)
        if proposal is None:
            self._idle = True
        return proposal

    def submitted_as(self, trial_id: str, proposal: SubmitTrial, source: str | None) -> None:
        """The proposal was submitted as ``trial_id``, from ``source``'s checkpoint if any."""
        self.to_do.extend(self.search.handle(TrialSubmitted(trial_id, self.submitted, proposal.parameters, source)))
        self.submitted += 1
        self._limit_reached = self._configurations_done()

    def refused(self, proposal: SubmitTrial, error: Exception) -> None:
        """The proposal cannot be submitted: the search fails, saying why."""
        self.search.refused(proposal.parameters, error)
        self._idle = True

    def settle(self, settled: bool, paused: Sequence[str]) -> GiveUp | End | None:
        """The pass's end. ``settled``: no trial runs, waits or is ending; ``paused``: the
        paused trials. A GiveUp to carry out (another pass follows), the End, or None: wait
        for the engine (``changed`` set: pass again at once)."""
        search = self.search
        self.to_do.extend(search.take_orders())
        if self.to_do:
            self.changed = True
        if not (self._idle and not self.to_do and settled):  # something will still happen by itself
            return None
        if search.failure:
            return End("failed", search.failure)
        if any(search.holds(t) for t in paused):
            self.to_do.extend(search.ending())  # the last chance for what it holds
            if self.to_do:
                self.changed = True
                return None
        held = self._held(paused)
        if held:  # their ends reach the search, which may propose more
            self.changed = True
            return GiveUp(tuple(held), "paused by the search, which ended without continuing it")
        if any(not search.holds(t) for t in paused):
            return End("paused", f"{len(paused)} trials are paused and nothing else runs", paused=tuple(paused))
        if not paused and search.exhausted:
            return End("done", "the tuner has nothing more to propose")
        if not paused and self._limit_reached and not search.promotions_only:
            return End("done", f"maxTrialNumber ({self.limits.max_trial_number}) reached")
        return None

    def _held(self, paused: Sequence[str]) -> list[str]:
        """The paused trials the search holds, not given up yet (each given up once)."""
        held = [t for t in paused if self.search.holds(t) and t not in self._given_up]
        self._given_up.update(held)
        return held

    def _budget_spent(self, elapsed: float) -> str:
        """Why the search's budget is spent (time, or training), or ''."""
        limits = self.limits
        if limits.max_experiment_duration is not None and elapsed >= limits.max_experiment_duration:
            return f"maxExperimentDuration ({limits.max_experiment_duration:g} s) reached"
        if limits.max_trial_resource is not None and self.trained >= limits.max_trial_resource:
            return f"maxTrialResource ({limits.max_trial_resource:g}) reached: {self.trained} results reported"
        return ""

    def _configurations_done(self) -> bool:
        """Whether maxTrialNumber configurations are submitted (the tuner then proposes only
        promotions of those, if it can; told once)."""
        if self.limits.max_trial_number is None or self.search.configurations < self.limits.max_trial_number:
            return False
        self.search.no_more_configurations()
        return True
