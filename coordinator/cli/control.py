"""The server of a running experiment's control channel: how ``trialkeeper pause``,
``continue``, ``stop`` and ``cancel`` (and the dashboard's actions) reach the coordinator that
``run`` or ``resume`` started. Where its socket is and how a request is sent: the client,
``control/client.py``.

Requests: ``pause {trials}``, ``continue {trials}``, ``cancel {trials}`` and ``stop {}`` (the
trials that checkpoint are paused, the others canceled, the experiment ends STOPPED). A
request naming a trial that does not exist, or is in a state the request does not apply to,
changes nothing and says why for each. Every read and connect has a timeout.

``update {limits}`` changes ``trialConcurrency``, ``maxTrialNumber`` or
``maxExperimentDuration`` (seconds) of the running experiment; ``submit {parameters}`` adds a
trial of the user's own parameters and ``rerun {trials}`` (or ``rerun {failed: true}``) a new
trial with each named (or each FAILED) trial's parameters: the experiment loop submits them
and tells its tuner, as NNI does with customized trials.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..control.client import (
    APPLIES_TO,
    CONNECT_TIMEOUT_S,
    MAX_LINE,
    MAX_SOCKET_PATH,
    REPLY_TIMEOUT_S,
    ControlError,
    NoCoordinator,
    _check_private,
    _in_temp,
    alive,
    no_coordinator,
    request,
    socket_path,
)
from ..engine.states import TrialStatus

if TYPE_CHECKING:
    from ..search.steering import Steering

# The client's names, which the CLI's commands take from here with the server's.
__all__ = [
    "APPLIES_TO", "CONNECT_TIMEOUT_S", "LIMITS", "MAX_LINE", "MAX_SOCKET_PATH", "OPS", "REPLY_TIMEOUT_S",
    "ControlError", "ControlHook", "ControlServer", "NoCoordinator", "alive", "no_coordinator", "request",
    "socket_path", "valid_limit",
]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0  # for the server: a client that connects and says nothing is let go
MAX_TRIALS = 10_000  # trial ids in one request
STOP_REASON = "stopped by `trialkeeper stop`: trials that save checkpoints paused, the others canceled"

OPS = (*APPLIES_TO, "stop", "ping", "update", "submit", "rerun")
# What `update` changes: the config's name -> the coordinator's, and what a valid value is.
LIMITS = {
    "trialConcurrency": ("trial_concurrency", "an integer >= 1"),
    "maxTrialNumber": ("max_trial_number", "an integer >= 1"),
    "maxExperimentDuration": ("max_experiment_duration", "a number of seconds > 0"),
}
SUBMIT_TIMEOUT_S = 20.0  # for the experiment loop to take a submitted trial


# ---- the server ----------------------------------------------------------------------------


class ControlServer:
    """Serves the control socket of ``coordinator``'s experiment on the running loop.

    ``stop`` is what a ``stop`` request runs (default: ``coordinator.stop(pause_trials=True)``);
    ``run`` and ``resume`` give theirs, which ends the run as SIGINT does (:class:`ControlHook`)."""

    def __init__(
        self, coordinator: Any, experiment_dir: Path, *, stop: Callable[[], Awaitable[None]] | None = None,
        steering: Steering | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.steering = steering  # the experiment loop's, when one drives the coordinator
        self.experiment_dir = Path(experiment_dir)
        self.path = socket_path(self.experiment_dir)
        self._stop = stop or self._default_stop
        self._server: asyncio.AbstractServer | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    async def _default_stop(self) -> None:
        await self.coordinator.stop(pause_trials=True, status="STOPPED", reason=STOP_REASON)

    def bind(self) -> Path:
        """Create the socket (mode 0600) and listen: connections wait in its backlog until
        :meth:`start` serves them. Raises ControlError."""
        if _in_temp(self.path, self.experiment_dir):
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.path.parent, 0o700)
            _check_private(self.path.parent)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            # Before listen(), no one can connect: the mode is set before it matters.
            os.chmod(self.path, 0o600)
            sock.listen(64)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise ControlError(f"cannot open the control socket {self.path}: {e.strerror or e}") from e
        self._sock = sock
        return self.path

    def _remove_stale(self) -> None:
        """A socket file a dead coordinator left is removed; a live one is not ours to take."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise ControlError(f"cannot look at {self.path}: {e.strerror or e}") from e
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlError(f"{self.path} exists and is not a socket: remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(CONNECT_TIMEOUT_S)
        try:
            probe.connect(str(self.path))
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        finally:
            probe.close()
        raise ControlError(f"another coordinator answers on {self.path}")

    async def start(self) -> Path:
        """Bind (if not done yet) and serve."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        self._server = await asyncio.start_unix_server(self._serve, sock=self._sock, limit=MAX_LINE)
        return self.path

    async def close(self) -> None:
        """Stop serving and remove the socket (and its private directory)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), CONNECT_TIMEOUT_S)
            self._server = None
        elif self._sock is not None:
            self._sock.close()
        self._sock = None
        self.remove()

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if _in_temp(self.path, self.experiment_dir):
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
                answer = await self.answer(line)
            except asyncio.TimeoutError:
                answer = {"ok": False, "error": f"no request within {REQUEST_TIMEOUT_S:g} s"}
            except (ValueError, asyncio.LimitOverrunError):
                answer = {"ok": False, "error": f"a request is one JSON line of at most {MAX_LINE} bytes"}
            writer.write((json.dumps(answer) + "\n").encode())
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            pass  # the client went away
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), REQUEST_TIMEOUT_S)

    async def answer(self, line: bytes) -> dict[str, Any]:
        """The answer to one request line."""
        try:
            request = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return {"ok": False, "error": "a request is one JSON object on one line"}
        if not isinstance(request, dict):
            return {"ok": False, "error": "a request is one JSON object on one line"}
        op = request.get("op")
        if op not in OPS:
            return {"ok": False, "error": f"op: {op!r} is not one of {', '.join(OPS)}"}
        if op == "ping":
            # The address too: where agents started by hand dial (`run --detach` prints it).
            return {"ok": True, "experiment": self.coordinator.experiment_id, "address": self.coordinator.address}
        if op == "stop":
            return self._stop_asked()
        if op == "update":
            return await self._update(request.get("limits"))
        if op == "submit":
            return await self._submit(request.get("parameters"))
        if op == "rerun":
            return await self._rerun(request)
        trials = request.get("trials")
        if (
            not isinstance(trials, list) or not trials or len(trials) > MAX_TRIALS
            or not all(isinstance(t, str) for t in trials)
        ):
            return {"ok": False, "error": f"trials: a list of 1 to {MAX_TRIALS} trial ids is needed"}
        by = "the dashboard" if request.get("from") == "dashboard" else f"trialkeeper {op}"  # for the history
        return await self._on_trials(op, list(dict.fromkeys(trials)), by)

    async def _update(self, limits: Any) -> dict[str, Any]:
        if not isinstance(limits, dict) or not limits:
            return {"ok": False, "error": f"limits: an object with one or more of {', '.join(LIMITS)} is needed"}
        changes, errors = {}, []
        for name, value in limits.items():
            if name not in LIMITS:
                errors.append(f"{name!r} cannot be updated (only {', '.join(LIMITS)})")
                continue
            field, valid = LIMITS[name]
            if not valid_limit(field, value):
                errors.append(f"{name}: {value!r} is not valid: {valid} is needed")
                continue
            changes[field] = float(value) if field == "max_experiment_duration" else value
        if errors:
            return {"ok": False, "error": "; ".join(errors) + "; nothing was changed"}
        from ..core import CoordinatorError
        from ..search.steering import SteeringError

        try:
            if self.steering is not None:
                await self.steering.update(**changes)
            else:
                await self.coordinator.update(**changes)
        except (CoordinatorError, SteeringError, ValueError) as e:
            return {"ok": False, "error": f"cannot update: {e}"}
        config = self.coordinator.config
        now = {name: getattr(config, field) for name, (field, _) in LIMITS.items()}
        log.info("limits updated on the control socket: %s", now)
        submitted = self.steering.submitted if self.steering is not None else len(self.coordinator.trials())
        return {"ok": True, "limits": now, "submitted": submitted}

    async def _submit(self, parameters: Any) -> dict[str, Any]:
        if not isinstance(parameters, dict):
            return {"ok": False, "error": "parameters: a JSON object of parameter names to values is needed"}
        why = _outside_space(parameters, self.coordinator.config.search_space or {})
        if why:
            return {"ok": False, "error": f"parameters: {why}"}
        try:
            trial_id = await self._new_trial(parameters, "submitted by the user (trialkeeper submit)")
        except ValueError as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True, "done": [trial_id]}

    async def _rerun(self, request: dict[str, Any]) -> dict[str, Any]:
        trials = request.get("trials")
        if request.get("failed") is True and not trials:
            trials = [t.id for t in self.coordinator.trials() if t.status is TrialStatus.FAILED]
            if not trials:
                return {"ok": False, "error": f"no trial of experiment {self.coordinator.experiment_id} is FAILED"}
        if (
            not isinstance(trials, list) or not trials or len(trials) > MAX_TRIALS
            or not all(isinstance(t, str) for t in trials)
        ):
            return {"ok": False, "error": f"trials: a list of 1 to {MAX_TRIALS} trial ids, or failed: true, is needed"}
        trials = list(dict.fromkeys(trials))
        unknown = [t for t in trials if not self._knows(t)]
        if unknown:
            return {"ok": False, "error": "; ".join(
                f"no trial {t!r} in experiment {self.coordinator.experiment_id}" for t in unknown
            ) + "; nothing was done"}
        done, rerun, failed = [], [], []
        for old in trials:
            try:
                new = await self._new_trial(
                    dict(self.coordinator.trial(old).parameters), f"a rerun of trial {old} (trialkeeper rerun)"
                )
            except ValueError as e:
                failed.append(f"trial {old}: {e}")
                continue
            done.append(new)
            rerun.append([old, new])
        answer: dict[str, Any] = {"ok": not failed, "done": done, "rerun": rerun}
        if failed:
            answer["error"] = "; ".join(failed)
        return answer

    def _knows(self, trial_id: str) -> bool:
        try:
            self.coordinator.trial(trial_id)
        except KeyError:
            return False
        return True

    async def _new_trial(self, parameters: dict[str, Any], why: str) -> str:
        """A new trial of ``parameters``, submitted by the experiment loop (its tuner hears
        of it) or, without one, by the coordinator; ValueError says why not."""
        from ..core import CoordinatorError
        from ..search.steering import SteeringError

        try:
            if self.steering is None:
                return str((await self.coordinator.submit(parameters)).id)
            return await asyncio.wait_for(self.steering.submit(parameters, why), SUBMIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ValueError(f"the experiment did not take the trial within {SUBMIT_TIMEOUT_S:g} s") from None
        except (CoordinatorError, SteeringError, TypeError) as e:
            raise ValueError(str(e)) from e

    def _stop_asked(self) -> dict[str, Any]:
        if self._stopping is None:
            log.info("experiment stop asked on the control socket")
            self._stopping = asyncio.get_running_loop().create_task(self._stop())
            self._stopping.add_done_callback(_said_if_failed)
        return {"ok": True, "stopping": True}

    async def _on_trials(self, op: str, trials: Sequence[str], by: str) -> dict[str, Any]:
        errors = []
        for tid in trials:
            why = self._refusal(op, tid)
            if why:
                errors.append({"trial": tid, "error": why})
        if errors:  # nothing done: the request names what to fix
            return {"ok": False, "error": "; ".join(e["error"] for e in errors), "errors": errors}
        done, failed = [], []
        for tid in trials:
            try:
                await self._act(op, tid, by)
            except Exception as e:  # noqa: BLE001 - the coordinator's refusal, told to the caller
                failed.append({"trial": tid, "error": f"cannot {op} trial {tid}: {e}"})
            else:
                done.append(tid)
                log.info("trial %s: %s asked on the control socket", tid, op)
        answer: dict[str, Any] = {"ok": not failed, "done": done}
        if failed:
            answer.update(error="; ".join(e["error"] for e in failed), errors=failed)
        return answer

    def _refusal(self, op: str, trial_id: str) -> str:
        try:
            info = self.coordinator.trial(trial_id)
        except KeyError:
            return f"no trial {trial_id!r} in experiment {self.coordinator.experiment_id}"
        status = getattr(info.status, "value", str(info.status))
        valid = APPLIES_TO[op]
        if status not in valid:
            either = valid[0] if len(valid) == 1 else f"{', '.join(valid[:-1])} or {valid[-1]}"
            return f"trial {trial_id} is {status}: {op} applies to a trial that is {either}"
        return ""

    async def _act(self, op: str, trial_id: str, by: str) -> None:
        c = self.coordinator
        if op == "pause":
            await c.pause(trial_id, reason=f"paused by the user ({by})")
        elif op == "continue":
            await c.resume_trial(trial_id)
        else:
            await c.cancel(trial_id, reason=f"canceled by the user ({by})")


def valid_limit(field: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if field == "max_experiment_duration":
        return math.isfinite(value) and value > 0
    return isinstance(value, int) and value >= 1


def _outside_space(parameters: dict[str, Any], space: dict[str, Any]) -> str:
    """Why ``parameters`` do not fit the search space's names ("" when they do, or when
    there is no search space)."""
    if not space:
        return ""
    unknown = sorted(set(parameters) - set(space))
    missing = sorted(set(space) - set(parameters))
    said = []
    if unknown:
        said.append(f"{', '.join(map(repr, unknown))} not in the search space")
    if missing:
        said.append(f"{', '.join(map(repr, missing))} missing")
    return f"{'; '.join(said)} (the search space has {', '.join(sorted(space))})" if said else ""


def _said_if_failed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("stopping the experiment failed: %s", task.exception())


class ControlHook:
    """For ``run`` and ``resume``: :meth:`on_start` opens the control socket once the
    coordinator runs (the hook ``run_experiment`` calls), :meth:`close` removes it at the end.

    A ``stop`` request ends the run as SIGINT does (``end_run``): the run stops its
    coordinator pausing the trials that checkpoint and canceling the others, and the
    experiment ends STOPPED. :meth:`signalled` is the run's SIGINT and SIGTERM handler."""

    def __init__(self, end_run: Callable[[], None], say: Callable[[str], None]) -> None:
        self._end_run = end_run
        self._say = say
        self.server: ControlServer | None = None
        self._serving: asyncio.Task[Path] | None = None
        self._coordinator: Any = None
        self._signals = 0
        self._canceling: asyncio.Task[None] | None = None
        from ..search.steering import Steering

        #: What the experiment loop (``run_experiment``) takes, for update, submit and rerun.
        self.steering = Steering()

    def signalled(self) -> None:
        """The first signal stops the run, pausing its trials; the next one cancels those
        that have not paused yet, instead of waiting up to pauseGracePeriod for them."""
        self._signals += 1
        if self._signals == 1:
            self._end_run()
            self._say(
                "trialkeeper: stopping: trials that save checkpoints pause (within pauseGracePeriod), the others "
                "are canceled; a second Ctrl-C cancels the trials still pausing"
            )
        elif self._coordinator is not None and self._canceling is None:
            self._say("trialkeeper: canceling the trials that have not paused")
            self._canceling = asyncio.get_running_loop().create_task(self._cancel_unpaused())
            self._canceling.add_done_callback(_said_if_failed)

    async def _cancel_unpaused(self) -> None:
        for t in self._coordinator.trials():
            if t.status in (TrialStatus.WAITING, TrialStatus.RUNNING):
                with contextlib.suppress(KeyError, ValueError):  # it ended meanwhile
                    await self._coordinator.cancel(
                        t.id, reason="the experiment stopped: canceled by a second signal before it paused",
                        status=TrialStatus.SYS_CANCELED,
                    )

    def on_start(self, coordinator: Any) -> None:
        self._coordinator = coordinator

        async def stop() -> None:
            self._end_run()

        server = ControlServer(coordinator, coordinator.experiment_dir, stop=stop, steering=self.steering)
        try:
            server.bind()
        except ControlError as e:
            # The run goes on; only the commands that steer it cannot reach it.
            self._say(f"trialkeeper: {e}; `trialkeeper pause`, `continue`, `cancel`, `stop`, `update`, `submit` and "
                      "`rerun` cannot reach this run")
            return
        self.server = server
        self._serving = asyncio.get_running_loop().create_task(server.start())

    async def close(self) -> None:
        if self._serving is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._serving, CONNECT_TIMEOUT_S)
        if self.server is not None:
            await self.server.close()
