"""A synchronous face for :class:`~trialkeeper.coordinator.core.Coordinator`.

For tuning tools that are not written with asyncio: the coordinator runs on an event loop
in a background thread and every method here blocks until its coroutine has finished.
Callbacks registered with :meth:`SyncCoordinator.on_metric`, :meth:`SyncCoordinator.on_status`
and :meth:`SyncCoordinator.on_checkpoint` run on that background thread; keep them short.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from .config.experiment import ExperimentConfig
from .core import Coordinator, CoordinatorError
from .engine.events import CheckpointSaved
from .engine.model import MetricEvent, StatusEvent, TrialInfo
from .read.model import CheckpointInfo, EnvSnapshot

T = TypeVar("T")

_START_TIMEOUT_S = 120.0


class SyncTrialHandle:
    """A submitted trial, as seen from synchronous code."""

    def __init__(self, owner: SyncCoordinator, trial_id: str) -> None:
        self._owner = owner
        self.id = trial_id

    @property
    def info(self) -> TrialInfo:
        return self._owner.trial(self.id)

    def wait(self, timeout: float | None = None) -> TrialInfo:
        return self._owner.wait(self.id, timeout)

    def cancel(self) -> None:
        self._owner.cancel(self.id)

    def __repr__(self) -> str:
        return f"SyncTrialHandle({self.id!r}, {self.info.status.value})"


class SyncCoordinator:
    """Blocking wrapper: ``with SyncCoordinator(config) as c: c.submit({...}).wait()``."""

    def __init__(self, config: ExperimentConfig, *, experiment_dir: Path | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trialkeeper-coordinator", daemon=True)
        self._thread.start()
        try:
            self._coordinator: Coordinator = self._call(_build(config, experiment_dir, kwargs))
        except BaseException:
            self._end_loop()
            raise

    @property
    def coordinator(self) -> Coordinator:
        """The asyncio coordinator underneath (use only from its own loop)."""
        return self._coordinator

    @property
    def experiment_dir(self) -> Path:
        return self._coordinator.experiment_dir

    @property
    def address(self) -> str:
        return self._coordinator.address

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if not self._thread.is_alive() or self._loop.is_closed():
            coro.close()  # never scheduled: close it so that it is not reported as never awaited
            raise CoordinatorError("the coordinator is not running")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        if not self._thread.is_alive():
            # Stopped: nothing changes the state any more, so it is safe to read it here;
            # results stay readable after the ``with`` block.
            return fn()

        async def run() -> T:
            return fn()

        return self._call(run(), _START_TIMEOUT_S)

    def _end_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def start(self) -> SyncCoordinator:
        """Start the coordinator; if that fails, the background loop is ended too."""
        try:
            self._call(self._coordinator.start(), _START_TIMEOUT_S)
        except BaseException:
            self._end_loop()
            raise
        return self

    def stop(self) -> None:
        """Stop trials and environments, close the store, and end the background loop."""
        if not self._thread.is_alive():
            return
        try:
            self._call(self._coordinator.stop())
        finally:
            self._end_loop()

    def __enter__(self) -> SyncCoordinator:  # noqa: PYI034 - Self needs Python 3.11
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def submit(self, parameters: dict[str, Any], **kwargs: Any) -> SyncTrialHandle:
        handle = self._call(self._coordinator.submit(parameters, **kwargs), _START_TIMEOUT_S)
        return SyncTrialHandle(self, handle.id)

    def cancel(self, trial_id: str, **kwargs: Any) -> None:
        self._call(self._coordinator.cancel(trial_id, **kwargs), _START_TIMEOUT_S)

    def early_stop(self, trial_id: str, reason: str = "stopped early by the assessor") -> None:
        self._call(self._coordinator.early_stop(trial_id, reason), _START_TIMEOUT_S)

    def pause(self, trial_id: str, **kwargs: Any) -> None:
        self._call(self._coordinator.pause(trial_id, **kwargs), _START_TIMEOUT_S)

    def resume_trial(self, trial_id: str, **kwargs: Any) -> None:
        self._call(self._coordinator.resume_trial(trial_id, **kwargs), _START_TIMEOUT_S)

    def update(self, **limits: Any) -> None:
        """Change trial_concurrency, max_trial_number or max_experiment_duration while it runs."""
        self._call(self._coordinator.update(**limits), _START_TIMEOUT_S)

    def checkpoints(self, trial_id: str) -> list[CheckpointInfo]:
        return self._on_loop(lambda: self._coordinator.checkpoints(trial_id))

    def wait(self, trial_id: str, timeout: float | None = None) -> TrialInfo:
        return self._call(self._coordinator.wait(trial_id, timeout))

    def wait_all(self, timeout: float | None = None) -> list[TrialInfo]:
        return self._call(self._coordinator.wait_all(timeout))

    def trial(self, trial_id: str) -> TrialInfo:
        return self._on_loop(lambda: self._coordinator.trial(trial_id))

    def trials(self) -> list[TrialInfo]:
        return self._on_loop(self._coordinator.trials)

    def environments(self) -> list[EnvSnapshot]:
        return self._on_loop(self._coordinator.environments)

    def on_metric(self, callback: Callable[[MetricEvent], Any]) -> None:
        self._on_loop(lambda: self._coordinator.on_metric(callback))

    def on_status(self, callback: Callable[[StatusEvent], Any]) -> None:
        self._on_loop(lambda: self._coordinator.on_status(callback))

    def on_checkpoint(self, callback: Callable[[CheckpointSaved], Any]) -> None:
        """Call ``callback(event)`` for every checkpoint a trial saves, once it is recorded."""
        self._on_loop(lambda: self._coordinator.on_checkpoint(callback))


async def _build(config: ExperimentConfig, experiment_dir: Path | None, kwargs: dict[str, Any]) -> Coordinator:
    # Built on the loop's thread so that its asyncio primitives belong to that loop.
    return Coordinator(config, experiment_dir=experiment_dir, **kwargs)
