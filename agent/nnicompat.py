"""NNI's legacy trial protocol, so that trial scripts written for NNI run unchanged.

A trial's ``import nni`` picks its channel from the environment: with ``NNI_PLATFORM=local``
and ``REUSE_MODE=true`` (what NNI's own reuse-mode runner sets; nni 2.x and 3.x behave
the same with it) it reads its parameters from ``$NNI_SYS_DIR/parameter.cfg`` and prints
each result on its stdout as a line holding ``NNISDK_MEb'<json>'``. The agent writes that
file beside its own ``parameter.json`` and reads those lines back from the trial's
``stdout.log``, which it already owns; they stay there, as they do in NNI's trial logs.

This module only says what to write and what a line means; the runner does the I/O
and hands each result to the same checks and path as the trial SDK's reports.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from trialkeeper.protos.wire import PBT_LOAD, PBT_SAVE

__all__ = [
    "NniLine", "NniStdoutScanner", "PbtDirs", "nni_environment", "pbt_dirs", "without_results", "write_parameter_cfg",
]

PARAMETER_FILE = "parameter.cfg"
MARK = b"NNISDK_MEb'"
# NNI's trial side refuses to send a metric of a million characters or more.
MAX_LINE_BYTES = 1_000_000
# How much of a trial's stdout one scan reads while it runs; the rest waits for the next
# tick, so a trial that prints gigabytes cannot hold the agent's event loop.
SCAN_CHUNK_BYTES = 4 << 20
_KINDS = {"PERIODICAL": "intermediate", "FINAL": "final"}


def nni_environment(
    *, trial_id: str, sequence_id: int, experiment_id: str, sys_dir: Path, output_dir: Path, checkpoint_dir: str = ""
) -> dict[str, str]:
    """The variables a trial's ``nni`` reads. ``MULTI_PHASE`` stays unset: with it a second
    ``get_next_parameter()`` would wait forever for a file nobody writes. The checkpoint
    directory (NNI_CHECKPOINT_DIRECTORY, where NNI's PBT trials keep their state) is the
    trial's live checkpoint directory, TRIALKEEPER_CHECKPOINT_DIR."""
    extra = {"NNI_CHECKPOINT_DIRECTORY": checkpoint_dir} if checkpoint_dir else {}
    return {
        **extra,
        "NNI_PLATFORM": "local",
        "REUSE_MODE": "true",
        "NNI_EXP_ID": experiment_id,
        "NNI_TRIAL_JOB_ID": trial_id,
        "NNI_TRIAL_SEQ_ID": str(sequence_id),
        "NNI_SYS_DIR": str(sys_dir),
        "NNI_OUTPUT_DIR": str(output_dir),
    }


@dataclass(frozen=True)
class PbtDirs:
    """A trial of NNI's PBT tuner, its two paths pointed at its own checkpoint directory."""

    parameters_json: str  # as the trial reads them
    # NNI's step, the last part of its save_checkpoint_dir (0 when it is no number), at which
    # what it leaves is saved; None on another rank than 0, whose files are never saved.
    step: int | None


def pbt_dirs(parameters_json: str, checkpoint_dir: str, node_rank: int = 0) -> PbtDirs | None:
    """For a trial of NNI's PBT tuner (its parameters hold both paths): its parameters with
    ``load_checkpoint_dir`` and ``save_checkpoint_dir`` both ``checkpoint_dir``, this node's
    own checkpoint directory, never NNI's paths (names only; without an ``all_checkpoint_dir``
    relative ones, which would land in the working directory). It holds the checkpoint the trial starts
    from (the one NNI named by load_checkpoint_dir, which the coordinator sent). On rank 0
    what the trial leaves there when it exits 0 becomes its checkpoint; on the other ranks of
    a multi-node trial it is a copy of that checkpoint of their own, and what they leave
    there goes with them, unsaved, as their own saves are (rank 0's checkpoint directory is
    the trial's). None for any other trial."""
    if not checkpoint_dir or PBT_SAVE not in parameters_json:
        return None
    try:
        params = json.loads(parameters_json)
    except ValueError:
        return None
    if not isinstance(params, dict) or not all(isinstance(params.get(k), str) for k in (PBT_LOAD, PBT_SAVE)):
        return None
    step = os.path.basename(os.path.normpath(params[PBT_SAVE]))
    params[PBT_LOAD] = params[PBT_SAVE] = checkpoint_dir
    return PbtDirs(json.dumps(params), None if node_rank else int(step) if step.isdigit() else 0)


def write_parameter_cfg(sys_dir: Path, parameter_id: int, parameters_json: str) -> None:
    """Write ``parameter.cfg`` whole or not at all: a trial that finds it missing asks for
    it and polls every 3 s, but one that finds it half written would read garbage."""
    text = (
        f'{{"parameter_id": {int(parameter_id)}, "parameter_source": "algorithm", '
        f'"parameters": {parameters_json}, "parameter_index": 0}}'
    )
    target = sys_dir / PARAMETER_FILE
    temporary = sys_dir / f".{PARAMETER_FILE}.tmp"
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, target)


