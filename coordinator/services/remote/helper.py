"""Run on a remote machine by its own Python, sent over SSH: one operation per call.

The coordinator runs ``PYTHON -c BOOT N 'JSON'``: BOOT reads the first N bytes of stdin
(``helper_setup.py`` and this file, sent as one script) and executes them; whatever follows
on stdin is the operation's input (the experiment token, for ``start``). The operation and
its arguments come as one JSON argument, and the answer is one JSON line on stdout.
Secrets never travel in argv. Here: the agents' processes (start, status, stop, the
environments of an experiment); the machine's set-up is in ``helper_setup.py``.

Both files use the standard library only and no syntax newer than Python 3.6, so that an
old or bare Python still runs them far enough to say what is wrong with it.
"""

import json
import os
import signal
import subprocess
import sys
import time

if __package__:  # imported on the coordinator; on the machine the parts arrive as one script
    from .helper_setup import (
        AGENT_MODULE,
        _makedirs,
        _read,
        _write,
        op_bootstrap,
        op_extract,
        op_probe,
    )

BOOT_MARK = "trialkeeper-remote"  # the code name in the command that runs this file


def op_start(args):
    """Start the agent detached (its own session), the token on its stdin."""
    env_dir, cwd = args["env_dir"], args["cwd"]
    _makedirs(env_dir)
    token = sys.stdin.buffer.read()
    for name in ("agent.pid", "exit.json"):
        try:
            os.unlink(os.path.join(env_dir, name))
        except OSError:
            pass
    env = dict(os.environ)
    for name in ("SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    with open(os.path.join(env_dir, "agent.log"), "ab") as log:
        proc = subprocess.Popen(
            [args["python"], "-m", AGENT_MODULE, "--exit-file", os.path.join(env_dir, "exit.json"), *args["argv"]],
            cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            close_fds=True, start_new_session=True,
        )
    proc.stdin.write(token)
    proc.stdin.close()
    _write(os.path.join(env_dir, "agent.pid"), str(proc.pid))
    return {"pid": proc.pid}


def op_status(args):
    out = {}
    for env_id, env_dir in _env_dirs(args).items():
        out[env_id] = _env_status(env_id, env_dir)
    return out


def op_stop(args):
    """Stop agents (after a grace period) and every trial process they left."""
    grace = float(args.get("grace", 0.0))
    envs = _env_dirs(args)
    pids = {}
    for env_id, env_dir in envs.items():
        pid = _agent_pid(env_id, env_dir)
        if pid:
            pids[env_id] = pid
    deadline = time.time() + grace
    while pids and time.time() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.1)
    out = {}
    for env_id, env_dir in envs.items():
        pid = pids.get(env_id)
        killed_agent = False
        if pid and _alive(pid):
            _kill(pid, signal.SIGKILL)
            killed_agent = True
        trials = _trial_processes(env_dir)
        for p in trials:
            _kill_group_and_pid(p, signal.SIGTERM)
        end = time.time() + 2.0
        while time.time() < end and any(_alive(p) for p in trials):
            time.sleep(0.05)
        for p in trials:
            if _alive(p):
                _kill_group_and_pid(p, signal.SIGKILL)
        if pid and killed_agent:
            _write(os.path.join(env_dir, "exit.json"), json.dumps({"killed": "SIGKILL", "by": "stop"}))
        out[env_id] = {
            "killed_agent": killed_agent,
            "trial_processes": len(trials),
            "status": _env_status(env_id, env_dir),
        }
    return out


def op_envs(args):
    """Every environment directory of an experiment on this machine (``~`` expanded), with its status."""
    root = os.path.join(os.path.expanduser(args["dir"]), "envs")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    dirs = {n: os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))}
    return {"envs": {n: dict(_env_status(n, d), dir=d) for n, d in dirs.items()}}


def op_processes(args):
    """Every live process of an experiment directory (agents and trials), for checks."""
    root = os.path.realpath(args["dir"])
    found = []
    for pid in _pids():
        if pid in (os.getpid(), os.getppid()) or BOOT_MARK in _cmdline(pid):
            continue  # this helper, its shell, and other helpers naming the directory
        if _mentions(pid, root):
            found.append({"pid": pid, "cmdline": _cmdline(pid)})
    return {"processes": found}


# ---- helpers ---------------------------------------------------------------------------


def _env_dirs(args):
    """env id -> its directory (``~`` expanded: a sweep names them so)."""
    return {env_id: os.path.expanduser(d) for env_id, d in args["envs"].items()}


def _env_status(env_id, env_dir):
    status = {"pid": None, "alive": False, "exit": None, "log_tail": ""}
    try:
        status["pid"] = int(_read(os.path.join(env_dir, "agent.pid")))
    except (OSError, ValueError):
        status["started"] = False
        return status
    status["started"] = True
    status["alive"] = _agent_pid(env_id, env_dir) is not None
    try:
        status["exit"] = json.loads(_read(os.path.join(env_dir, "exit.json")))
    except (OSError, ValueError):
        pass
    if not status["alive"]:
        status["log_tail"] = _tail(os.path.join(env_dir, "agent.log"))
        status["orphans"] = len(_trial_processes(env_dir))
    return status


def _agent_pid(env_id, env_dir):
    """The agent's pid if it still runs (checked by its command line, not just the pid)."""
    try:
        pid = int(_read(os.path.join(env_dir, "agent.pid")))
    except (OSError, ValueError):
        return None
    if not _alive(pid):
        return None
    if os.path.isdir("/proc/self"):
        cmd = _cmdline(pid)
        if AGENT_MODULE not in cmd or env_id not in cmd:
            return None  # the pid was reused by something else
    return pid


def _trial_processes(env_dir):
    """Processes started for this environment's trials (their TRIALKEEPER_TRIAL_DIR or
    working directory lies in it), whoever their parent is now."""
    if not os.path.isdir("/proc/self"):
        return []
    trials = os.path.join(os.path.realpath(env_dir), "trials") + os.sep
    me = os.getpid()
    found = []
    for pid in _pids():
        if pid == me or not _alive(pid):
            continue
        if _cmdline(pid).find(AGENT_MODULE) >= 0:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        hit = any(
            v.startswith(b"TRIALKEEPER_TRIAL_DIR=")
            and (v.split(b"=", 1)[1].decode("utf-8", "replace") + os.sep).startswith(trials)
            for v in environ
        )
        if not hit:
            try:
                hit = (os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) + os.sep).startswith(trials)
            except OSError:
                hit = False
        if hit:
            found.append(pid)
    return found


def _mentions(pid, root):
    if root in _cmdline(pid):
        return True
    try:
        if (os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) + os.sep).startswith(root + os.sep):
            return True
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return root.encode() in f.read()
    except OSError:
        return False


def _pids():
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _kill_group_and_pid(pid, sig):
    try:
        pgid = os.getpgid(pid)
        if pgid != os.getpgid(0):
            os.killpg(pgid, sig)
    except OSError:
        pass
    _kill(pid, sig)


def _tail(path, limit=1500):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln for ln in data.splitlines() if ln.strip()]
    return "\n".join(lines[-6:])


OPS = {
    "probe": op_probe,
    "extract": op_extract,
    "bootstrap": op_bootstrap,
    "start": op_start,
    "status": op_status,
    "stop": op_stop,
    "processes": op_processes,
    "envs": op_envs,
}


def main(argv):
    request = json.loads(argv[2])
    try:
        result = OPS[request["op"]](request)
    except Exception as e:  # noqa: BLE001 - reported to the coordinator as data
        result = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv)
