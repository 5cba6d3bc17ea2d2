"""Warm trial starts: a template process that has imported the experiment's ``trialPreload``
modules forks each Python trial, which then skips those imports.

Standard library only, and runnable as a script: the template is started as
``python warm.py FD MODULE...`` with one end of a ``SOCK_SEQPACKET`` socket pair as ``FD``.
Each message is one JSON object. The agent sends a start request with the trial's stdout
and stderr as two file descriptors (SCM_RIGHTS); the template forks, answers with the
child's pid, waits for it and reports its exit status as a returncode (negative: killed by
that signal), as ``subprocess`` would for a cold start.

The forked child becomes what a cold ``python script.py`` or ``python -m module`` would be:
a new session, the trial's working directory, exactly its environment, argv and
``sys.path[0]``, stdin from /dev/null, the interpreter's start-up signal dispositions, the
trial's code run as ``__main__`` and the interpreter's own handling of its end (SystemExit,
tracebacks, atexit, non-daemon threads). What the interpreter fixes at its own start
(``PYTHON*`` variables, the string hash seed) is the template's: the agent starts a trial
warm only when its ``PYTHON*`` variables are the template's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# A start request carries the trial's whole environment: one datagram must hold it.
MAX_MESSAGE_BYTES = 4 << 20
# Variables the interpreter reads once at its start: a trial whose values differ starts cold.
_STARTUP_PREFIX = "PYTHON"


def interpreter_variables(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIX)}


@dataclass(frozen=True)
class WarmCommand:
    """A trial command the template can run: ``python script.py ...`` or ``python -m mod ...``."""

    executable: str  # the interpreter, as a cold start's sys.executable would be
    argv: list[str]  # the trial's sys.argv before runpy adjusts it for -m
    module: str  # "" for a script
    path0: str  # sys.path[0] as a cold start sets it


def warm_command(argv: list[str], cwd: str, env: dict[str, str], python: str) -> WarmCommand | None:
    """What the template runs for ``argv``, or None where it must start cold (not Python,
    another interpreter, interpreter options, a script that is not a file)."""
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python"):
        return None
    found = shutil.which(argv[0], path=env.get("PATH", os.defpath)) if os.sep not in argv[0] else argv[0]
    if found is None:
        return None
    found = os.path.join(cwd, found) if not os.path.isabs(found) else found
    # Same file and same directory: the same interpreter in the same environment (a venv's
    # python is a link to the base interpreter, its directory tells them apart).
    try:
        same = os.path.samefile(found, python) and os.path.dirname(found) == os.path.dirname(python)
    except OSError:
        return None
    if not same:
        return None
    if argv[1] == "-m" and len(argv) >= 3 and argv[2] and not argv[2].startswith("-"):
        return WarmCommand(found, [argv[0], *argv[3:]], argv[2], cwd)
    if argv[1].startswith("-"):
        return None
    script = os.path.join(cwd, argv[1])
    if not os.path.isfile(script):
        return None
    return WarmCommand(found, argv[1:], "", os.path.dirname(os.path.realpath(script)))


# ---- the template (runs in its own process) ----------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _preload(modules: list[str]) -> str | None:
    """Import ``modules``; why the template must not serve, or None."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - any failure to import is reported, not raised
            return f"trialPreload: importing {name} failed: {type(e).__name__}: {e}"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        # A CUDA context does not survive fork: every trial forked from it would fail.
        return "trialPreload: importing them initialised CUDA, which a forked trial cannot use"
    return None


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork trials on request until the agent closes the socket. Returns the request in a
    forked child (which then becomes the trial), None in the template when done."""
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        readable = _wait_readable(sock.fileno(), rfd)
        if rfd in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(rfd, 4096)
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    _send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if sock.fileno() in readable:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 2)
            if not data:
                return None
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (rfd, wfd):
                    os.close(fd)
                _become(request, fds)
                sock.close()
                return request
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, {"started": request["id"], "pid": pid})


def _wait_readable(*fds: int) -> set[int]:
    import select

    while True:
        try:
            return set(select.select(list(fds), [], [])[0])
        except InterruptedError:
            continue


_STARTUP_SIGNALS: dict[int, Any] = {}


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """Make this forked child what a cold start of the trial would be, up to running its code."""
    for signum, handler in _STARTUP_SIGNALS.items():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, handler)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.orig_argv = list(request["orig_argv"])
    sys.executable = request["executable"]
    sys.path.insert(0, request["path0"])  # the template took its own directory out
    numpy_random = getattr(sys.modules.get("numpy"), "random", None)
    if numpy_random is not None:
        # Seeded once at import: every trial forked from the template would draw the same numbers.
        numpy_random.seed()


def _run(request: dict[str, Any]) -> None:
    import builtins
    import importlib.machinery
    import runpy
    import types

    # A fresh __main__: the template's own globals are no trial's.
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__annotations__ = {}  # as the interpreter's own __main__ starts
    sys.modules["__main__"] = main
    if request["module"]:
        runpy._run_module_as_main(request["module"], alter_argv=True)  # type: ignore[attr-defined]  # what -m runs
        return
    path = os.path.abspath(sys.argv[0])
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    try:
        exec(code, main.__dict__)  # noqa: S102 - running the trial's script is the point
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - printed and turned into exit status 1, as Python does
        # As the interpreter prints it for a cold start: from the trial's own frames on.
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == _run.__code__.co_filename:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


def template_main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    # The template's own directory is no trial's: a cold start's sys.path has it nowhere.
    sys.path.pop(0)
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            _STARTUP_SIGNALS[signum] = signal.getsignal(signum)
    _STARTUP_SIGNALS.pop(signal.SIGKILL, None)
    _STARTUP_SIGNALS.pop(signal.SIGSTOP, None)
    refused = _preload(argv[1:])
    _send(sock, {"refused": refused} if refused else {"ready": os.getpid()})
    if refused:
        return
    request = _serve(sock)
    if request is not None:
        _run(request)


# ---- the agent's side ---------------------------------------------------------------------


class WarmProcess:
    """A trial forked by the template: its pid, and its returncode once the template reaped
    it (or the agent did, after the template died). Waited on as an asyncio Process is."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def _exited(self, returncode: int) -> None:
        if not self._done.done():
            self.returncode = returncode
            self._done.set_result(returncode)

    async def wait(self) -> int:
        return await self._done


