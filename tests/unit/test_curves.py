"""The learning-curve model behind the ``bo`` sampler's curve proposals, alone and in a study."""

from __future__ import annotations

from typing import Any

import numpy as np
import optuna
import pytest
from trialkeeper.coordinator.search import curves, gp
from trialkeeper.coordinator.search.algorithms import create_tuner
from trialkeeper.coordinator.search.gpsampler import GaussianProcessSampler
from trialkeeper.coordinator.search.tuners import TunerError

optuna.logging.set_verbosity(optuna.logging.ERROR)

EPOCHS = 27


def _cliff(x: float, epochs: int = EPOCHS) -> np.ndarray:
    """A warm-up that ends later the larger ``x``, towards a ceiling that rises with it: the
    last epoch's score climbs with ``x`` up to about 0.5, then falls off a cliff (the curves of
    larger ``x`` are still warming up when the run ends)."""
    e = np.arange(1, epochs + 1, dtype=float)
    return curves.hill(e, 0.5 + 0.4 * x, 3.0 + 30.0 * x, 8.0)


def _power(x: float, epochs: int = EPOCHS) -> np.ndarray:
    """Still rising at the end of the run: no ceiling to see."""
    e = np.arange(1, epochs + 1, dtype=float)
    return (0.5 + 0.4 * x) * (e / epochs) ** (0.4 + x)


def test_a_fit_recovers_the_ceiling_the_half_way_epoch_and_the_sharpness() -> None:
    e = np.arange(1, EPOCHS + 1, dtype=float)
    for c, h, k in ((0.8, 9.0, 2.5), (0.9, 20.0, 6.0), (0.6, 1.5, 1.0)):
        noisy = curves.hill(e, c, h, k) + np.random.default_rng(0).normal(0.0, 0.003, EPOCHS)
        found = curves.fit(noisy)
        assert abs(np.exp(found.log_c) / c - 1) < 0.03, (c, h, k, found)
        assert abs(np.exp(found.log_h) / h - 1) < 0.06, (c, h, k, found)
        assert abs(np.exp(found.log_k) / k - 1) < 0.2, (c, h, k, found)
        assert found.rms < 0.005


def test_a_curve_that_cannot_be_fitted_is_refused() -> None:
    for bad in ([0.5], [0.1, float("nan"), 0.3], [0.1, float("inf")]):
        with pytest.raises(ValueError, match="two or more finite scores"):
            curves.fit(bad)


def test_ceilings_are_seen_in_curves_that_level_off_not_in_curves_still_rising() -> None:
    xs = np.linspace(0.0, 0.6, 12)
    for shape, seen in ((_cliff, True), (_power, False)):
        finals = np.array([shape(x)[-1] for x in xs])
        best = curves.best_quarter(finals)
        assert len(best) == 5 and set(finals[best]) == set(sorted(finals)[-5:])
        assert curves.ceilings_seen([curves.fit(shape(xs[i])) for i in best], EPOCHS) is seen, shape.__name__


def test_the_curve_model_proposes_on_the_near_side_of_a_cliff() -> None:
    grid = np.linspace(0.0, 1.0, 2001)
    truth = np.array([_cliff(x)[-1] for x in grid])
    for seed in range(3):
        rng = np.random.default_rng(seed)
        x = rng.random((20, 1))
        fits = [curves.fit(_cliff(v) + rng.normal(0.0, 0.003, EPOCHS)) for v in x[:, 0]]
        finals = np.array([_cliff(v)[-1] for v in x[:, 0]])
        model = curves.CurveModel(x, fits, EPOCHS, {})
        chosen = model.propose([gp.Dimension()], float(finals.max()), x[np.argsort(-finals)[:5]], rng)
        assert _cliff(chosen[0])[-1] > 0.98 * truth.max(), (seed, chosen, grid[truth.argmax()])


def _study_objective(shape: Any) -> Any:
    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", 0.0, 1.0)
        trial.suggest_categorical("kind", ["a", "b"])
        values = shape(x)
        for epoch, v in enumerate(values, 1):
            trial.report(float(v), epoch)
        return float(values[-1])

    return objective


def _curve_proposals(monkeypatch: pytest.MonkeyPatch, shape: Any, direction: str = "maximize") -> list[int]:
    """The trials of a 28-trial study that the curve model proposed."""
    proposed: list[int] = []
    real = curves.CurveModel.propose

    def counted(self: curves.CurveModel, *args: Any, **kwargs: Any) -> np.ndarray:
        proposed.append(len(study.trials) - 1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(curves.CurveModel, "propose", counted)
    study = optuna.create_study(direction=direction,
                                sampler=GaussianProcessSampler(seed=0, n_startup_trials=10, refine_from=20))
    objective = _study_objective(shape)
    study.optimize(objective if direction == "maximize" else (lambda t: -objective(t)), n_trials=28)
    return proposed


def test_every_fourth_proposal_comes_from_the_curves_where_their_ceilings_are_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _curve_proposals(monkeypatch, _cliff) == [12, 16, 20, 24]


def test_no_proposal_comes_from_curves_still_rising_or_from_a_minimized_score(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _curve_proposals(monkeypatch, _power) == []
    assert _curve_proposals(monkeypatch, _cliff, direction="minimize") == []


def test_curve_every_below_zero_is_named() -> None:
    with pytest.raises(TunerError, match=r"GaussianProcessSampler: curve_every must be 0 .* got -1"):
        create_tuner("optuna", None, {"sampler": "bo", "sampler_args": {"curve_every": -1}},
                     {"x": {"_type": "uniform", "_value": [0, 1]}})
