"""NNI's tuners and assessors by their names (``TPE``, ``Evolution``, ``Medianstop``, ...)
and a user's own NNI classes, behind trialkeeper's Tuner and Assessor interfaces.

NNI itself builds them: ``nni.tools.package_utils.create_builtin_class_instance`` with
the classArgs as NNI takes them, after NNI's own classArgs validator has checked them.
NNI runs in the coordinator's interpreter; without it, naming one of its algorithms is an
error that says what to install.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trialkeeper.protos.wire import PBT_LOAD, PBT_SAVE

from .assessors import Assessor, AssessorError
from .space import is_batch_tuner
from .tuners import NoMoreTrials, PastTrial, TryLater, Tuner, TunerError, normalized

log = logging.getLogger(__name__)

__all__ = [
    "NNI_ASSESSOR_NAMES",
    "NNI_TUNER_NAMES",
    "NniAssessor",
    "NniTuner",
    "checkpoint_directory",
    "create_nni_assessor",
    "create_nni_tuner",
    "nni_custom_assessor",
    "nni_custom_tuner",
]

# NNI's registered names and aliases (nni 2.10 and 3.0 agree), as normalized() compares
# them, each to the name NNI registers. Kept here so that an unknown or uninstalled name
# is explained without importing NNI.
NNI_TUNER_NAMES: dict[str, str] = {
    "tpe": "TPE", "tpelegacy": "TPE_legacy", "random": "Random", "anneal": "Anneal",
    "evolution": "Evolution", "gridsearch": "GridSearch", "batch": "Batch", "batchtuner": "Batch",
    "metis": "Metis", "metistuner": "Metis", "gp": "GP", "gptuner": "GP", "pbt": "PBT", "pbttuner": "PBT",
    "smac": "SMAC", "dngo": "DNGO", "dngotuner": "DNGO", "ppo": "PPO", "ppotuner": "PPO",
    "networkmorphism": "NetworkMorphism", "regularizedevolution": "RegularizedEvolutionTuner",
    "regularizedevolutiontuner": "RegularizedEvolutionTuner",
}
NNI_ADVISOR_NAMES: dict[str, str] = {"hyperband": "Hyperband", "bohb": "BOHB"}
NNI_ASSESSOR_NAMES: dict[str, str] = {"medianstop": "Medianstop", "curvefitting": "Curvefitting"}
# What an algorithm needs beyond NNI, by NNI's name: the pip command that installs it.
_EXTRAS: dict[str, str] = {
    "Anneal": "pip install hyperopt", "TPE_legacy": "pip install hyperopt", "SMAC": "pip install 'nni[SMAC]'",
    "BOHB": "pip install 'nni[BOHB]'", "DNGO": "pip install 'nni[DNGO]'", "PPO": "pip install 'nni[PPOTuner]'",
    "NetworkMorphism": "pip install torch",
}


# NNI's PBT tuner names each trial's checkpoint by a path, <all_checkpoint_dir>/<member>/<step>:
# save_checkpoint_dir where the trial saves, load_checkpoint_dir where it loads from (what an
# earlier trial saved). Here those paths are only names: the agent points both at the trial's
# own checkpoint directory, keeps what the trial leaves there as its checkpoint, and starts it
# from the checkpoint of the trial that saved under its load_checkpoint_dir (checkpoint_from),
# so no directory is shared with the trials. all_checkpoint_dir defaults to
# $NNI_CHECKPOINT_DIRECTORY when the tuner is built (an experiment sets it, checkpoint_directory);
# without either, the names start with PBT_NAMES.
CHECKPOINT_VARIABLE = "NNI_CHECKPOINT_DIRECTORY"
PBT_NAMES = "nni-checkpoints"
_PBT_MODULE = "nni.algorithms.hpo.pbt_tuner"


def is_pbt(name: object, class_name: object = None) -> bool:
    """Whether a config's tuner is NNI's PBT, by its name or its class's path, as far as
    they tell without importing it (a subclass under another name is known once its
    class is imported, by is_pbt_class)."""
    if name == "pbt":  # in lower case, the built-in one
        return False
    if isinstance(name, str):
        return NNI_TUNER_NAMES.get(normalized(name)) == "PBT"
    return isinstance(class_name, str) and class_name.replace(":", ".").endswith(".PBTTuner")


def is_pbt_class(cls: object) -> bool:
    """Whether ``cls`` is NNI's PBTTuner or a subclass of it, under whatever name. Such a
    class was made after NNI's module of it was imported: without that module, none is."""
    base = getattr(sys.modules.get(_PBT_MODULE), "PBTTuner", None)
    return isinstance(base, type) and isinstance(cls, type) and issubclass(cls, base)


