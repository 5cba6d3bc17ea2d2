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
from typing import BinaryIO

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
                # One reader for both answers: for an empty file they may come in one packet.
                with conn.makefile("rb") as answers:
                    answer = _line(answers)
                    if answer != "ok":
                        return sent, answer.removeprefix("no ")
                    with open(directory / f.path, "rb") as fh:
                        if f.size:
                            conn.sendfile(fh, 0, f.size)
                    done = _line(answers)
                if done != f"done {f.size}":
                    return sent, f"the coordinator answered {done!r} for {f.path}"
        except OSError as e:
            return sent, f"the coordinator's bulk port at {address[0]}:{address[1]}: {e}"
        sent.add(f.path)
    return sent, ""


def _line(answers: BinaryIO) -> str:
    """The coordinator's next answer line."""
    data = answers.readline(8193)
    if not data.endswith(b"\n"):
        raise ConnectionError("an overlong answer" if len(data) > 8192 else "the coordinator closed the connection")
    return data.decode(errors="replace").strip()
