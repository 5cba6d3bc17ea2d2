"""Gaussian-process Bayesian optimization as an Optuna sampler: ``sampler: bo``.

``tuner: {name: optuna, classArgs: {sampler: bo, seed: 1}}``. Each parameter becomes columns
of the unit cube (a float or a wide int: one column, in log where its distribution is; a
choice of numbers or a narrow int: one column in steps, in the numbers' order; a choice of
anything else: one column per option), a Gaussian process (``gp.py``) is fitted to the
finished trials' values (a continuous parameter's best free to move with a choice of numbers,
as a learning rate's does with the width; a value unlike what its neighbours predict of it
read as noisier, ``gp.outlier_noise``), and the next configuration is the one of most expected
improvement (augmented: a near-copy of a trial is worth little), under a process whose mean
is the 0.9 quantile of the values seen. Trials still running count as having reached what
the process predicts for them (the "kriging believer"), so that trials proposed side by side
spread out. Once ``refine_from`` trials have finished, every other proposal refines around
the best with a process fitted to its ``local`` nearest trials alone (``gp.refine``); every
``curve_every``-th proposal that does not refine comes from a model of the finished trials'
learning curves (``curves.py``) where the curves show their ceilings. The first
``n_startup_trials`` are drawn at random. Trials told PRUNED (stopped early, or paused and
told with ``tell_paused``) teach it nothing: their values are of fewer epochs.

Unlike Optuna's ``GP`` sampler it needs numpy and scipy only, not torch, and it reads a choice
of numbers (``width: [64, 128, 256]``) as ordered. One objective only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.search_space import IntersectionSearchSpace
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from . import curves, gp

__all__ = ["GaussianProcessSampler"]

log = logging.getLogger(__name__)

_STEPS_AT_MOST = 32  # an int of more values than this is read as continuous
_INCUMBENTS = 5  # the best points seen, around which candidates are also drawn
_MEAN_QUANTILE = 0.9  # the process's mean, among the values seen: what a point far from all is deemed


def _ordered(choices: Sequence[Any]) -> bool:
    return all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in choices) and len(choices) > 1


class _Column:
    """One parameter's place in the unit cube: how its values go in and come out."""

    def __init__(self, dist: BaseDistribution) -> None:
        self.dist = dist
        self.order: list[Any] = []
        if isinstance(dist, CategoricalDistribution):
            if _ordered(dist.choices):
                self.order = sorted(dist.choices)
                self.dim = gp.Dimension(levels=len(self.order))
            else:
                self.dim = gp.Dimension(levels=len(dist.choices), onehot=True)
        elif (isinstance(dist, IntDistribution) and not dist.log
              and (dist.high - dist.low) // dist.step < _STEPS_AT_MOST):
            self.order = list(range(dist.low, dist.high + 1, dist.step))
            self.dim = gp.Dimension(levels=len(self.order))
        else:
            self.dim = gp.Dimension()

    def encode(self, value: Any) -> list[float]:
        dist = self.dist
        if isinstance(dist, CategoricalDistribution) and self.dim.onehot:
            return [float(i == dist.to_internal_repr(value)) for i in range(self.dim.width)]
        if self.order:
            return [self.order.index(value) / max(len(self.order) - 1, 1)]
        assert isinstance(dist, (FloatDistribution, IntDistribution))
        low, high, v = float(dist.low), float(dist.high), float(value)
        if dist.log:
            low, high, v = math.log(low), math.log(high), math.log(v)
        return [0.0 if high == low else (v - low) / (high - low)]

    def decode(self, cols: np.ndarray) -> Any:
        dist = self.dist
        if isinstance(dist, CategoricalDistribution) and self.dim.onehot:
            return dist.choices[int(np.argmax(cols))]
        if self.order:
            return self.order[round(cols[0] * (len(self.order) - 1))]
        assert isinstance(dist, (FloatDistribution, IntDistribution))
        low, high = float(dist.low), float(dist.high)
        u = float(np.clip(cols[0], 0.0, 1.0))
        v = math.exp(math.log(low) + u * (math.log(high) - math.log(low))) if dist.log else low + u * (high - low)
        if dist.step is not None:
            v = low + round((v - low) / dist.step) * dist.step
        v = min(max(v, low), high)
        return round(v) if isinstance(dist, IntDistribution) else v


class GaussianProcessSampler(BaseSampler):
    """Proposes by expected improvement under a Gaussian process fitted to the study's
    finished trials (see the module's docstring)."""

    def __init__(self, *, seed: int | None = None, n_startup_trials: int = 10, candidates: int = 1024,
                 max_points: int = 400, local: int = 40, refine_from: int = 30, curve_every: int = 4) -> None:
        if n_startup_trials < 1 or candidates < 1 or max_points < 2:
            raise ValueError("n_startup_trials and candidates must be at least 1, max_points at least 2")
        if local and local < 5:
            raise ValueError(f"local must be 0 (never refine) or at least 5 trials, got {local}")
        if refine_from < 5:
            raise ValueError(f"refine_from must be at least 5 finished trials, got {refine_from}")
        if curve_every < 0:
            raise ValueError(f"curve_every must be 0 (never propose from the curves) or more, got {curve_every}")
        self._rng = np.random.default_rng(seed)
        self._random = RandomSampler(seed=seed)
        self._space = IntersectionSearchSpace(include_pruned=True)
        self._startup, self._candidates, self._max_points = n_startup_trials, candidates, max_points
        self._theta: np.ndarray | None = None
        self._local, self._refine_from = local, refine_from
        self._curve_every = curve_every
        self._curve_fits: dict[int, curves.Fit] = {}  # by trial number: a finished curve is fitted once
        self._curve_thetas: dict[str, np.ndarray] = {}

    def reseed_rng(self) -> None:
        self._rng = np.random.default_rng()
        self._random.reseed_rng()

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        if study._is_multi_objective():
            raise ValueError("the bo sampler optimizes one objective; for several use TPE, NSGA-II or GP")
        return {name: d for name, d in self._space.calculate(study).items() if not d.single()}

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        names = sorted(search_space)
        finished = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.value is not None and math.isfinite(t.value) and all(n in t.params for n in names)]
        if len(finished) < self._startup:
            return {}
        sign = 1.0 if study.direction == StudyDirection.MAXIMIZE else -1.0
        if len(finished) > self._max_points:  # the best half of what is kept, and the newest of the rest
            ranked = sorted(finished, key=lambda t: -sign * t.value)  # type: ignore[operator]
            keep = {t.number for t in ranked[: self._max_points // 2]}
            rest = [t for t in finished if t.number not in keep][-(self._max_points - len(keep)) :]
            keep |= {t.number for t in rest}
            finished = [t for t in finished if t.number in keep]
        columns = [_Column(search_space[n]) for n in names]
        dims = [c.dim for c in columns]

        def point(params: dict[str, Any]) -> list[float]:
            return [v for c, n in zip(columns, names) for v in c.encode(params[n])]

        x = np.array([point(t.params) for t in finished])
        raw = sign * np.array([t.value for t in finished], dtype=float)
        spread = raw.std()
        y = (raw - raw.mean()) / (spread if spread > 0 else 1.0)
        mean = float(np.quantile(y, _MEAN_QUANTILE))
        try:
            pairs = gp.shifts(dims)
            self._theta = gp.fit(x, y - mean, self._theta, pairs)
            extra = gp.outlier_noise(gp.model(self._theta, x, y, mean, pairs))
            fitted = gp.model(self._theta, x, y, mean, pairs, extra)
        except (np.linalg.LinAlgError, ValueError) as e:  # numerics: this proposal is drawn at random
            log.warning("the bo sampler drew trial %d at random: the model could not be fitted (%s)", trial.number, e)
            self._theta = None
            return {}
        seen, _ = fitted.predict(x)
        best = float(seen.max())
        incumbents = x[np.argsort(-seen)[:_INCUMBENTS]]
        chosen = None
        refines = self._local and len(x) >= self._refine_from and any(d.levels == 0 for d in dims)
        if refines and trial.number % 2:  # every other proposal refines
            near = gp.nearest(x, incumbents[0], fitted.scales, dims, self._local)
            try:
                chosen = gp.refine(x[near], y[near], dims, self._rng)
            except (np.linalg.LinAlgError, ValueError) as e:
                log.debug("the bo sampler could not refine around its best (%s); it proposes from the whole", e)
        if chosen is None and self._curve_every and sign > 0 and trial.number % self._curve_every == 0:
            chosen = self._from_curves(finished, x, raw, dims, incumbents)
        if chosen is None:
            pending = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                       if t.number != trial.number and all(n in t.params for n in names)]
            if pending:  # what they are expected to reach, as if already seen
                xp = np.array([point(t.params) for t in pending])
                fitted = gp.model(self._theta, np.vstack([x, xp]), np.r_[y, fitted.predict(xp)[0]], mean, pairs,
                                  np.r_[extra, np.zeros(len(xp))])
            chosen = gp.propose(fitted, dims, best, incumbents, self._rng, candidates=self._candidates)
        out: dict[str, Any] = {}
        col = 0
        for c, n in zip(columns, names):
            out[n] = c.decode(chosen[col : col + c.dim.width])
            col += c.dim.width
        return out

    def _from_curves(self, finished: list[FrozenTrial], x: np.ndarray, finals: np.ndarray,
                     dims: list[gp.Dimension], incumbents: np.ndarray) -> np.ndarray | None:
        """A proposal from the model of the finished trials' learning curves (``curves.py``), or
        None where it does not apply: curves of unequal lengths, of fewer than 5 epochs, or
        below 0 (not scores rising to a ceiling), or ceilings not seen within the run."""
        values = [[t.intermediate_values[s] for s in sorted(t.intermediate_values)] for t in finished]
        epochs = len(values[0])
        if epochs < 5 or any(len(v) != epochs for v in values) or min(min(v) for v in values) < 0:
            return None
        def fitted(i: int) -> curves.Fit:
            if finished[i].number not in self._curve_fits:
                self._curve_fits[finished[i].number] = curves.fit(values[i])
            return self._curve_fits[finished[i].number]

        try:  # the best quarter's curves first: where they show no ceilings, the rest need no fit
            if not curves.ceilings_seen([fitted(i) for i in curves.best_quarter(finals)], epochs):
                return None
            model = curves.CurveModel(x, [fitted(i) for i in range(len(finished))], epochs, self._curve_thetas)
            return model.propose(dims, float(finals.max()), incumbents, self._rng, candidates=self._candidates)
        except (np.linalg.LinAlgError, ValueError) as e:
            log.debug("the bo sampler could not model the learning curves (%s); it proposes from the scores", e)
            return None

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._random.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        self._random.after_trial(study, trial, state, values)

