"""Starting a trial command and ending its whole process tree."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterable

import psutil

from .trial import ENV_TRIAL_ID

# A command with none of these characters means the same with or without a shell, so it is
# run directly: one process less to start, and a signal that kills it is reported as such
# rather than as the shell's exit status 128+N.
_SHELL_SYNTAX = set("|&;<>()$`\\\"'*?[]#~=%{}!\n")


def command_argv(command: str) -> list[str]:
    """The argv that runs ``command``: split directly when plain, else through /bin/sh."""
    if not (_SHELL_SYNTAX & set(command)):
        argv = shlex.split(command)
        if argv:
            return argv
    return ["/bin/sh", "-c", command]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def group_alive(pgid: int) -> bool:
    """Whether any process is left in the process group (zombies aside, almost)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _live_members(pgid) != []


def _live_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return members


def tree(pid: int, pgid: int) -> list[psutil.Process]:
    """Every live process of a trial but its root ``pid``: the process group and the
    descendants that left it. The root is left out because the runner reaps it itself;
    waiting on it here too would steal its exit status."""
    found: dict[int, psutil.Process] = {}
    try:
        for p in psutil.Process(pid).children(recursive=True):
            found[p.pid] = p
    except psutil.Error:
        pass
    try:
        os.killpg(pgid, 0)
        for p in _live_members(pgid):
            found.setdefault(p.pid, p)
    except (ProcessLookupError, PermissionError):
        pass
    found.pop(pid, None)
    return [p for p in found.values() if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(procs: Iterable[psutil.Process], pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(signum)
        except psutil.Error:
            pass


async def terminate_tree(
    pid: int, pgid: int, grace_s: float, root_exited: asyncio.Future[object] | None = None
) -> None:
    """SIGTERM the trial's whole tree, SIGKILL whatever is left after ``grace_s``.

    ``root_exited`` completes when the runner has reaped the root process; without it the
    root is taken as gone. Returns once nothing of the tree is alive, or after a bounded
    wait for the kernel to reap what was SIGKILLed.
    """
    root_alive = root_exited is not None and not root_exited.done()
    procs = await asyncio.to_thread(tree, pid, pgid)
    if not procs and not root_alive:
        return
    if root_alive:
        _kill(pid, signal.SIGTERM)
    _signal_all(procs, pgid, signal.SIGTERM)
    waits: list[asyncio.Future[object]] = [asyncio.ensure_future(asyncio.to_thread(psutil.wait_procs, procs, grace_s))]
    if root_alive:
        assert root_exited is not None
        waits.append(asyncio.ensure_future(asyncio.wait_for(asyncio.shield(root_exited), grace_s)))
    await asyncio.gather(*waits, return_exceptions=True)
    # Processes may have been forked while we waited: look again before the hard kill.
    alive = await asyncio.to_thread(tree, pid, pgid)
    if root_exited is not None and not root_exited.done():
        _kill(pid, signal.SIGKILL)
    if alive:
        _signal_all(alive, pgid, signal.SIGKILL)
        await asyncio.to_thread(psutil.wait_procs, alive, 10.0)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# prctl option (linux/prctl.h): orphaned descendants are reparented to this process.
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> str | None:
    """Make this process the parent that orphaned descendants are given (Linux), so that a
    trial's daemon which double-forked and left its process group is reparented to the
    agent rather than to init, where the agent can still find and end it. Returns why it
    could not, or None."""
    if not sys.platform.startswith("linux"):
        return f"child subreapers exist on Linux only, not on {sys.platform}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as e:
        return f"prctl is not available: {e}"
    return None


def strays(own: Collection[int]) -> list[tuple[psutil.Process, str | None]]:
    """This process's live children that it did not start itself (not in ``own``): orphans
    reparented to it as subreaper. Each comes with the trial id in its environment (every
    process a trial starts inherits it), None where it has none or it cannot be read."""
    found = []
    for p in psutil.Process().children():
        if p.pid in own or not _alive(p):
            continue
        try:
            marker: str | None = p.environ().get(ENV_TRIAL_ID)
        except (psutil.Error, OSError):
            marker = None
        found.append((p, marker))
    return found


def _zombie_children() -> list[int]:
    found = []
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if p.status() == psutil.STATUS_ZOMBIE:
                found.append(p.pid)
    return found


async def reap(own: Callable[[], Collection[int] | None]) -> None:
    """Collect the exit status of dead children that this process did not start itself:
    reparented orphans would stay zombies otherwise. The trials' roots (``own()``) are left
    to asyncio, which waits for them; ``own()`` is None while a child is being started, whose
    pid is not known yet, and then nothing is reaped."""
    if own() is None:
        return
    candidates = await asyncio.to_thread(_zombie_children)
    # Asked again on the event loop, where children are started: none can be started between
    # this answer and the waits below.
    mine = own()
    if mine is None:
        return
    for pid in candidates:
        if pid not in mine:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG, on a zombie: does not block


async def end_strays(
    pick: Callable[[str | None], bool], own: Callable[[], Collection[int] | None], grace_s: float
) -> int:
    """SIGTERM the strays whose marker ``pick`` accepts and everything they started, SIGKILL
    what is left after ``grace_s``, and reap them. ``own`` gives the children this process
    started itself, or None while one is being started. Returns how many processes were
    signalled."""
    if _only_own_children(own):
        return 0  # the common case, known from /proc in microseconds: nothing escaped
    await reap(own)
    procs = await _victims(pick, own)
    if not procs:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    await _wait_dead(procs, own, grace_s)
    # What they forked meanwhile is found again before the hard kill.
    left = {p.pid: p for p in procs if _alive(p)}
    left.update((p.pid, p) for p in await _victims(pick, own))
    for p in left.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    await _wait_dead(list(left.values()), own, 10.0)
    return len(procs)


def child_pids() -> set[int] | None:
    """This process's children (zombies included), from /proc/self/task/*/children; None
    where the kernel does not list them."""
    found: set[int] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                found.update(int(pid) for pid in f.read().split())
    except (OSError, ValueError):
        return None
    return found


def _only_own_children(own: Callable[[], Collection[int] | None]) -> bool:
    """Whether every child of this process is one it started itself (a trial's root): then
    there is no stray to end and no orphan to reap."""
    mine = own()
    kids = child_pids() if mine is not None else None
    return kids is not None and mine is not None and kids.issubset(mine)


def _candidates(mine: Collection[int]) -> list[tuple[psutil.Process, str | None, list[psutil.Process]]]:
    found = []
    for p, marker in strays(mine):
        try:
            descendants = p.children(recursive=True)
        except psutil.Error:
            descendants = []
        found.append((p, marker, descendants))
    return found


async def _victims(
    pick: Callable[[str | None], bool], own: Callable[[], Collection[int] | None]
) -> list[psutil.Process]:
    """The strays ``pick`` accepts and their descendants. Looked for in a thread, decided on
    the event loop, where children are started: a child started during the look (its
    environment not yet the trial's) is known as the agent's own by then, and none can be
    started between this answer and the signals its caller sends."""
    deadline = time.monotonic() + 5.0
    while True:
        mine = own()
        if mine is not None:
            candidates = await asyncio.to_thread(_candidates, mine)
            now = own()
            if now is not None:
                break
        if time.monotonic() >= deadline:
            return []
        await asyncio.sleep(0.01)
    found: dict[int, psutil.Process] = {}
    for p, marker, descendants in candidates:
        if p.pid not in now and pick(marker):
            found[p.pid] = p
            found.update((d.pid, d) for d in descendants)
    return [p for p in found.values() if _alive(p)]


async def reap_forever(own: Callable[[], Collection[int] | None], interval_s: float) -> None:
    """Reap dead orphans now and then: a trial's background job that ends on its own while
    the trial runs would otherwise stay a zombie of the agent."""
    while True:
        await asyncio.sleep(interval_s)
        await reap(own)


async def _wait_dead(
    procs: list[psutil.Process], own: Callable[[], Collection[int] | None], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = not any(_alive(p) for p in procs)
        await reap(own)
        if done or time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.02)
