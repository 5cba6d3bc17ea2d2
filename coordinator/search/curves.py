"""A model of the learning curves behind the ``bo`` sampler's curve proposals.

A configuration next to a cliff of the final score (one whose warm-up ends just before the
last epoch, beside one whose warm-up does not) is where a process on the final scores alone is
least sure: it smooths the cliff over and proposes on the wrong side of it as often as on the
right one. Read through the curves, the cliff is smooth: each finished trial's curve is fitted
with ``v(e) = c / (1 + (h / e)^k)`` (``c`` the ceiling it rises to, ``h`` the epoch at which it
is half way there, ``k`` how sharply it turns: a saturating curve, or a warm-up and then a
sigmoid), and ``log c``, ``log h`` and ``log k`` are each modelled by a process over the space
(``gp.py``). The last epoch's score of a candidate is drawn by drawing the three and composing
them, and a proposal is the candidate of most expected improvement of that score.

A ceiling is seen only where a curve got past half of it within the run: ``c`` is fitted to
those trials alone, and the model is trusted (``ceilings_seen``) only where most of the best
trials' curves did. Curves that keep rising to the end (a power law, a jump that comes late)
leave their ceilings unknown; the sampler then proposes from the final scores alone.

Plain numpy and scipy; nothing here knows of Optuna or of trials.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from . import gp

__all__ = ["CurveModel", "Fit", "best_quarter", "ceilings_seen", "fit"]

_DRAWS = 64  # draws of (c, h, k) per candidate for its expected improvement


@dataclass(frozen=True)
class Fit:
    """One curve's fit: log ceiling, log half-way epoch, log sharpness, rms residual."""

    log_c: float
    log_h: float
    log_k: float
    rms: float


def hill(epoch: np.ndarray | float, c: np.ndarray, h: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``c / (1 + (h / epoch)^k)``: the score after ``epoch`` epochs."""
    return c / (1.0 + (h / epoch) ** k)


def fit(values: Sequence[float]) -> Fit:
    """The least-squares fit of a curve's scores (one per epoch, from the first), from the two
    best of six starts (the half-way epoch early, mid-run or past the end, the turn soft or
    sharp), with the residuals' derivatives in closed form."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2 or not np.all(np.isfinite(v)):
        raise ValueError("a curve needs two or more finite scores")
    log_e = np.log(np.arange(1, len(v) + 1, dtype=float))
    top = max(float(v.max()), 1e-3)
    low = [np.log(top * 0.5), np.log(0.05), np.log(0.2)]
    high = [np.log(max(top * 20, 2.0)), np.log(1e4), np.log(12.0)]

    def residuals(p: np.ndarray) -> np.ndarray:  # p: log c, log h, log k; (h / e)^k = exp(k (log h - log e))
        return np.exp(p[0]) / (1.0 + np.exp(np.exp(p[2]) * (p[1] - log_e))) - v

    def jacobian(p: np.ndarray) -> np.ndarray:
        c, k = np.exp(p[0]), np.exp(p[2])
        u = np.exp(k * (p[1] - log_e))
        score = c / (1.0 + u)
        down = -score * u / (1.0 + u)  # d score / d log u
        return np.stack([score, down * k, down * k * (p[1] - log_e)], axis=1)

    starts = [np.clip(np.log([top * 1.1, h0, k0]), np.add(low, 1e-6), np.subtract(high, 1e-6))
              for h0 in (2.0, len(v) / 2, len(v) * 2.0) for k0 in (1.0, 3.0)]
    starts.sort(key=lambda p: float(np.sum(residuals(p) ** 2)))
    best = min((least_squares(residuals, p0, jac=jacobian, bounds=(low, high)) for p0 in starts[:2]),
               key=lambda found: found.cost)
    return Fit(float(best.x[0]), float(best.x[1]), float(best.x[2]), float(np.sqrt(2 * best.cost / len(v))))


def best_quarter(finals: np.ndarray) -> np.ndarray:
    """The indices of the best quarter of the final scores ``finals`` (higher better), at least
    five of them."""
    return np.argsort(-finals)[: max(5, len(finals) // 4)]


def ceilings_seen(best: Sequence[Fit], epochs: int, share: float = 0.75) -> bool:
    """Whether at least ``share`` of the curves of the best trials (``best_quarter``'s) got past
    half of their ceilings within the ``epochs`` of the run: what the model needs to tell a
    ceiling from a slope."""
    return float(np.mean([f.log_h <= np.log(epochs) for f in best])) >= share


class CurveModel:
    """Three processes over the space, for ``log c``, ``log h`` and ``log k`` of the trials at
    ``x``; ``thetas`` holds their hyperparameters from one proposal to the next (each fit starts
    from the last)."""

    def __init__(self, x: np.ndarray, fits: Sequence[Fit], epochs: int, thetas: dict[str, np.ndarray]) -> None:
        self.epochs, self._thetas = epochs, thetas
        log_c = np.array([f.log_c for f in fits])
        log_h = np.array([f.log_h for f in fits])
        log_k = np.array([f.log_k for f in fits])
        known = log_h <= np.log(epochs)  # the ceiling is known where the curve got past half of it
        if known.sum() < 5:
            known = np.ones(len(x), dtype=bool)
        self._parts = [self._process("c", x[known], log_c[known]),
                       self._process("h", x, np.minimum(log_h, np.log(epochs * 4.0))),
                       self._process("k", x, log_k)]

    def _process(self, name: str, x: np.ndarray, t: np.ndarray) -> tuple[gp.Model, float, float]:
        mu, sd = float(t.mean()), float(t.std()) or 1.0
        y = (t - mu) / sd
        theta = gp.fit(x, y, self._thetas.get(name))
        self._thetas[name] = theta
        return gp.model(theta, x, y), mu, sd

    def draw_last(self, points: np.ndarray, rng: np.random.Generator, n: int = _DRAWS) -> np.ndarray:
        """``n`` draws of the last epoch's score at each of ``points``, shape ``(n, len(points))``."""
        drawn = []
        for m, mu, sd in self._parts:
            mean, s = m.predict(points)
            s = np.sqrt(s**2 + m.noise)
            drawn.append(np.exp(mu + sd * (mean[None, :] + s[None, :] * rng.standard_normal((n, len(points))))))
        c, h, k = drawn
        return hill(float(self.epochs), c, h, k)

    def propose(self, dims: Sequence[gp.Dimension], best: float, incumbents: np.ndarray, rng: np.random.Generator,
                *, candidates: int = 1024) -> np.ndarray:
        """The candidate (random points and small steps around ``incumbents``, as ``gp.pool``
        draws them for ``gp.propose``) of most expected improvement of its last epoch's score over ``best``."""
        points = gp.pool(rng, dims, incumbents, candidates)
        gain = np.maximum(self.draw_last(points, rng) - best, 0.0).mean(axis=0)
        return points[int(np.argmax(gain))]
