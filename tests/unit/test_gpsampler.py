"""The ``bo`` sampler: the Gaussian process behind it, and the sampler in a real Optuna study."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from scipy.optimize import approx_fprime
from scipy.stats import norm
from trialkeeper.coordinator.search import gp
from trialkeeper.coordinator.search.algorithms import create_tuner
from trialkeeper.coordinator.search.gpsampler import GaussianProcessSampler, _Column
from trialkeeper.coordinator.search.tuners import TunerError

optuna.logging.set_verbosity(optuna.logging.ERROR)


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 3))
    y = np.sin(3 * x[:, 0]) + x[:, 1] ** 2 + 0.02 * rng.normal(size=n)
    return x, (y - y.mean()) / y.std()


def test_the_likelihoods_gradient_is_its_derivative() -> None:
    x, y = _data(25)
    theta = np.r_[np.log([0.3, 0.5, 2.0]), 0.2, math.log(0.03)]
    analytic = gp._nll(theta, x, y)[1]
    numeric = approx_fprime(theta, lambda t: gp._nll(t, x, y)[0], 1e-6)
    assert np.allclose(analytic, numeric, rtol=1e-4, atol=1e-4)


def test_the_likelihoods_gradient_in_the_shifts_is_their_derivative() -> None:
    x, y = _data(25)
    x[:, 2] = np.round(x[:, 2] * 3) / 3  # an ordered column of 4 levels
    pairs = gp.shifts([gp.Dimension(), gp.Dimension(), gp.Dimension(levels=4)])
    assert pairs == [(0, 2), (1, 2)]
    theta = np.r_[np.log([0.3, 0.5, 2.0]), 0.2, math.log(0.03), 0.4, -0.3]
    analytic = gp._nll(theta, x, y, pairs)[1]
    numeric = approx_fprime(theta, lambda t: gp._nll(t, x, y, pairs)[0], 1e-6)
    assert np.allclose(analytic, numeric, rtol=1e-4, atol=1e-4)


def _moving_ridge(n: int, levels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A narrow ridge in the first column whose place moves with the second, ordered one (4
    levels): at 0.3 for level 0, 0.6 for level 3."""
    rng = np.random.default_rng(3)
    x = np.c_[rng.random(n), rng.choice(levels, n) / 3]
    y = np.exp(-(((x[:, 0] - 0.3 - 0.3 * x[:, 1]) / 0.1) ** 2))
    return x, (y - y.mean()) / y.std()


def test_the_process_learns_that_a_continuous_best_moves_with_an_ordered_choice() -> None:
    dims = [gp.Dimension(), gp.Dimension(levels=4)]
    pairs = gp.shifts(dims)
    assert pairs == [(0, 1)]
    x, y = _moving_ridge(60, [0, 1, 2])  # level 3 never tried
    shifted = gp.fit(x, y, pairs=pairs)
    assert shifted[-1] < -0.1  # the ridge, x0 - 0.3 x1 constant, read as one place
    grid = np.c_[np.linspace(0, 1, 201), np.ones(201)]
    with_shift = grid[np.argmax(gp.model(shifted, x, y, pairs=pairs).predict(grid)[0]), 0]
    without = grid[np.argmax(gp.model(gp.fit(x, y), x, y).predict(grid)[0]), 0]
    assert abs(with_shift - 0.6) < 0.06
    assert abs(with_shift - 0.6) < abs(without - 0.6)


def test_predictions_use_the_same_kernel_the_likelihood_is_fitted_with() -> None:
    x, _ = _data(30)
    points = np.random.default_rng(1).random((50, 3))
    scales = np.array([0.2, 0.7, 3.0])
    assert np.allclose(gp._kernel(points, x, scales), gp._matern(points, x, scales)[0], rtol=1e-10, atol=1e-12)