def _pbt_args(pbt: bool, class_args: dict[str, Any]) -> dict[str, Any]:
    """NNI's PBT needs all_checkpoint_dir, a name only here: its default when nothing gives one."""
    if not pbt or not isinstance(class_args, dict):
        return class_args
    if class_args.get("all_checkpoint_dir") or os.environ.get(CHECKPOINT_VARIABLE):
        return class_args
    return {**class_args, "all_checkpoint_dir": PBT_NAMES}


@contextlib.contextmanager
def checkpoint_directory(path: Path) -> Iterator[None]:
    """NNI_CHECKPOINT_DIRECTORY is ``path`` while the tuner is built, as NNI's manager sets
    it for its dispatcher: NNI's PBT tuner keeps the trials' checkpoints there by default.
    Only while: trials get their own, and several experiments may share this process."""
    before = os.environ.get(CHECKPOINT_VARIABLE)
    os.environ[CHECKPOINT_VARIABLE] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CHECKPOINT_VARIABLE, None)
        else:
            os.environ[CHECKPOINT_VARIABLE] = before


def _nni(what: str, error: type[TunerError] = TunerError) -> Any:
    try:
        import nni
        from nni.tools.package_utils import tuner_factory  # noqa: F401 - needed below
    except ImportError as e:
        raise error(
            f"{what} is one of NNI's algorithms, and NNI is not installed in the interpreter that runs "
            f"the coordinator ({sys.executable}): install it with pip install 'trialkeeper[nni]'", missing="nni"
        ) from e
    _quiet_nni()
    return nni


def _quiet_nni() -> None:
    """NNI prints its log lines to stdout from the moment it is imported, over the live
    view: take its stdout handler away and let its records flow into the logging system
    like ours (the console at the chosen --log-level, the experiment's log file)."""
    from nni.runtime import log as nni_log

    silence = getattr(nni_log, "silence_stdout", None)
    if silence is not None:
        silence()
    # NNI sets its logger to INFO; the level the user chose for the process decides instead.
    logging.getLogger("nni").setLevel(logging.NOTSET)


def _build(
    name: str, args: dict[str, Any], algo_type: str, error: type[TunerError], *, validate_only: bool = False
) -> Any:
    kind = "advisor" if name in NNI_ADVISOR_NAMES.values() else algo_type[:-1]
    nni = _nni(f"{kind} {name!r}", error)
    from nni.tools.package_utils import tuner_factory

    if not isinstance(args, dict):
        raise error(f"classArgs of {kind} {name!r} must be a mapping of name -> value")
    try:
        validator = tuner_factory.create_validator_instance(algo_type, name)
        if validator is not None:
            validator.validate_class_args(**args)
    except ModuleNotFoundError as e:
        raise error(_missing(name, kind, e), missing=e.name) from e
    except Exception as e:  # NNI's validators raise schema errors and plain ValueErrors alike
        raise error(f"invalid classArgs for {kind} {name!r}: {' '.join(str(e).split())}") from e
    if validate_only:
        return None
    try:
        return tuner_factory.create_builtin_class_instance(name, dict(args), algo_type)
    except ModuleNotFoundError as e:
        raise error(_missing(name, kind, e), missing=e.name) from e
    except (TypeError, ValueError, RuntimeError, nni.NoMoreTrialError) as e:
        raise error(f"{kind} {name!r} failed to start: {type(e).__name__}: {' '.join(str(e).split())}") from e


def _missing(name: str, kind: str, e: ModuleNotFoundError) -> str:
    how = _EXTRAS.get(name, f"pip install {e.name}")
    return f"{kind} {name!r} needs the package {e.name!r}, which is not installed: {how}"


def create_nni_tuner(name: str, class_args: dict[str, Any], search_space: dict[str, Any]) -> Tuner:
    """NNI's tuner ``name`` (a key of NNI_TUNER_NAMES, any case) with NNI's classArgs."""
    key = normalized(name)
    if key in NNI_ADVISOR_NAMES:
        return create_nni_advisor(name, class_args, search_space)
    nni_name = NNI_TUNER_NAMES[key]
    built = _build(nni_name, _pbt_args(is_pbt(name), class_args), "tuners", TunerError)
    return NniTuner(built, search_space, class_args, nni_name)


