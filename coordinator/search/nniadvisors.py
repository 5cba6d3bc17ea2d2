"""NNI's advisors (Hyperband, BOHB) as tuners.

An advisor is an NNI message dispatcher: instead of answering calls it sends commands
(``NewTrialJob``, ``NoMoreTrialJobs``) and decides how long each trial runs through the
``TRIAL_BUDGET`` parameter it adds; a trial it promotes to a larger budget is a new trial
with the same parameters. Here its commands are captured as they are sent and turned into
proposals; the experiment's events are handed to it as NNI's manager would.

Its parameter ids are strings (``"0-4_0_3"``, bracket, round, number) where NNI's manager
keeps integers (microsoft/nni#5263): trialkeeper keeps its own integer ids and maps them,
and the recovery check that compares the two kinds is answered here, since an advisor
here is never recovered by NNI.

A configuration keeps its bracket and number from round to round (NNI's brackets build the
promoted id from the old one's last part, with the same parameters and a larger
``TRIAL_BUDGET``): so a promoted trial is known, and it starts from the checkpoint of the
trial that ran the configuration in the round before, going on from the step it saved
instead of training again the epochs it already trained (``Tuner.checkpoint_from``).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from .tuners import PastTrial, TryLater, Tuner, TunerError

log = logging.getLogger(__name__)

__all__ = ["NniAdvisor", "configuration_key"]

_BUDGET = "TRIAL_BUDGET"

# NNI's own switch for a dispatcher without a manager to talk to (its unit tests use it).
_NO_CHANNEL = "ws://_unittest_trialkeeper"


def build_advisor(name: str, class_args: dict[str, Any]) -> Any:
    """NNI's advisor ``name``, made without a connection to an NNI manager."""
    import nni.runtime.msg_dispatcher_base as base
    from nni.tools.package_utils import tuner_factory

    saved = base.dispatcher_env_vars
    base.dispatcher_env_vars = saved._replace(NNI_TUNER_COMMAND_CHANNEL=_NO_CHANNEL)
    try:
        return tuner_factory.create_builtin_class_instance(name, dict(class_args), "tuners")
    finally:
        base.dispatcher_env_vars = saved


