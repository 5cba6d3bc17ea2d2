"""One owner of an experiment directory at a time.

A coordinator (``run``, ``resume``, the embedding API) and ``clean`` hold an exclusive
``flock`` on ``coordinator.lock`` in the experiment directory for as long as they work on
it. The kernel releases the lock when its holder's file is closed, which includes the
process dying however it dies: a lock left by a dead process is never seen as held, so
there is no stale lock to judge or break. The file names its holder (pid, host, command)
for the refusal a second one gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from .store import StoreError

LOCK_FILENAME = "coordinator.lock"


class DirectoryInUse(StoreError):
    """Another process owns the experiment directory."""


class ExperimentLock:
    """An exclusive hold on an experiment directory; :meth:`release` (or the process's end)
    gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, experiment_dir: Path, *, command: str | None = None) -> ExperimentLock:
        """Take the directory, or raise DirectoryInUse naming the process that has it."""
        path = Path(experiment_dir) / LOCK_FILENAME
        # Not inherited by the processes this one starts (Python's default, said again):
        # an agent that outlives its coordinator must not keep the directory taken.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise DirectoryInUse(
                f"{experiment_dir} is in use by {holder}: one coordinator at a time; "
                "stop that one first"
            ) from None
        except OSError:
            os.close(fd)
            raise
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": command or _command()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only its holder goes unnamed
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # The file stays: removing it would let a newcomer lock a new file while a third
        # process still waits on the old one.
        with contextlib.suppress(OSError):
            os.close(fd)

    def __enter__(self) -> ExperimentLock:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _command() -> str:
    argv = list(sys.argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:  # python -m trialkeeper.coordinator.cli ...
        argv[:1] = ["python", "-m", spec.name.removesuffix(".__main__")]
    elif argv and argv[0]:
        argv[0] = os.path.basename(argv[0])  # trialkeeper run ...
    return " ".join(argv)


def _read_holder(fd: int) -> dict[str, object]:
    try:
        data = os.pread(fd, 4096, 0)
        found = json.loads(data.decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _describe(owner: dict[str, object]) -> str:
    pid = owner.get("pid")
    if not isinstance(pid, int):
        # Between the holder's lock and its write of its name, or a file it could not write.
        return "another process"
    text = f"process {pid}"
    host = owner.get("host")
    if isinstance(host, str) and host and host != socket.gethostname():
        text += f" on {host}"
    command = owner.get("command")
    if isinstance(command, str) and command:
        text += f" ({command[:200]})"
    return text
