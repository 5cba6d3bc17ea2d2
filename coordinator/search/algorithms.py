"""The registry of search algorithms: what a config's ``tuner``, ``assessor`` and
``advisor`` name, made into objects behind the Tuner and Assessor interfaces.

Built-in ones first (``random``, ``grid``, ``pbt``; ``median``, ``asha``), then ``optuna`` (its samplers and
pruners), then NNI's by their names and aliases; ``className`` imports a trialkeeper
class or an NNI one. NNI and Optuna are imported only when named.
"""

from __future__ import annotations

import difflib
import inspect
import sys
from typing import Any

from ..config.objectives import Objectives
from .asha import Asha
from .assessors import Assessor, AssessorError, MedianStopAssessor, construct
from .pbt import PopulationBasedTraining
from .space import SearchSpaceError, is_batch_tuner, is_discrete, validate_search_space
from .tuners import (
    BUILTIN_TUNERS,
    TUNER_ALIASES,
    Tuner,
    TunerError,
    check_class_args,
    import_class,
    normalized,
    one_line,
)

__all__ = ["BUILTIN_ASSESSORS", "create_assessor", "create_tuner"]

BUILTIN_ASSESSORS: dict[str, type[Assessor]] = {"median": MedianStopAssessor, "asha": Asha}
BUILTIN_PBT = "pbt"  # the built-in population-based training (NNI's is "PBT")


def create_tuner(
    name: str | None,
    class_name: str | None,
    class_args: dict[str, Any] | None,
    search_space: dict[str, Any],
    code_directory: str | None = None,
    *,
    experiment_id: str | None = None,
    objectives: Objectives | None = None,
) -> Tuner:
    """Create the tuner an experiment config names.

    ``name`` picks a built-in tuner (case-insensitive), ``optuna`` (Optuna's samplers), or
    one of NNI's by its name or alias (``TPE``, ``Evolution``, ...); ``class_name``, as
    ``package.module:ClassName`` or ``package.module.ClassName``, imports a Tuner subclass
    or an NNI tuner, with ``code_directory`` put on sys.path first. Exactly one must be
    given. ``class_args`` are passed as keyword arguments. ``experiment_id`` names the
    Optuna study a tuner keeps in its storage. ``objectives`` (the config's section): what
    an Optuna study optimizes (several objectives, constraints), and how a tuner that
    ranks by one number (``use_objectives``) ranks.

    Raises SearchSpaceError for an invalid space (checked first) and TunerError for
    anything else that prevents creating the tuner.
    """
    validate_search_space(search_space, batch=is_batch_tuner(name, class_name))
    if (name is None) == (class_name is None):
        which = "both" if name is not None else "neither"
        raise TunerError(
            f"a tuner needs either name (built-in: {', '.join([*BUILTIN_TUNERS, BUILTIN_PBT])}; optuna; NNI's names) "
            f"or className, got {which}"
        )
    args_in = {} if class_args is None else class_args
    if name == BUILTIN_PBT:  # in lower case: built in; PBT in any other case, or PBTTuner, is NNI's
        label, cls = name, PopulationBasedTraining
    elif name is not None:
        key = TUNER_ALIASES.get(normalized(name), normalized(name))
        if key == "optuna":
            from .optunasearch import create_optuna_tuner

            return create_optuna_tuner(args_in, search_space, experiment_id, objectives)
        if key not in BUILTIN_TUNERS:
            from .nnialgos import NNI_ADVISOR_NAMES, NNI_TUNER_NAMES, create_nni_tuner

            if key in NNI_TUNER_NAMES or key in NNI_ADVISOR_NAMES:
                return create_nni_tuner(name, args_in, search_space)
        if key == "grid" and normalized(name) != "grid":
            nni_grid = _nni_grid_search(name, args_in, search_space)
            if nni_grid is not None:
                return nni_grid
        label = _builtin_name(name)
        cls: type = BUILTIN_TUNERS[label]
    else:
        assert class_name is not None
        label, cls = class_name, import_class(class_name, code_directory, "tuner")
        if not (isinstance(cls, type) and issubclass(cls, Tuner)):
            from .nnialgos import nni_custom_tuner

            return nni_custom_tuner(class_name, cls, args_in, search_space)
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
            raise TunerError(f"tuner {class_name!r} does not implement {missing}")
    args = check_class_args(label, cls, args_in)
    try:
        tuner = cls(search_space, **args)
    except (TunerError, SearchSpaceError):
        raise
    except Exception as e:
        raise TunerError(f"tuner {label!r} failed to start: {one_line(e)}") from e
    if objectives is not None and callable(getattr(tuner, "use_objectives", None)):
        tuner.use_objectives(objectives)
    return tuner