@dataclass(frozen=True)
class NniLine:
    """What one ``NNISDK_MEb`` line says: a result (``kind`` and ``value``), or nothing to
    do (a parameter request, already answered by ``parameter.cfg``), or a ``problem``."""

    kind: str = ""
    value: object = None
    problem: str = ""


def parse_line(line: bytes) -> NniLine:
    """Read the message of a line holding ``MARK`` anywhere in it, as NNI's own parser
    does (a trial's logging may put a prefix before it)."""
    start = line.find(MARK)
    body = line[start + len(MARK):].rstrip(b"\r\n \t")
    if not body.endswith(b"'"):
        return NniLine(problem="an NNI metric line without its closing quote")
    try:
        message = json.loads(body[:-1].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return NniLine(problem=f"an NNI metric line that is not JSON ({e})")
    if not isinstance(message, dict):
        return NniLine(problem="an NNI metric line whose message is not a JSON object")
    kind = message.get("type")
    if kind == "REQUEST_PARAMETER":
        return NniLine()
    if kind not in _KINDS:
        return NniLine(problem=f"an NNI metric of unknown type {str(kind)[:40]!r} (PERIODICAL or FINAL)")
    raw = message.get("value")
    if not isinstance(raw, str):
        return NniLine(problem="an NNI metric whose value is not a JSON string")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return NniLine(problem=f"an NNI metric whose value is not JSON ({e})")
    return NniLine(kind=_KINDS[kind], value=value)


class NniStdoutScanner:
    """Finds the ``NNISDK_MEb`` lines a trial has appended to its stdout log so far.

    Keeps its place in the file and the unfinished last line; a line longer than NNI's
    own limit is reported once and skipped to its end without being kept in memory.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._pending = b""
        self._skipping = False  # inside a line already found too long

    def scan(self, *, final: bool = False) -> list[NniLine]:
        """What the lines completed since the last scan say. With ``final`` (the trial has
        ended) everything left is read and an unfinished last line counts as complete."""
        found: list[NniLine] = []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                while True:
                    chunk = f.read(SCAN_CHUNK_BYTES)
                    if not chunk:
                        break
                    self.offset += len(chunk)
                    found += self._feed(chunk)
                    if not final:
                        break
        except FileNotFoundError:
            return found
        if final and self._pending and not self._skipping:
            found += self._lines([self._pending])
        if final:
            self._pending, self._skipping = b"", False
        return found

    def _feed(self, chunk: bytes) -> list[NniLine]:
        found: list[NniLine] = []
        if self._skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return found
            self._skipping = False
            chunk = chunk[end + 1:]
        data = self._pending + chunk
        if MARK not in data:  # the common case: no line to look at
            lines = [data[data.rfind(b"\n") + 1:]]
        else:
            lines = data.split(b"\n")
        self._pending = lines.pop()
        found += self._lines(lines)
        if len(self._pending) > MAX_LINE_BYTES:
            if MARK in self._pending:
                found.append(NniLine(problem=f"an NNI metric line longer than {MAX_LINE_BYTES} bytes"))
            self._pending, self._skipping = b"", True
        return found

    @staticmethod
    def _lines(lines: list[bytes]) -> list[NniLine]:
        found = []
        for line in lines:
            if MARK not in line:
                continue
            if len(line) > MAX_LINE_BYTES:
                found.append(NniLine(problem=f"an NNI metric line longer than {MAX_LINE_BYTES} bytes"))
            else:
                found.append(parse_line(line))
        return found


def without_results(data: bytes, *, final: bool) -> tuple[bytes, bytes]:
    """Output to show: ``data`` less its result lines (stored as metrics), and an unfinished
    last line holding ``MARK`` to hold back until it is complete (none when ``final``).
    Any other unfinished line is shown as it comes, so progress output is not delayed."""
    cut = data.rfind(b"\n") + 1
    done, rest = data[:cut], data[cut:]
    if final or MARK not in rest or len(rest) > MAX_LINE_BYTES:
        done, rest = data, b""
    if MARK in done:
        parts = done.split(b"\n")  # each but the last ended with a newline
        kept = [part + b"\n" for part in parts[:-1] if MARK not in part]
        done = b"".join(kept) + (b"" if MARK in parts[-1] else parts[-1])
    return done, rest
