"""The node side of the ray platform: the actor that hosts an agent, and its launcher.

The actor (:class:`AgentHost`) runs in a Ray worker process. It does not run the agent as
its own child: Ray kills a dying worker's children, which would orphan the agent's trials
(they run in their own sessions). It starts the launcher instead (this module run as
``python -m trialkeeper.coordinator.services.ray.node --launch``), which detaches itself,
becomes the subreaper of the agent's process tree and watches a pipe from the actor. When
the actor goes away for any reason (``ray.kill``, a crash, its node failing) the pipe reads
EOF and the launcher kills the agent and every trial: an environment never outlives its
actor. The launcher reports the agent's pid and, at the end, its exit status on a second
pipe, which the actor reads.

Only the standard library, psutil and trialkeeper's standard-library-only ``_launch`` are
imported at module level: the launcher must start fast, and Ray imports this module in
every actor it places.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from trialkeeper.protos.wire import TOKEN_ENV

from .._launch import agent_argv
from .._launch import log_tail as _tail

_LAUNCHER_MODULE = "trialkeeper.coordinator.services.ray.node"
SETTLE_S = 30.0  # how long the launcher may take to report the agent's start or end
# How long an actor outlives its agent for the coordinator to collect how the agent ended.
LINGER_S = 120.0


def describe_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class AgentHost:
    """The actor: launches the agent on its node and reports on it until it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._launched = threading.Event()
        self._done = threading.Event()
        self._info: dict[str, Any] = {}
        self._result: dict[str, Any] = {}
        self._ctrl: int | None = None
        self._log: Path | None = None
        self._linger_s = LINGER_S

    def launch(self, spec: dict[str, Any], token: str, code: bytes | None) -> dict[str, Any]:
        with self._lock:
            if not self._launched.is_set():
                try:
                    self._info = self._spawn(spec, token, code)
                except Exception as e:  # noqa: BLE001 - reported to the coordinator as data
                    self._info = {"error": f"could not start the agent: {describe_error(e)}"}
                    self._finish({"state": "failed", "detail": self._info["error"]})
                self._launched.set()
            return self._info

    def describe(self) -> dict[str, Any]:
        self._launched.wait()
        return self._info

    def wait(self) -> dict[str, Any]:
        self._done.wait()
        return self._result

    def shutdown(self, grace_s: float) -> dict[str, Any]:
        """End the agent: after ``grace_s`` for it to go on its own, its whole tree, hard."""
        if not self._launched.wait(SETTLE_S):
            return {}
        if not self._done.wait(grace_s):
            self._close_ctrl()
            self._done.wait(SETTLE_S)
        return self._result

    def _spawn(self, spec: dict[str, Any], token: str, code: bytes | None) -> dict[str, Any]:
        import ray

        self._linger_s = float(spec.get("linger_s", LINGER_S))
        root = Path(spec["node_dir"] or Path(tempfile.gettempdir()) / "trialkeeper-ray")
        exp_dir = root / spec["experiment_id"]
        env_dir = exp_dir / "envs" / spec["env_id"]
        env_dir.mkdir(parents=True, exist_ok=True)
        if code is not None:
            _unpack(code, exp_dir / "code" / spec["code"])
        gpu_ids = [str(i) for i in ray.get_gpu_ids()]
        argv = agent_argv(spec["coordinator"], spec["env_id"], "ray", python=sys.executable, workdir=str(env_dir),
                          copy_working_directory=True,
                          agent_args=[*_gpu_args(spec["num_gpus"], gpu_ids), *spec["agent_args"]])
        env = dict(os.environ)
        env[TOKEN_ENV] = token
        env.pop("CUDA_VISIBLE_DEVICES", None)  # the agent hands out GPUs by --gpu-indices
        self._log = env_dir / "agent.log"
        # The agent's working directory: where the code was unpacked, or the runtime env's.
        cwd = str(exp_dir) if code is not None else os.getcwd()
        pid = self._start_launcher(argv, env, cwd)
        return {"pid": pid, "node": socket.gethostname(), "gpus": ",".join(gpu_ids), "dir": str(env_dir)}

    def _start_launcher(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        """Start the launcher with its two pipes; the agent's pid once it runs."""
        assert self._log is not None
        ctrl_r, ctrl_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            with open(self._log, "ab") as out:
                first = subprocess.Popen(
                    [sys.executable, "-m", _LAUNCHER_MODULE, "--launch", str(ctrl_r), str(status_w), "--", *argv],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                    pass_fds=(ctrl_r, status_w), start_new_session=True, cwd=cwd,
                )
            first.wait(SETTLE_S)  # it forks the launcher and exits at once
        except BaseException:
            os.close(ctrl_w)
            os.close(status_r)
            raise
        finally:
            os.close(ctrl_r)
            os.close(status_w)
        self._ctrl = ctrl_w
        status = os.fdopen(status_r, "rb")
        line = status.readline()
        if not line:
            status.close()
            self._close_ctrl()
            raise RuntimeError(f"the agent launcher ended early: {_tail(self._log)}")
        threading.Thread(target=self._watch, args=(status,), daemon=True).start()
        return int(json.loads(line)["pid"])

    def _watch(self, status: Any) -> None:
        with status:
            line = status.readline()
        end = json.loads(line) if line else {}
        code, stopped = end.get("code"), end.get("stopped", False)
        if code == 0:
            self._finish({"state": "exited", "detail": "agent exited normally", "code": 0})
        elif stopped:
            self._finish({"state": "exited", "detail": "stopped", "code": code})
        else:
            from ..local import exit_detail as _exit_detail

            how = f"agent {_exit_detail(code)}" if code is not None else "the agent launcher died"
            tail = _tail(self._log) if self._log else ""
            self._finish({"state": "failed", "detail": f"{how}: {tail}" if tail else how, "code": code})
        self._close_ctrl()

    def _finish(self, result: dict[str, Any]) -> None:
        self._result = result
        self._done.set()
        threading.Thread(target=self._linger, daemon=True).start()

    def _linger(self) -> None:
        """Its agent is gone; normally the coordinator now kills this actor. If no one does
        (a coordinator that died and was never resumed), end it anyway, so that a detached
        actor does not hold its CPUs and GPUs for ever."""
        time.sleep(self._linger_s)
        os._exit(0)

    def _close_ctrl(self) -> None:
        with contextlib.suppress(OSError, TypeError):
            ctrl, self._ctrl = self._ctrl, None
            if ctrl is not None:
                os.close(ctrl)


def _unpack(archive: bytes, dest: Path) -> None:
    """Unpack the code once per node; actors racing for it all end with the same tree."""
    if dest.is_dir():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")
        with contextlib.suppress(OSError):  # another actor was first: its copy is the same
            os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gpu_args(num_gpus: float, gpu_ids: list[str]) -> list[str]:
    """The agent's GPU options: exactly the GPUs Ray assigned to the actor, or none."""
    if num_gpus <= 0 or not gpu_ids:
        return ["--no-gpu"]
    if not all(i.isdigit() for i in gpu_ids):
        raise RuntimeError(f"Ray assigned GPUs {gpu_ids}, which are not NVML indices")
    return ["--gpu-indices", ",".join(gpu_ids)]


# ---- the launcher: ``python -m trialkeeper.coordinator.services.ray.service --launch ...`` ------


def _launch(ctrl_fd: int, status_fd: int, argv: list[str]) -> int:
    """Run the agent until it ends or the actor goes away; report both ends on status_fd."""
    if os.fork() != 0:
        os._exit(0)  # the actor's child exits: Ray's cleanup of its worker spares us
    _become_subreaper()
    agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    os.environ.pop(TOKEN_ENV, None)
    status = os.fdopen(status_fd, "w")
    _report(status, {"pid": agent.pid})
    stopped = False
    while agent.poll() is None:
        readable, _, _ = select.select([ctrl_fd], [], [], 0.2)
        if readable and not stopped and not _read_or_eof(ctrl_fd):
            stopped = True  # the actor is gone or stops us: end the agent and its trials
            _kill_descendants()
    _end_orphans()
    _report(status, {"code": agent.returncode, "stopped": stopped})
    return 0


def _read_or_eof(fd: int) -> bool:
    try:
        return bool(os.read(fd, 64))
    except OSError:
        return False


def _report(stream: Any, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        stream.write(json.dumps(message) + "\n")
        stream.flush()


def _become_subreaper() -> None:
    """Orphaned trial processes are re-parented to us, so we can still end them (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _kill_descendants() -> None:
    """SIGKILL every process below us and their process groups (trials have their own)."""
    import psutil

    own_group = os.getpgid(0)
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(OSError):
                group = os.getpgid(p.pid)
                if group != own_group:
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                p.kill()


def _end_orphans(timeout: float = 10.0) -> None:
    """Kill and reap whatever the agent left behind (re-parented to us) until none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _kill_descendants()
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)


if __name__ == "__main__" and sys.argv[1:2] == ["--launch"]:
    sys.exit(_launch(int(sys.argv[2]), int(sys.argv[3]), sys.argv[5:]))