def _nni_grid_search(
    name: str, class_args: dict[str, Any], search_space: dict[str, Any]
) -> Tuner | None:
    """NNI's name GridSearch means NNI's algorithm, which also grids continuous and unbounded
    parameters (the middle first, then ever finer): NNI's class where NNI is installed. Without
    NNI, a discrete space is searched by the built-in grid, which proposes the same points
    (None); a continuous one needs NNI."""
    import importlib.util

    from .nnialgos import create_nni_tuner

    if importlib.util.find_spec("nni") is not None:
        return create_nni_tuner("GridSearch", class_args, search_space)
    if is_discrete(search_space):
        return None
    raise TunerError(
        f"tuner {name!r} is NNI's grid search, which grids continuous parameters (uniform, normal, "
        "...) ever finer, and NNI is not installed in the interpreter that runs the coordinator "
        f"({sys.executable}): install it with pip install 'trialkeeper[nni]', or give name: grid "
        "with a discrete space (quniform, choice, randint)",
        missing="nni",
    )


def _builtin_name(name: str) -> str:
    key = normalized(name)
    key = TUNER_ALIASES.get(key, key)
    if key in BUILTIN_TUNERS:
        return key
    from .nnialgos import NNI_ADVISOR_NAMES, NNI_TUNER_NAMES

    nni_names = {**NNI_TUNER_NAMES, **NNI_ADVISOR_NAMES}
    close = difflib.get_close_matches(key, [*BUILTIN_TUNERS, *TUNER_ALIASES, "optuna", *nni_names], n=1)
    hint = f"did you mean {TUNER_ALIASES.get(close[0], close[0])!r}? " if close else ""
    raise TunerError(
        f"unknown tuner {name!r}; {hint}built-in tuners: {', '.join([*BUILTIN_TUNERS, BUILTIN_PBT])}; optuna (Optuna's "
        f"samplers); NNI's: {', '.join(sorted(set(nni_names.values())))} (or give className to load your own)"
    )


def create_assessor(
    name: str | None,
    class_name: str | None,
    class_args: dict[str, Any] | None,
    code_directory: str | None = None,
    *,
    tuner: Tuner | None = None,
) -> Assessor:
    """Create the assessor an experiment config names: a built-in (``median``), Optuna's
    pruners (``optuna``), NNI's by its name (``Medianstop``, ``Curvefitting``), or a class
    by ``className``: an Assessor subclass or an NNI assessor. ``tuner`` is the experiment's
    tuner (an Optuna pruner shares the Optuna tuner's study)."""
    args = {} if class_args is None else class_args
    if (name is None) == (class_name is None):
        raise AssessorError("an assessor needs either name or className, not " + ("both" if name else "neither"))
    if class_name is not None:
        try:
            cls = import_class(class_name, code_directory, "assessor")
        except TunerError as e:
            raise AssessorError(str(e)) from e.__cause__
        if isinstance(cls, type) and issubclass(cls, Assessor):
            return construct(class_name, cls, args)
        from .nnialgos import nni_custom_assessor

        return nni_custom_assessor(class_name, cls, args)
    assert name is not None
    key = normalized(name)
    if key in BUILTIN_ASSESSORS:
        return construct(name, BUILTIN_ASSESSORS[key], args)
    if key == "optuna":
        from .optunasearch import create_optuna_assessor

        return create_optuna_assessor(args, tuner)
    from .nnialgos import NNI_ASSESSOR_NAMES, create_nni_assessor

    if key in NNI_ASSESSOR_NAMES:
        return create_nni_assessor(name, args)
    known = [*BUILTIN_ASSESSORS, "optuna", *NNI_ASSESSOR_NAMES]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise AssessorError(
        f"unknown assessor {name!r}; {hint}valid: {', '.join(BUILTIN_ASSESSORS)} (built in), optuna "
        f"(its pruners), NNI's Medianstop and Curvefitting (or give className to load your own)"
    )