def test_a_fitted_process_follows_the_data_and_is_unsure_away_from_it() -> None:
    x, y = _data(40)
    theta = gp.fit(x, y)
    fitted = gp.model(theta, x, y)
    mean, sd = fitted.predict(x)
    assert np.abs(mean - y).max() < 0.3
    # The third column does not matter: its length scale is fitted long, the others short.
    scales = np.exp(theta[:3])
    assert scales[2] > 3 * max(scales[0], scales[1])
    far = np.array([[5.0, 5.0, 0.5]])
    assert fitted.predict(far)[1][0] > 5 * sd.mean()


def test_far_from_every_trial_the_process_predicts_its_mean() -> None:
    x, y = _data(30)
    theta = gp.fit(x, y - 0.8)
    far = np.array([[9.0, 9.0, 9.0]])
    assert abs(gp.model(theta, x, y, mean=0.8).predict(far)[0][0] - 0.8) < 1e-6
    assert abs(gp.model(theta, x, y).predict(far)[0][0]) < 1e-6


def test_a_near_copy_of_a_noisy_trial_is_worth_less_than_expected_improvement_says() -> None:
    rng = np.random.default_rng(3)
    x = rng.random((30, 1))
    y = np.sin(4 * x[:, 0]) + 0.3 * rng.normal(size=30)  # noisy
    y = (y - y.mean()) / y.std()
    fitted = gp.model(gp.fit(x, y), x, y)
    assert fitted.noise > 0.05
    seen, _ = fitted.predict(x)
    best = float(seen.max())
    copy, far = x[[int(np.argmax(seen))]], np.array([[3.0]])
    mean, sd = fitted.predict(np.vstack([copy, far]))
    plain = gp.log_expected_improvement(mean, sd, best)
    augmented = gp.acquisition(fitted, np.vstack([copy, far]), best)
    # Where only the noise is uncertain, much less; far away, where the process is unsure, less so.
    penalty = plain - augmented
    assert np.all(penalty > 0) and penalty[0] > penalty[1] + 1.0, penalty


def test_outlier_noise_is_the_student_t_weight_of_each_points_leave_one_out_residual() -> None:
    x, y = _data(25)
    y[7] += 2.5  # one value its neighbours do not predict
    theta, nu = gp.fit(x, y), 4.0
    extra = gp.outlier_noise(gp.model(theta, x, y), nu)
    for i in range(len(y)):  # the slow way: a process on the others, asked about point i
        others = np.arange(len(y)) != i
        loo = gp.model(theta, x[others], y[others])
        mean, sd = loo.predict(x[[i]])
        var = sd[0] ** 2 + loo.noise + gp._JITTER
        z2 = (y[i] - mean[0]) ** 2 / var
        assert extra[i] == pytest.approx(max(var * ((nu + z2) / (nu + 1) - 1), 0.0), rel=1e-4, abs=1e-9)
    assert int(np.argmax(extra)) == 7 and (extra == 0).sum() > len(y) // 2, extra


def test_a_lone_value_unlike_its_neighbours_is_smoothed_over_not_interpolated() -> None:
    # A smooth curve with a lucky spike on a slope and a pit on the crest (a slow starter): the
    # plain process spreads them as noise over every point and still bends towards both; with
    # the outlier noise each is read nearer its neighbours and the crest stays the best.
    x = np.linspace(0.0, 1.0, 31)[:, None]
    clean = np.sin(np.pi * x[:, 0])
    spike, pit = 6, 15
    y = clean.copy()
    y[spike] += 1.2
    y[pit] -= 1.2
    clean, y = (clean - y.mean()) / y.std(), (y - y.mean()) / y.std()
    theta = gp.fit(x, y)
    plain = gp.model(theta, x, y).predict(x)[0]
    robust = gp.model(theta, x, y, extra=gp.outlier_noise(gp.model(theta, x, y))).predict(x)[0]
    neighbours = {i: (y[i - 1] + y[i + 1]) / 2 for i in (spike, pit)}
    for i in (spike, pit):
        assert abs(robust[i] - neighbours[i]) < 0.5 * abs(plain[i] - neighbours[i]), (i, plain[i], robust[i])
    assert abs(int(np.argmax(robust)) - pit) <= 1, robust
    others = np.ones(len(y), dtype=bool)
    others[[spike, pit]] = False  # elsewhere it is also nearer the curve the two were drawn from
    assert np.abs(robust - clean)[others].mean() < 0.7 * np.abs(plain - clean)[others].mean()


