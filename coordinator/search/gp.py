"""A Gaussian process over points in the unit cube, and where to look next.

The model behind the ``bo`` sampler (``gpsampler.py``): a process on standardized values,
its constant mean given (the sampler puts it high among the scores, at their 0.9 quantile, so
that what is far from every trial is not deemed worse than most), with a Matérn 5/2 kernel,
a length scale per dimension, and a noise variance, all fitted by maximum marginal likelihood
with analytic gradients (a weak log-normal prior keeps the length scales away from the
degenerate ends when points are few). A continuous parameter's best can move with an ordered
one (a learning rate's with the width): the kernel reads each continuous column ``i`` as
``x_i + s_ij x_j`` for each ordered column ``j`` (``shifts``), the ``s_ij`` fitted with the
rest (a normal prior of sd 0.5 keeps them near 0 unless the points ask). A value far from what
the other points predict of it gets more noise (``outlier_noise``, the weight a Student-t
likelihood would give it), so that one lucky or slow run is smoothed over, not chased or
fenced off. ``propose`` maximizes
augmented expected improvement (expected improvement times the share of the uncertainty that
is not the noise's, so that near-copies of a trial are not worth trying again) over random
points and small steps around the best points seen: cheap, and good enough in the few
dimensions hyperparameter searches have.

Plain numpy and scipy; nothing here knows of Optuna or of trials.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.linalg import cho_solve, solve_triangular
from scipy.optimize import minimize
from scipy.spatial.distance import cdist
from scipy.special import log_ndtr

__all__ = ["Dimension", "Model", "acquisition", "fit", "model", "nearest", "outlier_noise", "pool",
           "propose", "random_points", "refine", "shifts"]

_SQRT5 = math.sqrt(5.0)
_PRIOR_LS, _PRIOR_SD = math.log(0.3), 1.0  # the length scales' log-normal prior
_LS_BOUNDS = (math.log(0.01), math.log(10.0))
_VAR_BOUNDS = (math.log(0.05), math.log(20.0))
_NOISE_BOUNDS = (math.log(1e-6), math.log(1.0))
_JITTER = 1e-6
_SHIFT_SD, _SHIFT_BOUNDS = 0.5, (-2.0, 2.0)  # a shift's normal prior, and its bounds
_NU = 4.0  # the degrees of freedom of outlier_noise's Student-t


@dataclass(frozen=True)
class Dimension:
    """Columns of the unit cube that one parameter takes: ``levels`` 0 for a continuous
    one, n for an ordered one of n values (a column rounded to one of n steps), or the
    number of one-hot columns of an unordered choice (``onehot``)."""

    levels: int = 0
    onehot: bool = False

    @property
    def width(self) -> int:
        return self.levels if self.onehot else 1


@dataclass(frozen=True)
class Model:
    """A fitted process: predicts the standardized value's mean and standard deviation."""

    x: np.ndarray
    chol: np.ndarray
    alpha: np.ndarray
    scales: np.ndarray
    variance: float
    noise: float
    mean: float = 0.0  # the process's constant mean
    warp: np.ndarray | None = None  # the shifts: points are read as ``points @ warp.T`` (``x`` already is)

    def predict(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.warp is not None:
            points = points @ self.warp.T
        k = self.variance * _kernel(points, self.x, self.scales)
        mean = self.mean + k @ self.alpha
        v = _solve_lower(self.chol, k.T)
        var = np.maximum(self.variance - np.einsum("ij,ij->j", v, v), 1e-12)
        return mean, np.sqrt(var)


def _matern(a: np.ndarray, b: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel matrix, and what its derivatives need: the scaled squared differences
    per dimension and the kernel's derivative factor."""
    sq = ((a[:, None, :] - b[None, :, :]) / scales) ** 2
    r = np.sqrt(sq.sum(-1))
    e = np.exp(-_SQRT5 * r)
    k = (1.0 + _SQRT5 * r + 5.0 / 3.0 * r * r) * e
    dk = 5.0 / 3.0 * (1.0 + _SQRT5 * r) * e  # -dk/dr / r: d k / d log(scale_d) = dk * sq_d
    return k, sq, dk


def _kernel(a: np.ndarray, b: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The kernel matrix alone: what predictions need, without ``_matern``'s per-dimension
    differences."""
    r = np.sqrt(cdist(a / scales, b / scales, "sqeuclidean"))
    return (1.0 + _SQRT5 * r + 5.0 / 3.0 * r * r) * np.exp(-_SQRT5 * r)


def _solve_lower(chol: np.ndarray, b: np.ndarray) -> np.ndarray:
    return solve_triangular(chol, b, lower=True, check_finite=False)


def shifts(dims: Sequence[Dimension]) -> list[tuple[int, int]]:
    """The pairs of columns ``(i, j)``, ``i`` continuous and ``j`` ordered, whose shift the
    process fits: column ``i`` read as ``x_i + s x_j``."""
    col, continuous, ordered = 0, [], []
    for dim in dims:
        if dim.levels == 0:
            continuous.append(col)
        elif not dim.onehot:
            ordered.append(col)
        col += dim.width
    return [(i, j) for i in continuous for j in ordered]


def _warp(d: int, pairs: Sequence[tuple[int, int]], shift: np.ndarray) -> np.ndarray:
    """The matrix that reads a point's columns shifted: the identity, ``shift`` at the pairs."""
    warp = np.eye(d)
    for (i, j), s in zip(pairs, shift):
        warp[i, j] = s
    return warp


def _nll(theta: np.ndarray, x: np.ndarray, y: np.ndarray, pairs: Sequence[tuple[int, int]] = ()
         ) -> tuple[float, np.ndarray]:
    """The negative log marginal likelihood (with the length scales' and shifts' priors) and
    its gradient in (log scales, log variance, log noise, shifts of ``pairs``)."""
    n, d = x.shape
    scales, variance, noise = np.exp(theta[:d]), math.exp(theta[d]), math.exp(theta[d + 1])
    raw = x
    if pairs:
        x = x @ _warp(d, pairs, theta[d + 2 :]).T
    k, sq, dk = _matern(x, x, scales)
    big_k = variance * k + (noise + _JITTER) * np.eye(n)
    try:
        chol = np.linalg.cholesky(big_k)
    except np.linalg.LinAlgError:
        return 1e25, np.zeros_like(theta)
    alpha = cho_solve((chol, True), y, check_finite=False)
    inv = cho_solve((chol, True), np.eye(n), check_finite=False)
    inner = inv - np.outer(alpha, alpha)  # d nll / d K = inner / 2
    prior = theta[:d] - _PRIOR_LS
    value = 0.5 * y @ alpha + np.log(np.diag(chol)).sum() + 0.5 * (prior**2).sum() / _PRIOR_SD**2
    grad = np.empty_like(theta)
    grad[:d] = 0.5 * variance * np.einsum("ij,ijd->d", inner * dk, sq) + prior / _PRIOR_SD**2
    grad[d] = 0.5 * np.sum(inner * (variance * k))
    grad[d + 1] = 0.5 * np.trace(inner) * noise
    if pairs:  # d K / d s_ij = -variance * dk * (shifted difference in i) / scale_i² * (difference in j)
        w = 0.5 * variance * inner * dk
        for m, (i, j) in enumerate(pairs):
            di = (x[:, None, i] - x[None, :, i]) / scales[i] ** 2
            dj = raw[:, None, j] - raw[None, :, j]
            grad[d + 2 + m] = -np.sum(w * di * dj) + theta[d + 2 + m] / _SHIFT_SD**2
        value += 0.5 * float((theta[d + 2 :] ** 2).sum()) / _SHIFT_SD**2
    return float(value), grad


def model(theta: np.ndarray, x: np.ndarray, y: np.ndarray, mean: float = 0.0,
          pairs: Sequence[tuple[int, int]] = (), extra: np.ndarray | None = None) -> Model:
    """The process with hyperparameters ``theta`` (log scales, log variance, log noise, the
    shifts of ``pairs``) and constant ``mean``, conditioned on ``y`` (standardized) at ``x``;
    ``extra`` adds noise variance point by point (``outlier_noise``'s)."""
    d = x.shape[1]
    scales, variance, noise = np.exp(theta[:d]), math.exp(theta[d]), math.exp(theta[d + 1])
    warp = _warp(d, pairs, theta[d + 2 :]) if pairs else None
    if warp is not None:
        x = x @ warp.T
    k = variance * _kernel(x, x, scales)
    diagonal = np.full(len(x), noise) if extra is None else noise + extra
    for jitter in (_JITTER, 1e-4, 1e-2):  # many equal points (a small discrete space) can need more
        try:
            chol = np.linalg.cholesky(k + np.diag(diagonal + jitter))
            break
        except np.linalg.LinAlgError:
            continue
    else:
        raise np.linalg.LinAlgError("the kernel matrix is not positive definite, even with jitter 1e-2")
    return Model(x, chol, cho_solve((chol, True), y - mean, check_finite=False), scales, variance, noise, mean,
                 warp)


def outlier_noise(fitted: Model, nu: float = _NU) -> np.ndarray:
    """The noise variance to add at each point of ``fitted`` so that a value its neighbours do
    not predict (a run that started slow or ended lucky, beside better or worse ones) is
    smoothed over rather than interpolated: one reweighting step of a Student-t likelihood of
    ``nu`` degrees of freedom. A point ``z`` standard deviations from what the others predict
    (leave-one-out, ``var`` its variance) gets weight ``w = (nu + 1) / (nu + z²)``, read as
    noise ``var (1/w - 1)``: none for ``z² <= 1``, about ``var z² / (nu + 1)`` far out.

    In closed form from the fit: with ``K = L Lᵀ``, ``diag(K⁻¹)`` is the column sums of
    squares of ``L⁻¹``, ``var = 1 / diag(K⁻¹)``, and the residual is ``alpha · var``."""
    half = _solve_lower(fitted.chol, np.eye(len(fitted.alpha)))  # L⁻¹
    var = 1.0 / np.einsum("ij,ij->j", half, half)
    z2 = fitted.alpha**2 * var  # (residual / var)² var = residual² / var
    weight = (nu + 1.0) / (nu + z2)
    return np.maximum(var * (1.0 / weight - 1.0), 0.0)


def fit(x: np.ndarray, y: np.ndarray, start: np.ndarray | None = None,
        pairs: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """The hyperparameters (log scales, log variance, log noise, the shifts of ``pairs``) that best explain ``y``
    (standardized, less the process's mean) at ``x``, searched from ``start`` (the last fit's, which is usually
    close) or else from the prior's centre."""
    d = x.shape[1]
    centre = np.r_[np.full(d, _PRIOR_LS), 0.0, math.log(1e-2), np.zeros(len(pairs))]
    starts = [start] if start is not None and start.shape == centre.shape else [centre]
    bounds = [_LS_BOUNDS] * d + [_VAR_BOUNDS, _NOISE_BOUNDS] + [_SHIFT_BOUNDS] * len(pairs)
    found = [minimize(_nll, s, args=(x, y, pairs), jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": 200})
             for s in starts]
    return min(found, key=lambda f: f.fun).x


def log_expected_improvement(mean: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """log E[max(f - best, 0)], computed without underflow far below ``best``."""
    z = (mean - best) / sd
    # E = sd * (z Φ(z) + φ(z)); for very negative z use its asymptote φ(z)/z² form.
    out = np.empty_like(z)
    near = z > -6.0
    zn = z[near]
    out[near] = np.log(np.maximum(zn * np.exp(log_ndtr(zn)) + np.exp(-0.5 * zn * zn) / math.sqrt(2 * math.pi),
                                  1e-300))
    zf = z[~near]
    out[~near] = -0.5 * zf * zf - 0.5 * math.log(2 * math.pi) - 2.0 * np.log(-zf)
    return out + np.log(sd)


def _snap(points: np.ndarray, dims: Sequence[Dimension]) -> np.ndarray:
    """Points moved onto what the parameters can take: an ordered one's steps, one hot."""
    col = 0
    for dim in dims:
        if dim.onehot:
            block = points[:, col : col + dim.width]
            hot = block.argmax(1)
            block[:] = 0.0
            block[np.arange(len(points)), hot] = 1.0
        elif dim.levels > 1:
            points[:, col] = np.round(np.clip(points[:, col], 0, 1) * (dim.levels - 1)) / (dim.levels - 1)
        col += dim.width
    return np.clip(points, 0.0, 1.0)


def random_points(rng: np.random.Generator, dims: Sequence[Dimension], n: int) -> np.ndarray:
    return _snap(rng.random((n, sum(d.width for d in dims))), dims)


def _steps(rng: np.random.Generator, dims: Sequence[Dimension], around: np.ndarray, n: int, size: float,
           swap: float = 0.2) -> np.ndarray:
    """``n`` small random steps from each point of ``around``: continuous columns moved by
    a normal of ``size``, an ordered or unordered choice changed with probability ``swap``."""
    pts = np.repeat(around, n, axis=0)
    fresh = random_points(rng, dims, len(pts))
    col = 0
    for dim in dims:
        cols = slice(col, col + dim.width)
        if dim.levels == 0:
            pts[:, cols] += rng.normal(0.0, size, (len(pts), dim.width))
        elif swap:
            moved = rng.random(len(pts)) < swap
            pts[moved, cols] = fresh[moved, cols]
        col += dim.width
    return _snap(pts, dims)


def propose(
    model: Model,
    dims: Sequence[Dimension],
    best: float,
    incumbents: np.ndarray,
    rng: np.random.Generator,
    *,
    candidates: int = 1024,
    steps: int = 256,
) -> np.ndarray:
    """The point of the most augmented expected improvement over ``best`` (standardized)
    among ``pool``'s points."""
    points = pool(rng, dims, incumbents, candidates, steps)
    return points[int(np.argmax(acquisition(model, points, best)))]


def pool(rng: np.random.Generator, dims: Sequence[Dimension], incumbents: np.ndarray, n: int = 1024,
         steps: int = 256) -> np.ndarray:
    """Where to look: ``n`` random points, and ``steps`` small steps of two sizes around each
    of ``incumbents``."""
    points = [random_points(rng, dims, n)]
    if len(incumbents):
        points += [_steps(rng, dims, incumbents, steps, 0.05), _steps(rng, dims, incumbents, steps, 0.01)]
    return np.concatenate(points)


def nearest(x: np.ndarray, centre: np.ndarray, scales: np.ndarray, dims: Sequence[Dimension], k: int) -> np.ndarray:
    """The indices of the ``k`` points of ``x`` nearest ``centre`` (by the length scales) that
    take the same options of every unordered choice, or of all points where fewer than 5 do."""
    col, same = 0, np.ones(len(x), dtype=bool)
    for dim in dims:
        if dim.onehot:
            same &= np.all(x[:, col : col + dim.width] == centre[col : col + dim.width], axis=1)
        col += dim.width
    far = np.sqrt((((x - centre) / scales) ** 2).sum(1))
    if same.sum() >= 5:
        far[~same] = np.inf
    return np.argsort(far)[: min(k, int(np.isfinite(far).sum()))]


def refine(x: np.ndarray, y: np.ndarray, dims: Sequence[Dimension], rng: np.random.Generator,
           steps: int = 256) -> np.ndarray:
    """A proposal close to the best of a few neighbouring points: a process fitted to them
    alone (standardized anew, its mean their median), free of the length scales the whole space
    needs, and its most augmented expected improvement among steps of three small sizes around
    its three best, the choices kept."""
    y = (y - y.mean()) / (y.std() or 1.0)
    mean = float(np.median(y))
    local = model(fit(x, y - mean), x, y, mean)
    seen, _ = local.predict(x)
    around = x[np.argsort(-seen)[:3]]
    points = np.concatenate([_steps(rng, dims, around, steps, size, swap=0.0) for size in (0.05, 0.02, 0.005)])
    return points[int(np.argmax(acquisition(local, points, float(seen.max()))))]


def acquisition(model: Model, points: np.ndarray, best: float) -> np.ndarray:
    """log augmented expected improvement over ``best`` at ``points``: expected improvement
    times the share of a point's uncertainty that is not the noise's, little for a point that
    only the noise leaves uncertain (a near-copy of a trial)."""
    mean, sd = model.predict(points)
    not_noise = np.maximum(1.0 - math.sqrt(model.noise) / np.sqrt(sd * sd + model.noise), 1e-300)
    return log_expected_improvement(mean, sd, best) + np.log(not_noise)
