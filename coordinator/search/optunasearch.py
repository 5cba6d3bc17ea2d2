"""Optuna's samplers as a tuner and its pruners as an assessor.

``tuner: {name: optuna, classArgs: {sampler: TPE, seed: 1, storage: sqlite:///s.db}}`` and
``assessor: {name: optuna, classArgs: {pruner: median}}``. NNI's search-space types map to
Optuna's distributions exactly (nested ``choice`` suggests its options' parameters only when
chosen, under ``name/option/param``); a type Optuna cannot express is refused with the
reason. With ``storage`` the study lives there, named after the experiment (or
``study_name``), so ``optuna-dashboard`` and Optuna's analysis functions read it live.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections.abc import Sequence
from typing import Any

from .. import TrialStatus  # the public API
from ..config.experiment import without_url_password
from ..config.objectives import Objectives, number
from .assessors import Assessor, AssessorError
from .space import SearchSpaceError, validate_search_space
from .tuners import PastTrial, Tuner, TunerError, normalized

log = logging.getLogger(__name__)

__all__ = ["OptunaAssessor", "OptunaTuner", "create_optuna_assessor", "create_optuna_tuner", "optuna_space_issues"]

_PID_ATTR = "trialkeeper_parameter_id"
# On the record a continued trial goes on in: the number of the PRUNED record its pause left.
_CONTINUES_ATTR = "trialkeeper_continues"
_SAMPLERS = {"tpe": "TPESampler", "cmaes": "CmaEsSampler", "gp": "GPSampler", "nsgaii": "NSGAIISampler",
             "nsga2": "NSGAIISampler", "qmc": "QMCSampler", "random": "RandomSampler", "bo": "GaussianProcessSampler"}
# Samplers of our own, by the name in _SAMPLERS, imported when chosen (they import Optuna).
_OWN_SAMPLERS = {"GaussianProcessSampler": ".gpsampler"}
_PRUNERS = {"median": "MedianPruner", "percentile": "PercentilePruner", "successivehalving": "SuccessiveHalvingPruner",
            "sha": "SuccessiveHalvingPruner", "hyperband": "HyperbandPruner", "wilcoxon": "WilcoxonPruner"}
# What a sampler needs beyond Optuna, imported when it is chosen so that a missing one is
# named at start rather than at the first proposal Optuna hands to it.
_NEEDS = {"CmaEsSampler": ("cmaes",), "GPSampler": ("torch", "scipy"), "QMCSampler": ("scipy",),
          "GaussianProcessSampler": ("scipy",)}
_UNMAPPABLE = {
    "qloguniform": "Optuna has no quantized log-uniform distribution (its float step cannot be combined with log)",
    "normal": "Optuna's distributions are bounded and normal is not",
    "qnormal": "Optuna's distributions are bounded and qnormal is not",
    "lognormal": "Optuna's distributions are bounded and lognormal is not",
    "qlognormal": "Optuna's distributions are bounded and qlognormal is not",
}


def _optuna(what: str) -> Any:
    try:
        import optuna
    except ImportError as e:
        raise TunerError(
            f"{what} needs Optuna: install it with pip install 'trialkeeper[optuna]'", missing="optuna"
        ) from e
    return optuna


# ---- search space ------------------------------------------------------------------------------


def _multiple(x: float, q: float) -> bool:
    return abs(round(x / q) * q - x) <= 1e-9 * max(1.0, abs(x))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nested(item: object) -> bool:
    return isinstance(item, dict) and "_name" in item


def _labels(items: list[Any]) -> list[Any] | None:
    """The categorical choices of a ``choice``: its values (a nested option by its
    ``_name``), or None when Optuna cannot hold them as they are (then: their indices)."""
    labels = [item["_name"] if _nested(item) else item for item in items]
    plain = all(v is None or isinstance(v, (bool, int, float, str)) for v in labels)
    unique = len({(type(v), v) for v in labels}) == len(labels) if plain else False
    return labels if plain and unique else None


def optuna_space_issues(space: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """(path, reason) for each parameter Optuna cannot sample exactly as NNI would."""
    issues: list[tuple[str, str]] = []
    for name, spec in space.items():
        path = f"{prefix}{name}"
        kind, value = spec["_type"], spec["_value"]
        if kind in _UNMAPPABLE:
            issues.append((path, f"{kind} cannot be given to Optuna: {_UNMAPPABLE[kind]}"))
        elif kind == "quniform" and not (_multiple(value[0], value[2]) and _multiple(value[1], value[2])):
            issues.append((path, (
                f"quniform {value} cannot be given to Optuna exactly: NNI rounds to multiples of q and clips to "
                f"[low, high], Optuna steps from low; make low and high multiples of q")))
        elif kind == "choice":
            for item in value:
                if _nested(item):
                    sub = {k: v for k, v in item.items() if k != "_name"}
                    issues += optuna_space_issues(sub, f"{path}/{item['_name']}/")
    return issues


def suggest(trial: Any, space: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Parameters in NNI's form for ``space``, sampled through ``trial`` (define-by-run)."""
    out: dict[str, Any] = {}
    for name, spec in space.items():
        key = f"{prefix}{name}"
        kind, v = spec["_type"], spec["_value"]
        if kind == "choice":
            labels = _labels(v)
            picked = trial.suggest_categorical(key, labels if labels is not None else list(range(len(v))))
            item = v[labels.index(picked)] if labels is not None else v[picked]
            if _nested(item):
                sub = {k: s for k, s in item.items() if k != "_name"}
                item = {"_name": item["_name"], **suggest(trial, sub, f"{key}/{item['_name']}/")}
            out[name] = item
        elif kind == "randint":
            out[name] = trial.suggest_int(key, v[0], v[1] - 1)
        elif kind == "uniform":
            out[name] = trial.suggest_float(key, v[0], v[1])
        elif kind == "loguniform":
            out[name] = trial.suggest_float(key, v[0], v[1], log=True)
        elif kind == "quniform":
            if all(_is_int(x) for x in v):
                out[name] = trial.suggest_int(key, v[0], v[1], step=v[2])
            else:
                out[name] = float(f"{trial.suggest_float(key, v[0], v[1], step=v[2]):.15g}")
        else:  # refused by optuna_space_issues before any trial
            raise SearchSpaceError([(key, f"{kind} cannot be given to Optuna")])
    return out