class WarmStarter:
    """Keeps one template and starts trials from it; rebuilt when it dies."""

    def __init__(self, modules: list[str], env: dict[str, str], log_path: str) -> None:
        self.modules = modules
        self.env = env
        self.log_path = log_path
        self.python = sys.executable
        self.refused = ""  # why the template will not serve (it is not rebuilt then)
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._ready: asyncio.Future[bool] | None = None
        self._pending: dict[int, asyncio.Future[WarmProcess]] = {}
        self._running: dict[int, WarmProcess] = {}
        self._next_id = 0
        self._closing = False
        # The loop keeps only weak references to tasks: an orphan's wait, dropped, would
        # leave its trial never ending.
        self._tasks: set[asyncio.Future[Any]] = set()

    @property
    def template_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    def owns(self, pid: int) -> bool:
        return pid in self._running

    async def start(
        self, argv: list[str], cwd: str, env: dict[str, str], stdout: int, stderr: int
    ) -> WarmProcess | None:
        """A trial started from the template, or None where it must start cold."""
        if self.refused or interpreter_variables(env) != interpreter_variables(self.env):
            return None
        command = warm_command(argv, cwd, env, self.python)
        if command is None or not await self._ensure():
            return None
        assert self._sock is not None
        self._next_id += 1
        rid = self._next_id
        request = {
            "id": rid, "cwd": cwd, "env": env, "argv": command.argv, "orig_argv": argv,
            "executable": command.executable, "path0": command.path0, "module": command.module,
        }
        data = json.dumps(request).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            return None
        answer: asyncio.Future[WarmProcess] = asyncio.get_running_loop().create_future()
        self._pending[rid] = answer
        try:
            socket.send_fds(self._sock, [data], [stdout, stderr])
            return await answer
        except (OSError, ConnectionError) as e:
            log.warning("the trial template could not start a trial, starting it cold: %s", e)
            return None
        finally:
            self._pending.pop(rid, None)

    def prime(self) -> None:
        """Start building the template now rather than for the first trial."""
        if self._ready is None and not self.refused:
            self._ready = asyncio.ensure_future(self._spawn())

    async def _ensure(self) -> bool:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._spawn())
        try:
            return await asyncio.shield(self._ready)
        except OSError as e:
            log.warning("the trial template could not be started: %s", e)
            self._ready = None
            return False

    async def _spawn(self) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE_BYTES)
        try:
            with open(self.log_path, "ab") as out:  # noqa: ASYNC230 - opened once per template
                self._proc = await asyncio.create_subprocess_exec(
                    self.python, os.path.abspath(__file__), str(theirs.fileno()), *self.modules,
                    env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                    pass_fds=(theirs.fileno(),), start_new_session=True,
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        first: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._first = first
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_readable)
        hello = await first
        if hello.get("refused") or "ready" not in hello:
            self.refused = hello.get("refused") or f"the trial template ended while importing; see {self.log_path}"
            log.warning("trials start cold: %s", self.refused)
            return False
        log.info("trial template ready (pid %d), preloaded %s", hello["ready"], ", ".join(self.modules))
        return True

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            message = json.loads(data)
            if "started" in message:
                # Known before this loop reads on: its end may be the very next message.
                proc = self._running[message["pid"]] = WarmProcess(message["pid"])
                future = self._pending.get(message["started"])
                if future is not None and not future.done():
                    future.set_result(proc)
            elif "exited" in message:
                ended = self._running.pop(message["exited"], None)
                if ended is not None:
                    ended._exited(message["returncode"])
            elif not self._first.done():
                self._first.set_result(message)

    def _lost(self) -> None:
        """The template is gone: the next trial rebuilds it, a start in flight goes cold,
        and the trials it had forked (now the agent's, its subreaper) are waited on here."""
        assert self._sock is not None
        asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        if not self._first.done():
            self._first.set_result({})
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the trial template ended"))
        if self._ready is not None and self._ready.done() and not self.refused and not self._closing:
            log.warning("the trial template ended; it is rebuilt for the next trial")
            self._ready = None
        proc = self._proc
        if proc is not None:
            self._background(proc.wait())
        for orphan in list(self._running.values()):
            self._background(self._adopt(orphan))
        self._running.clear()

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adopt(self, proc: WarmProcess) -> None:
        proc._exited(await asyncio.to_thread(_wait_orphan, proc.pid))

    async def close(self) -> None:
        self._closing = True
        if self._sock is not None:
            self._sock.shutdown(socket.SHUT_RDWR)  # the template sees the end and exits
        if self._proc is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 10.0)
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()


def _wait_orphan(pid: int) -> int:
    """The returncode of a trial whose template died: it is reparented to this process (the
    agent is their subreaper) a moment after the template's socket closed."""
    import time

    deadline = time.monotonic() + 10.0
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            if not os.path.exists(f"/proc/{pid}") or time.monotonic() > deadline:
                # Reparented elsewhere and gone: its status went with it.
                return -signal.SIGKILL
            time.sleep(0.01)


if __name__ == "__main__":
    template_main(sys.argv[1:])
