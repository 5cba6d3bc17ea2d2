"""How the control socket reaches a running experiment loop (``experiment.py``): the limits
``trialkeeper update`` changes, and the trials ``submit`` and ``rerun`` ask for, which the loop
submits as any of its own (the next parameter id) and tells the tuner of as NNI tells its
tuners of customized trials."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .search import Instruction, Search
from .search import TrialSubmitted as SearchTrialSubmitted

if TYPE_CHECKING:
    from .. import Coordinator
    from ..config.experiment import ExperimentConfig

log = logging.getLogger(__name__)


@dataclass
class Limits:
    """The limits the experiment loop keeps to: the config's, until ``trialkeeper update``
    changes them while it runs."""

    trial_concurrency: int
    max_trial_number: int | None
    max_experiment_duration: float | None
    max_trial_resource: float | None = None  # not changed while it runs

    @classmethod
    def of(cls, config: ExperimentConfig) -> Limits:
        return cls(
            config.trial_concurrency, config.max_trial_number, config.max_experiment_duration,
            config.max_trial_resource,
        )


class SteeringError(RuntimeError):
    """What the control socket asked cannot be done; the message is for the user."""


class Steering:
    """How the control socket reaches a running experiment loop (``cli/control.py``): new
    limits, and trials of the user's own parameters, which the loop submits and tells the
    tuner of as NNI's customized trials."""

    def __init__(self) -> None:
        self.limits: Limits | None = None  # set while the loop runs
        self.submitted = 0  # trials the loop has submitted (the next parameter id)
        self._coordinator: Coordinator | None = None
        self._wake: Callable[[], None] = lambda: None
        self._asked: list[tuple[dict[str, Any], str, asyncio.Future[str]]] = []

    @property
    def running(self) -> bool:
        return self._coordinator is not None and self.limits is not None

    def attach(self, coordinator: Coordinator, limits: Limits, wake: Callable[[], None]) -> None:
        self._coordinator, self.limits, self._wake = coordinator, limits, wake

    def detach(self, why: str) -> None:
        self._coordinator = None
        for _, _, answer in self.take():
            if not answer.done():
                answer.set_exception(SteeringError(why))

    async def update(self, **changes: Any) -> Limits:
        """Apply new limits (by the config's field names, checked by the caller)."""
        if not self.running:
            raise SteeringError("the experiment is ending")
        assert self._coordinator is not None and self.limits is not None
        await self._coordinator.update(**changes)
        for name, value in changes.items():
            setattr(self.limits, name, value)
        self._wake()
        return self.limits

    async def submit(self, parameters: dict[str, Any], why: str) -> str:
        """Have the loop submit a trial of these parameters; its id, once submitted."""
        if not self.running:
            raise SteeringError("the experiment is ending")
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._asked.append((dict(parameters), why, answer))
        self._wake()
        return await answer

    def take(self) -> list[tuple[dict[str, Any], str, asyncio.Future[str]]]:
        asked, self._asked = self._asked, []
        return asked


async def submit_customized(
    coordinator: Coordinator, search: Search, steering: Steering, limits: Limits, submitted: int,
    to_do: list[Instruction],
) -> int:
    """Submit the trials the user asked for (``trialkeeper submit`` and ``rerun``), each
    answered with its id or why not; returns how many trials are submitted now. The tuner
    hears each one's result as NNI's customized trials are heard: an NNI tuner learns it
    as imported data (``import_data``), Optuna's study takes the trial as its own."""
    for params, why, answer in steering.take():
        if answer.done():
            continue  # the one who asked gave up waiting
        if limits.max_trial_number is not None and search.configurations >= limits.max_trial_number:
            answer.set_exception(SteeringError(
                f"maxTrialNumber ({limits.max_trial_number}) is reached: raise it first "
                f"(trialkeeper update EXP --max-trials {search.configurations + 1})"
            ))
            continue
        try:
            handle = await coordinator.submit(params)
        except (TypeError, ValueError) as e:
            answer.set_exception(SteeringError(f"cannot submit parameters {params}: {e}"))
            continue
        log.info("trial %s: %s, parameters %.200s", handle.id, why, params)
        adopt_customized(search, submitted, params)
        to_do.extend(search.handle(SearchTrialSubmitted(handle.id, submitted, params)))
        submitted += 1
        answer.set_result(handle.id)
    steering.submitted = submitted
    return submitted


def adopt_customized(search: Search, parameter_id: int, params: dict[str, Any]) -> None:
    """Make a tuner that did not propose ``params`` ready to hear their result."""
    tuner = search.tuner
    try:
        adopt = getattr(tuner, "adopt", None)
        if callable(adopt):  # Optuna: a trial of the study; NNI's tuners: its result as imported data
            adopt(parameter_id, params)
    except Exception:  # the trial runs all the same; the tuner does not learn from it
        log.exception("the tuner could not take customized parameters %.200s", params)
