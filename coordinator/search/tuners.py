"""Tuners: what proposes each trial's parameters. Built-in ones, and third-party ones by name.

A tuner follows NNI's interface, so an NNI user's tuner ports with few changes::

    class MyTuner(Tuner):
        def generate_parameters(self, parameter_id: int) -> dict: ...
        def receive_trial_result(self, parameter_id, parameters, value) -> None: ...

and is named in the experiment config as ``tuner: {className: my_pkg.tuners:MyTuner}``.
``algorithms.create_tuner`` makes the tuner a config names.

Beyond NNI's interface, a tuner may pause trials and continue them later (``request_pause``,
``request_continue``, heard back through ``trial_paused`` and ``trial_continued``), and
start a new trial from another trial's checkpoint (``checkpoint_from``): what multi-fidelity
and population-based searches are built on.
"""

from __future__ import annotations

import abc
import contextlib
import difflib
import importlib
import inspect
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trialkeeper.coordinator import TrialStatus  # the public API
from trialkeeper.coordinator.search.requests import Requesting
from trialkeeper.coordinator.search.space import (
    grid,
    grid_size,
    is_discrete,
    sample,
    validate_search_space,
)

__all__ = [
    "BUILTIN_TUNERS",
    "GridTuner",
    "NoMoreTrials",
    "PastTrial",
    "RandomTuner",
    "TryLater",
    "Tuner",
    "TunerError",
    "check_class_args",
    "import_class",
    "normalized",
]


class NoMoreTrials(Exception):
    """Raised by Tuner.generate_parameters when the tuner has nothing left to propose."""


class TryLater(Exception):
    """Raised by Tuner.generate_parameters when the tuner has nothing to propose until a
    running trial ends (an NNI advisor between rounds). With nothing running, it means
    the tuner is done."""