def flatten(space: dict[str, Any], params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``params`` (NNI's form) as the flat Optuna parameters ``suggest`` would have set."""
    out: dict[str, Any] = {}
    for name, spec in space.items():
        key, value = f"{prefix}{name}", params.get(name)
        if spec["_type"] != "choice":
            out[key] = value
            continue
        items, labels = spec["_value"], _labels(spec["_value"])
        label = value["_name"] if isinstance(value, dict) and "_name" in value else value
        if labels is not None:
            out[key] = label
        else:
            out[key] = next((i for i, item in enumerate(items) if item == value), 0)
        for item in items:
            if _nested(item) and item["_name"] == label and isinstance(value, dict):
                sub = {k: s for k, s in item.items() if k != "_name"}
                out.update(flatten(sub, value, f"{key}/{label}/"))
    return out


# ---- samplers and pruners ------------------------------------------------------------------------


def _make(optuna: Any, module: str, table: dict[str, str], name: object, args: object, kind: str,
          seed: int | None, error: type[TunerError]) -> Any:
    if not isinstance(name, str) or normalized(name) not in table:
        raise error(f"classArgs.{kind}: unknown Optuna {kind} {name!r}; valid: {', '.join(sorted(set(table)))}")
    if not isinstance(args, dict):
        raise error(f"classArgs.{kind}_args must be a mapping of argument -> value, got {args!r}")
    attr = table[normalized(name)]
    for package in _NEEDS.get(attr, ()):
        try:
            importlib.import_module(package)
        except ImportError:
            whose = "" if attr in _OWN_SAMPLERS else "Optuna's "
            raise error(
                f"{whose}{attr} needs the package {package!r}, which is not installed: pip install {package}",
                missing=package,
            ) from None
    own = _OWN_SAMPLERS.get(attr) if module == "samplers" else None
    cls = getattr(importlib.import_module(own, __package__) if own else getattr(optuna, module), attr)
    kwargs = dict(args)
    if seed is not None and "seed" not in kwargs and module == "samplers":
        kwargs["seed"] = seed
    taken = _arguments(cls)
    if taken is not None and (unknown := sorted(set(args) - set(taken))):
        raise error(f"classArgs.{kind}_args for {cls.__name__}: unknown {', '.join(map(repr, unknown))}; "
                    f"valid: {', '.join(taken)}")
    try:
        return cls(**kwargs)
    except ImportError as e:
        raise error(f"Optuna's {cls.__name__} needs a package that is not installed: {e}",
                    missing=e.name or "?") from e
    except (TypeError, ValueError) as e:
        raise error(f"classArgs.{kind}_args for {cls.__name__}: {' '.join(str(e).split())}") from e


def _arguments(cls: type) -> list[str] | None:
    """The keyword arguments ``cls`` takes, in its order; None when it takes any."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


_CONSTRAINTS_ATTR = "constraints"  # where a trial's constraint values are kept for the sampler


def _constraint_values(trial: Any) -> Any:
    return trial.user_attrs.get(_CONSTRAINTS_ATTR, ())


def _constraints(sampler: object) -> Any:
    """The constraints function of a sampler that takes one (TPE, NSGA-II, GP); TunerError
    naming the field otherwise."""
    taking = [name for name, cls in _SAMPLERS.items() if cls in ("TPESampler", "NSGAIISampler", "GPSampler")]
    if not isinstance(sampler, str) or normalized(sampler) not in taking:
        raise TunerError(
            f"objectives.constraints: Optuna's sampler {sampler!r} takes no constraints; give classArgs.sampler "
            "TPE, NSGA-II or GP, or leave the constraints out"
        )
    return _constraint_values


def _direction(mode: object, error: type[TunerError]) -> str:
    if mode not in ("maximize", "minimize"):
        raise error(f"classArgs.optimize_mode must be 'maximize' or 'minimize', got {mode!r}")
    return str(mode)


def create_optuna_tuner(
    args: dict[str, Any], search_space: dict[str, Any], experiment_id: str | None, objectives: Objectives | None = None
) -> OptunaTuner:
    """The Optuna tuner for ``tuner: {name: optuna, classArgs: args}``, optimizing the
    config's ``objectives`` when given."""
    allowed = {"sampler", "sampler_args", "optimize_mode", "seed", "storage", "study_name", "tell_paused"}
    unexpected = sorted(set(args) - allowed)
    if unexpected:
        raise TunerError(
            f"unexpected classArgs {', '.join(map(repr, unexpected))} for tuner 'optuna'; "
            f"accepted: {', '.join(sorted(allowed))}"
        )
    return OptunaTuner(
        search_space,
        study_name=args.get("study_name") or f"trialkeeper-{experiment_id or 'experiment'}",
        objectives=objectives,
        **{k: v for k, v in args.items() if k != "study_name"},
    )


def create_optuna_mirror(storage: str, study_name: str, search_space: dict[str, Any], optimize_mode: str,
                         *, batch: bool = False) -> OptunaTuner:
    """An Optuna study at ``storage`` kept as a copy of an experiment whatever its tuner
    (``optunaStorage``): each trial enters it with the parameters the tuner proposed."""
    if batch:
        raise TunerError(
            "optunaStorage: NNI's Batch tuner's search space has no Optuna distributions; leave optunaStorage out"
        )
    try:
        # Random: the sampler is never consulted, every trial is enqueued with its parameters.
        return OptunaTuner(
            search_space, sampler="random", optimize_mode=optimize_mode, storage=storage, study_name=study_name
        )
    except SearchSpaceError as e:
        issues = [(f"optunaStorage: {where}", why) for where, why in e.issues]
        raise SearchSpaceError(issues) from e
    except TunerError as e:
        raise TunerError(str(e).replace("classArgs.storage", "optunaStorage", 1)) from e


def create_optuna_assessor(args: dict[str, Any], tuner: Tuner | None) -> OptunaAssessor:
    """The Optuna pruner for ``assessor: {name: optuna, classArgs: args}``; it shares the
    study of an Optuna tuner, else keeps a study of its own for the intermediate results."""
    allowed = {"pruner", "pruner_args", "optimize_mode"}
    unexpected = sorted(set(args) - allowed)
    if unexpected:
        raise AssessorError(
            f"unexpected classArgs {', '.join(map(repr, unexpected))} for assessor 'optuna'; "
            f"accepted: {', '.join(sorted(allowed))}"
        )
    optuna = _optuna("assessor 'optuna'")
    pruner = _make(
        optuna,
        "pruners",
        _PRUNERS,
        args.get("pruner", "median"),
        args.get("pruner_args", {}),
        "pruner",
        None,
        AssessorError,
    )
    if isinstance(tuner, OptunaTuner) and tuner.objectives is not None and tuner.objectives.several:
        raise AssessorError(
            "assessor 'optuna': Optuna's pruners judge one objective, and the tuner's study has several "
            f"({', '.join(tuner.objectives.keys)}): leave the assessor out, or give one that ranks by objectives.rank"
        )
    if isinstance(tuner, OptunaTuner):
        tuner.study.pruner = pruner
        return OptunaAssessor(tuner.study, tuner)
    direction = _direction(args.get("optimize_mode", getattr(tuner, "optimize_mode", "maximize")), AssessorError)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Named: Hyperband's pruner puts a trial in a bracket by the study's name and the trial's
    # number, so a run is the same run again (Optuna names a study at random otherwise).
    study = optuna.create_study(study_name="trialkeeper-assessor", direction=direction, pruner=pruner)
    return OptunaAssessor(study, None)


class OptunaTuner(Tuner):
    """Proposes through an Optuna study with the sampler named in classArgs."""

    def __init__(
        self,
        search_space: dict[str, Any],
        *,
        sampler: str = "TPE",
        sampler_args: dict[str, Any] | None = None,
        optimize_mode: str = "maximize",
        seed: int | None = None,
        storage: str | None = None,
        study_name: str = "trialkeeper",
        objectives: Objectives | None = None,
        tell_paused: bool = False,
    ) -> None:
        validate_search_space(search_space)
        if not isinstance(tell_paused, bool):
            raise TunerError(f"classArgs.tell_paused must be true or false, got {tell_paused!r}")
        issues = optuna_space_issues(search_space)
        if issues:
            raise SearchSpaceError([(f"search_space.{where}", why) for where, why in issues])
        super().__init__(search_space, optimize_mode=_direction(optimize_mode, TunerError), seed=seed)
        optuna = _optuna("tuner 'optuna'")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        #: The config's objectives: the study's directions, its constraints; results heard as reported.
        self.objectives = objectives
        self.takes_reported = objectives is not None
        sampler_args = dict(sampler_args or {})
        if objectives is not None and objectives.constraints:
            sampler_args["constraints_func"] = _constraints(sampler)
        made = _make(optuna, "samplers", _SAMPLERS, sampler, sampler_args, "sampler", seed, TunerError)
        directions = {"directions": list(objectives.directions)} if objectives else {"direction": optimize_mode}
        try:
            self.study = optuna.create_study(storage=storage, study_name=study_name, sampler=made,
                                             load_if_exists=True, **directions)
        except Exception as e:  # a bad URL, an unreachable database, another study's direction
            # Any URL in the error, however the driver wrote it back, loses its password.
            shown, why = without_url_password(str(storage)), without_url_password(str(e))
            raise TunerError(f"classArgs.storage {shown!r}: cannot open the study: {type(e).__name__}: {why}") from e
        self._trials: dict[int, Any] = {}
        self._finals: dict[int, float] = {}
        #: Whether a paused trial is told PRUNED (``trial_paused``); by default it stays RUNNING until it ends.
        self.tell_paused = tell_paused
        # Paused trials told PRUNED: parameter id -> (that record's number, its intermediate values).
        self._paused: dict[int, tuple[int, dict[int, float]]] = {}

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        trial = self.study.ask()
        trial.set_user_attr(_PID_ATTR, parameter_id)
        self._trials[parameter_id] = trial
        return suggest(trial, self.search_space)

    def adopt(self, parameter_id: int, parameters: dict[str, Any]) -> None:
        """Start an Optuna trial with ``parameters`` (NNI's form) that were proposed
        elsewhere: by another tuner, or before a resume."""
        self.study.enqueue_trial(flatten(self.search_space, parameters), skip_if_exists=False)
        self.generate_parameters(parameter_id)
        trial = self._trials[parameter_id]
        for name in sorted(parameters.keys() - self.search_space.keys()):  # an advisor's TRIAL_BUDGET
            trial.set_user_attr(name, parameters[name])

    def trial(self, parameter_id: int) -> Any | None:
        """The Optuna trial of ``parameter_id`` (None once it is told)."""
        return self._trials.get(parameter_id)

    def receive_intermediate_result(self, parameter_id: int, step: int, value: Any) -> None:
        trial = self._trials.get(parameter_id)
        if self.objectives is not None:  # Optuna keeps intermediate values for one objective only
            value = None if self.objectives.several else number(value, self.objectives.keys[0])
        if trial is not None and value is not None and math.isfinite(value):
            trial.report(value, step)

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: Any) -> None:
        self._finals[parameter_id] = value

    def trial_paused(self, parameter_id: int) -> None:
        """With ``tell_paused``, tell the study what the paused trial reached, as Optuna's
        multi-fidelity does: its trial becomes PRUNED with its intermediate values, which TPE
        ranks (by the last step reached, then its value) among the trials it learns from. A
        continued trial goes on in a fresh record (``trial_continued``); the PRUNED one stays
        as what the pause showed. Without, it stays RUNNING until it ends."""
        trial = self._trials.get(parameter_id)
        seen = {} if trial is None or not self.tell_paused else dict(self._intermediates(trial))
        if not seen:  # not told, or nothing reported (several objectives): RUNNING until it ends
            return
        del self._trials[parameter_id]
        self.study.tell(trial, state=self._optuna.trial.TrialState.PRUNED)
        self._paused[parameter_id] = (trial.number, seen)

    def trial_continued(self, parameter_id: int, parameters: dict[str, Any]) -> None:
        """A trial told PRUNED at its pause goes on in a fresh record with ``parameters`` and
        the intermediate values it had, told at its end as any trial."""
        paused = self._paused.pop(parameter_id, None)
        if paused is None:
            return
        number, seen = paused
        self.adopt(parameter_id, parameters)
        trial = self._trials[parameter_id]
        trial.set_user_attr(_CONTINUES_ATTR, number)
        for step, value in sorted(seen.items()):
            trial.report(value, step)

    @staticmethod
    def _intermediates(trial: Any) -> dict[int, float]:
        return trial.storage.get_trial(trial._trial_id).intermediate_values

    def trial_end(self, parameter_id: int, success: bool) -> None:
        trial = self._trials.pop(parameter_id, None)
        value = self._finals.pop(parameter_id, None)
        self._paused.pop(parameter_id, None)  # ended while paused: its PRUNED record is its end
        if trial is None:
            return
        state = self._optuna.trial.TrialState
        if success and value is not None and self.objectives is not None:
            values = self.objectives.values(value)
            if values is None:
                log.warning("trial %d: its final result %.200r lacks a key of the objectives (%s): told FAIL",
                            parameter_id, value, ", ".join(self.objectives.keys))
                self.study.tell(trial, state=state.FAIL)
                return
            if self.objectives.constraints:
                trial.set_user_attr(_CONSTRAINTS_ATTR, self.objectives.constraint_values(value))
            self.study.tell(trial, list(values))
        elif success and value is not None:
            self.study.tell(trial, value)
        elif value is not None:  # stopped early: Optuna's PRUNED keeps its intermediate results
            self.study.tell(trial, state=state.PRUNED)
        else:
            self.study.tell(trial, state=state.FAIL)

    def resume(self, history: Sequence[PastTrial]) -> None:
        """Trials the study's storage holds are taken as they are; the others are told
        again with their parameters, intermediate results and end."""
        # A trial continued after a pause has two records; its newest is the one it goes on in.
        stored = {t.user_attrs.get(_PID_ATTR): t for t in self.study.get_trials(deepcopy=False)}
        pruned = self._optuna.trial.TrialState.PRUNED
        for t in history:
            old = stored.get(t.parameter_id)
            if old is not None and t.status is None and t.paused and old.state is pruned:
                self._paused[t.parameter_id] = (old.number, dict(old.intermediate_values))  # told at its pause
                continue
            if old is not None and (t.status is not None or not old.state.is_finished()):
                if not old.state.is_finished():
                    self._trials[t.parameter_id] = self._optuna.trial.Trial(self.study, old._trial_id)
                    self._report_missing(t)
                    self._end_or_pause(t)
                continue
            self.adopt(t.parameter_id, t.parameters)
            self._report_missing(t)
            self._end_or_pause(t)

    def _end_or_pause(self, t: PastTrial) -> None:
        if t.status is not None:
            self._end(t)
        elif t.paused:
            self.trial_paused(t.parameter_id)

    def _report_missing(self, t: PastTrial) -> None:
        trial = self._trials[t.parameter_id]
        seen = self._intermediates(trial)
        for step, value in enumerate(t.intermediate):
            if step not in seen:
                self.receive_intermediate_result(t.parameter_id, step, value)

    def _end(self, t: PastTrial) -> None:
        result = t.reported if self.objectives is not None and t.reported is not None else t.result
        if result is not None:
            self.receive_trial_result(t.parameter_id, t.parameters, result)
        self.trial_end(t.parameter_id, t.status is TrialStatus.SUCCEEDED)


class OptunaAssessor(Assessor):
    """An Optuna pruner: each intermediate result becomes ``trial.report(value, step)``
    and the pruner's ``should_prune`` decides."""

    def __init__(self, study: Any, tuner: OptunaTuner | None) -> None:
        self.study, self.tuner = study, tuner
        self._pid: dict[str, int] = {}
        self._own: dict[str, Any] = {}  # without an Optuna tuner: this assessor's own trials
        self._history: dict[str, list[float]] = {}

    def trial_started(self, trial_id: str, parameter_id: int, parameters: dict[str, Any]) -> None:
        self._pid[trial_id] = parameter_id
        if self.tuner is None:
            self._own[trial_id] = self.study.ask()

    def assess_trial(self, trial_id: str, history: Sequence[float]) -> bool:
        if self.tuner is not None:  # the tuner reported the result to the shared trial
            trial = self.tuner.trial(self._pid.get(trial_id, -1))
        else:
            trial = self._own.get(trial_id)
            if trial is not None:
                done = self._history.setdefault(trial_id, [])
                for step in range(len(done), len(history)):
                    if math.isfinite(history[step]):
                        trial.report(history[step], step)
                done[:] = history
        return trial is None or not trial.should_prune()

    def trial_end(self, trial_id: str, success: bool) -> None:
        self._pid.pop(trial_id, None)
        trial, history = self._own.pop(trial_id, None), self._history.pop(trial_id, [])
        if trial is None:
            return
        states = _optuna("assessor 'optuna'").trial.TrialState
        if success and history:
            self.study.tell(trial, history[-1])  # the pruners compare intermediate results only
        else:
            self.study.tell(trial, state=states.PRUNED if history else states.FAIL)

    def resume(self, history: Sequence[PastTrial]) -> None:
        if self.tuner is None:
            super().resume(history)
            return
        for t in history:  # the Optuna tuner restored the shared study
            if t.status is None:
                self._pid[t.trial_id] = t.parameter_id
