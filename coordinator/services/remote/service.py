"""Remote environments: agents started over SSH on the machines of ``machineList``.

Per experiment the code directory is packed once (see ``_codedir``). Per machine, on the
first environment placed there, the service sets the machine up (see ``machine``): it
connects, checks the remote Python and its trialkeeper (or, with ``bootstrap``, installs
this coordinator's own version into a per-experiment virtualenv there), uploads the code
archive unless the machine already has that content, and unpacks it into the experiment's
directory on the machine::

    ~/trialkeeper-experiments/.cache/code-<hash>.tar.gz          shared by experiments
    ~/trialkeeper-experiments/<experiment>/code/<hash>/           the snapshot
    ~/trialkeeper-experiments/<experiment>/envs/<env>/            agent.log, trials/<id>/code, ...

The lifecycle (one start per env id, polling, stop with grace, sweep, errors as data) is
:mod:`..lifecycle`'s. Agents run detached (their own session) and get the token on stdin.
Each environment is watched twice: by its agent's heartbeat (the coordinator) and by a
check over SSH here (``observe``), which tells a crashed or killed agent from a clean exit
and stops any trial processes it left behind. A machine that cannot be used fails the
environment with the reason; in reuse mode its replacement then waits for the machine
while the others go on (see ``placement``), and a stop cancels that wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._launch import TLS_CERT_FILE, agent_argv, write_tls_cert
from ..base import EnvironmentRequest, Observation
from ..lifecycle import LifecycleService, PlatformError, State
from . import watch
from .config import RemoteConfig
from .machine import REMOTE_ROOT, Machine, MachineError
from .placement import Placement
from .reach import DialAddress, RemoteSetupError, check_reachable, with_port
from .watch import Agent

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig
    from .._codedir import PackedCode

__all__ = ["RemoteEnvironmentService", "RemoteSetupError"]

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


class RemoteEnvironmentService(LifecycleService[RemoteConfig, Agent]):
    """Starts agents over SSH; see the module docstring."""

    platform = "remote"
    shares_filesystem = False
    kind = "agent"
    record_type = Agent
    STOP_WAIT_S = 10.0  # a SIGKILLed process lingers for a moment
    STOP_POLL_S = 0.1
    PLAIN_ERRORS = (PlatformError, MachineError)

    def __init__(self, config: RemoteConfig, experiment_dir: Path, code_directory: Path, *,
                 bind_address: str = "127.0.0.1:0", advertise_address: str | None = None,
                 exclude: tuple[Path, ...] = ()) -> None:
        secrets = [s for m in config.machine_list for s in (m.password, m.ssh_passphrase) if s]
        # A launch command is waited for that long by a stop.
        super().__init__(poll_interval=CHECK_INTERVAL_S, secrets=secrets, call_timeout=60.0)
        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.bind_address = bind_address
        self.advertise_address = advertise_address
        self.exclude = exclude
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(32, 4 + 4 * len(config.machine_list)),
            thread_name_prefix="trialkeeper-ssh",
        )
        #: (machine label, remote path) of every file sent; tests and operators read it.
        self.uploads: list[tuple[str, str]] = []
        self.machines = [
            Machine.from_config(i, m, config, pool=self._pool, uploads=self.uploads)
            for i, m in enumerate(config.machine_list)
        ]
        self._placement = Placement(self.machines, reuse=config.reuse_mode)
        self._dial = DialAddress(config, advertise_address)
        self._adopted: dict[str, Machine] = {}  # env id -> its machine, after a restart
        self._code: PackedCode | None = None
        self._wheel: Path | None = None

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: RemoteConfig, experiment_dir: Path) -> Self:
        missing = [m for m in ("paramiko", "pathspec") if importlib.util.find_spec(m) is None]
        if missing:
            raise RemoteSetupError(
                f"platform remote needs {' and '.join(missing)}: "
                "pip install 'trialkeeper[remote]'"
            )
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(
            ts, experiment_dir, Path(config.trial_code_directory),
            bind_address=config.coordinator.address,
            advertise_address=config.coordinator.advertise_address,
            exclude=exclude,
        )

    def gpu_policy(self, env_id: str) -> tuple[int | None, bool | None]:
        env = self._records.get(env_id) or self._launching.get(env_id)
        if env is None or env.machine is None:
            return None, None
        return env.machine.config.max_trial_number_per_gpu, env.machine.config.use_active_gpu

    def working_directory(self) -> str:
        # Relative to the experiment directory on each machine (the agents' cwd), where
        # the snapshot lies; each trial runs in its own copy of it (see agent_main).
        assert self._code is not None, "prepare() was not called"
        return f"code/{self._code.short}"

    async def prepare(self) -> None:
        from .. import _codedir

        await check_reachable(self.config, self.machines, self.bind_address,
                              self.advertise_address)
        ts = self.config
        out = self.experiment_dir / "remote"
        self._code = await asyncio.to_thread(
            _codedir.pack, self.code_directory, out,
            max_files=ts.max_code_dir_files, max_bytes=int(ts.max_code_dir_size_mb * 1024 * 1024),
            exclude=self.exclude, secrets=tuple(self._secrets),
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

    def adopt(self, env_id: str, platform_id: str) -> None:
        # Not watched here (its agent's heartbeats are): only its machine is noted, to be
        # given this coordinator's code. platform_id is "<machine label> pid <pid>".
        m = self._machine_of(platform_id)
        if m is None:
            log.warning("environment %s: no machine %r in this config; its code is not checked",
                        env_id, platform_id.rpartition(" pid ")[0])
        else:
            self._adopted[env_id] = m

    async def ready_adopted(self, experiment_id: str) -> None:
        # The agents there run trials in code/<hash> of this coordinator's code; the previous
        # one uploaded its own, which differs when the code directory changed since.
        machines = {m.index: m for m in self._adopted.values()}
        results = await asyncio.gather(*(self._ready(m, experiment_id) for m in machines.values()),
                                       return_exceptions=True)
        for m, result in zip(machines.values(), results):
            if isinstance(result, MachineError):
                self._placement.failed(m, result)
                log.warning("%s: could not upload the code for its resumed environments: %s",
                            m.label, result)
            elif isinstance(result, BaseException):
                raise result

    async def close(self) -> None:
        self._placement.close()
        await super().close()
        tasks: list[asyncio.Future[Any]] = [m.connecting for m in self.machines if m.connecting]
        tasks += [m.setup for m in self.machines if m.setup is not None and not m.setup.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(m.ssh(m.conn.close) for m in self.machines), return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the provider ---------------------------------------------------------------

    def launch_timeout(self, request: EnvironmentRequest) -> float | None:
        # In reuse mode a start may wait for a machine as long as it takes; each SSH step
        # has a deadline of its own.
        return None

    def cancels_launch(self, env: Agent) -> bool:
        # Canceled while its launch command runs, the agent could start unseen.
        return not env.launching

    async def launch(self, env: Agent, request: EnvironmentRequest) -> str:
        began = time.monotonic()
        env.detail = "waiting for a machine"
        try:
            m = await self._placement.choose(lambda: self._load(env),
                                             lambda m, why: _hold(env, m, why))
            try:
                await self._ready(m, request.experiment_id)
                env.launching = True
                pid = await self._launch(env, m, request)
            except MachineError as e:
                self._placement.failed(m, e)
                raise PlatformError(str(e)) from None
            finally:
                env.launching = False
        except asyncio.CancelledError:
            env.machine = None
            self._placement.notify()  # its machine is free for a start that waits
            raise
        env.detail = f"agent started (pid {pid})"
        log.info("environment %s: agent started on %s (pid %d) in %.2f s",
                 env.env_id, m.label, pid, time.monotonic() - began)
        return f"{m.label} pid {pid}"

    def launch_error(self, request: EnvironmentRequest, error: PlatformError) -> str:
        return str(error)

    async def observe(self, records: Sequence[Agent]) -> dict[str, State]:
        by_machine: dict[int, list[Agent]] = {}
        for env in records:
            if self._place(env):
                assert env.machine is not None
                by_machine.setdefault(env.machine.index, []).append(env)
        found = await asyncio.gather(*(watch.check(self.machines[i], envs)
                                       for i, envs in by_machine.items()))
        return {env_id: state for states in found for env_id, state in states.items()}

    async def terminate(self, env: Agent, grace_s: float) -> None:
        if not self._place(env):
            env.phase = "gone"
            return
        assert env.machine is not None
        try:
            await watch.stop(env.machine, env, grace_s)
        except MachineError as e:
            raise PlatformError(str(e)) from None

    async def list_alive(self, experiment_id: str) -> dict[str, str]:
        # Every agent lives in <home>/trialkeeper-experiments/<experiment>/envs/<env> on its
        # machine, with its pid file there: that directory is the label, on every machine.
        found = await asyncio.gather(*(watch.leftovers(m, experiment_id) for m in self.machines))
        return {env_id: ref for one in found for env_id, ref in one.items()}

    def ended(self, env: Agent) -> Observation:
        if env.phase in ("succeeded", "stopped"):
            return Observation("exited", env.detail, env.platform_id)
        return Observation("failed", env.detail, env.platform_id)

    # ---- inside ---------------------------------------------------------------------

    def _load(self, env: Agent) -> dict[int, int]:
        """Machine index -> its environments that wait or run, ``env`` left out."""
        live: dict[int, int] = {}
        for e in (*self._records.values(), *self._launching.values()):
            if e is not env and e.machine is not None and e.observation is None:
                live[e.machine.index] = live.get(e.machine.index, 0) + 1
        return live

    def _machine_of(self, platform_id: str) -> Machine | None:
        label = platform_id.rpartition(" pid ")[0]
        return next((m for m in self.machines if m.label == label), None)

    def _place(self, env: Agent) -> bool:
        """Whether ``env``'s machine and directory are known (found by a sweep: from its
        platform id and experiment; the helper expands ``~``)."""
        if env.machine is None:
            env.machine = self._machine_of(env.platform_id)
            if env.machine is not None and env.experiment_id is not None:
                env.dir = f"~/{REMOTE_ROOT}/{env.experiment_id}/envs/{env.env_id}"
        return env.machine is not None and bool(env.dir)

    async def _ready(self, m: Machine, experiment_id: str) -> None:
        if m.setup is None or (m.setup.done() and m.setup.exception() is not None):
            m.setup = asyncio.ensure_future(self._set_up(m, experiment_id))
            # Its failure is reported by the starts that await it; one left alone when they
            # are canceled (a stop mid-setup) must not be logged as never retrieved.
            m.setup.add_done_callback(_ignore_result)
        await asyncio.shield(m.setup)
        self._placement.works(m)

    async def _set_up(self, m: Machine, experiment_id: str) -> None:
        started = time.monotonic()
        assert self._code is not None
        if self.config.bootstrap:
            assert self._wheel is not None
        await m.set_up(experiment_id, self._code, self._wheel if self.config.bootstrap else None)
        m.dial = await self._dial.of(m)
        log.info("%s: ready in %.2f s (python %s)", m.label, time.monotonic() - started, m.python)

    async def _launch(self, env: Agent, m: Machine, request: EnvironmentRequest) -> int:
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
        argv = agent_argv(with_port(m.dial, request.coordinator_address), env.env_id,
                          self.platform, python=None, workdir=env.dir,
                          copy_working_directory=True, tls_cert=tls_cert, agent_args=extra)
        answer = await m.helper(
            "start",
            {"python": m.python, "env_dir": env.dir, "cwd": m.exp_dir, "argv": argv},
            stdin=request.token.encode(),
        )
        env.pid = int(answer["pid"])
        return env.pid

def _hold(env: Agent, m: Machine, why: str) -> None:
    env.machine = m
    if why:
        env.detail = why


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # an early connect's or a setup's failure is reported by start()
