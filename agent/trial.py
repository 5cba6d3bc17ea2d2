"""The trial SDK: what a trial script calls to get its parameters and report results.

    from trialkeeper.agent import trial

    params = trial.get_next_parameter()
    trial.report_intermediate_result(loss)
    trial.report_final_result({"default": accuracy, "loss": loss})

A value is a finite number, or a dict of numbers with a ``default`` key (the number the
tuner compares), as in NNI. Reports go to the agent as datagrams on a Unix socket whose path
the agent puts in ``TRIALKEEPER_SOCKET``; any descendant process of the trial can report too.
Sends do not wait for the coordinator: the agent acknowledges nothing to the trial.

This module imports only the standard library (and the stdlib-only metric rule of
``trialkeeper.protos.limits``) so that a trial starts in milliseconds.

Standalone mode, for running a trial script by hand: set ``TRIALKEEPER_STANDALONE=1`` and
optionally ``TRIALKEEPER_PARAMETERS='{"lr": 0.1}'``; results are then printed to stderr.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Any

from trialkeeper.protos.limits import metric_value_problem

# The agent's own variable, which its trials inherit.
from trialkeeper.protos.wire import EXPERIMENT_ENV as ENV_EXPERIMENT_ID

__all__ = [
    "TrialSdkError",
    "get_experiment_id",
    "get_next_parameter",
    "get_output_dir",
    "get_sequence_id",
    "get_trial_id",
    "report_final_result",
    "report_intermediate_result",
]

ENV_TRIAL_ID = "TRIALKEEPER_TRIAL_ID"
ENV_SEQUENCE_ID = "TRIALKEEPER_SEQUENCE_ID"
ENV_PARAMETER_FILE = "TRIALKEEPER_PARAMETER_FILE"
ENV_OUTPUT_DIR = "TRIALKEEPER_OUTPUT_DIR"
ENV_SOCKET = "TRIALKEEPER_SOCKET"
ENV_STANDALONE = "TRIALKEEPER_STANDALONE"
ENV_PARAMETERS = "TRIALKEEPER_PARAMETERS"
# A socket named "@name" in ENV_SOCKET is in Linux's abstract namespace (no file to leave
# behind); environment variables cannot hold the NUL byte that begins such a name.
ABSTRACT_PREFIX = "@"


def socket_address(name: str) -> str:
    """The address to bind or connect to for a socket named as in ``ENV_SOCKET``."""
    return "\0" + name[len(ABSTRACT_PREFIX):] if name.startswith(ABSTRACT_PREFIX) else name


class TrialSdkError(RuntimeError):
    """The SDK is used where it cannot work (outside an agent, without standalone mode)."""


def _standalone() -> bool:
    return os.environ.get(ENV_STANDALONE, "") not in ("", "0", "false", "False")


def _require_agent() -> str:
    trial_id = os.environ.get(ENV_TRIAL_ID)
    if trial_id:
        return trial_id
    raise TrialSdkError(
        f"not running under a trialkeeper agent ({ENV_TRIAL_ID} is not set). To run this "
        f"script by hand, set {ENV_STANDALONE}=1 (and optionally {ENV_PARAMETERS}='{{...}}')."
    )


def get_trial_id() -> str:
    """The id of the running trial ("STANDALONE" in standalone mode)."""
    return "STANDALONE" if _standalone() else _require_agent()


def get_sequence_id() -> int:
    """The trial's sequence number in its experiment, from 0."""
    return 0 if _standalone() else int(os.environ.get(ENV_SEQUENCE_ID, "0"))


def get_experiment_id() -> str:
    """The id of the experiment the trial belongs to."""
    return "STANDALONE" if _standalone() else os.environ.get(ENV_EXPERIMENT_ID, "")


def get_output_dir() -> str:
    """A directory for the trial's own output files (checkpoints, plots)."""
    return os.environ.get(ENV_OUTPUT_DIR) or os.getcwd()


def get_next_parameter() -> dict[str, Any]:
    """The trial's parameters, as a dict."""
    if _standalone():
        raw = os.environ.get(ENV_PARAMETERS, "")
        return dict(json.loads(raw)) if raw else {}
    _require_agent()
    path = os.environ.get(ENV_PARAMETER_FILE)
    if not path:
        raise TrialSdkError(f"{ENV_PARAMETER_FILE} is not set; the agent sets it for every trial")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise TrialSdkError(f"parameter file {path} does not hold a JSON object")
    return data


def check_metric(value: object) -> str | None:
    """Why ``value`` is not a valid metric, or None when it is. The agent and the
    coordinator apply the same rule (:func:`trialkeeper.protos.limits.metric_value_problem`)."""
    return metric_value_problem(value)


MAX_REPORT_BYTES = 60 * 1024
_encode = json.JSONEncoder(separators=(",", ":")).encode  # made once: reports can come fast


class _Channel:
    """A datagram socket per process to the agent, opened on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pid = -1

    def send(self, line: bytes) -> None:
        with self._lock:
            # A forked child must not share the parent's connection: lines would interleave.
            if self._sock is None or self._pid != os.getpid():
                self._connect()
            assert self._sock is not None
            self._sock.send(line)

    def _connect(self) -> None:
        path = os.environ.get(ENV_SOCKET)
        if not path:
            raise TrialSdkError(f"{ENV_SOCKET} is not set; the agent sets it for every trial")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # A full agent queue blocks the sender (backpressure) rather than dropping a report.
        sock.settimeout(60.0)
        sock.connect(socket_address(path))
        self._sock = sock
        self._pid = os.getpid()


_channel = _Channel()


def _say(message: str) -> None:
    """One line to stderr in one write: the agent appends its own notes to the same file, and
    with PYTHONUNBUFFERED set, print() writes the text and its newline separately, so a note
    could land between them."""
    sys.stderr.write(f"trialkeeper: {message}\n")
    sys.stderr.flush()


def _report(kind: str, value: object) -> bool:
    problem = check_metric(value)
    if problem is not None:
        _say(f"{kind} result refused: {problem}")
        return False
    if _standalone():
        _say(f"{kind} result: {json.dumps(value)}")
        return True
    trial_id = _require_agent()
    line = _encode({"trial": trial_id, "kind": kind, "value": value}).encode()
    if len(line) > MAX_REPORT_BYTES:
        _say(f"{kind} result refused: larger than {MAX_REPORT_BYTES} bytes")
        return False
    _channel.send(line)
    return True


def report_intermediate_result(value: float | dict[str, Any]) -> bool:
    """Report a result during training (one per epoch, say). False when refused."""
    return _report("intermediate", value)


def report_final_result(value: float | dict[str, Any]) -> bool:
    """Report the trial's result. False when refused (an invalid value)."""
    return _report("final", value)
