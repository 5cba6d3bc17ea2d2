"""Remote environments: agents started over SSH on the machines of ``machineList``.

Per experiment the code directory is packed once (see ``_codedir``). Per machine, on the
first environment placed there, the service sets the machine up (see ``_remote_machine``):
it connects, checks the remote Python and its trialkeeper (or, with ``bootstrap``, installs
this coordinator's own version into a per-experiment virtualenv there), uploads the code
archive unless the machine already has that content, and unpacks it into the experiment's
directory on the machine::

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
import importlib.util
import ipaddress
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._launch import TLS_CERT_FILE, agent_argv, write_tls_cert
from .._record import EnvRecord
from ..base import EnvironmentRequest, EnvironmentService, Observation, StartResult
from .config import RemoteConfig
from .machine import REMOTE_ROOT, Machine, MachineError, python_command

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig
    from .._codedir import PackedCode

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
RETRY_DELAYS_S = (5.0, 10.0, 20.0, 40.0, 60.0)


class RemoteSetupError(ValueError):
    """The experiment cannot use the remote platform as configured (raised before any upload)."""


@dataclass
class _Env(EnvRecord):
    machine: Machine | None = None
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
        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.bind_address = bind_address
        self.advertise_address = advertise_address
        self.exclude = exclude
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(32, 4 + 4 * len(config.machine_list)), thread_name_prefix="trialkeeper-ssh"
        )
        #: (machine label, remote path) of every file sent; tests and operators read it.
        self.uploads: list[tuple[str, str]] = []
        self.machines = [
            Machine.from_config(i, m, config, pool=self._pool, uploads=self.uploads)
            for i, m in enumerate(config.machine_list)
        ]
        self._envs: dict[str, _Env] = {}
        self._adopted: dict[str, Machine] = {}  # env id -> its machine, after a restart
        self._code: PackedCode | None = None
        self._wheel: Path | None = None
        self._change: asyncio.Future[None] | None = None
        self._closed = False
        self._warned_dial: set[str] = set()

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
        from .. import _codedir

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
            m.connecting = asyncio.ensure_future(m.ssh(m.conn.connect))
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
            answer = await m.helper("stop", {"grace": grace_s, "envs": {env_id: env.dir}}, timeout=grace_s + 30)
        except MachineError as e:
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

    def adopt(self, env_id: str, platform_id: str) -> None:
        # platform_id is "<machine label> pid <pid>", as _start answered it.
        label = platform_id.rpartition(" pid ")[0]
        m = next((m for m in self.machines if m.label == label), None)
        if m is None:
            log.warning("environment %s: no machine %r in this config; its code is not checked", env_id, label)
        else:
            self._adopted[env_id] = m

    async def ready_adopted(self, experiment_id: str) -> None:
        # The agents there run trials in code/<hash> of this coordinator's code; the previous
        # one uploaded its own, which differs when the code directory changed since.
        machines = {m.index: m for m in self._adopted.values()}
        results = await asyncio.gather(*(self._ready(m, experiment_id) for m in machines.values()), return_exceptions=True)
        for m, result in zip(machines.values(), results):
            if isinstance(result, MachineError):
                self._machine_failed(m, result)
                log.warning("%s: could not upload the code for its resumed environments: %s", m.label, result)
            elif isinstance(result, BaseException):
                raise result

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        # Every agent lives in <home>/trialkeeper-experiments/<experiment>/envs/<env> on its
        # machine, with its pid file there: that directory is the label, on every machine.
        found = await asyncio.gather(*(self._sweep_machine(m, experiment_id, set(keep)) for m in self.machines))
        return sorted({env_id for ids in found for env_id in ids})

    async def _sweep_machine(self, m: Machine, experiment_id: str, keep: set[str]) -> list[str]:
        # The helper needs only the standard library: no probe of the machine's trialkeeper.
        python = python_command(m.config.python_path)
        try:
            seen = await m.helper("envs", {"dir": f"~/{REMOTE_ROOT}/{experiment_id}"}, python_cmd=python, timeout=60)
            doomed = {
                env_id: st["dir"]
                for env_id, st in seen["envs"].items()
                if env_id not in keep and (st.get("alive") or st.get("orphans"))
            }
            if not doomed:
                return []
            await m.helper("stop", {"grace": 0, "envs": doomed}, python_cmd=python, timeout=60)
            # A SIGKILLed process lingers for a moment: look again until it is gone.
            left = set(doomed)
            deadline = time.monotonic() + 10.0
            while left and time.monotonic() < deadline:
                seen = await m.helper("status", {"envs": {i: doomed[i] for i in left}}, python_cmd=python, timeout=30)
                left = {i for i, st in seen.items() if st.get("alive") or st.get("orphans")}
                if left:
                    await asyncio.sleep(0.1)
        except MachineError as e:
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
        tasks += [m.setup for m in self.machines if m.setup is not None and not m.setup.done()]
        tasks += [e.starting for e in self._envs.values() if e.starting is not None and not e.starting.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(m.ssh(m.conn.close) for m in self.machines), return_exceptions=True)
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
            except MachineError as e:
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

    def _pick(self, env: _Env) -> Machine | None:
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

    def _may_retry(self, m: Machine) -> bool:
        return not m.permanent and time.monotonic() >= m.retry_at

    async def _wait_for_change(self, m: Machine) -> None:
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

    def _machine_failed(self, m: Machine, e: MachineError) -> None:
        m.failures += 1
        m.error, m.permanent = str(e), e.permanent
        m.retry_at = time.monotonic() + RETRY_DELAYS_S[min(m.failures, len(RETRY_DELAYS_S)) - 1]
        self._notify()

    async def _ready(self, m: Machine, experiment_id: str) -> None:
        if m.setup is None or (m.setup.done() and m.setup.exception() is not None):
            m.setup = asyncio.ensure_future(self._set_up(m, experiment_id))
            # Its failure is reported by the starts that await it; one left alone when they
            # are canceled (a stop mid-setup) must not be logged as never retrieved.
            m.setup.add_done_callback(_ignore_result)
        await asyncio.shield(m.setup)
        if m.error:
            m.error, m.failures = "", 0
            self._notify()

    async def _set_up(self, m: Machine, experiment_id: str) -> None:
        started = time.monotonic()
        assert self._code is not None
        if self.config.bootstrap:
            assert self._wheel is not None
        await m.set_up(experiment_id, self._code, self._wheel if self.config.bootstrap else None)
        m.dial = await self._dial_address(m)
        log.info("%s: ready in %.2f s (python %s)", m.label, time.monotonic() - started, m.python)

    async def _dial_address(self, m: Machine) -> str:
        """host[:port] agents on ``m`` dial; the port is filled in at launch."""
        if self.config.coordinator_address:
            return self.config.coordinator_address
        if self.advertise_address:
            return self.advertise_address
        host = await m.ssh(m.conn.local_address)
        if m.label not in self._warned_dial:
            self._warned_dial.add(m.label)
            log.warning(
                "trainingService.coordinatorAddress is not set: agents on %s will dial %s, this "
                "machine's address on its SSH connection to them; set coordinatorAddress if they "
                "must use another", m.label, host,
            )
        return host

    async def _launch(self, env: _Env, m: Machine, request: EnvironmentRequest) -> int:
        env.dir = f"{m.exp_dir}/envs/{env.env_id}"
        extra = list(request.agent_args)
        if m.config.gpu_indices:
            extra += ["--gpu-indices", ",".join(str(i) for i in m.config.gpu_indices)]
        tls_cert = None
        cert = write_tls_cert(self.experiment_dir / "remote", request.tls_cert_pem)
        if cert is not None:
            tls_cert = f"{env.dir}/{TLS_CERT_FILE}"
            await m.upload(Path(cert), tls_cert)
        # The helper there supplies the interpreter; code is uploaded once per machine and
        # each trial runs in its own copy of it.
        argv = agent_argv(_with_port(m.dial, request.coordinator_address), env.env_id, self.platform, python=None,
                          workdir=env.dir, copy_working_directory=True, tls_cert=tls_cert, agent_args=extra)
        answer = await m.helper(
            "start",
            {"python": m.python, "env_dir": env.dir, "cwd": m.exp_dir, "argv": argv},
            stdin=request.token.encode(),
        )
        env.pid = int(answer["pid"])
        env.started = True
        env.state = "starting"
        return env.pid

    # ---- watching -----------------------------------------------------------------

    def _watch(self, m: Machine) -> None:
        if m.checker is None or m.checker.done():
            m.checker = asyncio.ensure_future(self._check_loop(m))

    async def _check_loop(self, m: Machine) -> None:
        while not self._closed:
            envs = {e.env_id: e for e in self._envs.values() if e.machine is m and e.started and not e.cleaned and e.state in ("starting", "running")}
            if not envs:
                return
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                seen = await m.helper("status", {"envs": {i: e.dir for i, e in envs.items()}}, timeout=30)
            except MachineError as e:
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

    async def _ended(self, env: _Env, m: Machine, st: dict[str, Any]) -> None:
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
                done = await m.helper("stop", {"grace": 0, "envs": {env.env_id: env.dir}}, timeout=30)
                n = done.get(env.env_id, {}).get("trial_processes", 0)
                detail += f"; {n} trial process{'es' if n != 1 else ''} it left were stopped"
                env.cleaned = True
            except MachineError as e:
                detail += f"; its trial processes could not be stopped: {e}"
        else:
            env.cleaned = True
        env.state, env.detail = state, detail
        log.info("environment %s: %s", env.env_id, detail)

    # ---- reaching the coordinator -------------------------------------------------

    async def _check_reachable_coordinator(self) -> None:
        """Refuse, before anything is sent, a coordinator that remote agents cannot reach."""
        if self.config.coordinator_address or self.advertise_address:
            return
        from ...config.rules import split_address

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
    from ...config.rules import split_address

    try:
        split_address(dial, allow_port_zero=False)
        return dial
    except ValueError:
        port = split_address(coordinator_address)[1]
        host = f"[{dial}]" if ":" in dial else dial
        return f"{host}:{port}"


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # an early connect's or a setup's failure is reported by start()
