"""Starting a trial command and ending its whole process tree."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
from collections.abc import Iterable

import psutil

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
