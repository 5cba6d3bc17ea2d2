"""A search replayed in virtual time against the learning curves an experiment recorded.

The decisions are those of a real run: the experiment's search (``search/``: the tuner and
the assessor a config names) proposes, stops, pauses and continues trials, and the decision
core (``engine/``, the Engine a coordinator runs) queues and places them on
``trialConcurrency`` environments, pauses them at a checkpoint and continues them. What is
virtual is the rest: the environments are answered at once, and each trial's process is the
curve of the recorded trial its configuration is drawn from (``curves.py``), reporting each
result after the seconds that result took to train when it was recorded. The clock jumps
from one of these moments to the next, so thousands of trials replay in seconds.

A trial whose recorded trial saved checkpoints saves one after each result; asked to pause,
it ends at once, its checkpoint that of its last result (one that saves none is canceled, as
in a real run). Continued, it reports on from its checkpoint's result, along the curve of
the configuration it continues with (its own, or the new parameters an exploit gave it); a
trial started or continued from another's checkpoint reports from that checkpoint's result
on. A recorded curve cut short (its trial was stopped or
failed) ends a trial that goes past it FAILED, saying so; starting a trial, and the time
between a trial's end and the next start, take no time.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.experiment import ExperimentConfig
from ..engine import checkpoints as ck
from ..engine import events as ev
from ..engine.engine import Engine
from ..engine.model import MetricEvent, StatusEvent
from ..engine.policy import PlatformPolicy, Policy
from ..engine.rows import MetricRun
from ..engine.states import TrialStatus
from ..experiment import make_search, optimize_mode_of
from ..search.loop import End, GiveUp, Loop
from ..search.search import ContinueTrial, Instruction, PauseTrial, StopTrial
from ..search.steering import Limits
from .curves import UNSEEN, Curves, Recorded, ReplayError

__all__ = ["Decision", "ReplayResult", "ReplayedTrial", "replay"]

log = logging.getLogger(__name__)

EXPERIMENT_ID = "replay"
_NEVER = 1e15  # the timers a virtual run never reaches (agents heartbeat in no time)
_FILES = (ck.CheckpointFile("replayed", 1),)


@dataclass(frozen=True)
class Decision:
    """What the search did to a trial, when, after how many of its results."""

    at: float  # virtual seconds from the start
    trial_id: str
    kind: str  # stop | pause | continue
    step: int  # results the trial had reported
    reason: str


@dataclass(frozen=True)
class ReplayedTrial:
    trial_id: str
    parameter_id: int
    parameters: dict[str, Any]
    drawn_from: str  # the recorded trial whose curve it followed ("" when skipped)
    exact: bool  # that trial ran these very parameters
    status: str
    reason: str
    results: int  # intermediate results it reported
    best: float | None  # its best result (intermediate or final)
    final: float | None
    ended_at: float | None


@dataclass
class ReplayResult:
    trials: list[ReplayedTrial]
    decisions: list[Decision]
    improvements: list[tuple[float, float, str]]  # (virtual seconds, best so far, trial) at each improvement
    virtual_seconds: float
    wall_seconds: float
    maximize: bool
    optimum: float | None  # the best result of the recorded experiment
    reason: str  # why the replayed search ended
    nearest: int = 0  # trials drawn from the nearest recorded configuration
    skipped: int = 0  # trials of configurations never recorded, not run

    @property
    def best(self) -> tuple[float, float, str] | None:
        return self.improvements[-1] if self.improvements else None

    def reached(self, within: float) -> float | None:
        """Virtual seconds until a result within ``within`` (a fraction) of the optimum."""
        if self.optimum is None:
            return None
        for at, value, _ in self.improvements:
            if _gap(value, self.optimum, self.maximize) <= within:
                return at
        return None

    def gap(self) -> float | None:
        """How far the best result found is from the optimum, as a fraction of it."""
        best = self.best
        if best is None or self.optimum is None:
            return None
        return _gap(best[1], self.optimum, self.maximize)


def _gap(value: float, optimum: float, maximize: bool) -> float:
    short = optimum - value if maximize else value - optimum
    return max(0.0, short) / (abs(optimum) or 1.0)


def replay(config: ExperimentConfig, recorded: list[Recorded], *, unseen: str = "nearest") -> ReplayResult:
    """Run ``config``'s search against the recorded curves in virtual time; what it found."""
    if unseen not in UNSEEN:
        raise ReplayError(f"unseen must be one of {', '.join(UNSEEN)}, got {unseen!r}")
    curves = Curves(recorded, maximize=optimize_mode_of(config) != "minimize")
    started = time.monotonic()
    run = _Virtual(config, curves, unseen)
    reason = run.run()
    return run.result(reason, time.monotonic() - started)


