"""The client of a running experiment's control channel: where its socket is, and one
request sent and its answer read, with a timeout on every connect and read. What
``trialkeeper pause``, ``cancel``, ``stop``, ``update`` ... and the dashboard's actions use
to reach the coordinator that ``run`` or ``resume`` started; the server is the CLI's
(``cli/control.py``, which describes the requests).

A Unix stream socket, ``control.sock`` in the experiment directory (mode 0600: only its
owner may connect), or, when that path is too long for a Unix socket, in a 0700 directory of
the system's temporary directory named by the user and a hash of the experiment directory's
real path, which client and server compute the same way. One JSON request line per
connection, one JSON answer line back::

    {"op": "pause", "trials": ["ab12cd"]}   ->   {"ok": true, "done": ["ab12cd"]}
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SOCKET_NAME = "control.sock"
# sun_path holds 108 bytes on Linux and 104 on macOS: keep well under both.
MAX_SOCKET_PATH = 100
CONNECT_TIMEOUT_S = 5.0
REPLY_TIMEOUT_S = 30.0
MAX_LINE = 1 << 20

# Which statuses each request on trials applies to (the trial state machine's edges out of them).
APPLIES_TO: dict[str, tuple[str, ...]] = {
    "pause": ("WAITING", "RUNNING"),
    "continue": ("PAUSED",),
    "cancel": ("WAITING", "RUNNING", "PAUSED"),
}


class ControlError(RuntimeError):
    """The control channel cannot be set up or used; the message is for the user."""


class NoCoordinator(ControlError):
    """Nothing answers on the experiment's control socket: its coordinator is gone."""


# ---- where the socket is -------------------------------------------------------------------



def socket_path(experiment_dir: Path) -> Path:
    """The control socket of the experiment in ``experiment_dir``: in it when the path is
    short enough for a Unix socket, else in this user's private directory for it under the
    system's temporary directory."""
    real = os.path.realpath(experiment_dir)
    here = Path(real) / SOCKET_NAME
    if len(os.fsencode(here)) <= MAX_SOCKET_PATH:
        return here
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / f"trialkeeper-{os.getuid()}-{digest}" / SOCKET_NAME


def _private(directory: Path) -> bool:
    """Whether ``directory`` is under the experiment directory (its own rules) or a private
    directory of ours: a real directory (no link), owned by this user, mode 0700."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def _check_private(directory: Path) -> None:
    if not _private(directory):
        raise ControlError(
            f"{directory} is not a private directory of this user (a real directory, mode 0700): "
            "refusing to use a control socket in it"
        )


def _in_temp(path: Path, experiment_dir: Path) -> bool:
    return path.parent != Path(os.path.realpath(experiment_dir))


# ---- a request -----------------------------------------------------------------------------



def no_coordinator(experiment: str) -> str:
    return f"no coordinator is running for {experiment} (it ended or crashed: trialkeeper resume {experiment})"


def request(
    experiment_dir: Path, op: str, trials: Sequence[str] = (), *, timeout: float = REPLY_TIMEOUT_S,
    shown: str | None = None, fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Send one request to the experiment's coordinator and return its answer (a dict with
    ``ok``). Raises NoCoordinator when none listens, ControlError when it cannot be asked
    or does not answer in time. ``shown``: how the experiment is named in messages;
    ``fields``: the request's other fields (``limits``, ``parameters``, ``failed``)."""
    name = shown or str(experiment_dir)
    path = socket_path(experiment_dir)
    if _in_temp(path, experiment_dir) and path.parent.exists():
        _check_private(path.parent)
    body: dict[str, Any] = {**(fields or {}), "op": op}
    if op in APPLIES_TO or trials:
        body["trials"] = list(trials)
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise NoCoordinator(no_coordinator(name)) from None
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                raise NoCoordinator(no_coordinator(name)) from None
            raise ControlError(f"cannot reach the coordinator of {name} on {path}: {e.strerror or e}") from e
        sock.sendall((json.dumps(body) + "\n").encode())
        data = _read_line(sock, deadline, name)
    except TimeoutError:
        raise ControlError(f"the coordinator of {name} did not answer within {timeout:g} s") from None
    except OSError as e:
        raise ControlError(f"the coordinator of {name} went away before it answered: {e.strerror or e}") from e
    finally:
        sock.close()
    try:
        answer = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ControlError(f"the coordinator of {name} answered something that is not JSON") from None
    if not isinstance(answer, dict) or "ok" not in answer:
        raise ControlError(f"the coordinator of {name} answered something that is not an answer")
    return answer


def _read_line(sock: socket.socket, deadline: float, name: str) -> bytes:
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        part = sock.recv(65536)
        if not part:
            if not data:
                raise ControlError(f"the coordinator of {name} closed the connection without an answer")
            break
        data += part
        if len(data) > MAX_LINE:
            raise ControlError(f"the coordinator of {name} answered more than {MAX_LINE} bytes")
    return data.split(b"\n", 1)[0]


def alive(experiment_dir: Path, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the experiment's coordinator is still there: its control socket takes a
    connection (one too busy to answer a ping in time still counts as there)."""
    try:
        request(experiment_dir, "ping", timeout=timeout)
    except NoCoordinator:
        return False
    except ControlError:
        return True
    return True