class TunerError(ValueError):
    """A tuner that cannot be created: unknown name, failed import, bad classArgs.
    ``missing`` names the package it needs that is not installed in this interpreter (the
    config may be right, for another one)."""

    def __init__(self, message: str, *, missing: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class PastTrial:
    """A trial an earlier run of the experiment submitted, as the store holds it."""

    trial_id: str
    parameter_id: int
    parameters: dict[str, Any]
    intermediate: tuple[float, ...]
    final: float | None
    status: TrialStatus | None  # None: it has not ended (it runs, waits, or is paused)
    paused: bool = False  # it was paused when the earlier run ended
    # The stored index of each intermediate result (empty: 0, 1, ...).
    intermediate_indexes: tuple[int, ...] = ()
    reported: Any = None  # the final result as reported (a dict of keys too), when it reported one
    # Each intermediate result as reported, where the search hears them so (Search.hears_reported).
    intermediate_reported: tuple[Any, ...] = ()

    @property
    def succeeded(self) -> bool:
        return self.status is TrialStatus.SUCCEEDED

    @property
    def result(self) -> float | None:
        """What a tuner learns from it: the final result, or the last intermediate one of
        a trial stopped early (as NNI tells its tuners)."""
        if self.final is not None:
            return self.final
        if self.status is TrialStatus.EARLY_STOPPED and self.intermediate:
            return self.intermediate[-1]
        return None


class Tuner(Requesting, abc.ABC):
    """Proposes parameters for trials and learns from their results.

    The coordinator calls, from one thread: ``generate_parameters`` once per new trial,
    ``receive_trial_result`` when a trial reports its final result, and ``trial_end`` when
    a trial ends (also for trials that failed without a result). ``value`` is the metric's
    ``default`` number; whether bigger is better is ``optimize_mode``.

    From any of these calls a tuner may ask, by parameter id, to pause a trial
    (``request_pause``), continue a paused one (``request_continue``, optionally with new
    parameters) or stop one (``request_stop``); it then hears ``trial_paused`` and
    ``trial_continued``. A paused trial holds no slot, and has not ended.

    Subclasses take the search space as first argument and their classArgs as keyword
    arguments, and should call ``super().__init__``.
    """

    #: The search space is in the format of NNI's Batch tuner (a choice of parameter sets).
    batch_space: bool = False

    def __init__(
        self,
        search_space: dict[str, Any],
        *,
        optimize_mode: str = "maximize",
        seed: int | None = None,
    ) -> None:
        validate_search_space(search_space, batch=self.batch_space)
        if optimize_mode not in ("maximize", "minimize"):
            raise TunerError(
                f"optimize_mode must be 'maximize' or 'minimize', got {optimize_mode!r}"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TunerError(f"seed must be an integer or null, got {seed!r}")
        self.search_space = search_space
        self.optimize_mode = optimize_mode
        self.seed = seed

    @abc.abstractmethod
    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        """The parameters of trial ``parameter_id``: a JSON-serialisable dict.

        Raise NoMoreTrials when the search space is exhausted; the experiment then
        stops creating trials.
        """

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None:
        """Learn the final result ``value`` of the trial that ran ``parameters``."""

    def receive_intermediate_result(self, parameter_id: int, step: int, value: float) -> None:
        """Learn a trial's intermediate result number ``step`` (0, 1, ...), as it is stored.

        A step heard before replaces that result and every later one: a trial continued
        from a checkpoint after its environment was lost reports again the results it had
        reported after that checkpoint."""

    def trial_end(self, parameter_id: int, success: bool) -> None:
        """Learn that trial ``parameter_id`` ended, successfully or not."""

    def checkpoint_from(self, parameter_id: int) -> int | None:
        """Asked right after ``generate_parameters(parameter_id)``: the parameter id of the
        trial whose latest checkpoint the new trial starts from (a configuration promoted to
        a larger budget goes on from where it stopped), or None to start afresh. A trial
        with no checkpoint saved starts afresh all the same."""
        return None

    #: A parameter a multi-fidelity tuner adds to say how far a trial trains (``TRIAL_BUDGET``
    #: for NNI's advisors): trials that differ only in it run the same configuration.
    budget_parameter: str | None = None

    def configuration_of(self, parameter_id: int) -> int | None:
        """Asked right after ``generate_parameters(parameter_id)``: the parameter id of the
        earlier trial whose configuration the new one trains further (a promotion to a larger
        budget), or None for a new configuration. ``maxTrialNumber`` counts configurations."""
        return None

    def only_promotions(self) -> bool:
        """``maxTrialNumber`` configurations have been proposed: whether the tuner goes on
        proposing promotions of those (``configuration_of``), and nothing new, until it raises
        NoMoreTrials or has nothing to wait for. The default: no, it is asked nothing more."""
        return False

    def trial_paused(self, parameter_id: int) -> None:
        """Learn that the trial saved a checkpoint and ended its process: it holds no slot
        and waits, not ended, until continued (``request_continue``) or stopped."""

    def trial_continued(self, parameter_id: int, parameters: dict[str, Any]) -> None:
        """Learn that a paused trial was continued from its checkpoint, with ``parameters``
        (its own, or those it was continued with)."""

    def resume(self, history: Sequence[PastTrial]) -> None:
        """Hear what an earlier run of this experiment did, before proposing anything.

        The default proposes again every stored trial (a seeded tuner proposes the same
        points, so it goes on where it was) and hears each result; trials still running
        report theirs later as usual, and paused ones are told paused."""
        for t in history:
            with contextlib.suppress(NoMoreTrials):
                self.generate_parameters(t.parameter_id)
            for step, value in enumerate(t.intermediate):
                self.receive_intermediate_result(t.parameter_id, step, value)
            if t.paused:
                self.trial_paused(t.parameter_id)
            if t.status is not None:
                if t.result is not None:
                    self.receive_trial_result(t.parameter_id, t.parameters, t.result)
                self.trial_end(t.parameter_id, t.succeeded)
        self.take_requests()  # what it asks while hearing the past was decided then


def _key(parameters: dict[str, Any]) -> str:
    return json.dumps(parameters, sort_keys=True, default=repr)


class RandomTuner(Tuner):
    """Samples the search space at random, with a seeded generator.

    On a fully discrete space it never proposes the same point twice and raises
    NoMoreTrials once every point was proposed; with a continuous parameter, repeats are
    possible in principle and the tuner never runs out.
    """

    # Redraws before picking among the remaining points directly: near exhaustion almost
    # every draw is a repeat, and redrawing alone would take about size-many draws.
    _MAX_REDRAWS = 100

    def __init__(
        self,
        search_space: dict[str, Any],
        *,
        optimize_mode: str = "maximize",
        seed: int | None = None,
    ) -> None:
        super().__init__(search_space, optimize_mode=optimize_mode, seed=seed)
        self._rng = random.Random(seed)
        self._size = grid_size(search_space) if is_discrete(search_space) else None
        self._seen: set[str] = set()

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        if self._size is None:
            return sample(self.search_space, self._rng)
        if len(self._seen) >= self._size:
            raise NoMoreTrials(f"random search proposed all {self._size} points of the space")
        for _ in range(self._MAX_REDRAWS):
            parameters = sample(self.search_space, self._rng)
            if _key(parameters) not in self._seen:
                break
        else:
            left = [p for p in grid(self.search_space) if _key(p) not in self._seen]
            parameters = self._rng.choice(left)
        self._seen.add(_key(parameters))
        return parameters


class GridTuner(Tuner):
    """Proposes every point of a discrete search space once, in order (see searchspace.grid)."""

    def __init__(
        self,
        search_space: dict[str, Any],
        *,
        optimize_mode: str = "maximize",
        seed: int | None = None,
    ) -> None:
        super().__init__(search_space, optimize_mode=optimize_mode, seed=seed)
        self.size = grid_size(search_space)
        self._points = grid(search_space)

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        try:
            return next(self._points)
        except StopIteration:
            raise NoMoreTrials(f"grid search proposed all {self.size} points") from None


BUILTIN_TUNERS: dict[str, type[Tuner]] = {"random": RandomTuner, "grid": GridTuner}
# NNI's names for the same tuners, compared after lower-casing and dropping "_", "-", " ".
# GridSearch is NNI's algorithm where NNI is installed (see algorithms.create_tuner).
TUNER_ALIASES = {"gridsearch": "grid", "randomsearch": "random"}


def normalized(name: str) -> str:
    """An algorithm's name as compared: lower case, without "_", "-" and spaces."""
    return "".join(c for c in name.lower() if c not in "_- ")


def import_class(class_name: str, code_directory: str | None, kind: str) -> Any:
    """The object ``class_name`` names, imported with ``code_directory`` on sys.path."""
    module_name, _, attr = (
        class_name.partition(":") if ":" in class_name else class_name.rpartition(".")
    )
    if not module_name or not attr:
        raise TunerError(
            f"className {class_name!r} must look like 'package.module:ClassName' "
            f"or 'package.module.ClassName'"
        )
    if code_directory is not None:
        path = os.path.abspath(code_directory)
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)  # first: its modules before those of the same name elsewhere
        _forget_shadowing(module_name, path)
        # The directory may have gained files since the import system last listed it.
        importlib.invalidate_caches()
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise TunerError(
            f"cannot import module {module_name!r} of {kind} {class_name!r}: {one_line(e)}"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TunerError(f"{kind} {class_name!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _forget_shadowing(module_name: str, path: str) -> None:
    """A module of that name imported before from elsewhere (another experiment's code
    directory, in the same process) would hide the one in ``path``: it is forgotten, so
    that ``path``'s is imported."""
    top = module_name.split(".")[0]
    module = sys.modules.get(top)
    here = os.path.join(path, top)
    if module is None or not (os.path.isfile(here + ".py") or os.path.isdir(here)):
        return
    if os.path.abspath(getattr(module, "__file__", None) or "").startswith(path + os.sep):
        return
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def check_class_args(
    label: str, cls: type, class_args: object, kind: str = "tuner", *, skip_first: bool = True
) -> dict[str, Any]:
    """``class_args`` checked against ``cls``'s signature; TunerError naming what is wrong.
    ``skip_first``: the first parameter receives the search space, so it is no classArg."""
    if not isinstance(class_args, dict) or not all(isinstance(k, str) for k in class_args):
        raise TunerError(f"classArgs of {kind} {label!r} must be a mapping of name -> value")
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return class_args  # no signature to check against (a C extension, say)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return class_args
    params = params[1:] if skip_first else params
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unexpected = []
    for key in class_args:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            unexpected.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if unexpected:
        raise TunerError(
            f"unexpected classArgs {', '.join(unexpected)} for {kind} {label!r}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    missing = [
        p.name for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in class_args
    ]
    if missing:
        raise TunerError(f"{kind} {label!r} needs classArgs {', '.join(missing)}")
    return class_args


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