def test_log_expected_improvement_is_the_closed_form_and_stays_finite_far_below() -> None:
    mean, sd = np.array([0.0, 0.5, -1.0, -40.0, -80.0]), np.array([1.0, 0.2, 0.5, 1.0, 1.0])
    got = gp.log_expected_improvement(mean, sd, 0.3)
    z = (mean[:3] - 0.3) / sd[:3]
    exact = np.log(sd[:3] * (z * norm.cdf(z) + norm.pdf(z)))
    assert np.allclose(got[:3], exact)
    assert np.all(np.isfinite(got)) and got[3] > got[4]  # ordered even where it underflows


@pytest.mark.parametrize(
    ("dist", "values"),
    [
        (FloatDistribution(1e-4, 1.0, log=True), [1e-4, 3e-3, 1.0]),
        (FloatDistribution(0.0, 0.9, step=0.3), [0.0, 0.3, 0.9]),
        (IntDistribution(1, 4), [1, 2, 4]),
        (IntDistribution(1, 1000, log=True), [1, 37, 1000]),
        (CategoricalDistribution([64, 512, 128, 256]), [64, 128, 512]),
        (CategoricalDistribution(["mlp", "cnn", "res"]), ["mlp", "res"]),
        (CategoricalDistribution([True, False]), [True, False]),
    ],
)
def test_a_parameter_goes_into_the_cube_and_comes_back(dist: Any, values: list[Any]) -> None:
    column = _Column(dist)
    for v in values:
        cols = np.array(column.encode(v))
        assert len(cols) == column.dim.width and np.all((cols >= 0) & (cols <= 1))
        back = column.decode(cols)
        assert back == pytest.approx(v) and type(back) is type(v)


def test_a_choice_of_numbers_is_ordered_and_any_other_is_one_hot() -> None:
    widths = _Column(CategoricalDistribution([512, 64, 256, 128]))
    assert widths.dim == gp.Dimension(levels=4)
    assert [widths.encode(w)[0] for w in (64, 128, 256, 512)] == pytest.approx([0, 1 / 3, 2 / 3, 1])
    archs = _Column(CategoricalDistribution(["mlp", "cnn", "res"]))
    assert archs.dim == gp.Dimension(levels=3, onehot=True) and archs.encode("cnn") == [0.0, 1.0, 0.0]


def _objective(trial: optuna.Trial) -> float:
    """A peak at x = 0.7 (log scale), y = 0.3, width 256, arch b; the other arch is 0.1 lower."""
    x = trial.suggest_float("x", 1e-3, 1.0, log=True)
    y = trial.suggest_float("y", 0.0, 1.0)
    width = trial.suggest_categorical("width", [64, 128, 256, 512])
    arch = trial.suggest_categorical("arch", ["a", "b"])
    return (-(math.log10(x) - math.log10(0.7)) ** 2 - (y - 0.3) ** 2 - 0.01 * abs(math.log2(width / 256))
            - (0.1 if arch == "a" else 0.0))


def test_it_finds_the_peak_closer_than_random_search_with_the_same_trials() -> None:
    for seed in range(3):
        found = {}
        samplers = {"bo": GaussianProcessSampler(seed=seed), "random": optuna.samplers.RandomSampler(seed)}
        for name, sampler in samplers.items():
            study = optuna.create_study(direction="maximize", sampler=sampler)
            study.optimize(_objective, n_trials=30)
            found[name] = study.best_value
        assert found["bo"] > found["random"] and found["bo"] > -0.02, (seed, found)


