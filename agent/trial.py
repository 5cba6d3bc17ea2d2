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

Checkpoints: a trial writes its whole state into ``get_checkpoint_dir()`` (the variable
``TRIALKEEPER_CHECKPOINT_DIR``), then calls ``save_checkpoint(step)``. The files are moved
into the checkpoint at once, whole, and the directory is empty again; the call returns once
the coordinator has recorded the checkpoint, or raises ``CheckpointError`` with the reason it
was refused (its files are then back in the directory when they could be put back). When the
coordinator asked the trial to pause, ``save_checkpoint`` ends the process with status 0
after the save instead of returning. A trial continued from a checkpoint finds its files in
the directory when it starts, and ``checkpoint_step()`` says its step (None on a fresh start)::

    ckpt = Path(trial.get_checkpoint_dir())
    start = 0 if trial.checkpoint_step() is None else load(ckpt / "state.pt") + 1
    for epoch in range(start, epochs):
        ...
        save(ckpt / "state.pt", epoch)
        trial.save_checkpoint(epoch)

Standalone mode, for running a trial script by hand: set ``TRIALKEEPER_STANDALONE=1`` and
optionally ``TRIALKEEPER_PARAMETERS='{"lr": 0.1}'``; results are then printed to stderr,
the checkpoint directory is ``./checkpoint`` and a save keeps the files where they are.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import operator
import os
import socket
import struct
import sys
import threading
import time
from typing import Any

from trialkeeper.protos.limits import metric_value_problem

# The agent's own variable, which its trials inherit.
from trialkeeper.protos.wire import EXPERIMENT_ENV as ENV_EXPERIMENT_ID

__all__ = [
    "CheckpointError",
    "TrialSdkError",
    "checkpoint_step",
    "flush",
    "get_checkpoint_dir",
    "get_experiment_id",
    "get_next_parameter",
    "get_output_dir",
    "get_sequence_id",
    "get_trial_id",
    "report_final_result",
    "report_intermediate_result",
    "save_checkpoint",
]

ENV_TRIAL_ID = "TRIALKEEPER_TRIAL_ID"
ENV_SEQUENCE_ID = "TRIALKEEPER_SEQUENCE_ID"
ENV_PARAMETER_FILE = "TRIALKEEPER_PARAMETER_FILE"
ENV_OUTPUT_DIR = "TRIALKEEPER_OUTPUT_DIR"
ENV_SOCKET = "TRIALKEEPER_SOCKET"
ENV_STANDALONE = "TRIALKEEPER_STANDALONE"
ENV_PARAMETERS = "TRIALKEEPER_PARAMETERS"
ENV_CHECKPOINT_DIR = "TRIALKEEPER_CHECKPOINT_DIR"
ENV_CHECKPOINT_STEP = "TRIALKEEPER_CHECKPOINT_STEP"
# How long save_checkpoint waits for the agent's answer (seconds).
ENV_CHECKPOINT_TIMEOUT = "TRIALKEEPER_CHECKPOINT_TIMEOUT"
DEFAULT_CHECKPOINT_TIMEOUT_S = 3600.0
STANDALONE_CHECKPOINT_DIR = "checkpoint"
# A socket named "@name" in ENV_SOCKET is in Linux's abstract namespace (no file to leave
# behind); environment variables cannot hold the NUL byte that begins such a name.
ABSTRACT_PREFIX = "@"


def socket_address(name: str) -> str:
    """The address to bind or connect to for a socket named as in ``ENV_SOCKET``."""
    return "\0" + name[len(ABSTRACT_PREFIX):] if name.startswith(ABSTRACT_PREFIX) else name


class TrialSdkError(RuntimeError):
    """The SDK is used where it cannot work (outside an agent, without standalone mode)."""