def create_nni_advisor(name: str, class_args: dict[str, Any], search_space: dict[str, Any]) -> Tuner:
    """NNI's advisor ``name`` (Hyperband or BOHB, any case): a tuner that also decides
    each trial's budget (the ``TRIAL_BUDGET`` parameter)."""
    from .nniadvisors import NniAdvisor, build_advisor

    nni_name = NNI_ADVISOR_NAMES[normalized(name)]
    _build(nni_name, class_args, "tuners", TunerError, validate_only=True)
    try:
        advisor = build_advisor(nni_name, class_args)
    except ModuleNotFoundError as e:
        raise TunerError(_missing(nni_name, "advisor", e)) from e
    except (TypeError, ValueError, RuntimeError) as e:
        raise TunerError(f"advisor {nni_name!r} failed to start: {type(e).__name__}: {' '.join(str(e).split())}") from e
    return NniAdvisor(advisor, search_space, class_args, nni_name)


def create_nni_assessor(name: str, class_args: dict[str, Any]) -> Assessor:
    """NNI's assessor ``name`` (Medianstop or Curvefitting, any case) with NNI's classArgs."""
    nni_name = NNI_ASSESSOR_NAMES[normalized(name)]
    return NniAssessor(_build(nni_name, class_args, "assessors", AssessorError))


def nni_custom_tuner(class_name: str, cls: Any, class_args: dict[str, Any], search_space: dict[str, Any]) -> Tuner:
    """A user's own NNI tuner class (``className`` + ``codeDirectory``)."""
    args = _pbt_args(is_pbt_class(cls), class_args)
    return NniTuner(_custom(class_name, cls, args, "tuner", TunerError), search_space, class_args, class_name)


def nni_custom_assessor(class_name: str, cls: Any, class_args: dict[str, Any]) -> Assessor:
    """A user's own NNI assessor class."""
    return NniAssessor(_custom(class_name, cls, class_args, "assessor", AssessorError))


def _custom(class_name: str, cls: Any, args: dict[str, Any], kind: str, error: type[TunerError]) -> Any:
    ours = f"trialkeeper.coordinator.search.{kind}s.{kind.capitalize()}"
    try:
        import nni.assessor
        import nni.tuner
    except ImportError:
        raise error(
            f"{kind} {class_name!r} is not a subclass of {ours} (and NNI, whose classes work too, is not installed)"
        ) from None
    _quiet_nni()
    base = nni.tuner.Tuner if kind == "tuner" else nni.assessor.Assessor
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise error(f"{kind} {class_name!r} is not a subclass of {ours} nor of NNI's {base.__module__}.{base.__name__}")
    if not isinstance(args, dict):
        raise error(f"classArgs of {kind} {class_name!r} must be a mapping of name -> value")
    try:
        return cls(**args)
    except Exception as e:
        raise error(f"{kind} {class_name!r} failed to start: {type(e).__name__}: {' '.join(str(e).split())}") from e