class NniAdvisor(Tuner):
    """An NNI advisor instance speaking trialkeeper's Tuner interface."""

    budget_parameter = _BUDGET

    def __init__(self, advisor: Any, search_space: dict[str, Any], class_args: dict[str, Any], label: str) -> None:
        mode = class_args.get("optimize_mode", "maximize")
        super().__init__(search_space, optimize_mode=mode if mode in ("maximize", "minimize") else "maximize")
        from nni.runtime.tuner_command_channel import CommandType

        self.advisor, self.label, self._commands = advisor, label, CommandType
        self._jobs: deque[dict[str, Any]] = deque()
        self._waiting = False  # it said NoMoreTrialJobs; ask again once something changed
        self._ids: dict[int, str] = {}  # trialkeeper's parameter id -> the advisor's
        self._params: dict[int, dict[str, Any]] = {}
        # A configuration (bracket, number) -> the last trialkeeper parameter id that ran it,
        # and its parameters without the budget.
        self._ran: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}
        self._sources: dict[int, int] = {}  # a promoted trial's parameter id -> its previous round's
        self._promotions_only = False  # maxTrialNumber configurations ran: no new bracket
        advisor.send = self._sent
        advisor.is_created_in_previous_exp = lambda _parameter_id: False
        try:
            advisor.handle_initialize(search_space)
        except Exception as e:
            raise TunerError(
                f"advisor {label!r} refused the search space: {type(e).__name__}: {' '.join(str(e).split())}"
            ) from e

    def _sent(self, command: Any, data: str) -> None:
        if command is self._commands.NewTrialJob:
            self._jobs.append(json.loads(data))
        elif command is self._commands.NoMoreTrialJobs:
            self._waiting = True

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        # With no more configurations to start, only promotions NNI holds ready are asked for:
        # asked for more, it would start a new bracket.
        if self._promotions_only and not self._drop_new():
            self._waiting = True  # nothing but promotions to come, and none is ready
        if not self._jobs and not self._waiting:
            self.advisor.handle_request_trial_jobs(1)
        if self._promotions_only:
            self._drop_new()
        if not self._jobs:
            self._waiting = True
            raise TryLater(f"{self.label} waits for running trials before it proposes more")
        job = self._jobs.popleft()
        sid = str(job["parameter_id"])
        self._ids[parameter_id] = sid
        params = dict(job["parameters"])
        self._params[parameter_id] = params
        key = configuration_key(sid)
        if key is not None:
            config = {k: v for k, v in params.items() if k != _BUDGET}
            before = self._ran.get(key)
            # The same configuration, checked by its content too: only then is the checkpoint its own.
            if before is not None and before[1] == config:
                self._sources[parameter_id] = before[0]
                log.info("advisor %s promotes configuration %s to budget %s: trial %d goes on from trial %d",
                         self.label, sid, params.get(_BUDGET), parameter_id, before[0])
            self._ran[key] = (parameter_id, config)
        return params

    def checkpoint_from(self, parameter_id: int) -> int | None:
        return self._sources.get(parameter_id)

    def configuration_of(self, parameter_id: int) -> int | None:
        return self._sources.get(parameter_id)

    def only_promotions(self) -> bool:
        """No new configuration from now on: those NNI drew and nobody ran yet are dropped,
        each bracket shrunk to those that ran (an incomplete bracket: its rounds promote the
        best 1/eta of those), and promotions go on."""
        self._promotions_only = True
        if self._drop_new() is None:
            log.warning("advisor %s: its pending configurations cannot be read; it proposes nothing more", self.label)
            return False
        return True

    def _drop_new(self) -> list[Any] | None:
        """Drop the new configurations (first rounds) NNI holds ready or sent; what it holds
        ready then (promotions only), None where that cannot be read."""
        ready = self._ready()
        if ready is None:
            return None
        dropped: dict[str, int] = {}
        for sid in [str(j["parameter_id"]) for j in self._jobs] + [str(c[0]) for c in ready]:
            if _first_round(sid):
                bracket_id = sid.split("_")[0]
                dropped[bracket_id] = dropped.get(bracket_id, 0) + 1
        self._jobs = deque(j for j in self._jobs if not _first_round(str(j["parameter_id"])))
        ready[:] = [c for c in ready if not _first_round(str(c[0]))]
        brackets = getattr(self.advisor, "brackets", {})
        for bracket_id, n in dropped.items():
            bracket = brackets.get(bracket_id, brackets.get(int(bracket_id)) if bracket_id.isdigit() else None)
            if bracket is not None and bracket.num_configs_to_run:
                bracket.num_configs_to_run[0] -= n
                bracket.n -= n
                log.info("advisor %s: maxTrialNumber reached, bracket %s goes on with the %d configurations that ran",
                         self.label, bracket_id, bracket.n)
        return ready

    def _ready(self) -> list[Any] | None:
        """The configurations NNI holds ready to propose (promotions, and what it drew for its
        current bracket), or None where its advisor keeps them otherwise."""
        ready = getattr(self.advisor, "generated_hyper_configs", None)
        return ready if isinstance(ready, list) else None

    def _report(self, parameter_id: int, kind: str, step: int, value: float) -> None:
        sid = self._ids.get(parameter_id)
        if sid is not None:
            self.advisor.handle_report_metric_data({
                "parameter_id": sid, "trial_job_id": f"p{parameter_id}", "type": kind,
                "value": json.dumps(value), "sequence": step,
            })

    def receive_intermediate_result(self, parameter_id: int, step: int, value: float) -> None:
        self._report(parameter_id, "PERIODICAL", step, value)

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None:
        self._report(parameter_id, "FINAL", 0, value)

    def trial_end(self, parameter_id: int, success: bool) -> None:
        sid = self._ids.pop(parameter_id, None)
        params = self._params.pop(parameter_id, {})
        if sid is None:
            return
        self._waiting = False  # a round may be complete: the advisor may have more now
        self.advisor.handle_trial_end({
            "trial_job_id": f"p{parameter_id}", "event": "SUCCEEDED" if success else "FAILED",
            "hyper_params": json.dumps({"parameter_id": sid, "parameters": params}),
        })

    def resume(self, history: Sequence[PastTrial]) -> None:
        """An advisor's brackets cannot be rebuilt from stored results (it drew their
        configurations at random and promotes by rank within each): after a resume it
        starts new brackets, and the stored trials stay as they are."""
        if history:
            log.warning("advisor %s starts new brackets after the resume; %d stored trials are kept but not told to it",
                        self.label, len(history))


def _first_round(parameter_id: str) -> bool:
    """Whether an advisor's ``"<bracket>_<round>_<number>"`` is a configuration's first round."""
    parts = parameter_id.split("_")
    return len(parts) == 3 and parts[1] == "0" and parts[0] != "-1"


def configuration_key(parameter_id: str) -> tuple[str, str] | None:
    """What identifies a configuration of an NNI advisor across its rounds: the bracket and
    the number of ``"<bracket>_<round>_<number>"``, None for an id of another form."""
    parts = parameter_id.split("_")
    if len(parts) != 3 or not all(parts):
        return None
    return parts[0], parts[2]