class CheckpointError(RuntimeError):
    """A checkpoint was not saved (too big, no room, refused by the coordinator, no answer
    in time); the message says why."""


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
# Intermediate results reported closer together than this share a datagram: a trial
# reporting in a tight loop sends hundreds per datagram (one system call, one wakeup of the
# agent), one reporting now and then sends each at once. Far below what anyone watching notices.
BATCH_LINGER_S = 0.002
_encode = json.JSONEncoder(separators=(",", ":")).encode  # made once: reports can come fast


class _Channel:
    """A datagram socket per process to the agent, opened on first use.

    A report is sent at once when the last datagram went out at least ``BATCH_LINGER_S``
    ago; otherwise it waits, at most that long, for the reports behind it, and they go out
    together as ``{"trial", "kind": "intermediate", "values": [...]}``. What waits is sent
    before a final result, at exit (sys.exit and uncaught exceptions included), before a
    fork, and by a helper thread when the trial stops reporting. (``os._exit``, ``exec`` and
    a fatal signal skip the last of these: at most the last ``BATCH_LINGER_S`` of a burst.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pid = -1
        self._reset_batch()

    def _reset_batch(self) -> None:
        self._wake = threading.Condition(self._lock)
        self._pending: list[str] = []  # JSON of each intermediate result waiting
        self._pending_bytes = 0
        self._pending_since = 0.0
        self._prefix = b""
        self._trial = ""
        self._last_sent = -BATCH_LINGER_S
        self._flusher: threading.Thread | None = None
        self._flusher_idle = False

    def send(self, line: bytes) -> None:
        """Send one datagram now, after whatever waits (which it must follow)."""
        with self._lock:
            if self._pending:
                self._flush()
            self._send(line)

    def add(self, trial_id: str, value_json: str) -> None:
        """An intermediate result, as JSON: sent now, or with those reported right after it."""
        now = time.monotonic()
        with self._lock:
            if self._pending and (
                trial_id != self._trial or self._pending_bytes + len(value_json) + 1 > MAX_REPORT_BYTES
            ):
                self._flush()
            if not self._pending:
                if now - self._last_sent >= BATCH_LINGER_S:
                    self._send(_single(trial_id, "intermediate", value_json))
                    return
                self._trial = trial_id
                self._prefix = b'{"trial":%s,"kind":"intermediate","values":[' % _encode(trial_id).encode()
                self._pending_since = now
                self._pending_bytes = len(self._prefix) + 1  # and "]}", less the first comma
                self._later()
            self._pending.append(value_json)
            self._pending_bytes += len(value_json) + 1
            if now - self._pending_since >= BATCH_LINGER_S:
                self._flush()

    def flush(self) -> None:
        """Send whatever waits."""
        with self._lock:
            if self._pending:
                self._flush()

    def _flush(self) -> None:
        # Called with the lock held and something pending.
        pending, self._pending = self._pending, []
        if len(pending) == 1:
            self._send(_single(self._trial, "intermediate", pending[0]))
        else:
            self._send(self._prefix + ",".join(pending).encode() + b"]}")

    def _send(self, line: bytes) -> None:
        # A forked child must not share the parent's connection: lines would interleave.
        if self._sock is None or self._pid != os.getpid():
            self._connect()
        assert self._sock is not None
        self._sock.send(line)
        self._last_sent = time.monotonic()

    def _later(self) -> None:
        """Make sure the helper thread sends what waits if the trial stops reporting."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_when_due, name="trialkeeper-reports", daemon=True)
            self._flusher.start()
        elif self._flusher_idle:
            self._wake.notify()

    def _flush_when_due(self) -> None:
        with self._lock:
            while True:
                if not self._pending:
                    self._flusher_idle = True
                    self._wake.wait()
                    self._flusher_idle = False
                    continue
                left = self._pending_since + BATCH_LINGER_S - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                count = len(self._pending)
                try:
                    self._flush()
                except (OSError, TrialSdkError) as e:  # the agent is gone: nothing to send them to
                    _say(f"{count} intermediate results could not be sent: {e}")

    def before_fork(self) -> None:
        # Sent by the parent, so that the child neither loses them nor sends them again;
        # the lock is held across the fork so that no other thread holds it in the child.
        self._lock.acquire()
        if self._pending:
            with contextlib.suppress(OSError, TrialSdkError):
                self._flush()

    def after_fork_in_parent(self) -> None:
        self._lock.release()

    def after_fork_in_child(self) -> None:
        # The child has none of the parent's threads: its own lock, and a helper when needed.
        self._lock = threading.Lock()
        self._reset_batch()

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