def test_it_minimizes_when_the_study_does() -> None:
    study = optuna.create_study(direction="minimize", sampler=GaussianProcessSampler(seed=1))
    study.optimize(lambda t: -_objective(t), n_trials=25)
    assert study.best_value < 0.02


def _apart(a: dict[str, Any], b: dict[str, Any]) -> float:
    return (abs(math.log10(a["x"]) - math.log10(b["x"])) / 3 + abs(a["y"] - b["y"])
            + 0.5 * (a["width"] != b["width"]) + 0.5 * (a["arch"] != b["arch"]))


def test_a_trial_still_running_pushes_the_next_proposal_away_from_it() -> None:
    apart: dict[bool, list[float]] = {True: [], False: []}
    for seed in range(6):
        for running in (True, False):
            study = optuna.create_study(direction="maximize",
                                        sampler=GaussianProcessSampler(seed=seed, n_startup_trials=5))
            study.optimize(_objective, n_trials=12)
            first = study.ask()
            _objective(first)
            if not running:  # ended without a value: nothing to believe, so the same model proposes again
                study.tell(first, state=optuna.trial.TrialState.FAIL)
            second = study.ask()
            _objective(second)
            apart[running].append(_apart(first.params, second.params))
    assert sum(apart[True]) > 2 * sum(apart[False]), apart


def test_several_objectives_are_refused_with_what_to_use() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=GaussianProcessSampler(seed=0))
    with pytest.raises(ValueError, match="one objective; for several use TPE, NSGA-II or GP"):
        study.optimize(lambda t: (t.suggest_float("x", 0, 1), 0.0), n_trials=1)


def test_bad_arguments_are_named_through_the_tuner_config() -> None:
    with pytest.raises(TunerError, match=r"classArgs.sampler_args for GaussianProcessSampler: .*n_startup_trials"):
        create_tuner("optuna", None, {"sampler": "bo", "sampler_args": {"n_startup_trials": 0}},
                     {"x": {"_type": "uniform", "_value": [0, 1]}})


def test_the_tuner_proposes_inside_a_space_with_nested_choices() -> None:
    space: dict[str, Any] = {
        "lr": {"_type": "loguniform", "_value": [1e-4, 1e-1]},
        "units": {"_type": "quniform", "_value": [32, 256, 32]},
        "opt": {"_type": "choice", "_value": [
            "adam", {"_name": "sgd", "wd": {"_type": "loguniform", "_value": [1e-6, 1e-3]}}]},
    }
    tuner = create_tuner("optuna", None, {"sampler": "bo", "seed": 4, "sampler_args": {"n_startup_trials": 3}}, space)
    for pid in range(12):
        p = tuner.generate_parameters(pid)
        assert 1e-4 <= p["lr"] <= 1e-1 and p["units"] in range(32, 257, 32)
        assert p["opt"] == "adam" or (p["opt"]["_name"] == "sgd" and 1e-6 <= p["opt"]["wd"] <= 1e-3)
        tuner.receive_trial_result(pid, p, -abs(math.log10(p["lr"]) + 2))
        tuner.trial_end(pid, True)


def test_a_small_discrete_space_proposed_again_and_again_keeps_working() -> None:
    study = optuna.create_study(direction="maximize", sampler=GaussianProcessSampler(seed=2, n_startup_trials=3))
    study.optimize(lambda t: t.suggest_categorical("a", [1, 2, 3]) - (t.suggest_categorical("b", ["x", "y"]) == "y"),
                   n_trials=40)
    seen = [(t.params["a"], t.params["b"]) for t in study.trials]
    assert len(set(seen)) <= 6 and seen.count((3, "x")) > 10  # the best, proposed again and again


