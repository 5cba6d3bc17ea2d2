"""Population-based training, built in (``tuner: {name: pbt}``), asynchronous as Ray Tune's.

The tuner proposes ``population_size`` trials from the search space and then none. Every
``perturbation_interval`` results a trial reports, it is ranked by its latest result among
the population's trials still going: one in the bottom ``quantile_fraction`` **exploits** a
trial of the top one: it is paused (it saves a checkpoint and ends its process), then
continued from the newest checkpoint of a top trial still going, picked at random once it is
paused, copied into it, with that trial's parameters **explored**: each parameter resampled from the space with
``resample_probability``, else perturbed (a number multiplied by one of
``perturbation_factors``, kept within its bounds and quantization; a choice moved to a
neighbouring option). The trial reads its new parameters when it continues
(``trial.get_next_parameter()``) and goes on from the copied state. A trial elsewhere in
the ranking goes on as it is.

With an ``objectives`` section, trials are ranked by its ranking (``objectives.py``); without,
by the reported number and ``optimize_mode``.

No I/O: the search hands it the events and carries out what it asks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config.objectives import Objectives, single
from .space import sample
from .tuners import NoMoreTrials, PastTrial, Tuner, TunerError

__all__ = ["PopulationBasedTraining", "explore"]


@dataclass
class _Member:
    parameters: dict[str, Any]
    score: float | None = None  # its latest result's rank, bigger is better
    results: int = 0  # how many results it has reported (its curve's length)
    mark: int = 0  # its curve's length when it was last ranked, or continued from another's state
    exploiting: bool = False  # paused to continue from another's checkpoint, not continued yet
    ended: bool = False


class PopulationBasedTraining(Tuner):
    """Asynchronous population-based training over a population of ``population_size`` trials."""

    def __init__(
        self,
        search_space: dict[str, Any],
        *,
        population_size: int = 10,
        perturbation_interval: int = 4,
        quantile_fraction: float = 0.25,
        resample_probability: float = 0.25,
        perturbation_factors: Sequence[float] = (1.2, 0.8),
        mutations: Sequence[str] | None = None,
        optimize_mode: str = "maximize",
        seed: int | None = None,
    ) -> None:
        super().__init__(search_space, optimize_mode=optimize_mode, seed=seed)
        _check_int("population_size", population_size, 2)
        _check_int("perturbation_interval", perturbation_interval, 1)
        if not _number(quantile_fraction) or not 0 < quantile_fraction <= 0.5:
            raise TunerError(
                f"pbt: classArgs.quantile_fraction must be a number in (0, 0.5], got {quantile_fraction!r}"
            )
        if not _number(resample_probability) or not 0 <= resample_probability <= 1:
            raise TunerError(
                f"pbt: classArgs.resample_probability must be a number in [0, 1], got {resample_probability!r}"
            )
        factors = list(perturbation_factors) if isinstance(perturbation_factors, (list, tuple)) else []
        if not factors or not all(_number(f) and f > 0 for f in factors):
            raise TunerError(
                f"pbt: classArgs.perturbation_factors must be a list of numbers > 0, got {perturbation_factors!r}"
            )
        names = list(search_space) if mutations is None else mutations
        unknown = [n for n in names if n not in search_space] if isinstance(names, (list, tuple)) else names
        if unknown:
            raise TunerError(
                f"pbt: classArgs.mutations must list parameters of the search space ({', '.join(search_space)}), "
                f"got {mutations!r}"
            )
        self.population_size = population_size
        self.interval = perturbation_interval
        self.quantile = quantile_fraction
        self.resample_probability = resample_probability
        self.factors = tuple(float(f) for f in factors)
        self.mutations = tuple(names)
        self.objectives: Objectives = single(optimize_mode)
        self._rng = random.Random(seed)
        self._members: dict[int, _Member] = {}
        self.exploits: list[tuple[int, int]] = []  # (trial, the trial whose state it took), in order

    def use_objectives(self, objectives: Objectives) -> None:
        """Rank trials by the experiment's objectives (their ranking) instead of the number."""
        self.objectives = objectives

    # ---- proposing ---------------------------------------------------------------------------

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        if len(self._members) >= self.population_size:
            raise NoMoreTrials(f"the population of {self.population_size} trials is complete")
        parameters = {name: _draw(spec, self._rng) for name, spec in self.search_space.items()}
        self._members[parameter_id] = _Member(dict(parameters))
        return parameters

    # ---- hearing results ---------------------------------------------------------------------

    #: The search hands it results as reported (a dict of keys too), for several objectives.
    takes_reported = True

    def receive_intermediate_result(self, parameter_id: int, step: int, value: Any) -> None:
        """A trial's result number ``step``, as reported (a number, or a dict of keys)."""
        m = self._members.get(parameter_id)
        if m is None or m.ended:
            return
        m.results = step + 1
        m.score = self.objectives.score(value)
        if m.exploiting or m.results - m.mark < self.interval:
            return
        m.mark = m.results
        if self._bottom(parameter_id):
            m.exploiting = True
            self.request_pause(parameter_id, "population-based training: it ranks in the bottom quantile")

    def trial_paused(self, parameter_id: int) -> None:
        """Paused to exploit: continued from the newest checkpoint of a top trial picked now
        among those still going, with that trial's parameters explored (from its own, as it
        is, when none is left)."""
        m = self._members.get(parameter_id)
        if m is None or not m.exploiting:
            return
        top = self._top(parameter_id)
        if not top:
            m.exploiting = False
            self.request_continue(parameter_id)
            return
        donor = top[self._rng.randrange(len(top))]
        self.exploits.append((parameter_id, donor))
        parameters = explore(self._members[donor].parameters, self.search_space, self.mutations, self._rng,
                             self.resample_probability, self.factors)
        self.request_continue(parameter_id, parameters, checkpoint_from=donor)

    def _ranked(self) -> list[int]:
        """The trials still going that have reported, best first; those whose result ranks
        nothing (a missing key, a broken constraint) last."""
        going = [(pid, m) for pid, m in self._members.items() if not m.ended and m.results > 0]
        going.sort(key=lambda pm: -math.inf if pm[1].score is None else pm[1].score, reverse=True)
        return [pid for pid, _ in going]

    def _quantile(self, n: int) -> int:
        return max(1, int(n * self.quantile))

    def _bottom(self, parameter_id: int) -> bool:
        """Whether the trial ranks in the bottom quantile (of two trials or more)."""
        ranked = self._ranked()
        return len(ranked) >= 2 and parameter_id in ranked[-self._quantile(len(ranked)):]

    def _top(self, parameter_id: int) -> list[int]:
        """The top quantile's trials another may take the state of (none exploiting itself)."""
        ranked = self._ranked()
        top = ranked[:self._quantile(len(ranked))]
        return [pid for pid in top if pid != parameter_id and not self._members[pid].exploiting]

    def trial_continued(self, parameter_id: int, parameters: dict[str, Any]) -> None:
        m = self._members.get(parameter_id)
        if m is not None:
            m.parameters, m.exploiting = dict(parameters), False
            m.mark = m.results  # its next ranking comes perturbation_interval results from now

    def trial_end(self, parameter_id: int, success: bool) -> None:
        m = self._members.get(parameter_id)
        if m is not None:
            m.ended, m.exploiting = True, False

    def resume(self, history: Sequence[PastTrial]) -> None:
        """The population as stored: each trial with its parameters now (after exploits), its
        results and whether it ended; the generator goes on reseeded from what was proposed."""
        for t in history:
            m = self._members[t.parameter_id] = _Member(dict(t.parameters), results=len(t.intermediate))
            m.mark, m.ended = m.results, t.status is not None
            if t.intermediate:
                last = t.intermediate_reported[-1] if t.intermediate_reported else t.intermediate[-1]
                m.score = self.objectives.score(last)
        self._rng = random.Random(None if self.seed is None else self.seed + len(history))
        self.take_requests()


