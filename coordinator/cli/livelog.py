"""While ``run``'s live view is on the terminal, log records and Python warnings go to the
experiment's log file (``experiment.log``) instead: a line written to the terminal would
tear the live table. ``run`` says afterwards how many there were and where."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..experimentlog import LOG_FILENAME

# Records kept until the experiment's directory is known (the first progress report).
_PENDING_MAX = 1000
# The loggers whose warnings the experiment's own log handler already writes to the file.
_FILED = ("trialkeeper", "nni")


def _filed_already(record: logging.LogRecord) -> bool:
    """Whether the experiment's own log handler (see experimentlog) takes this record."""
    top = record.name.split(".", 1)[0]
    if top not in _FILED:
        return False
    return any(
        str(getattr(h, "baseFilename", "")).endswith(LOG_FILENAME) and record.levelno >= h.level and h.filter(record)
        for h in logging.getLogger(top).handlers
    )


class LiveLog(logging.Handler):
    """A root log handler standing in for the terminal's while the live view is up."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.path: Path | None = None
        self.count = 0
        self._file: logging.FileHandler | None = None
        self._pending: list[logging.LogRecord] = []
        self._console: list[logging.Handler] = []
        self._captured = False

    def start(self) -> LiveLog:
        root = logging.getLogger()
        self._console = [
            h for h in root.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and getattr(h, "stream", None) in (sys.stderr, sys.stdout)
        ]
        for h in self._console:
            root.removeHandler(h)
        self.setLevel(min((h.level for h in self._console), default=logging.NOTSET))
        root.addHandler(self)
        logging.captureWarnings(True)  # warnings.warn(...) becomes a record of py.warnings
        self._captured = True
        return self

    def directory(self, experiment_dir: Path) -> None:
        """The experiment's directory is known: write there from now on, the records so far first."""
        if self._file is not None:
            return
        self.path = Path(experiment_dir) / LOG_FILENAME
        try:
            self._file = logging.FileHandler(self.path, encoding="utf-8", delay=True)
        except OSError:
            return
        self._file.setFormatter(self.formatter)
        pending, self._pending = self._pending, []
        for record in pending:
            self._write(record)

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if _filed_already(record):
            return
        if self._file is None:
            if len(self._pending) < _PENDING_MAX:
                self._pending.append(record)
            return
        self._write(record)

    def _write(self, record: logging.LogRecord) -> None:
        assert self._file is not None
        try:
            self._file.emit(record)
        except OSError:
            pass  # a full disk: the record is lost, as the experiment's own log loses it

    def stop(self) -> str:
        """Give the terminal its handlers back; what to say of the records written meanwhile ("" if none)."""
        root = logging.getLogger()
        root.removeHandler(self)
        for h in self._console:
            root.addHandler(h)
        if self._captured:
            logging.captureWarnings(False)
            self._captured = False
        if self._file is not None:
            self._file.close()
        if not self.count:
            return ""
        where = f"in {self.path}" if self._file is not None else "not kept (no experiment directory)"
        return f"{self.count} warning(s) or log line(s) while the live view was up: {where}"
