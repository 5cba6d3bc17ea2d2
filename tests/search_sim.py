"""A search driven in virtual time: trials with set learning curves, an epoch a tick, the
search's instructions carried out as the experiment loop carries them out (a pause lands at
the trial's next checkpoint, a continue goes ahead of new trials, a trial paused by the
search and never continued is stopped once nothing else runs). No clock, no processes: the
scenario tests of multi-fidelity searches run on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.search import (
    ContinueTrial,
    Instruction,
    IntermediateStored,
    PauseTrial,
    Search,
    StopTrial,
    TrialCheckpointed,
    TrialContinued,
    TrialEnded,
    TrialPaused,
    TrialSubmitted,
)
from trialkeeper.coordinator.search.tuners import PastTrial

Curve = Callable[[dict[str, Any], int], float]  # (parameters, epoch from 1) -> result


@dataclass
class SimTrial:
    id: str
    parameter_id: int
    parameters: dict[str, Any]
    status: str = "running"  # running | waiting | paused | ended
    epoch: int = 0  # epochs trained in the current run
    checkpoint: int | None = None  # the step of its last checkpoint
    curve: list[float] = field(default_factory=list)  # its results, by index
    pausing: bool = False
    end: TrialStatus | None = None
    trained: int = 0  # epochs trained, over all its runs
    held_by_search: bool = False
    state: float = 0.0  # with a cumulative curve: the result, what its checkpoint keeps
    saved: dict[int, float] = field(default_factory=dict)  # checkpoint step -> its state then
    took_from: list[str] = field(default_factory=list)  # the trials whose checkpoints it continued from


@dataclass
class Sim:
    search: Search
    curve: Curve
    epochs: int  # what each trial trains to
    concurrency: int = 2
    max_trials: int | None = None
    checkpoints: bool = True  # whether trials save checkpoints
    checkpoint_every: int = 1  # the epochs between two checkpoints
    hears_checkpoints: bool = False  # the loop tells a save before the trial's next result
    # The curve gives what each epoch adds to the trial's state, its result; a checkpoint keeps
    # the state, so a trial continued from another's checkpoint goes on from that one's state.
    cumulative: bool = False
    trials: dict[str, SimTrial] = field(default_factory=dict)
    log: list[tuple[int, str, str, int]] = field(default_factory=list)  # (tick, what, trial, epoch)
    tick: int = 0
    submitted: int = 0
    orders: list[Instruction] = field(default_factory=list)

    # ---- the experiment loop ---------------------------------------------------------------

    def run(self, *, until: Callable[[Sim], bool] | None = None, ticks: int = 10_000) -> Sim:
        for _ in range(ticks):
            if until is not None and until(self):
                return self
            if not self.step():
                return self
        raise AssertionError("the simulated search did not end")

    def step(self) -> bool:
        """One tick: carry out orders, fill the slots, train every running trial one epoch.
        False once nothing is left to do."""
        self._carry_out()
        self._fill()
        running = [t for t in self.trials.values() if t.status == "running"]
        if not running:
            if self._give_up_held():
                return True
            return bool(self.orders) or any(t.status == "waiting" for t in self.trials.values())
        for t in running:
            self._train(t)
        self.tick += 1
        return True

    def _fill(self) -> None:
        active = sum(1 for t in self.trials.values() if t.status == "running")
        for t in self.trials.values():  # continued trials go first
            if active < self.concurrency and t.status == "waiting":
                t.status, t.epoch = "running", t.checkpoint or 0
                t.state = t.saved.get(t.epoch, 0.0)
                active += 1
        while active < self.concurrency and (self.max_trials is None or self.submitted < self.max_trials):
            proposal = self.search.propose_trial(self.submitted)
            if proposal is None:
                break
            trial_id = f"t{self.submitted}"
            t = self.trials[trial_id] = SimTrial(trial_id, self.submitted, proposal.parameters)
            self.log.append((self.tick, "submitted", trial_id, 0))
            self.orders += self.search.handle(TrialSubmitted(trial_id, self.submitted, proposal.parameters))
            self.submitted += 1
            active += 1
            assert t.status == "running"
        self.orders += self.search.take_orders()

    def _train(self, t: SimTrial) -> None:
        t.epoch += 1
        t.trained += 1
        value = self.curve(t.parameters, t.epoch)
        if self.cumulative:
            t.state = value = t.state + value
        del t.curve[t.epoch - 1:]
        t.curve.append(value)
        self.log.append((self.tick, "result", t.id, t.epoch))
        self.orders += self.search.handle(IntermediateStored(
            t.id, value, t.epoch - 1, t.checkpoint is not None, {"default": value, "step": 100 * t.epoch}
        ))
        self._carry_out()  # what the search answers reaches the trial before its next save
        if t.status != "running":  # stopped by what it reported
            return
        if self.checkpoints and t.epoch % self.checkpoint_every == 0:
            t.checkpoint = t.epoch
            if self.hears_checkpoints:
                self.orders += self.search.handle(TrialCheckpointed(t.id))
                self._carry_out()
            t.saved[t.epoch] = t.state
            if t.pausing:
                self._pause(t)
                return
        if t.epoch >= self.epochs:
            self._end(t, TrialStatus.SUCCEEDED)

    def _carry_out(self) -> None:
        while self.orders:
            order = self.orders.pop(0)
            t = self.trials[order.trial_id]
            if isinstance(order, StopTrial):
                if t.status != "ended":
                    self._end(t, TrialStatus.EARLY_STOPPED)
            elif isinstance(order, PauseTrial):
                if t.status == "running":
                    t.pausing = True
            elif isinstance(order, ContinueTrial) and t.status == "paused":
                self.continue_trial(t, order)

    def continue_trial(self, t: SimTrial, order: ContinueTrial | None = None) -> None:
        """Continue a paused trial from its checkpoint, or (``order.checkpoint_from``) from
        another trial's newest one, copied into it, with the order's parameters if any."""
        source = self.trials[order.checkpoint_from] if order and order.checkpoint_from else None
        if source is not None and source.checkpoint is not None:
            t.checkpoint, t.saved = source.checkpoint, {source.checkpoint: source.saved[source.checkpoint]}
            t.took_from.append(source.id)
        parameters = order.parameters if order else None
        if parameters is not None:
            t.parameters = dict(parameters)
        t.status = "waiting"
        self.log.append((self.tick, "continued", t.id, t.checkpoint or 0))
        self.orders += self.search.handle(TrialContinued(t.id, parameters))

    def _pause(self, t: SimTrial) -> None:
        t.status, t.pausing = "paused", False
        self.log.append((self.tick, "paused", t.id, t.checkpoint or 0))
        self.orders += self.search.handle(TrialPaused(t.id))

    def _end(self, t: SimTrial, status: TrialStatus) -> None:
        t.status, t.end, t.pausing = "ended", status, False
        self.log.append((self.tick, status.value.lower(), t.id, t.epoch))
        final = t.curve[-1] if status is TrialStatus.SUCCEEDED else None
        self.orders += self.search.handle(TrialEnded(t.id, status, final))

    def _give_up_held(self) -> bool:
        """Nothing runs: trials the search holds paused are stopped (as the loop does)."""
        if self.orders or any(t.status == "waiting" for t in self.trials.values()):
            return False
        held = [t for t in self.trials.values() if t.status == "paused" and self.search.holds(t.id)]
        if held:
            self.orders += self.search.ending()  # the last chance: the search may continue some
            if self.orders:
                return True
        for t in held:
            self._end(t, TrialStatus.EARLY_STOPPED)
        return bool(held)

    # ---- what happens to trials from outside ----------------------------------------------

    def lose_environment(self, trial_id: str) -> None:
        """The trial's environment is gone: it is retried from its last checkpoint."""
        t = self.trials[trial_id]
        assert t.status == "running"
        t.epoch = t.checkpoint or 0
        t.state = t.saved.get(t.epoch, 0.0)
        self.log.append((self.tick, "lost", t.id, t.epoch))

    def stop_experiment(self) -> list[PastTrial]:
        """``trialkeeper stop``: every running trial pauses at its checkpoint; what the store
        would hand a resume."""
        for t in self.trials.values():
            if t.status in ("running", "waiting"):
                t.status, t.pausing, t.epoch = "paused", False, t.checkpoint or 0
                del t.curve[t.epoch:]
        self.orders.clear()
        return [
            PastTrial(t.id, t.parameter_id, t.parameters, tuple(t.curve),
                      t.curve[-1] if t.end is TrialStatus.SUCCEEDED else None, t.end,
                      paused=t.status == "paused", intermediate_indexes=tuple(range(len(t.curve))),
                      intermediate_reported=tuple({"default": v, "step": 100 * (i + 1)} for i, v in enumerate(t.curve)))
            for t in self.trials.values()
        ]

    def resume(self, search: Search, history: list[PastTrial]) -> None:
        """``trialkeeper resume``: a new search hears the past; the paused trials it does not
        hold go on first."""
        self.search = search
        search.resume(history)
        for t in self.trials.values():
            if t.status == "paused" and not search.holds(t.id):
                self.continue_trial(t)
        self.orders += search.take_orders()

    # ---- what a test reads ----------------------------------------------------------------

    def events(self, what: str, trial_id: str | None = None) -> list[tuple[int, str, str, int]]:
        return [e for e in self.log if e[1] == what and (trial_id is None or e[2] == trial_id)]

    def ended(self, status: TrialStatus) -> set[str]:
        return {t.id for t in self.trials.values() if t.end is status}