def test_a_model_that_cannot_be_fitted_draws_that_trial_at_random(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    study = optuna.create_study(direction="maximize", sampler=GaussianProcessSampler(seed=0, n_startup_trials=3))
    study.optimize(_objective, n_trials=3)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise np.linalg.LinAlgError("Matrix is not positive definite")

    monkeypatch.setattr(gp, "fit", broken)
    study.optimize(_objective, n_trials=2)
    assert len(study.trials) == 5 and all(t.state is TrialState.COMPLETE for t in study.trials)
    assert "the bo sampler drew trial 3 at random: the model could not be fitted" in caplog.text


def test_the_points_near_the_best_share_its_options_and_are_nearest_by_the_length_scales() -> None:
    dims = [gp.Dimension(), gp.Dimension(levels=2, onehot=True)]
    rng = np.random.default_rng(3)
    x = np.c_[rng.random(30), np.eye(2)[rng.integers(0, 2, 30)]]
    centre = np.array([0.5, 0.0, 1.0])
    near = gp.nearest(x, centre, np.array([0.1, 1.0, 1.0]), dims, 6)
    same = np.flatnonzero(x[:, 2] == 1.0)
    assert set(near) == set(same[np.argsort(np.abs(x[same, 0] - 0.5))[:6]])
    # Fewer than 5 trials with the best's options: the nearest of all.
    few = np.r_[x[x[:, 1] == 1.0], [centre]]
    assert len(gp.nearest(few, centre, np.ones(3), dims, 40)) == len(few)


def test_refining_proposes_close_to_a_narrow_peak_the_neighbours_surround_and_keeps_the_choices() -> None:
    dims = [gp.Dimension(), gp.Dimension(), gp.Dimension(levels=4)]
    for seed in range(3):
        rng = np.random.default_rng(seed)
        x = np.c_[0.3 + 0.2 * rng.random((30, 2)), np.full(30, 2 / 3)]
        y = -((x[:, 0] - 0.41) ** 2 + (x[:, 1] - 0.38) ** 2) / 0.01 + 0.01 * rng.normal(size=30)
        chosen = gp.refine(x, y, dims, rng)
        assert chosen[2] == 2 / 3
        assert math.dist(chosen[:2], (0.41, 0.38)) < 0.04, (seed, chosen)


def _two_kinds(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    return -((x - 0.3) ** 2) - (0.0 if trial.suggest_categorical("kind", ["a", "b", "c"]) == "b" else 1.0)


def test_every_other_proposal_refines_around_the_best_once_refine_from_trials_have_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = gp.refine

    def counted(x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        calls.append(len(x))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gp, "refine", counted)
    for seed in range(3):
        sampler = GaussianProcessSampler(seed=seed, local=15, refine_from=20)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        study.optimize(_two_kinds, n_trials=20)
        assert not calls
        refined = [study.ask(), study.ask()][1]
        _two_kinds(refined)  # (Optuna samples at the first suggestion)
        assert refined.number % 2 == 1 and len(calls) == 1 and 5 <= calls.pop() <= 15
        # Small steps around the best trials, all near 0.3, with their option kept.
        assert refined.params["kind"] == "b" and abs(refined.params["x"] - 0.3) < 0.25, (seed, refined.params)


def test_local_and_refine_from_are_named_when_too_small() -> None:
    with pytest.raises(TunerError, match=r"sampler_args for GaussianProcessSampler: local must be 0 .* got 3"):
        create_tuner("optuna", None, {"sampler": "bo", "sampler_args": {"local": 3}},
                     {"x": {"_type": "uniform", "_value": [0, 1]}})
    with pytest.raises(TunerError, match=r"GaussianProcessSampler: refine_from must be at least 5 .* got 4"):
        create_tuner("optuna", None, {"sampler": "bo", "sampler_args": {"refine_from": 4}},
                     {"x": {"_type": "uniform", "_value": [0, 1]}})
