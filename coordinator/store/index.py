"""The index of this machine's experiments, wherever their directories are, so that
``trialkeeper list`` finds them all as ``nnictl experiment list`` does.

One JSON file, ``experiments.json`` in the user's trialkeeper folder (``~/.trialkeeper``, or
``$TRIALKEEPER_HOME``): an entry per experiment directory, with the experiment's id and when
it was recorded. Writers take an exclusive ``flock`` on a lock file beside it, read, change
and write a new file that replaces the old one at once (``os.replace``), so readers, which
take no lock, see the whole old index or the whole new one, and concurrent writers never
lose each other's entries. An entry whose directory no longer holds a store is dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .store import Store

log = logging.getLogger(__name__)
__all__ = [
    "INDEX_FILENAME",
    "IndexEntry",
    "default_index",
    "entries",
    "experiment_path",
    "forget_gone",
    "no_experiment",
    "record",
    "record_or_warn",
    "resolve_experiment",
]

INDEX_FILENAME = "experiments.json"
HOME_VARIABLE = "TRIALKEEPER_HOME"


@dataclass(frozen=True)
class IndexEntry:
    experiment_id: str
    directory: Path
    recorded_at: float

    def exists(self) -> bool:
        """Whether the directory still holds an experiment's store."""
        try:
            return (self.directory / Store.FILENAME).is_file()
        except OSError:
            return False


def default_index(environ: dict[str, str] | None = None) -> Path:
    """The index file: ``$TRIALKEEPER_HOME/experiments.json``, else ``~/.trialkeeper/...``."""
    env = os.environ if environ is None else environ
    home = env.get(HOME_VARIABLE) or str(Path("~/.trialkeeper").expanduser())
    return Path(home).expanduser() / INDEX_FILENAME


def _read(index: Path) -> list[IndexEntry]:
    """The entries the index holds; an unreadable or damaged index holds none."""
    try:
        data: Any = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    rows = data.get("experiments") if isinstance(data, dict) else None
    found = []
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        exp_id, directory, at = row.get("id"), row.get("directory"), row.get("recorded_at")
        if isinstance(exp_id, str) and isinstance(directory, str) and isinstance(at, (int, float)):
            found.append(IndexEntry(exp_id, Path(directory), float(at)))
    return found


def _write(index: Path, rows: list[IndexEntry]) -> None:
    data = {
        "version": 1,
        "experiments": [
            {"id": e.experiment_id, "directory": str(e.directory), "recorded_at": e.recorded_at}
            for e in rows
        ],
    }
    fd, tmp = tempfile.mkstemp(prefix=".experiments-", suffix=".tmp", dir=index.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, index)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(index: Path) -> Iterator[None]:
    index.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(
        index.with_name(index.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def record(experiment_id: str, directory: Path, index: Path | None = None) -> None:
    """Add (or refresh) the experiment in ``directory``; entries of gone ones are dropped.
    Raises OSError when the index cannot be written."""
    index = default_index() if index is None else index
    directory = Path(os.path.abspath(directory))
    with _locked(index):
        kept = [e for e in _read(index) if e.directory != directory and e.exists()]
        _write(index, [*kept, IndexEntry(experiment_id, directory, time.time())])


def record_or_warn(experiment_id: str, directory: Path, index: Path | None = None) -> None:
    """`record`, where failing to write the index only costs `list` this experiment."""
    try:
        record(experiment_id, directory, index)
    except OSError as e:
        log.warning(
            "experiment %s is not in the index of experiments (`trialkeeper list` shows it "
            "only with --dir): %s",
            experiment_id,
            e,
        )


def entries(index: Path | None = None) -> list[IndexEntry]:
    """The indexed experiments whose directories still hold one, oldest record first."""
    index = default_index() if index is None else index
    return [e for e in _read(index) if e.exists()]


def forget_gone(index: Path | None = None) -> int:
    """Drop the entries whose directories hold no experiment any more; how many went."""
    index = default_index() if index is None else index
    if not any(not e.exists() for e in _read(index)):
        return 0  # nothing to drop: no lock, no write
    with _locked(index):
        rows = _read(index)
        kept = [e for e in rows if e.exists()]
        _write(index, kept)
    return len(rows) - len(kept)


def resolve_experiment(target: str) -> Path | None:
    """The directory of an experiment named by its directory, or by its id: under the
    default working directory, or anywhere the index of this machine's experiments knows."""
    from ..config.experiment import _default_working_directory
    from .reads import holds_experiment

    for candidate in (Path(target).expanduser(), _default_working_directory() / target):
        if holds_experiment(candidate):
            return candidate.resolve()
    known = [e for e in entries() if e.experiment_id == target]
    if known:
        return max(known, key=lambda e: e.recorded_at).directory.resolve()
    return None


def no_experiment(target: object) -> str:
    """What a command says of an experiment it cannot find."""
    return (f"no experiment {str(target)!r}: neither a directory holding one nor a known experiment id "
            "(`trialkeeper list` shows them)")


def experiment_path(target: str) -> Path:
    """An experiment named by its directory or its id, as the commands take it (an argparse
    type); a path that holds none stays as given, for the command to say so."""
    from .reads import holds_experiment

    given = Path(target)
    if holds_experiment(given):
        return given
    return resolve_experiment(target) or given