def _plain(value: Any) -> Any:
    """NNI's tuners return numpy numbers here and there; trial parameters are plain JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    item = getattr(value, "item", None)  # a numpy scalar
    return item() if callable(item) and not isinstance(value, (str, bytes)) else value


class NniTuner(Tuner):
    """An NNI tuner instance speaking trialkeeper's Tuner interface."""

    def __init__(self, tuner: Any, search_space: dict[str, Any], class_args: dict[str, Any], label: str) -> None:
        mode = class_args.get("optimize_mode", "maximize")
        self.batch_space = is_batch_tuner(label, type(tuner).__name__)
        super().__init__(search_space, optimize_mode=mode if mode in ("maximize", "minimize") else "maximize")
        self.nni_tuner, self.label = tuner, label
        self._no_more: type[BaseException] = _nni(label).NoMoreTrialError
        # Trials that ran before a resume: NNI learns their results through import_data,
        # since this instance never proposed them.
        self._adopted: set[int] = set()
        # NNI's PBT: which parameter id's trial saved under each save_checkpoint_dir, and the
        # one whose checkpoint each new trial starts from (what its load_checkpoint_dir names).
        self._pbt = is_pbt_class(type(tuner))
        self._saved_by: dict[str, int] = {}
        self._sources: dict[int, int] = {}
        try:
            tuner.update_search_space(search_space)
        except Exception as e:
            raise TunerError(
                f"tuner {label!r} refused the search space: {type(e).__name__}: {' '.join(str(e).split())}"
            ) from e

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        try:
            params = self.nni_tuner.generate_parameters(parameter_id)
        except self._no_more as e:
            if self._between_generations():
                raise TryLater(f"{self.label}: {e}") from None
            raise NoMoreTrials(f"{self.label}: {e}") from None
        if params is None:
            raise NoMoreTrials(f"{self.label} proposed nothing more")
        params = _plain(params)
        if not isinstance(params, dict):
            # NNI's Batch tuner hands out the items of its one choice as they are.
            raise TunerError(
                f"tuner {self.label!r} proposed {params!r}, which is not a mapping of parameter names to values "
                f"(with Batch, make the choice's items such mappings)"
            )
        if self._pbt:
            self._name_checkpoints(parameter_id, params)
        return params

    def _name_checkpoints(self, parameter_id: int, params: dict[str, Any]) -> None:
        load, save = params.get(PBT_LOAD), params.get(PBT_SAVE)
        source = self._saved_by.get(load) if isinstance(load, str) else None
        if source is not None and source != parameter_id:
            self._sources[parameter_id] = source
        if isinstance(save, str):
            self._saved_by[save] = parameter_id

    def _resume_names(self, history: Sequence[PastTrial]) -> None:
        """NNI's PBT goes on after its last whole step: the trials of the next one start from
        the checkpoints of the trials that ran before. NNI resumes only when each of that step's
        save_checkpoint_dir is a directory: they are made (empty, as names) where NNI's own
        directory lies (not for relative names, which only the embedding API makes)."""
        for t in history:
            save = t.parameters.get(PBT_SAVE)
            if not isinstance(save, str):
                continue
            self._saved_by[save] = t.parameter_id
            if t.status is not None and os.path.isabs(save):
                with contextlib.suppress(OSError):
                    os.makedirs(save, exist_ok=True)

    def checkpoint_from(self, parameter_id: int) -> int | None:
        """NNI's PBT: the trial that saved what this one's load_checkpoint_dir names."""
        return self._sources.pop(parameter_id, None)

    def _between_generations(self) -> bool:
        """Whether NNI's PBT said NoMoreTrialError because its generation still runs. It then
        keeps the request, to answer later through a callback of NNI's manager; here the
        request is taken back and asked again once a trial ends."""
        t = self.nni_tuner
        if not self._pbt or not getattr(t, "param_ids", None) or not getattr(t, "credit", 0):
            return False
        t.credit -= 1
        t.param_ids.pop()
        return True

    def adopt(self, parameter_id: int, parameters: dict[str, Any]) -> None:
        """A trial it did not propose (a user's own parameters): its result reaches NNI's
        tuner as imported data, not as the answer to a proposal."""
        self._adopted.add(parameter_id)

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None:
        if parameter_id in self._adopted:
            self._adopted.discard(parameter_id)
            self.nni_tuner.import_data([{"parameter": parameters, "value": value}])
            return
        self.nni_tuner.receive_trial_result(parameter_id, parameters, value)

    def trial_end(self, parameter_id: int, success: bool) -> None:
        if parameter_id not in self._adopted:
            self.nni_tuner.trial_end(parameter_id, success)

    def resume(self, history: Sequence[PastTrial]) -> None:
        import nni.tuner

        if type(self.nni_tuner).import_data is nni.tuner.Tuner.import_data:
            super().resume(history)  # it cannot import: replay instead
            return
        done = [
            {"parameter": t.parameters, "value": t.result}
            for t in history
            if t.status is not None and t.result is not None
        ]
        if self._pbt:
            self._resume_names(history)
        if done:
            self.nni_tuner.import_data(done)
        self._adopted.update(t.parameter_id for t in history if t.status is None)


class NniAssessor(Assessor):
    """An NNI assessor instance speaking trialkeeper's Assessor interface."""

    def __init__(self, assessor: Any) -> None:
        self.nni_assessor = assessor

    def assess_trial(self, trial_id: str, history: Sequence[float]) -> bool:
        verdict = self.nni_assessor.assess_trial(trial_id, list(history))
        return bool(getattr(verdict, "value", verdict))  # AssessResult.Good.value is True

    def trial_end(self, trial_id: str, success: bool) -> None:
        self.nni_assessor.trial_end(trial_id, success)
