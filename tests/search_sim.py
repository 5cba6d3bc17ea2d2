"""A search driven in virtual time: trials with set learning curves, an epoch a tick, and the
experiment loop's real pass (``search/loop.py``'s ``Loop``) deciding what happens: what the
search asks is carried out as the experiment carries it out (a pause lands at the trial's next
checkpoint, or at the save it was decided on: the experiment answers a save once the search
has had its pass over it; a continue goes ahead of new trials, a trial paused by the search
and never continued is given up once nothing else runs). No clock, no processes: the scenario tests of
multi-fidelity searches run on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trialkeeper.coordinator.engine.model import MetricEvent, StatusEvent, TrialInfo
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.loop import End, GiveUp, Loop
from trialkeeper.coordinator.search.search import ContinueTrial, PauseTrial, Search, StopTrial
from trialkeeper.coordinator.search.steering import Limits
from trialkeeper.coordinator.search.tuners import PastTrial

Curve = Callable[[dict[str, Any], int], float]  # (parameters, epoch from 1) -> result
_STATUS = {"running": TrialStatus.RUNNING, "waiting": TrialStatus.WAITING, "paused": TrialStatus.PAUSED}


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
    max_trials: int | None = None  # maxTrialNumber
    checkpoints: bool = True  # whether trials save checkpoints
    checkpoint_every: int = 1  # the epochs between two checkpoints
    hears_checkpoints: bool = False  # the loop hears a save (the engine's CheckpointSaved) before the next result
    # The curve gives what each epoch adds to the trial's state, its result; a checkpoint keeps
    # the state, so a trial continued from another's checkpoint goes on from that one's state.
    cumulative: bool = False
    trials: dict[str, SimTrial] = field(default_factory=dict)
    log: list[tuple[int, str, str, int]] = field(default_factory=list)  # (tick, what, trial, epoch)
    tick: int = 0
    outcome: End | None = None  # how the pass ended the search (None while it goes on)

    def __post_init__(self) -> None:
        self.loop = Loop(self.search, Limits(self.concurrency, self.max_trials, None))

    @property
    def submitted(self) -> int:
        return self.loop.submitted

    # ---- the experiment loop: the real pass, an epoch a tick -------------------------------

    def run(self, *, until: Callable[[Sim], bool] | None = None, ticks: int = 10_000) -> Sim:
        for _ in range(ticks):
            if until is not None and until(self):
                return self
            if not self.step():
                # The real experiment would wait forever for what will not happen.
                assert self.outcome is not None, "nothing runs and the loop's pass does not end the search"
                return self
        raise AssertionError("the simulated search did not end")

    def step(self) -> bool:
        """One tick: the loop's pass (carry out orders, fill the slots, give up or end), then
        every running trial trains one epoch. False once the search ended or nothing would
        happen any more."""
        if self.outcome is None:
            self._pass()
        if self.outcome is not None:
            return False
        running = [t for t in self.trials.values() if t.status == "running"]
        if not running:
            return self.loop.changed or any(t.status == "waiting" for t in self.trials.values())
        for t in running:
            self._train(t)
        self.tick += 1
        return True

    def _pass(self) -> None:
        loop = self.loop
        loop.begin()
        self._carry_out()
        active = sum(1 for t in self.trials.values() if t.status == "running")
        for t in self.trials.values():  # continued trials go first (the engine places them first)
            if active < self.concurrency and t.status == "waiting":
                t.status, t.epoch = "running", t.checkpoint or 0
                t.state = t.saved.get(t.epoch, 0.0)
                active += 1
        spent = loop.spent(self.tick, self._paused())
        if spent is not None:
            self._give_up(spent.give_up)
            self.outcome = spent
            return
        while (proposal := loop.propose(active)) is not None:
            trial_id = f"t{loop.submitted}"
            t = self.trials[trial_id] = SimTrial(trial_id, loop.submitted, dict(proposal.parameters))
            source = self.trials.get(proposal.checkpoint_from or "")
            if source is not None and source.checkpoint is None:
                source = None  # it saved none: a fresh start
            if source is not None:  # the engine copies its newest checkpoint into the new trial
                t.checkpoint = t.epoch = source.checkpoint
                t.saved = {t.epoch: source.saved[t.epoch]}
                t.state = t.saved[t.epoch]
                t.took_from.append(source.id)
            self.log.append((self.tick, "submitted", trial_id, t.epoch))
            loop.submitted_as(trial_id, proposal, source.id if source else None)
            active += 1
        settled = not any(t.status in ("running", "waiting") for t in self.trials.values())
        ending = loop.settle(settled, self._paused())
        if isinstance(ending, GiveUp):
            self._give_up(ending)
        elif isinstance(ending, End):
            self.outcome = ending

    def _paused(self) -> list[str]:
        return sorted(t.id for t in self.trials.values() if t.status == "paused")

    def _give_up(self, give_up: GiveUp | None) -> None:
        for trial_id in give_up.trial_ids if give_up is not None else ():
            self._end(self.trials[trial_id], TrialStatus.EARLY_STOPPED)

    def _train(self, t: SimTrial) -> None:
        t.epoch += 1
        t.trained += 1
        value = self.curve(t.parameters, t.epoch)
        if self.cumulative:
            t.state = value = t.state + value
        del t.curve[t.epoch - 1:]
        t.curve.append(value)
        self.log.append((self.tick, "result", t.id, t.epoch))
        result = {"default": value, "step": 100 * t.epoch}
        self.loop.metric(MetricEvent(t.id, "intermediate", t.epoch - 1, value, result), t.checkpoint is not None)
        self._carry_out()  # what the search answers reaches the trial before its next save
        if t.status != "running":  # stopped by what it reported
            return
        if self.checkpoints and t.epoch % self.checkpoint_every == 0:
            t.checkpoint = t.epoch
            if self.hears_checkpoints:
                self.loop.checkpointed(t.id)
                self._carry_out()
            t.saved[t.epoch] = t.state
            if t.pausing:
                self._pause(t)
                return
        if t.epoch >= self.epochs:
            self._end(t, TrialStatus.SUCCEEDED)

    def _carry_out(self) -> None:
        """The orders part of the pass (``Loop.next_order``), run as soon as the search answers."""
        while (order := self.loop.next_order()) is not None:
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
        self._set(t, "waiting")
        self.log.append((self.tick, "continued", t.id, t.checkpoint or 0))

    def _pause(self, t: SimTrial) -> None:
        t.pausing = False
        self._set(t, "paused")
        self.log.append((self.tick, "paused", t.id, t.checkpoint or 0))

    def _end(self, t: SimTrial, status: TrialStatus) -> None:
        t.end, t.pausing = status, False
        self._set(t, "ended")
        self.log.append((self.tick, status.value.lower(), t.id, t.epoch))

    def _set(self, t: SimTrial, status: str) -> None:
        """The trial's status changes: the loop hears it as the engine publishes it."""
        old, t.status = _STATUS[t.status], status
        new = t.end if status == "ended" else _STATUS[status]
        assert new is not None
        final = t.curve[-1] if new is TrialStatus.SUCCEEDED else None
        info = TrialInfo(
            t.id, t.parameter_id, new, dict(t.parameters), None, (), final, final, None, None, "", "",
            None, None, None, 1, checkpoint_step=t.checkpoint,
        )
        self.loop.status(StatusEvent(info, old))

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
        self.loop.to_do.clear()  # what the search asked dies with the experiment
        return [
            PastTrial(t.id, t.parameter_id, t.parameters, tuple(t.curve),
                      t.curve[-1] if t.end is TrialStatus.SUCCEEDED else None, t.end,
                      paused=t.status == "paused", intermediate_indexes=tuple(range(len(t.curve))),
                      intermediate_reported=tuple({"default": v, "step": 100 * (i + 1)} for i, v in enumerate(t.curve)))
            for t in self.trials.values()
        ]

    def resume(self, search: Search, history: list[PastTrial]) -> None:
        """``trialkeeper resume``: a new search and a new loop hear the past; the paused trials
        the search does not hold go on first."""
        self.search, self.outcome = search, None
        # As the experiment's resume: the trials the store holds, and the results they reported.
        trained = sum(len(t.intermediate) for t in history)
        self.loop = Loop(search, self.loop.limits, submitted=len(history), trained=trained)
        search.resume(history)
        for t in self.trials.values():
            if t.status == "paused" and not search.holds(t.id):
                self.continue_trial(t)

    # ---- what a test reads ----------------------------------------------------------------

    def events(self, what: str, trial_id: str | None = None) -> list[tuple[int, str, str, int]]:
        return [e for e in self.log if e[1] == what and (trial_id is None or e[2] == trial_id)]

    def ended(self, status: TrialStatus) -> set[str]:
        return {t.id for t in self.trials.values() if t.end is status}