def _flush_at_exit() -> None:
    try:
        _channel.flush()
    except (OSError, TrialSdkError) as e:
        _say(f"the last intermediate results could not be sent at exit: {e}")


atexit.register(_flush_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_channel.before_fork,
        after_in_parent=_channel.after_fork_in_parent,
        after_in_child=_channel.after_fork_in_child,
    )


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
    # A number's JSON is its repr (bool, NaN and infinities were refused above).
    raw = repr(value) if type(value) is float or type(value) is int else _encode(value)
    # Measured as sent on its own; in a batch it takes fewer bytes than that.
    if (
        len(raw) + len(trial_id) + _SINGLE_OVERHEAD > MAX_REPORT_BYTES
        and len(_single(trial_id, kind, raw)) > MAX_REPORT_BYTES
    ):
        _say(f"{kind} result refused: larger than {MAX_REPORT_BYTES} bytes")
        return False
    if kind == "intermediate":
        _channel.add(trial_id, raw)
    else:
        _channel.send(_single(trial_id, kind, raw))
    return True


def _single(trial_id: str, kind: str, value_json: str) -> bytes:
    return b'{"trial":%s,"kind":"%s","value":%s}' % (_encode(trial_id).encode(), kind.encode(), value_json.encode())


# What _single adds to the value's JSON and the trial id, at least (the id may grow as JSON).
_SINGLE_OVERHEAD = len(_single("", "final", ""))


def flush() -> None:
    """Send the intermediate results that wait for others to share their datagram (at most
    ``BATCH_LINGER_S``). Done by itself before a final result, at exit and before a fork;
    call it before ``os._exit`` or ``exec``."""
    if not _standalone():
        _channel.flush()


def report_intermediate_result(value: float | dict[str, Any]) -> bool:
    """Report a result during training (one per epoch, say). False when refused."""
    return _report("intermediate", value)


def report_final_result(value: float | dict[str, Any]) -> bool:
    """Report the trial's result. False when refused (an invalid value)."""
    return _report("final", value)


# ---- checkpoints ------------------------------------------------------------------------

# One save at a time per process: each waits for its own answer.
_checkpoint_lock = threading.Lock()
_REPLY_BYTES = 64 * 1024
_CREDENTIALS = struct.Struct("iII")  # struct ucred (pid, uid, gid)


def get_checkpoint_dir() -> str:
    """The directory to write the trial's state into before ``save_checkpoint``: empty on a
    fresh start, holding the files of the checkpoint the trial continues from otherwise."""
    if _standalone():
        path = os.environ.get(ENV_CHECKPOINT_DIR) or os.path.abspath(STANDALONE_CHECKPOINT_DIR)
        os.makedirs(path, exist_ok=True)
        return path
    _require_agent()
    given = os.environ.get(ENV_CHECKPOINT_DIR)
    if not given:
        raise TrialSdkError(f"{ENV_CHECKPOINT_DIR} is not set; the agent sets it for every trial")
    return given


