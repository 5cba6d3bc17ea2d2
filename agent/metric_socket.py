"""The Unix datagram socket on which an agent's trials report their metrics.

It is a file in the agent's work dir, ``0600``. Where that path is too long for a Unix
socket (about 107 bytes), it is a name in Linux's abstract namespace instead, which the
kernel removes with the agent however it ends, ``kill -9`` included; as such a name has no
file mode, each datagram carries its sender's credentials and only the agent's own user is
heard.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import sys
import uuid
from pathlib import Path

from . import trial as sdk

log = logging.getLogger(__name__)

MAX_DATAGRAM = 64 * 1024
# struct ucred (pid, uid, gid), which SO_PASSCRED attaches to each datagram.
_UCRED = struct.Struct("iII")
_CREDENTIALS_SPACE = socket.CMSG_SPACE(_UCRED.size)


def socket_name(workdir: Path, environment_id: str) -> str:
    """The name (``TRIALKEEPER_SOCKET``) of an agent's socket: a path, or ``@name``."""
    # Several agents may share a work dir (local environments do): one socket each.
    path = workdir / "sockets" / f"{environment_id}.sock"
    if len(str(path)) < 100:
        return str(path)
    if sys.platform.startswith("linux"):
        return f"{sdk.ABSTRACT_PREFIX}trialkeeper-{os.getuid()}-{uuid.uuid4().hex}"
    # Elsewhere a file it must be: named after the agent's work dir and environment, so the
    # agent that takes its place removes it before binding its own.
    digest = hashlib.sha256(f"{workdir.resolve()}\0{environment_id}".encode()).hexdigest()[:24]
    base = Path(os.environ.get("TMPDIR") or "/tmp")
    return str(base / f"trialkeeper-{os.getuid()}-{digest}.sock")


class MetricSocket:
    """The bound, non-blocking socket; ``receive`` gives what the agent's user sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.abstract = name.startswith(sdk.ABSTRACT_PREFIX)
        self._refused = 0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if self.abstract:
            sock.bind(sdk.socket_address(name))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        else:
            path = Path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            sock.bind(name)
            os.chmod(path, 0o600)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 1024 * 1024)
        sock.setblocking(False)
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> bytes | None:
        """The next datagram, None when none is waiting. Raises OSError."""
        while True:
            try:
                if not self.abstract:
                    return self.sock.recv(MAX_DATAGRAM)
                data, ancillary, _, _ = self.sock.recvmsg(MAX_DATAGRAM, _CREDENTIALS_SPACE)
            except (BlockingIOError, InterruptedError):
                return None
            uid = _sender_uid(ancillary)
            if uid == os.getuid():
                return data
            self._refused += 1
            if self._refused <= 10 or self._refused % 1000 == 0:
                log.warning("a metric datagram from uid %s was refused (%d so far)", uid, self._refused)

    def close(self) -> None:
        self.sock.close()
        if not self.abstract:
            with contextlib.suppress(FileNotFoundError):
                Path(self.name).unlink()


def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == getattr(socket, "SCM_CREDENTIALS", -1) and len(data) >= _UCRED.size:
            return int(_UCRED.unpack_from(data)[1])
    return None
