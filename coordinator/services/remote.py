"""Remote environments: agents started over SSH on the machines of ``machineList``.

Per experiment the code directory is packed once (see ``_codedir``). Per machine, on the
first environment placed there, the service connects, checks the remote Python and its
trialkeeper (or, with ``bootstrap``, installs this coordinator's own version into a
per-experiment virtualenv there), uploads the code archive unless the machine already has
that content, and unpacks it into the experiment's directory on the machine::

    ~/trialkeeper-experiments/.cache/code-<hash>.tar.gz          shared by experiments
    ~/trialkeeper-experiments/<experiment>/code/<hash>/           the snapshot
    ~/trialkeeper-experiments/<experiment>/envs/<env>/            agent.log, trials/<id>/code, ...

Agents run detached (their own session) and get the token on stdin. Each environment is
watched twice: by its agent's heartbeat (the coordinator) and by a check over SSH here,
which tells a crashed or killed agent from a clean exit and stops any trial processes it
left behind. A machine that cannot be used fails the environment with the reason; in
reuse mode its replacement then waits for the machine while the others go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.metadata
import importlib.util
import ipaddress
import json
import logging
import shlex
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ._launch import agent_argv
from ._record import EnvRecord
from .base import EnvironmentRequest, EnvironmentService, Observation, StartResult
from .remote_config import RemoteConfig, RemoteMachineConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config import ExperimentConfig
    from ._codedir import PackedCode
    from ._ssh import SshConnection

log = logging.getLogger(__name__)

REMOTE_ROOT = "trialkeeper-experiments"
CHECK_INTERVAL_S = 1.0
RETRY_DELAYS_S = (5.0, 10.0, 20.0, 40.0, 60.0)
_HELPER = Path(__file__).with_name("_remote_helper.py")
_BOOT = "import sys;exec(compile(sys.stdin.buffer.read(int(sys.argv[1])),'trialkeeper-remote','exec'))"
_T = TypeVar("_T")


class RemoteSetupError(ValueError):
    """The experiment cannot use the remote platform as configured (raised before any upload)."""


class _MachineError(Exception):
    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass
class _Machine:
    index: int
    config: RemoteMachineConfig
    conn: SshConnection
    label: str
    setup: asyncio.Future[None] | None = None
    error: str = ""
    permanent: bool = False
    failures: int = 0
    retry_at: float = 0.0
    python: str = ""  # the Python that runs agents there (absolute)
    exp_dir: str = ""
    dial: str = ""
    checker: asyncio.Task[None] | None = None
    connecting: asyncio.Future[None] | None = None  # the early connect begun by prepare()

    @property
    def broken(self) -> bool:
        return bool(self.error)


@dataclass
class _Env(EnvRecord):
    machine: _Machine | None = None
    state: str = "starting"  # starting | running | exited | failed
    detail: str = "waiting for a machine"
    pid: int | None = None
    dir: str = ""
    started: bool = False  # an agent was launched
    launching: bool = False  # the launch command is under way
    cleaned: bool = False  # its processes are known gone
    timings: dict[str, float] = field(default_factory=dict)


class RemoteEnvironmentService(EnvironmentService[RemoteConfig]):
    """Starts agents over SSH; see the module docstring."""

    platform = "remote"
    shares_filesystem = False

    def __init__(self, config: RemoteConfig, experiment_dir: Path, code_directory: Path, *,
                 bind_address: str = "127.0.0.1:0", advertise_address: str | None = None,
                 exclude: tuple[Path, ...] = ()) -> None:
        from ._ssh import SshConnection, SshTarget

        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.bind_address = bind_address
        self.advertise_address = advertise_address
        self.exclude = exclude
        self.machines = [
            _Machine(
                index=i,
                config=m,
                label=m.label,
                conn=SshConnection(
                    SshTarget(
                        host=m.host, port=m.port, user=m.user, password=m.password,
                        key_file=m.ssh_key_file, passphrase=m.ssh_passphrase,
                        known_hosts=config.known_hosts_file,
                        accept_unknown_host_key=config.accept_unknown_host_keys,
                        timeout=config.ssh_timeout,
                    )
                ),
            )
            for i, m in enumerate(config.machine_list)
        ]
        self._envs: dict[str, _Env] = {}
        self._code: PackedCode | None = None
        self._wheel: Path | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(32, 4 + 4 * len(self.machines)), thread_name_prefix="trialkeeper-ssh"
        )
        self._change: asyncio.Future[None] | None = None
        self._closed = False
        self._warned_dial: set[str] = set()
        #: (machine label, remote path) of every file sent; tests and operators read it.
        self.uploads: list[tuple[str, str]] = []

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: RemoteConfig, experiment_dir: Path) -> Self:
        missing = [m for m in ("paramiko", "pathspec") if importlib.util.find_spec(m) is None]
        if missing:
            raise RemoteSetupError(
                f"platform remote needs {' and '.join(missing)}: pip install 'trialkeeper[remote]'"
            )
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(
            ts, experiment_dir, Path(config.trial_code_directory),
            bind_address=config.coordinator.address,
            advertise_address=config.coordinator.advertise_address,
            exclude=exclude,
        )

    # ---- the contract -------------------------------------------------------------

    def gpu_policy(self, env_id: str) -> tuple[int | None, bool | None]:
        env = self._envs.get(env_id)
        if env is None or env.machine is None:
            return None, None
        return env.machine.config.max_trial_number_per_gpu, env.machine.config.use_active_gpu

    def working_directory(self) -> str:
        # Relative to the experiment directory on each machine (the agents' cwd), where
        # the snapshot lies; each trial runs in its own copy of it (see _remote_agent).
        assert self._code is not None, "prepare() was not called"
        return f"code/{self._code.short}"

    async def prepare(self) -> None:
        from . import _codedir

        await self._check_reachable_coordinator()
        ts = self.config
        out = self.experiment_dir / "remote"
        self._code = await asyncio.to_thread(
            _codedir.pack, self.code_directory, out,
            max_files=ts.max_code_dir_files, max_bytes=int(ts.max_code_dir_size_mb * 1024 * 1024),
            exclude=self.exclude, secrets=self._secrets(),
        )
        log.info(
            "code directory %s packed: %d files, %.1f MB, content %s",
            self.code_directory, self._code.files, self._code.bytes / 1e6, self._code.short,
        )
        if ts.bootstrap:
            self._wheel = await asyncio.to_thread(_codedir.build_self_wheel, out)
        for m in self.machines:  # connect early, in the background; start() waits for it
            m.connecting = asyncio.ensure_future(self._ssh(m.conn.connect))
            m.connecting.add_done_callback(_ignore_result)

    def _secrets(self) -> tuple[str, ...]:
        return tuple(
            s for m in self.config.machine_list for s in (m.password, m.ssh_passphrase) if s
        )

    async def start(self, request: EnvironmentRequest) -> StartResult:
        env = self._envs.get(request.env_id)
        if env is None:
            env = self._envs[request.env_id] = _Env(request.env_id)
            env.starting = asyncio.ensure_future(self._start(env, request))
        assert env.starting is not None
        try:
            return await asyncio.shield(env.starting)
        except asyncio.CancelledError:
            if env.starting.cancelled():
                return StartResult(error="the start was canceled")
            raise

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        out = {}
        for env_id in env_ids:
            env = self._envs.get(env_id)
            if env is None:
                out[env_id] = Observation("unknown")
            else:
                state = env.state if env.state in ("starting", "running", "exited", "failed") else "unknown"
                out[env_id] = Observation(state, env.detail, env.platform_id)  # type: ignore[arg-type]
        return out

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        env = self._envs.get(env_id)
        if env is None:
            return
        env.stop_requested = True
        if env.starting is not None and not env.starting.done():
            if env.launching:
                # Canceled now, the agent could start unseen: let the launch finish, then stop it.
                await asyncio.wait([env.starting], timeout=60.0)
            if not env.starting.done():
                env.starting.cancel()
                self._notify()
        if not env.started or env.cleaned or env.machine is None:
            if env.state == "starting":
                env.state, env.detail = "exited", "stopped before its agent was started"
            return
        m = env.machine
        try:
            answer = await self._helper(m, "stop", {"grace": grace_s, "envs": {env_id: env.dir}}, timeout=grace_s + 30)
        except _MachineError as e:
            log.warning("environment %s: could not stop its agent on %s: %s", env_id, m.label, e)
            return
        done = answer.get(env_id, {})
        env.cleaned = True
        if env.state in ("starting", "running"):
            env.state, env.detail = "exited", "stopped"
        if done.get("killed_agent") or done.get("trial_processes"):
            log.info(
                "environment %s: stopped on %s (agent killed: %s, trial processes stopped: %s)",
                env_id, m.label, bool(done.get("killed_agent")), done.get("trial_processes", 0),
            )

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        # Every agent lives in <home>/trialkeeper-experiments/<experiment>/envs/<env> on its
        # machine, with its pid file there: that directory is the label, on every machine.
        found = await asyncio.gather(*(self._sweep_machine(m, experiment_id, set(keep)) for m in self.machines))
        return sorted({env_id for ids in found for env_id in ids})

    async def _sweep_machine(self, m: _Machine, experiment_id: str, keep: set[str]) -> list[str]:
        # The helper needs only the standard library: no probe of the machine's trialkeeper.
        python = self._python_command(m.config.python_path)
        try:
            seen = await self._helper(m, "envs", {"dir": f"~/{REMOTE_ROOT}/{experiment_id}"}, python_cmd=python, timeout=60)
            doomed = {
                env_id: st["dir"]
                for env_id, st in seen["envs"].items()
                if env_id not in keep and (st.get("alive") or st.get("orphans"))
            }
            if not doomed:
                return []
            await self._helper(m, "stop", {"grace": 0, "envs": doomed}, python_cmd=python, timeout=60)
            # A SIGKILLed process lingers for a moment: look again until it is gone.
            left = set(doomed)
            deadline = time.monotonic() + 10.0
            while left and time.monotonic() < deadline:
                seen = await self._helper(m, "status", {"envs": {i: doomed[i] for i in left}}, python_cmd=python, timeout=30)
                left = {i for i, st in seen.items() if st.get("alive") or st.get("orphans")}
                if left:
                    await asyncio.sleep(0.1)
        except _MachineError as e:
            log.warning("%s: could not remove the leftover environments of experiment %s: %s", m.label, experiment_id, e)
            return []
        for env_id in sorted(left):
            log.warning("environment %s on %s: its processes could not all be stopped", env_id, m.label)
        removed = sorted(set(doomed) - left)
        for env_id in removed:
            log.info("environment %s of experiment %s: leftover agent removed from %s", env_id, experiment_id, m.label)
        return removed

    async def close(self) -> None:
        self._closed = True
        self._notify()
        tasks: list[asyncio.Future[Any]] = [m.checker for m in self.machines if m.checker]
        tasks += [m.connecting for m in self.machines if m.connecting]
        tasks += [e.starting for e in self._envs.values() if e.starting is not None and not e.starting.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(self._ssh(m.conn.close) for m in self.machines), return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- starting -----------------------------------------------------------------

    async def _start(self, env: _Env, request: EnvironmentRequest) -> StartResult:
        began = time.monotonic()
        while True:
            m = self._pick(env)
            if m is None:
                env.state = "failed"
                env.detail = "no machine can take it: " + "; ".join(x.error for x in self.machines if x.error)
                return StartResult(error=env.detail)
            env.machine = m
            if m.broken and not self._may_retry(m):
                if not any(not x.broken for x in self.machines) or not self.config.reuse_mode:
                    env.state, env.detail = "failed", m.error
                    return StartResult(error=m.error)
                # Reuse mode: this environment stands for the machine. Failing it again and
                # again would end the experiment; wait instead while the others work.
                env.detail = f"waiting for {m.label}: {m.error}"
                await self._wait_for_change(m)
                continue
            try:
                await self._ready(m, request.experiment_id)
                env.launching = True
                pid = await self._launch(env, m, request)
            except _MachineError as e:
                self._machine_failed(m, e)
                env.state, env.detail = "failed", str(e)
                return StartResult(error=str(e))
            finally:
                env.launching = False
            env.timings["start_s"] = time.monotonic() - began
            env.platform_id = f"{m.label} pid {pid}"
            env.detail = f"agent started (pid {pid})"
            log.info(
                "environment %s: agent started on %s (pid %d) in %.2f s",
                env.env_id, m.label, pid, env.timings["start_s"],
            )
            self._watch(m)
            return StartResult(platform_id=env.platform_id)

    def _pick(self, env: _Env) -> _Machine | None:
        live: dict[int, int] = {}
        for e in self._envs.values():
            if e is not env and e.machine is not None and e.state in ("starting", "running"):
                live[e.machine.index] = live.get(e.machine.index, 0) + 1
        if self.config.reuse_mode:
            free = [m for m in self.machines if m.index not in live]
            if not free:
                free = sorted(self.machines, key=lambda m: live.get(m.index, 0))
            # Working machines first; a broken one only when nothing else is free.
            free.sort(key=lambda m: (m.broken and not self._may_retry(m), live.get(m.index, 0)))
            return free[0]
        usable = [m for m in self.machines if not m.broken or self._may_retry(m)]
        if not usable:
            return None
        return min(usable, key=lambda m: (live.get(m.index, 0), m.index))

    def _may_retry(self, m: _Machine) -> bool:
        return not m.permanent and time.monotonic() >= m.retry_at

    async def _wait_for_change(self, m: _Machine) -> None:
        timeout = None if m.permanent else max(0.1, m.retry_at - time.monotonic())
        if self._change is None:
            self._change = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._change), timeout)
        if self._closed:
            raise asyncio.CancelledError

    def _notify(self) -> None:
        """Wake the starts that wait for a machine: something about the machines changed."""
        if self._change is not None and not self._change.done():
            self._change.set_result(None)
        self._change = None

    def _machine_failed(self, m: _Machine, e: _MachineError) -> None:
        m.failures += 1
        m.error, m.permanent = str(e), e.permanent
        m.retry_at = time.monotonic() + RETRY_DELAYS_S[min(m.failures, len(RETRY_DELAYS_S)) - 1]
        self._notify()

    async def _ready(self, m: _Machine, experiment_id: str) -> None:
        if m.setup is None or (m.setup.done() and m.setup.exception() is not None):
            m.setup = asyncio.ensure_future(self._set_up(m, experiment_id))
        await asyncio.shield(m.setup)
        if m.error:
            m.error, m.failures = "", 0
            self._notify()

    async def _set_up(self, m: _Machine, experiment_id: str) -> None:
        """Connect, check the Python and trialkeeper there, upload and unpack the code."""
        from ._ssh import SshError

        started = time.monotonic()
        connecting, m.connecting = m.connecting, None
        try:
            await (connecting or self._ssh(m.conn.connect))
        except SshError as e:
            raise _MachineError(str(e), permanent=e.permanent) from None
        info = await self._probe(m, self._python_command(m.config.python_path))
        root = f"{info['home'].rstrip('/')}/{REMOTE_ROOT}"
        m.exp_dir = f"{root}/{experiment_id}"
        if self.config.bootstrap:
            assert self._wheel is not None
            wheel = f"{root}/.cache/{self._wheel.name}"
            await self._upload(m, self._wheel, wheel)
            venv = f"{m.exp_dir}/venv-{info['hostname']}"
            made = await self._helper(m, "bootstrap", {"wheel": wheel, "venv": venv}, python=info["python"], timeout=300)
            agent_info = await self._probe(m, shlex.quote(made["python"]), bootstrapped=True)
            m.python = made["python"]
            log.info("%s: trialkeeper %s installed into %s", m.label, agent_info.get("trialkeeper"), venv)
        else:
            self._check_trialkeeper(m, info)
            m.python = info["python"]
        assert self._code is not None
        archive = f"{root}/.cache/{self._code.archive.name}"
        await self._upload(m, self._code.archive, archive)
        await self._helper(m, "extract", {"archive": archive, "dest": f"{m.exp_dir}/code/{self._code.short}"})
        m.dial = await self._dial_address(m)
        log.info("%s: ready in %.2f s (python %s)", m.label, time.monotonic() - started, m.python)

    async def _probe(self, m: _Machine, python_cmd: str, *, bootstrapped: bool = False) -> dict[str, Any]:
        where = m.label
        configured = m.config.python_path or "python3"
        try:
            info = await self._helper(m, "probe", {}, python_cmd=python_cmd, timeout=60)
        except _MachineError as e:
            if e.permanent:
                raise
            raise _MachineError(str(e), permanent=False) from None
        version = tuple(info.get("version", (0, 0, 0)))
        if version < (3, 10):
            raise _MachineError(
                f"{where}: {info.get('python')} is Python {'.'.join(map(str, version))}; trialkeeper needs "
                "3.10 or newer: set pythonPath to a newer Python there",
                permanent=True,
            )
        if bootstrapped and info.get("import_error"):
            reqs = " ".join(shlex.quote(r) for r in _requirements())
            raise _MachineError(
                f"{where}: trialkeeper was installed into {info.get('python')}, but it cannot run: "
                f"{info['import_error']}. Its dependencies must be importable by {configured}; install them "
                f"there with: {configured} -m pip install {reqs}",
                permanent=True,
            )
        return info

    def _check_trialkeeper(self, m: _Machine, info: dict[str, Any]) -> None:
        from trialkeeper.agent import __version__
        from trialkeeper.protos.wire import PROTOCOL_VERSION

        python = info.get("python", "python3")
        hint = (
            f"install it there ({python} -m pip install 'trialkeeper=={__version__}') or set "
            "trainingService.bootstrap: true to have this coordinator install itself into a "
            "virtualenv on the machine"
        )
        theirs = info.get("trialkeeper")
        if not theirs:
            raise _MachineError(
                f"{m.label}: trialkeeper is not importable by {python} ({info.get('import_error', 'not found')}); {hint}",
                permanent=True,
            )
        if info.get("protocol") != PROTOCOL_VERSION or theirs.split(".")[:2] != __version__.split(".")[:2]:
            raise _MachineError(
                f"{m.label}: {python} has trialkeeper {theirs} (protocol {info.get('protocol')}), but this "
                f"coordinator is {__version__} (protocol {PROTOCOL_VERSION}); {hint}",
                permanent=True,
            )
        if info.get("import_error"):
            raise _MachineError(
                f"{m.label}: trialkeeper {theirs} is installed for {python} but cannot run: {info['import_error']}; "
                f"install its dependencies there ({python} -m pip install 'trialkeeper=={__version__}')",
                permanent=True,
            )
        if theirs != __version__:
            log.warning("%s: trialkeeper %s there, %s here; same protocol, going on", m.label, theirs, __version__)

    async def _upload(self, m: _Machine, local: Path, remote: str) -> None:
        from ._ssh import SshError

        try:
            sent = await self._ssh(m.conn.upload, local, remote)
        except SshError as e:
            raise _MachineError(str(e), permanent=e.permanent) from None
        if sent:
            self.uploads.append((m.label, remote))
            log.info("%s: uploaded %s (%.1f MB)", m.label, remote, local.stat().st_size / 1e6)

    async def _dial_address(self, m: _Machine) -> str:
        """host[:port] agents on ``m`` dial; the port is filled in at launch."""
        if self.config.coordinator_address:
            return self.config.coordinator_address
        if self.advertise_address:
            return self.advertise_address
        host = await self._ssh(m.conn.local_address)
        if m.label not in self._warned_dial:
            self._warned_dial.add(m.label)
            log.warning(
                "trainingService.coordinatorAddress is not set: agents on %s will dial %s, this "
                "machine's address on its SSH connection to them; set coordinatorAddress if they "
                "must use another", m.label, host,
            )
        return host

    async def _launch(self, env: _Env, m: _Machine, request: EnvironmentRequest) -> int:
        env.dir = f"{m.exp_dir}/envs/{env.env_id}"
        extra = list(request.agent_args)
        if m.config.gpu_indices:
            extra += ["--gpu-indices", ",".join(str(i) for i in m.config.gpu_indices)]
        tls_cert = None
        if request.tls_cert_pem is not None:
            cert = self.experiment_dir / "remote" / "coordinator.pem"
            cert.parent.mkdir(parents=True, exist_ok=True)
            cert.write_bytes(request.tls_cert_pem)
            await self._upload(m, cert, f"{env.dir}/coordinator.pem")
            tls_cert = f"{env.dir}/coordinator.pem"
        # The helper there supplies the interpreter; code is uploaded once per machine and
        # each trial runs in its own copy of it.
        argv = agent_argv(_with_port(m.dial, request.coordinator_address), env.env_id, self.platform, python=None,
                          workdir=env.dir, copy_working_directory=True, tls_cert=tls_cert, agent_args=extra)
        answer = await self._helper(
            m, "start",
            {"python": m.python, "env_dir": env.dir, "cwd": m.exp_dir, "argv": argv},
            stdin=request.token.encode(),
        )
        env.pid = int(answer["pid"])
        env.started = True
        env.state = "starting"
        return env.pid

    # ---- watching -----------------------------------------------------------------

    def _watch(self, m: _Machine) -> None:
        if m.checker is None or m.checker.done():
            m.checker = asyncio.ensure_future(self._check_loop(m))

    async def _check_loop(self, m: _Machine) -> None:
        while not self._closed:
            envs = {e.env_id: e for e in self._envs.values() if e.machine is m and e.started and not e.cleaned and e.state in ("starting", "running")}
            if not envs:
                return
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                seen = await self._helper(m, "status", {"envs": {i: e.dir for i, e in envs.items()}}, timeout=30)
            except _MachineError as e:
                for watched in envs.values():
                    watched.detail = f"cannot check over SSH: {e}"
                continue
            for env_id, st in seen.items():
                env = envs.get(env_id)
                if env is None or env.cleaned:
                    continue
                if st.get("alive"):
                    env.state = "running"
                    continue
                await self._ended(env, m, st)

    async def _ended(self, env: _Env, m: _Machine, st: dict[str, Any]) -> None:
        ended = st.get("exit") or {}
        tail = (st.get("log_tail") or "").strip().splitlines()
        last = f"; last agent log line: {tail[-1]}" if tail else ""
        who = f"the agent (pid {env.pid}) on {m.label}"
        if ended.get("code") == 0:
            state, detail = "exited", "agent exited normally"
        elif "code" in ended:
            state, detail = "failed", f"{who} exited with status {ended['code']}{last}"
        elif ended.get("killed"):
            state, detail = "exited", f"{who} was stopped"
        else:
            state, detail = "failed", (
                f"{who} died without an exit status (killed by a signal such as SIGKILL, or "
                f"by the out-of-memory killer){last}"
            )
        if st.get("orphans"):
            try:
                done = await self._helper(m, "stop", {"grace": 0, "envs": {env.env_id: env.dir}}, timeout=30)
                n = done.get(env.env_id, {}).get("trial_processes", 0)
                detail += f"; {n} trial process{'es' if n != 1 else ''} it left were stopped"
                env.cleaned = True
            except _MachineError as e:
                detail += f"; its trial processes could not be stopped: {e}"
        else:
            env.cleaned = True
        env.state, env.detail = state, detail
        log.info("environment %s: %s", env.env_id, detail)

    # ---- plumbing -----------------------------------------------------------------

    async def _ssh(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def _helper(self, m: _Machine, op: str, args: dict[str, Any], *, python: str | None = None,
                      python_cmd: str | None = None, stdin: bytes = b"", timeout: float = 60.0) -> dict[str, Any]:
        from ._ssh import SshError

        script = _HELPER.read_bytes()
        command = python_cmd or shlex.quote(python or m.python)
        payload = json.dumps({"op": op, **args})
        full = f"{command} -c {shlex.quote(_BOOT)} {len(script)} {shlex.quote(payload)}"
        try:
            result = await self._ssh(functools.partial(m.conn.run, full, stdin=script + stdin, timeout=timeout))
        except SshError as e:
            raise _MachineError(str(e), permanent=e.permanent) from None
        lines = result.stdout.decode("utf-8", "replace").strip().splitlines()
        try:
            answer = json.loads(lines[-1]) if lines else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            err = result.stderr.decode("utf-8", "replace").strip().splitlines()
            why = err[-1] if err else (lines[-1] if lines else "no output")
            if op == "probe":
                configured = m.config.python_path or "python3"
                raise _MachineError(
                    f"{m.label}: cannot run Python with pythonPath {configured!r} (exit {result.rc}: {why}); set "
                    f"machineList[{m.index}].pythonPath to the Python 3.10+ (or its bin directory) that runs "
                    "trials there",
                    permanent=True,
                )
            raise _MachineError(f"{m.label}: remote {op} failed (exit {result.rc}): {why}", permanent=False)
        if "error" in answer:
            raise _MachineError(f"{m.label}: remote {op} failed: {answer['error']}", permanent=op in ("probe", "bootstrap"))
        return answer

    @staticmethod
    def _python_command(python_path: str | None) -> str:
        if not python_path:
            return "python3"
        # NNI's pythonPath is a bin directory put first on PATH; a path to the executable
        # works too.
        p = shlex.quote(python_path)
        return (
            f'p={p}; if [ -d "$p" ]; then PATH="$p:$PATH"; export PATH; '
            f'if [ -x "$p/python3" ]; then p="$p/python3"; else p="$p/python"; fi; fi; "$p"'
        )

    async def _check_reachable_coordinator(self) -> None:
        """Refuse, before anything is sent, a coordinator that remote agents cannot reach."""
        if self.config.coordinator_address or self.advertise_address:
            return
        from ..configrules import split_address

        host = split_address(self.bind_address)[0]
        if not await _is_loopback(host):
            return
        remote = [m.label for m in self.machines if not await _is_loopback(m.config.host)]
        if remote:
            raise RemoteSetupError(
                f"the coordinator listens on {self.bind_address}, which {', '.join(remote)} cannot reach: set "
                "coordinator.address to 0.0.0.0:0 (or an address of this machine they can reach), or set "
                "trainingService.coordinatorAddress if you forward the port yourself"
            )


async def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, None), 5.0)
    except (OSError, asyncio.TimeoutError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def _with_port(dial: str, coordinator_address: str) -> str:
    """``dial`` with the coordinator's port when it names only a host."""
    from ..configrules import split_address

    try:
        split_address(dial, allow_port_zero=False)
        return dial
    except ValueError:
        port = split_address(coordinator_address)[1]
        host = f"[{dial}]" if ":" in dial else dial
        return f"{host}:{port}"


def _requirements() -> list[str]:
    try:
        reqs = importlib.metadata.requires("trialkeeper") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r for r in reqs if "extra ==" not in r]


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # an early connect's failure is reported by start()