def checkpoint_step() -> int | None:
    """The step of the checkpoint the trial continues from, None on a fresh start."""
    raw = os.environ.get(ENV_CHECKPOINT_STEP, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise TrialSdkError(f"{ENV_CHECKPOINT_STEP} must be a whole number, got {raw!r}") from None


def save_checkpoint(step: int) -> None:
    """Save what the checkpoint directory holds now as the checkpoint at ``step`` (a whole
    number, larger than the trial's last one), whole or not at all. The files move into the
    checkpoint and the directory is empty again. Returns once the checkpoint is recorded;
    raises CheckpointError with the reason when it is not. When the trial was asked to pause,
    ends the process with status 0 after the save instead of returning."""
    if isinstance(step, bool):
        raise TypeError("step must be a whole number, got bool")
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"step must be 0 or more, got {step}")
    if _standalone():
        _say(f"checkpoint at step {step}: standalone mode keeps the files in {get_checkpoint_dir()}")
        return
    trial_id = _require_agent()
    with _checkpoint_lock:
        answer = _ask_agent(trial_id, step)
    if answer.get("ok") is not True:
        raise CheckpointError(str(answer.get("error") or "the agent refused the checkpoint"))
    if answer.get("pause"):
        _end_for_pause(step)


def _checkpoint_timeout() -> float:
    raw = os.environ.get(ENV_CHECKPOINT_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_CHECKPOINT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise TrialSdkError(f"{ENV_CHECKPOINT_TIMEOUT} must be a number of seconds above 0, got {raw!r}")
    return value


# While it waits for the agent's answer to a save, a trial checks this often that its agent is
# still there (an agent killed meanwhile never answers).
_ALIVE_CHECK_S = 1.0


def _ask_agent(trial_id: str, step: int) -> dict[str, Any]:
    """Send the save to the agent and wait for its answer on a socket of our own."""
    timeout = _checkpoint_timeout()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = ""
    try:
        if sys.platform.startswith("linux"):
            name = f"{ABSTRACT_PREFIX}trialkeeper-reply-{os.getuid()}-{os.getpid()}-{os.urandom(8).hex()}"
            sock.bind(socket_address(name))
            # Only the agent's user may answer: the name is open to every process on the machine.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        else:
            import tempfile  # only here: it costs a trial's start a few imports

            path = name = os.path.join(tempfile.mkdtemp(prefix="tk-"), "reply.sock")
            sock.bind(path)
        request = _encode({"trial": trial_id, "kind": "checkpoint", "step": step, "reply": name}).encode()
        try:
            # After whatever results wait: they count among those reported before the save.
            _channel.send(request)
        except OSError as e:
            raise CheckpointError(f"cannot reach the agent: {e}") from e
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(
                    f"the agent did not answer within {timeout:g} s ({ENV_CHECKPOINT_TIMEOUT} sets how long to wait)"
                )
            sock.settimeout(min(left, _ALIVE_CHECK_S))
            try:
                data, ancillary, _, _ = sock.recvmsg(_REPLY_BYTES, socket.CMSG_SPACE(_CREDENTIALS.size))
            except TimeoutError:
                if not _agent_listens():
                    raise CheckpointError("the agent went away before the checkpoint was safe") from None
                continue
            if not path and _sender_uid(ancillary) != os.getuid():
                continue
            try:
                answer = json.loads(data.decode())
            except (UnicodeDecodeError, ValueError):
                continue
            if isinstance(answer, dict):
                return answer
    finally:
        sock.close()
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(os.path.dirname(path))


def _agent_listens() -> bool:
    """Whether the agent's socket still has its agent: a datagram socket whose process died
    refuses a connection (nothing is sent)."""
    name = os.environ.get(ENV_SOCKET, "")
    if not name:
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(socket_address(name))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # not a sign that it is gone
    finally:
        probe.close()
    return True


def _sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == getattr(socket, "SCM_CREDENTIALS", -1) and len(data) >= 12:
            return int(_CREDENTIALS.unpack_from(data)[1])
    return None


def _end_for_pause(step: int) -> None:
    """The coordinator asked the trial to pause and its checkpoint is safe: end cleanly."""
    with contextlib.suppress(OSError, TrialSdkError):
        _channel.flush()
    _say(f"paused after its checkpoint at step {step} was saved; it continues from there later")
    if threading.current_thread() is threading.main_thread():
        sys.exit(0)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(0)
