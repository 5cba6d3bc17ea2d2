"""An experiment's own log file (``experiment.log`` in its directory), scoped to it.

Several experiments may run embedded in one process, so the file must not take every
record of the shared ``trialkeeper`` logger: a context variable names the experiment a
piece of code works for (asyncio tasks and ``asyncio.to_thread`` inherit it), and each
file keeps the records made under its own experiment. A record made outside any
experiment's context (a thread pool that does not carry the context) goes to the file only
while a single experiment is open, where it cannot belong to another one.

NNI's algorithms log under the ``nni`` logger; their warnings and errors join the file too.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from pathlib import Path

#: The file's name in the experiment directory: warnings and errors, tracebacks included.
LOG_FILENAME = "experiment.log"
# The loggers whose records an experiment's file takes.
_SOURCES = ("trialkeeper", "nni")

current_experiment: contextvars.ContextVar[str | None] = contextvars.ContextVar("trialkeeper_experiment", default=None)
_open: set[str] = set()


class _ThisExperiment(logging.Filter):
    def __init__(self, experiment_id: str) -> None:
        super().__init__()
        self.experiment_id = experiment_id

    def filter(self, record: logging.LogRecord) -> bool:
        owner = current_experiment.get()
        if owner is None:
            return _open == {self.experiment_id}
        return owner == self.experiment_id


def enter(experiment_id: str) -> contextvars.Token[str | None]:
    """Mark the calling task (and the tasks it starts) as working for ``experiment_id``."""
    return current_experiment.set(experiment_id)


def leave(token: contextvars.Token[str | None]) -> None:
    current_experiment.reset(token)


class _QuietFileHandler(logging.FileHandler):
    """A file handler that stays quiet when its file cannot be written (a full disk): the
    records it loses are on the console too, and Python's ``--- Logging error ---`` report
    with its traceback for every record would bury the one line that says what happened."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            super().flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            super().close()


def open_log(experiment_id: str, experiment_dir: Path) -> logging.Handler:
    """Start writing the experiment's warnings and errors to its ``experiment.log``."""
    handler = _QuietFileHandler(experiment_dir / LOG_FILENAME, encoding="utf-8")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ThisExperiment(experiment_id))
    _open.add(experiment_id)
    for name in _SOURCES:
        logging.getLogger(name).addHandler(handler)
    return handler


def close_log(experiment_id: str, handler: logging.Handler) -> None:
    for name in _SOURCES:
        logging.getLogger(name).removeHandler(handler)
    _open.discard(experiment_id)
    handler.close()