@dataclass
class _Run:
    """The virtual process of a trial: where on which curve it is."""

    recorded: Recorded | None
    token: int
    reported: int  # intermediate results reported so far, its own index


@dataclass
class _Trial:
    parameter_id: int
    parameters: dict[str, Any]
    drawn_from: str = ""
    exact: bool = False
    results: int = 0
    best: float | None = None
    started: bool = False


class _Virtual:
    def __init__(self, config: ExperimentConfig, curves: Curves, unseen: str) -> None:
        self.config, self.curves, self.unseen = config, curves, unseen
        self.limits = Limits.of(config)
        self.search = make_search(config, EXPERIMENT_ID)
        self.loop = Loop(self.search, self.limits)
        c = max(1, config.trial_concurrency)
        self.engine = Engine(Policy(
            experiment_id=EXPERIMENT_ID, trial_concurrency=c,
            platforms=(PlatformPolicy("replay", reuse=True, environment_count=c, trial_slots=1),),
            agent_lost_timeout_s=_NEVER, trial_lost_timeout_s=_NEVER, agent_start_timeout_s=_NEVER,
            pause_grace_s=_NEVER,
        ))
        self.engine.publish_metrics = self.engine.publish_checkpoints = True
        self.now = 0.0
        self.due: list[tuple[float, int, Callable[[], None]]] = []  # when, and in which order
        self.count = itertools.count()
        self.links: dict[int, str] = {}
        self.link_of: dict[str, int] = {}
        self.seqs: dict[str, int] = {}
        self.runs: dict[str, _Run] = {}
        self.trials: dict[str, _Trial] = {}
        self.drawn: dict[str, tuple[Recorded | None, bool]] = {}
        self.tokens = itertools.count()
        self.unsettled: set[str] = set()  # neither ended nor paused
        self.stopping: set[str] = set()
        self.paused: set[str] = set()
        self.decisions: list[Decision] = []
        self.improvements: list[tuple[float, float, str]] = []
        self.nearest = self.skipped = 0

    # ---- the clock -----------------------------------------------------------------------------

    def at(self, when: float, call: Callable[[], None]) -> None:
        heapq.heappush(self.due, (when, next(self.count), call))

    def feed(self, event: ev.Event) -> None:
        self.apply(self.engine.handle(event, now=self.now, wall=self.now))

    def run(self) -> str:
        self.apply(self.engine.start(now=0.0, wall=0.0))
        duration = self.limits.max_experiment_duration
        if duration is not None:
            self.at(duration, lambda: None)
        while True:
            if self.loop.changed:
                reason = self.step()
                if reason:
                    return reason
            if self.engine.wants_pass():
                self.feed(ev.Ticked())
                continue
            if not self.due:
                return "nothing more would happen: no trial runs and the search proposes none"
            self.now, _, call = heapq.heappop(self.due)
            call()
            if duration is not None and self.now >= duration:
                self.loop.changed = True

    # ---- the experiment loop (``search/loop.py``'s pass, in virtual time) -----------------------

    def step(self) -> str:
        """One pass of the experiment loop: carry out what the search asked, propose trials to
        fill the free slots, and say why the search ends ('' while it goes on)."""
        loop = self.loop
        loop.begin()
        while (order := loop.next_order()) is not None:
            self.carry_out(order)
        spent = loop.spent(self.now, sorted(self.paused))
        if spent is not None:  # the search ends: what it holds paused will not be continued
            self.give_up(spent.give_up)
            return spent.reason
        active = len(self.unsettled - self.stopping)
        while (proposal := loop.propose(active)) is not None:
            source = proposal.checkpoint_from
            if source is not None and (source not in self.engine.trials or self.engine.trials[source].checkpoint
                                       is None):
                source = None  # it saved none: a fresh start
            trial_id = f"r{loop.submitted:06d}"
            self.trials[trial_id] = _Trial(loop.submitted, dict(proposal.parameters))
            self.unsettled.add(trial_id)
            self.feed(ev.TrialSubmitted(trial_id, dict(proposal.parameters), self.config.trial_command, 0, 0,
                                        checkpoint_from=source or ""))
            loop.submitted_as(trial_id, proposal, source)
            active += 1
        settled = loop.settle(not self.unsettled, sorted(self.paused))
        if isinstance(settled, GiveUp):
            self.give_up(settled)
        elif isinstance(settled, End):
            return settled.reason
        return ""

    def give_up(self, give_up: GiveUp | None) -> None:
        """End EARLY_STOPPED the paused trials the search holds and will not continue."""
        for trial_id in give_up.trial_ids if give_up is not None else ():
            self.feed(ev.CancelRequested(trial_id, give_up.reason, TrialStatus.EARLY_STOPPED))

    def carry_out(self, order: Instruction) -> None:
        t = self.engine.trials.get(order.trial_id)
        if t is None:
            return
        status, results = t.status, self.trials[order.trial_id].results
        if isinstance(order, StopTrial):
            if not status.terminal:
                self.decisions.append(Decision(self.now, t.id, "stop", results, order.reason))
                self.stopping.add(t.id)
                self.feed(ev.CancelRequested(t.id, order.reason, TrialStatus.EARLY_STOPPED))
        elif isinstance(order, PauseTrial):
            if status in (TrialStatus.WAITING, TrialStatus.RUNNING):
                self.decisions.append(Decision(self.now, t.id, "pause", results, order.reason))
                self.feed(ck.PauseRequested(t.id, order.reason))
        elif isinstance(order, ContinueTrial) and status is TrialStatus.PAUSED:
            source = order.checkpoint_from
            if source is not None and (source not in self.engine.trials or self.engine.trials[source].checkpoint
                                       is None):
                source = None  # it saved none: the trial continues from its own
            self.decisions.append(Decision(self.now, t.id, "continue", results, f"from {source}" if source else ""))
            self.feed(ck.ContinueRequested(t.id, None if order.parameters is None else dict(order.parameters),
                                           checkpoint_from=source or ""))

    # ---- what the engine says ------------------------------------------------------------------

    def apply(self, out: list[Any]) -> None:
        for i in out:
            if isinstance(i, ev.Publish):
                self.published(i.event)
            elif isinstance(i, ev.Send):
                self.message(self.links.get(i.link, ""), i.message)
            elif isinstance(i, ev.StartEnvironment | ev.StartEnvironmentGroup):
                for env_id in (i.env_id,) if isinstance(i, ev.StartEnvironment) else i.env_ids:
                    self.at(self.now, lambda env_id=env_id: self.environment_up(env_id))

    def published(self, e: MetricEvent | StatusEvent | ev.CheckpointSaved) -> None:
        if isinstance(e, ev.CheckpointSaved):  # ASHA judges a trial at its rung once it can pause it
            self.loop.checkpointed(e.trial_id)
            return
        if isinstance(e, MetricEvent):
            t = self.trials.get(e.trial_id)
            if t is not None and (t.best is None or self._better(e.value, t.best)):
                t.best = e.value
            if not self.improvements or self._better(e.value, self.improvements[-1][1]):
                self.improvements.append((self.now, e.value, e.trial_id))
            if e.kind == "intermediate":
                if t is not None:
                    t.results = e.index + 1
                state = self.engine.trials.get(e.trial_id)
                self.loop.metric(e, state is not None and state.checkpoint is not None)
            return
        info = e.trial
        if info.status.terminal:
            self.unsettled.discard(info.id)
            self.stopping.discard(info.id)
            self.paused.discard(info.id)
        elif info.status is TrialStatus.PAUSED:
            self.unsettled.discard(info.id)
            self.paused.add(info.id)
        elif e.old is TrialStatus.PAUSED:
            self.unsettled.add(info.id)
            self.paused.discard(info.id)
        self.loop.status(e)

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.curves.maximize else a < b

    # ---- the virtual agents --------------------------------------------------------------------

    def environment_up(self, env_id: str) -> None:
        self.feed(ev.EnvironmentStarted(env_id, f"virtual-{env_id}"))
        link = len(self.links) + 1
        self.links[link] = env_id
        self.link_of[env_id] = link
        self.seqs[env_id] = 0
        self.feed(ev.AgentRegistered(
            env_id=env_id, link=link, instance_id=f"virtual-{env_id}", hostname="replay", pid=0, platform="",
            gpus=(), gpu_unavailable_reason="", active_trial_ids=frozenset(), info={},
        ))

    def report(self, env_id: str, report: Any) -> None:
        self.seqs[env_id] += 1
        self.feed(ev.AgentReported(env_id, self.link_of[env_id], self.seqs[env_id], report))

    def message(self, env_id: str, m: Any) -> None:
        if isinstance(m, ev.StartTrial):
            self.start(env_id, m)
        elif isinstance(m, ev.CancelTrial):
            self.end_run(env_id, m.trial_id, ev.Outcome.CANCELED, m.reason)
        elif isinstance(m, ck.PauseTrial) and m.trial_id in self.runs:
            # Its checkpoint is that of its last result (one that saves none is canceled).
            self.end_run(env_id, m.trial_id, ev.Outcome.PAUSED, "")

    def draw(self, trial_id: str, parameters: dict[str, Any]) -> Recorded | None:
        key = repr(sorted(parameters.items()))
        got = self.drawn.get(key)
        if got is None:
            got = self.drawn[key] = self.curves.draw(parameters, self.unseen)
        t = self.trials[trial_id]
        recorded, t.exact = got
        t.drawn_from = recorded.trial_id if recorded is not None else ""
        return recorded

    def start(self, env_id: str, m: ev.StartTrial) -> None:
        t = self.trials[m.trial_id]
        first, t.started = not t.started, True
        recorded = self.draw(m.trial_id, m.parameters)
        if first and recorded is not None and not t.exact:
            self.nearest += 1
        index = m.checkpoint.metric_index if m.checkpoint is not None else m.first_metric_index
        run = self.runs[m.trial_id] = _Run(recorded, next(self.tokens), index)
        self.report(env_id, ev.TrialStartReported(m.trial_id, 0, self.now))
        if recorded is None:
            self.skipped += 1
            self.end_run(env_id, m.trial_id, ev.Outcome.FAILED, "skipped: the experiment never ran this configuration")
            return
        self.next_result(env_id, m.trial_id, run)

    def next_result(self, env_id: str, trial_id: str, run: _Run) -> None:
        rec = run.recorded
        assert rec is not None
        token = run.token
        if run.reported < len(rec.values):
            k = run.reported

            def result() -> None:
                if self.runs.get(trial_id) is not run or run.token != token:
                    return
                run.reported = k + 1
                self.report(env_id, ev.MetricsReported((MetricRun(
                    trial_id, "intermediate", k, (rec.values[k],), None, (self.now,)),)))
                if rec.checkpoints and self.runs.get(trial_id) is run and run.token == token:
                    self.report(env_id, ck.CheckpointSavedReported(
                        trial_id, k + 1, k + 1, 1, f"sha256:{trial_id}-{k + 1}", _FILES, "", self.now))
                if self.runs.get(trial_id) is run and run.token == token:
                    self.next_result(env_id, trial_id, run)

            self.at(self.now + rec.seconds[k], result)
            return

        def end() -> None:
            if self.runs.get(trial_id) is not run or run.token != token:
                return
            if rec.complete and rec.final is not None:
                self.report(env_id, ev.MetricsReported((MetricRun(
                    trial_id, "final", 0, (rec.final,), None, (self.now,)),)))
                self.end_run(env_id, trial_id, ev.Outcome.SUCCEEDED, "")
            elif rec.complete:
                self.end_run(env_id, trial_id, ev.Outcome.SUCCEEDED, "")
            else:
                why = (f"the recorded curve it follows (trial {rec.trial_id}, {rec.status}) ends after "
                       f"{len(rec.values)} results")
                self.end_run(env_id, trial_id, ev.Outcome.FAILED, why)

        self.at(self.now + (rec.final_seconds if rec.complete else 0.0), end)

    def end_run(self, env_id: str, trial_id: str, outcome: ev.Outcome, reason: str) -> None:
        run = self.runs.pop(trial_id, None)
        if run is not None:
            run.token = -1
        code = 0 if outcome in (ev.Outcome.SUCCEEDED, ev.Outcome.PAUSED) else 1
        self.report(env_id, ev.TrialEndReported(trial_id, outcome, code, None, reason, "", self.now))

    # ---- the outcome ---------------------------------------------------------------------------

    def result(self, reason: str, wall: float) -> ReplayResult:
        trials = []
        for trial_id, t in self.trials.items():
            s = self.engine.trials[trial_id]
            trials.append(ReplayedTrial(
                trial_id, t.parameter_id, s.parameters, t.drawn_from, t.exact, s.status.value, s.reason, t.results,
                t.best, s.final_metric, s.ended_at,
            ))
        return ReplayResult(
            trials, self.decisions, self.improvements, self.now, wall, self.curves.maximize, self.curves.best(),
            reason, self.nearest, self.skipped,
        )
