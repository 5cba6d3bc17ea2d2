"""A plain TCP port that takes the bytes of checkpoint files straight to disk.

Checkpoints go up an agent's gRPC stream in 1 MiB pieces, which costs a Python process about
three times what the bytes cost over a bare socket. Where the coordinator does not serve over
TLS, agents send each file of an upload here instead (``Welcome.checkpoint_data_port``), with
``sendfile`` on their side and ``splice`` (elsewhere ``recv_into``) into a file on this one, and fall back to the stream
when this port cannot be reached. What a file's bytes are is still decided on the stream:
the ``CheckpointSaved`` that follows is checked against the files on disk before the core
records it, exactly as for pieces that came by the stream.

One connection per file. The agent sends a header line, JSON: ``{"token", "env", "trial",
"step", "path", "offset", "size"}``; the answer is ``ok`` (then ``size`` bytes follow and the
answer is ``done N``) or ``no REASON``. The experiment's token is compared in constant time;
the file lands in the trial's incoming checkpoint (as pieces from the stream do), never
elsewhere. On Linux the bytes go from the socket to the file by ``splice``, never through
this process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import logging
import os
import select
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from ..engine.checkpoints import path_problem

log = logging.getLogger(__name__)

HEADER_LIMIT = 8192
IO_TIMEOUT_S = 30.0
_BUFFER = 1 << 20


class BulkReceiver:
    """Listens on ``host`` (port chosen by the system) in a thread; each connection in one."""

    def __init__(
        self, token: str, incoming: Callable[[str, int], Path], allowed: Callable[[str, str], bool], max_bytes: int,
    ) -> None:
        self._token = token.encode()
        self._incoming = incoming  # (trial, step) -> the directory an upload of it fills
        self._allowed = allowed  # (environment, trial) -> whether the trial is placed there now
        self._max_bytes = max_bytes
        self._sock: socket.socket | None = None
        self._closed = False

    def start(self, host: str) -> int:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]") or "0.0.0.0", 0))
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._accept, name="checkpoint-bulk", daemon=True).start()
        return int(sock.getsockname()[1])

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="checkpoint-bulk-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                header, rest = _read_line(conn)
                target, size, why = self._check(header)
                if why:
                    conn.sendall(f"no {why}\n".encode())
                    return
                conn.sendall(b"ok\n")
                got = _receive(conn, target, size, rest)
                conn.sendall(f"done {got}\n".encode())
            except (OSError, ValueError) as e:
                log.info("a checkpoint upload on the bulk port ended early: %s", e)

    def _check(self, header: bytes) -> tuple[tuple[Path, int], int, str]:
        try:
            h = json.loads(header)
            token, env, trial, step = str(h["token"]), str(h["env"]), str(h["trial"]), int(h["step"])
            path, offset, size = str(h["path"]), int(h["offset"]), int(h["size"])
        except (ValueError, KeyError, TypeError):
            return (Path(), 0), 0, "an unreadable header"
        if not hmac.compare_digest(token.encode(), self._token):
            return (Path(), 0), 0, "wrong experiment token"
        why = path_problem(path) or path_problem(trial)
        if why or step < 0 or offset < 0 or size < 0:
            return (Path(), 0), 0, why or "a negative step, offset or size"
        if self._max_bytes and offset + size > self._max_bytes:
            return (Path(), 0), 0, f"more than maxCheckpointSize ({self._max_bytes} bytes)"
        if not self._allowed(env, trial):
            return (Path(), 0), 0, f"trial {trial} is not placed on {env}"
        return (self._incoming(trial, step) / path, offset), size, ""


def _read_line(conn: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\n" not in data:
        more = conn.recv(4096)
        if not more:
            raise ValueError("the connection closed before its header")
        data += more
        if len(data) > HEADER_LIMIT:
            raise ValueError("a header over 8 KiB")
    line, _, rest = data.partition(b"\n")
    return line, rest


def _receive(conn: socket.socket, target: tuple[Path, int], size: int, first: bytes) -> int:
    """``size`` bytes into ``target`` (file, offset); a file's bytes from offset 0 start it anew."""
    path, offset = target
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "r+b" if offset and path.exists() else "wb") as f:
        f.seek(offset)
        got = 0
        if first:
            f.write(first[:size])
            got = min(len(first), size)
        if got < size and hasattr(os, "splice"):
            f.flush()
            return got + _splice(conn, f.fileno(), size - got)
        buffer = bytearray(_BUFFER)
        view = memoryview(buffer)
        while got < size:
            n = conn.recv_into(view, min(_BUFFER, size - got))
            if n == 0:
                raise ValueError(f"the connection closed after {got} of {size} bytes")
            f.write(view[:n])
            got += n
    return got


def _splice(conn: socket.socket, fd: int, size: int) -> int:
    """``size`` bytes from ``conn`` to the file ``fd`` at its position, through a pipe in the
    kernel (Linux): the bytes are never copied into this process, which keeps the interpreter
    free for the coordinator's loop while an upload runs."""
    r, w = os.pipe()
    try:
        with contextlib.suppress(OSError):  # a larger pipe where allowed: fewer calls
            fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), _BUFFER)
        room = fcntl.fcntl(w, getattr(fcntl, "F_GETPIPE_SZ", 1032))
        got = 0
        while got < size:
            try:
                n = os.splice(conn.fileno(), w, min(room, size - got))
            except BlockingIOError:  # the socket has a timeout: it is non-blocking underneath
                if not select.select([conn], [], [], IO_TIMEOUT_S)[0]:
                    raise ValueError(f"no bytes for {IO_TIMEOUT_S:g} s after {got} of {size}") from None
                continue
            if n == 0:
                raise ValueError(f"the connection closed after {got} of {size} bytes")
            left = n
            while left:
                left -= os.splice(r, fd, left)
            got += n
        return got
    finally:
        os.close(r)
        os.close(w)
