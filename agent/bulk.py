"""Sending an upload's files to the coordinator's bulk port (``Welcome.checkpoint_data_port``,
see the coordinator's ``transport/bulk.py``): one connection per file, a JSON header line
with the experiment's token, then the file's bytes by ``sendfile``. Blocking: the keeper calls
it in a thread. What could not go this way goes up the stream as pieces instead."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Sequence
from pathlib import Path

from .checkpoint_files import FileEntry

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
IO_TIMEOUT_S = 30.0


def send_files(
    address: tuple[str, int], token: str, env_id: str, trial_id: str, step: int, directory: Path,
    files: Sequence[FileEntry],
) -> tuple[set[str], str]:
    """The paths of ``files`` the coordinator took, and why it stopped there ("" when it took
    them all). Stops at the first that fails: the rest go by the stream."""
    sent: set[str] = set()
    for f in files:
        try:
            with socket.create_connection(address, timeout=CONNECT_TIMEOUT_S) as conn:
                conn.settimeout(IO_TIMEOUT_S)
                header = {"token": token, "env": env_id, "trial": trial_id, "step": step, "path": f.path,
                          "offset": 0, "size": f.size}
                conn.sendall(json.dumps(header).encode() + b"\n")
                answer = _line(conn)
                if answer != "ok":
                    return sent, answer.removeprefix("no ")
                with open(directory / f.path, "rb") as fh:
                    if f.size:
                        conn.sendfile(fh, 0, f.size)
                done = _line(conn)
                if done != f"done {f.size}":
                    return sent, f"the coordinator answered {done!r} for {f.path}"
        except OSError as e:
            return sent, f"the coordinator's bulk port at {address[0]}:{address[1]}: {e}"
        sent.add(f.path)
    return sent, ""


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        more = conn.recv(1024)
        if not more:
            raise ConnectionError("the coordinator closed the connection")
        data += more
        if len(data) > 8192:
            raise ConnectionError("an overlong answer")
    return data.decode(errors="replace").strip()