def explore(
    parameters: dict[str, Any], space: dict[str, Any], names: Sequence[str], rng: random.Random,
    resample_probability: float, factors: Sequence[float],
) -> dict[str, Any]:
    """``parameters`` with each of ``names`` resampled from ``space`` (with
    ``resample_probability``) or perturbed."""
    explored = dict(parameters)
    for name in names:
        spec = space[name]
        if name not in parameters or rng.random() < resample_probability:
            explored[name] = _draw(spec, rng)
        else:
            explored[name] = _perturb(spec, parameters[name], rng, factors)
    return explored


def _perturb(spec: dict[str, Any], value: Any, rng: random.Random, factors: Sequence[float]) -> Any:
    kind, v = spec["_type"], spec["_value"]
    if kind == "choice":
        options = list(v)
        found = [i for i, o in enumerate(options) if o == value or (isinstance(o, dict) and isinstance(value, dict)
                                                                      and o.get("_name") == value.get("_name"))]
        if not found or isinstance(options[found[0]], dict):  # a nested space: drawn anew
            return _draw(spec, rng)
        i = min(max(found[0] + rng.choice((-1, 1)), 0), len(options) - 1)
        return options[i]
    if not _number(value):
        return _draw(spec, rng)
    x = value * rng.choice(list(factors))
    if kind == "randint":
        return int(min(max(round(x), v[0]), v[1] - 1))
    if kind in ("uniform", "quniform", "loguniform", "qloguniform"):
        x = min(max(x, v[0]), v[1])
    if kind.startswith("q"):
        q = v[2]
        x = round(x / q) * q
        if kind in ("quniform", "qloguniform"):
            x = min(max(x, v[0]), v[1])
        return int(x) if all(isinstance(b, int) for b in (v[0], v[1], q)) else x
    return float(x)


def _draw(spec: dict[str, Any], rng: random.Random) -> Any:
    """One value of a parameter of the space, drawn as the random tuner draws it."""
    return sample({"p": spec}, rng)["p"]


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TunerError(f"pbt: classArgs.{name} must be an integer >= {least}, got {value!r}")


