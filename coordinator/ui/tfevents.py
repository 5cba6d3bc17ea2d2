"""TensorBoard event files of scalars, written without TensorFlow or TensorBoard installed.

An event file is a TFRecord file of ``Event`` protocol buffers: each record is its length
(8 bytes, little-endian), the masked CRC-32C of those 8 bytes, the data, and the masked CRC-32C
of the data. The first event names the file's version (``brain.Event:2``); each scalar is an
``Event`` with ``wall_time``, ``step`` and a ``Summary`` of one ``Value`` (``tag``,
``simple_value``). The few protocol buffer fields are encoded here by hand."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord files use it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def record(data: bytes) -> bytes:
    """One TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + _masked(length) + data + _masked(data)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int64 as protocol buffers write it
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _text(field: int, value: str) -> bytes:
    data = value.encode()
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """An ``Event`` holding one scalar."""
    summary_value = _text(1, tag) + b"\x15" + struct.pack("<f", value)
    summary = b"\x0a" + _varint(len(summary_value)) + summary_value
    return _event(wall_time, step, b"\x2a" + _varint(len(summary)) + summary)


def write_scalars(directory: Path, scalars: Iterable[tuple[str, float, int, float]]) -> Path:
    """An event file in ``directory`` of ``scalars`` ((tag, value, step, wall time) each),
    written whole under a temporary name and then renamed (a board reading meanwhile never sees
    half of it); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    path = directory / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.trialkeeper"
    partial = directory / f".writing-{os.getpid()}"  # no "tfevents" in its name: no board reads it
    with open(partial, "wb") as f:
        f.write(record(_event(now, 0, _text(3, FILE_VERSION))))
        f.writelines(record(scalar_event(tag, value, step, at)) for tag, value, step, at in scalars)
    partial.replace(path)
    return path
