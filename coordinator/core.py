"""The coordinator: starts environments, accepts agents, places trials, stores everything.

It runs on one asyncio loop. Agent messages are persisted inside one transaction each and
acknowledged after the commit; callbacks and event subscribers hear of them after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
from trialkeeper.protos.v1 import coordinator_pb2 as pb

from . import scheduler
from . import tls as tls_identity
from .config import ExperimentConfig, config_to_dict
from .model import EnvState, MetricEvent, StatusEvent, TrialInfo, TrialState
from .server import AgentLink, AgentRejected, Servicer, create_server
from .services import create_service
from .services.base import EnvironmentRequest, EnvironmentService
from .states import EnvStatus, TrialStatus, check_env, check_trial
from .store import GpuSampleRow, MetricRow, Store

log = logging.getLogger(__name__)

_KIND_NAMES = {pb.METRIC_KIND_INTERMEDIATE: "intermediate", pb.METRIC_KIND_FINAL: "final"}
_STREAM_NAMES = {pb.LOG_STREAM_STDOUT: "stdout", pb.LOG_STREAM_STDERR: "stderr"}
CANCEL_GRACE_S = 5.0
# How long an agent may take to register once its platform runs it (queue time not counted).
AGENT_START_TIMEOUT_S = 60.0
# How often a GPU sample of each environment is kept in the store (and on every change of
# which trials hold its GPUs).
GPU_SAMPLE_INTERVAL_S = 5.0
# A trial's stdout or stderr streamed from an agent is kept up to this size.
MAX_TRIAL_LOG_BYTES = 1 << 30
# Retries of a trial wait 1, 2, 4, ... seconds, at most RETRY_BACKOFF_MAX_S.
RETRY_BACKOFF_S = 1.0
RETRY_BACKOFF_MAX_S = 60.0


class CoordinatorError(RuntimeError):
    """Root of the coordinator's errors."""


class TrialRefused(CoordinatorError, ValueError):
    """A submitted trial can never run here (it asks for more than any environment has)."""


class TrialHandle:
    """A submitted trial: its id, a snapshot of its state, and a way to wait for its end."""

    def __init__(self, coordinator: Coordinator, trial_id: str) -> None:
        self._c = coordinator
        self.id = trial_id

    @property
    def info(self) -> TrialInfo:
        return self._c.trial(self.id)

    async def wait(self, timeout: float | None = None) -> TrialInfo:
        """Wait until the trial reaches a terminal status; returns its final snapshot."""
        return await self._c.wait(self.id, timeout)

    async def cancel(self) -> None:
        await self._c.cancel(self.id)

    def __repr__(self) -> str:
        return f"TrialHandle({self.id!r}, {self.info.status.value})"


class Coordinator:
    """Runs an experiment's trials on the environments its config describes.

    Use it as ``async with Coordinator(config) as c:`` or call :meth:`start` and
    :meth:`stop`. Submit parameter sets with :meth:`submit`; hear of results through
    :meth:`on_metric` / :meth:`on_status` callbacks or the :meth:`events` iterator.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        *,
        experiment_dir: Path | None = None,
        experiment_id: str | None = None,
        service: EnvironmentService | None = None,
    ) -> None:
        self.config = config
        self.experiment_id = experiment_id or _new_id(8)
        self.experiment_dir = Path(
            experiment_dir or Path(config.experiment_working_directory) / self.experiment_id
        ).resolve()
        self.address = ""
        self._service = service
        self._ts = config.training_service
        self._reuse = bool(self._ts.reuse_mode)
        self._token = secrets.token_urlsafe(32)
        #: SHA-256 of the certificate agents pin when ``coordinator.tls`` is on, else None.
        self.tls_fingerprint: str | None = None
        self._trials: dict[str, TrialState] = {}
        self._queue: list[str] = []
        self._envs: dict[str, EnvState] = {}
        self._env_counter = 0
        self._failed_starts = 0
        self._env_error = ""
        self._metric_callbacks: list[Callable[[MetricEvent], Any]] = []
        self._status_callbacks: list[Callable[[StatusEvent], Any]] = []
        self._subscribers: set[asyncio.Queue[MetricEvent | StatusEvent]] = set()
        self._notes: list[MetricEvent | StatusEvent] = []
        self._gpu_rows: list[GpuSampleRow] = []  # sampled, not yet stored (see _record_gpu_samples)
        self._server: grpc.aio.Server | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._started = False
        self._resuming = False
        self.store: Store | None = None
        self._changed = asyncio.Event()
        self._pass_pending = False
        # Heartbeat interval and lost timeouts are stretched by this factor for a large fleet.
        self._beat_scale = 1.0
        # Poll the platform at the monitor's next wake-up rather than at its next tick.
        self._check_now = False
        self._linked: set[str] = set()  # environments whose agent has a stream open

    # ---- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Coordinator:  # noqa: PYI034 - Self needs Python 3.11
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @classmethod
    def resume(
        cls,
        experiment_dir: Path,
        *,
        config: ExperimentConfig | None = None,
        service: EnvironmentService | None = None,
    ) -> Coordinator:
        """A coordinator that carries on the experiment in ``experiment_dir`` after a crash.

        Its state is rebuilt from the store when it starts; it binds the address the
        experiment had, so agents still running reconnect within their window and their
        trials go on. ``config`` replaces the stored one (which has its secrets redacted).
        """
        experiment_dir = Path(experiment_dir).resolve()
        store = Store.in_dir(experiment_dir, readonly=True)
        try:
            exp = store.experiment()
        finally:
            store.close()
        if exp is None:
            raise CoordinatorError(f"{experiment_dir} holds no experiment to resume")
        if config is None:
            from .config import ConfigError, parse_config

            try:
                config = parse_config(json.loads(exp["config_json"]), experiment_dir)
            except ConfigError as e:
                raise CoordinatorError(
                    f"the stored config of {experiment_dir} cannot be used as it is ({e}); pass the config file"
                ) from e
        c = cls(config, experiment_dir=experiment_dir, experiment_id=exp["id"], service=service)
        c._resuming = True
        return c

    async def start(self) -> None:
        """Open the store, start the gRPC server and the first environments."""
        self.experiment_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store.in_dir(self.experiment_dir)
        token_file = self.experiment_dir / ".token"
        bind = self.config.coordinator.address
        if self._resuming:
            try:
                self._token = token_file.read_text().strip()
            except OSError as e:
                raise CoordinatorError(f"cannot resume: the experiment's token file is unreadable: {e}") from e
            bind = self.store.meta("bound_address") or bind
            self._load_state()
            self.store.set_experiment_status("RUNNING", "resumed")
        else:
            if self.store.experiment() is not None:
                raise CoordinatorError(f"{self.experiment_dir} already holds an experiment; choose another directory")
            self.store.create_experiment(
                self.experiment_id, self.config.experiment_name, config_to_dict(self.config, redact=True)
            )
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._token)
        if self._service is None:
            self._service = create_service(self.config, self.experiment_dir)
        await self._service.prepare()
        for env in self._live_envs():
            if env.platform_id:
                self._service.adopt(env.id, env.platform_id)
        if self._resuming:
            await self._sweep_orphans()
        settings = self.config.coordinator
        servicer = Servicer(self, self._token)
        # With TLS, agents are launched with the certificate's fingerprint and pin it.
        identity = tls_identity.load_or_create(self.experiment_dir) if settings.tls else None
        self.tls_fingerprint = identity.fingerprint if identity else None
        self._server, port = await create_server(
            bind, servicer, tls_key_cert=identity.key_cert if identity else None
        )
        self.store.set_meta("bound_address", f"{bind.rsplit(':', 1)[0]}:{port}")
        host = settings.address.rsplit(":", 1)[0]
        if settings.advertise_address:
            self.address = settings.advertise_address
        else:
            if host in ("", "0.0.0.0", "[::]"):
                host = socket.gethostname()
            self.address = f"{host}:{port}"
        self.store.set_coordinator_address(self.address)
        self._started = True
        log.info("experiment %s: coordinator listening on %s; directory %s", self.experiment_id, self.address, self.experiment_dir)
        self._monitor = asyncio.create_task(self._monitor_loop(), name="coordinator-monitor")
        self._reconcile()

    async def stop(self, grace_s: float = CANCEL_GRACE_S, *, status: str = "DONE", reason: str = "") -> None:
        """Cancel what still runs, stop every environment, close the server and store."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        for t in list(self._trials.values()):
            if not t.status.terminal:
                await self.cancel(t.id, reason="the experiment stopped", status=TrialStatus.SYS_CANCELED)
        for env in self._live_envs():
            self._shutdown_env(env, drain=False, reason="the experiment stopped", grace_s=grace_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._until(lambda: all(e.link is None for e in self._envs.values())), grace_s + 10)
        assert self._service is not None
        await asyncio.gather(*(self._service.stop(e.id, 2.0) for e in self._envs.values()), return_exceptions=True)
        for env in self._live_envs():
            self._env_to(env, EnvStatus.STOPPED, "the experiment stopped")
        for t in list(self._trials.values()):
            if not t.status.terminal:
                self._trial_to(t, TrialStatus.SYS_CANCELED, "the experiment stopped before the agent confirmed")
        self._flush_notes()
        if self._monitor:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self._service.close()
        if self._server:
            await self._server.stop(1.0)
        for task in list(self._tasks):
            task.cancel()
        assert self.store is not None
        self._store_gpu_samples()
        self.store.set_experiment_status(status, reason, ended=True)
        self.store.close()
        self._started = False

    async def _sweep_orphans(self) -> None:
        """After a crash: remove what the platform still runs for this experiment that the
        store does not count on (an environment started just before the crash and never
        recorded, or one the store had already ended), so that nothing is left orphaned."""
        assert self._service is not None
        keep = {e.id for e in self._live_envs()}
        try:
            removed = await self._service.sweep(self.experiment_id, keep=keep)
        except Exception:  # a service must return errors, but resume goes on without the sweep
            log.exception("environment service %s raised on sweep", self._service.platform)
            return
        if removed:
            log.info("experiment %s: removed %d orphaned environment(s): %s", self.experiment_id, len(removed), ", ".join(removed))

    def _load_state(self) -> None:
        """Rebuild trials, queue and environments from the store (after a crash).

        Environments that were up are taken as unreachable until their agents reconnect;
        the usual timers apply from now. Trials keep their placements: a running trial
        whose agent comes back goes on, one whose agent does not is lost like any other.
        """
        assert self.store is not None
        now = time.monotonic()
        for r in self.store.trials():
            t = TrialState(
                id=r["id"], seq=r["seq"], status=TrialStatus(r["status"]),
                parameters=json.loads(r["parameters_json"]), command=r["command"], gpu_number=r["gpu_number"],
                submitted_at=r["submitted_at"], gpu_memory=self.config.trial_gpu_memory if r["gpu_number"] else 0,
                env_id=r["environment_id"], gpu_indices=tuple(json.loads(r["gpu_indices_json"])),
                gpu_uuids=tuple(json.loads(r["gpu_uuids_json"])),
                exit_code=r["exit_code"], signal=r["signal"], reason=r["reason"], stderr_tail=r["stderr_tail"],
                final_metric=r["final_metric"], final_metric_json=r["final_metric_json"], attempts=r["attempts"],
                started_at=r["started_at"], ended_at=r["ended_at"],
            )
            if t.status.terminal:
                t.done.set()
            elif t.env_id is None:
                self._queue.append(t.id)
            self._trials[t.id] = t
        for r in self.store.envs():
            number = r["id"].removeprefix("env-")
            if number.isdigit():
                self._env_counter = max(self._env_counter, int(number))
            status = EnvStatus(r["status"])
            info = json.loads(r["info_json"] or "{}")
            env = EnvState(
                id=r["id"], status=status, single_use=not self._reuse,
                trial_slots=1 if not self._reuse else self._ts.trial_slots_per_environment(self.config.trial_concurrency),
                platform_id=r["platform_id"], reason=r["reason"], hostname=r["hostname"],
                instance_id=r["agent_instance_id"], last_seq=r["last_seq"], last_seen=now, requested_at=now,
            )
            per_gpu, env.use_active_gpu = self._gpu_policy(env.id)
            env.gpus = [
                scheduler.GpuSlot(g["uuid"], g["index"], per_gpu, memory_total_bytes=g.get("memory_total_bytes", 0))
                for g in info.get("gpus", [])
            ]
            env.gpu_names = {g["uuid"]: g["name"] + (" (simulated)" if g.get("simulated") else "") for g in info.get("gpus", [])}
            self._envs[env.id] = env
            if status in (EnvStatus.READY, EnvStatus.BUSY, EnvStatus.DRAINING):
                env.status = EnvStatus.LOST
                env.draining = status is EnvStatus.DRAINING
                self.store.update_env(env.id, status=EnvStatus.LOST.value, reason="the coordinator restarted")
                self.store.record("environment", env.id, status.value, EnvStatus.LOST.value, "the coordinator restarted; waiting for its agent")
        for t in self._trials.values():
            if t.status.terminal or t.env_id is None:
                continue
            host = self._envs.get(t.env_id)
            if host is None or host.status.terminal:
                # Placed on an environment that is gone: back to the queue, or lost.
                t.env_id, t.gpu_indices = None, ()
                if t.status is TrialStatus.WAITING:
                    self._queue.append(t.id)
                else:
                    self._trial_to(t, TrialStatus.FAILED, "environment lost: it ended while the coordinator was down")
                continue
            host.holders.add(t.id)
            # By UUID: MIG devices share their parent's index. (A store from before UUIDs
            # were kept has indices only.)
            if not t.gpu_uuids:
                t.gpu_uuids = tuple(g.uuid for g in host.gpus if g.index in t.gpu_indices)
            for g in host.gpus:
                if g.uuid in t.gpu_uuids:
                    g.take(t.id)
        self._queue.sort(key=lambda tid: self._trials[tid].seq)
        log.info(
            "experiment %s resumed: %d trials (%d not finished), %d environments waiting for their agents",
            self.experiment_id, len(self._trials), sum(1 for t in self._trials.values() if not t.status.terminal),
            len(self._live_envs()),
        )

    # ---- the embedding API -------------------------------------------------------------

    async def submit(
        self,
        parameters: dict[str, Any],
        *,
        command: str | None = None,
        gpu_number: int | None = None,
        gpu_memory: int | None = None,
        env: dict[str, str] | None = None,
    ) -> TrialHandle:
        """Queue a trial with these parameters; returns at once with its handle.

        ``command``, ``gpu_number`` and ``gpu_memory`` (bytes each GPU must have free)
        override the config for this trial. Raises :class:`TrialRefused` when no
        environment could ever run it.
        """
        if not self._started or self._stopping:
            raise CoordinatorError("the coordinator is not running")
        if not isinstance(parameters, dict):
            raise TypeError(f"parameters must be a dict, got {type(parameters).__name__}")
        try:
            params_json = json.dumps(parameters)
        except (TypeError, ValueError) as e:
            raise TypeError(f"parameters must be JSON-serialisable: {e}") from e
        gpus = self.config.trial_gpu_number if gpu_number is None else gpu_number
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
            raise ValueError(f"gpu_number must be an integer >= 0, got {gpus!r}")
        memory = self.config.trial_gpu_memory if gpu_memory is None else gpu_memory
        if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
            raise ValueError(f"gpu_memory must be a number of bytes >= 0, got {memory!r}")
        refusal = self._never_fits(gpus, memory)
        if refusal:
            raise TrialRefused(refusal)
        assert self.store is not None
        seq = self.store.next_trial_seq()
        trial_id = _new_id(6)
        while trial_id in self._trials:
            trial_id = _new_id(6)
        t = TrialState(
            id=trial_id,
            seq=seq,
            status=TrialStatus.WAITING,
            parameters=json.loads(params_json),
            command=command or self.config.trial_command,
            gpu_number=gpus,
            gpu_memory=memory if gpus else 0,
            submitted_at=time.time(),
            env_overrides=dict(env or {}),
        )
        self.store.insert_trial(
            {
                "id": t.id, "seq": t.seq, "status": t.status.value, "parameters_json": params_json,
                "command": t.command, "gpu_number": gpus, "submitted_at": t.submitted_at,
            }
        )
        self._trials[trial_id] = t
        self._queue.append(trial_id)
        self._notes.append(StatusEvent(t.info(), TrialStatus.WAITING))
        self._flush_notes()
        self._pass_soon()
        return TrialHandle(self, trial_id)

    async def cancel(
        self, trial_id: str, *, reason: str = "canceled by the user", status: TrialStatus = TrialStatus.USER_CANCELED
    ) -> None:
        """Cancel a trial; a running one gets SIGTERM, then SIGKILL after the grace period."""
        t = self._trial_state(trial_id)
        if t.status.terminal:
            return
        if not t.placed:
            self._queue.remove(trial_id)
            self._trial_to(t, status, reason)
        else:
            t.cancel_status = status
            t.reason = reason
            assert self.store is not None
            # Shown while the agent stops it; the end replaces it with the final reason.
            self.store.update_trial(t.id, reason=f"stopping: {reason}")
            env = self._envs.get(t.env_id or "")
            if env is not None and env.link is not None:
                env.link.send(pb.CoordinatorMessage(cancel_trial=pb.CancelTrial(trial_id=trial_id, grace_s=CANCEL_GRACE_S, reason=reason)))
        self._flush_notes()

    async def early_stop(self, trial_id: str, reason: str = "stopped early by the assessor") -> None:
        """Stop a running trial because it is not promising (EARLY_STOPPED)."""
        await self.cancel(trial_id, reason=reason, status=TrialStatus.EARLY_STOPPED)

    def trial(self, trial_id: str) -> TrialInfo:
        """A snapshot of one trial."""
        return self._trial_state(trial_id).info()

    def trials(self) -> list[TrialInfo]:
        """Snapshots of every trial, in submission order."""
        return [t.info() for t in sorted(self._trials.values(), key=lambda t: t.seq)]

    def environments(self) -> list[EnvState]:
        return list(self._envs.values())

    async def wait(self, trial_id: str, timeout: float | None = None) -> TrialInfo:
        """Wait for one trial to end."""
        t = self._trial_state(trial_id)
        await asyncio.wait_for(t.done.wait(), timeout)
        return t.info()

    async def wait_all(self, timeout: float | None = None) -> list[TrialInfo]:
        """Wait until every submitted trial has ended."""
        await asyncio.wait_for(self._until(lambda: all(t.status.terminal for t in self._trials.values())), timeout)
        return self.trials()

    def on_metric(self, callback: Callable[[MetricEvent], Any]) -> None:
        """Call ``callback(event)`` for every stored metric (async callbacks are scheduled)."""
        self._metric_callbacks.append(callback)

    def on_status(self, callback: Callable[[StatusEvent], Any]) -> None:
        """Call ``callback(event)`` for every trial status change."""
        self._status_callbacks.append(callback)

    async def events(self) -> AsyncIterator[MetricEvent | StatusEvent]:
        """Iterate over metric and status events from now on."""
        q: asyncio.Queue[MetricEvent | StatusEvent] = asyncio.Queue()
        self._subscribers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._subscribers.discard(q)

    @property
    def environment_error(self) -> str:
        """Why environments can no longer be started, or ''."""
        return self._env_error

    # ---- agent streams (called by the servicer) ----------------------------------------

    def agent_connected(self, reg: pb.Register, link: AgentLink) -> None:
        env = self._envs.get(reg.environment_id)
        if self._stopping:
            raise AgentRejected(grpc.StatusCode.FAILED_PRECONDITION, "the experiment is stopping")
        if env is None:
            if not self._reuse:
                raise AgentRejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"unknown environment {reg.environment_id!r}; without reuse mode agents join only environments the coordinator started",
                )
            # An operator started this agent by hand: it joins as an extra environment.
            env = self._new_env(reg.environment_id, platform=reg.platform or "manual", status=EnvStatus.STARTING)
        if env.status.terminal:
            raise AgentRejected(grpc.StatusCode.FAILED_PRECONDITION, f"environment {env.id} was {env.status.value.lower()}: {env.reason}")
        if env.link is not None and not env.link.closed:
            if env.instance_id != reg.agent_instance_id:
                raise AgentRejected(grpc.StatusCode.FAILED_PRECONDITION, f"environment {env.id} already has a connected agent")
            env.link.close()  # the same agent reconnected before its old stream was noticed dead
        assert self.store is not None
        new_instance = env.instance_id != reg.agent_instance_id
        if new_instance:
            if env.instance_id:
                self._lose_trials(env, "its agent restarted", keep=set())
            env.instance_id = reg.agent_instance_id
            env.last_seq = 0
            per_gpu, env.use_active_gpu = self._gpu_policy(env.id)
            env.gpus = [
                scheduler.GpuSlot(g.uuid, g.index, per_gpu, memory_total_bytes=g.memory_total_bytes)
                for g in reg.gpus
            ]
            env.gpu_names = {
                g.uuid: g.name + (" (MIG)" if g.mig else "") + (" (simulated)" if g.simulated else "") for g in reg.gpus
            }
            env.gpu_reason = reg.gpu_unavailable_reason
            info = {
                "pid": reg.pid, "cpu_count": reg.cpu_count, "memory_total_bytes": reg.memory_total_bytes,
                "agent_version": reg.agent_version, "driver_version": reg.driver_version,
                "cuda_version": reg.cuda_version, "gpu_unavailable_reason": reg.gpu_unavailable_reason,
                "gpus": [
                    {
                        "index": g.index, "uuid": g.uuid, "name": g.name, "memory_total_bytes": g.memory_total_bytes,
                        "simulated": g.simulated, "mig": g.mig,
                    }
                    for g in reg.gpus
                ],
            }
            self.store.update_env(env.id, hostname=reg.hostname, agent_instance_id=env.instance_id, last_seq=0, info_json=json.dumps(info))
        env.hostname = reg.hostname
        env.link = link
        self._linked.add(env.id)
        env.last_seen = time.monotonic()
        self._failed_starts = 0
        if env.status in (EnvStatus.STARTING, EnvStatus.LOST):
            self._env_to(env, EnvStatus.READY, f"agent registered from {reg.hostname} (pid {reg.pid})")
            if env.holders:
                self._env_to(env, EnvStatus.BUSY, f"it runs {len(env.holders)} trial(s)")
        if new_instance:
            self._refuse_unfittable()
        active = set(reg.active_trial_ids)
        unwanted = [
            tid for tid in active
            if tid not in self._trials or self._trials[tid].env_id != env.id or self._trials[tid].cancel_status is not None
        ]
        link.send(
            pb.CoordinatorMessage(
                welcome=pb.Welcome(
                    experiment_id=self.experiment_id,
                    acked_seq=env.last_seq,
                    heartbeat_interval_s=self.heartbeat_interval,
                    protocol_version=1,
                    cancel_trial_ids=unwanted,
                )
            )
        )
        # A StartTrial lost in a broken stream: the agent does not know the trial, send it again.
        for tid in sorted(env.holders - active, key=lambda i: self._trials[i].seq):
            t = self._trials[tid]
            if not t.status.terminal and t.cancel_status is None:
                self._send_start(env, t)
        self._rescale_heartbeats()  # after the Welcome: it must be the agent's first message
        self._schedule()
        self._flush_notes()

    @property
    def heartbeat_interval(self) -> float:
        """The interval agents heartbeat at now: the configured one, or longer for a fleet
        that would otherwise send more than maxHeartbeatsPerSecond."""
        return self.config.coordinator.heartbeat_interval * self._beat_scale

    def _rescale_heartbeats(self) -> None:
        """Stretch (or shrink back) the heartbeat interval to the number of connected agents,
        with headroom so that a growing fleet changes it a few times, not on every join;
        connected agents are told at once."""
        settings = self.config.coordinator
        connected = len(self._linked)
        needed = max(1.0, connected / (settings.heartbeat_interval * settings.max_heartbeats_per_second))
        if self._beat_scale >= needed and (self._beat_scale <= 1.0 or needed * 2 > self._beat_scale):
            return
        self._beat_scale = 1.0 if needed <= 1.0 else needed * 1.25
        log.info(
            "%d agents connected: heartbeats every %.3g s, lost after %.3g s / %.3g s",
            connected, self.heartbeat_interval, settings.agent_lost_timeout * self._beat_scale,
            settings.trial_lost_timeout * self._beat_scale,
        )
        message = pb.CoordinatorMessage(settings=pb.Settings(heartbeat_interval_s=self.heartbeat_interval))
        for e in self._envs.values():
            if e.link is not None:
                e.link.send(message)

    def agent_disconnected(self, env_id: str, link: AgentLink) -> None:
        env = self._envs.get(env_id)
        if env is None or env.link is not link:
            return
        env.link = None
        self._linked.discard(env.id)
        log.info("environment %s: agent stream closed", env_id)
        self._rescale_heartbeats()
        self._check_now = True  # did its process exit? Ask the platform now, not at the next tick
        self._changed.set()

    def agent_message(self, env_id: str, link: AgentLink, msg: pb.AgentMessage) -> None:
        env = self._envs.get(env_id)
        if env is None or env.link is not link:
            return  # a stream that was replaced
        env.last_seen = time.monotonic()
        if env.status is EnvStatus.LOST:
            self._env_to(env, EnvStatus.BUSY if env.holders else EnvStatus.READY, "its agent is heard from again")
            self._flush_notes()
        kind = msg.WhichOneof("body")
        if kind == "heartbeat":
            self._on_heartbeat(env, msg.heartbeat)
            return
        if kind in (None, "register"):
            log.warning("environment %s sent an unexpected %s message; ignored", env_id, kind)
            return
        if msg.seq == 0:
            log.warning("environment %s sent %s without a sequence number; ignored", env_id, kind)
            return
        if msg.seq <= env.last_seq:
            link.ack(env.last_seq)  # a replay of something already stored
            return
        assert self.store is not None
        try:
            with self.store.transaction():
                getattr(self, f"_on_{kind}")(env, getattr(msg, kind))
                self.store.update_env(env.id, last_seq=msg.seq)
        except Exception:
            # A message we cannot apply must not be replayed forever: skip it, loudly.
            log.exception("environment %s: could not apply %s #%d; skipped", env_id, kind, msg.seq)
            self.store.update_env(env.id, last_seq=msg.seq)
        env.last_seq = msg.seq
        link.ack(msg.seq)
        self._flush_notes()
        self._pass_soon()

    # ---- agent message handlers (inside the store transaction) -------------------------

    def _own_trial(self, env: EnvState, trial_id: str, what: str) -> TrialState | None:
        t = self._trials.get(trial_id)
        if t is None or t.env_id != env.id:
            env.ignored_messages += 1
            # Logged, but not one line per message: a broken or hostile agent may send many.
            if env.ignored_messages <= 10 or env.ignored_messages % 1000 == 0:
                log.warning(
                    "environment %s reported %s for trial %r, which is not placed there; ignored (%d so far)",
                    env.id, what, trial_id, env.ignored_messages,
                )
            return None
        return t

    def _on_trial_started(self, env: EnvState, m: pb.TrialStarted) -> None:
        t = self._own_trial(env, m.trial_id, "a start")
        if t is None or t.status is not TrialStatus.WAITING:
            return
        t.started_at = m.started_at or time.time()
        assert self.store is not None
        self.store.update_trial(t.id, started_at=t.started_at)
        self._trial_to(t, TrialStatus.RUNNING, f"running on {env.id} (pid {m.pid})")

    def _on_metrics(self, env: EnvState, batch: pb.MetricBatch) -> None:
        rows: list[MetricRow] = []
        finals: dict[str, tuple[float, str]] = {}
        owned: dict[str, TrialState | None] = {}
        for m in batch.metrics:  # every metric a trial reports passes here: kept lean
            trial_id, value = m.trial_id, m.value
            t = owned[trial_id] if trial_id in owned else owned.setdefault(trial_id, self._own_trial(env, trial_id, "a metric"))
            kind = _KIND_NAMES.get(m.kind)
            if t is None or kind is None or not math.isfinite(value):
                continue
            row = MetricRow(trial_id, m.index, kind, value, m.value_json, m.reported_at)
            rows.append(row)
            if kind == "final":
                finals[trial_id] = (value, row.value_json)
        assert self.store is not None
        self.store.add_metrics(rows)
        for trial_id, (value, raw) in finals.items():
            t = self._trials[trial_id]
            t.final_metric, t.final_metric_json = value, raw
            self.store.update_trial(trial_id, final_metric=value, final_metric_json=raw)
        if self._metric_callbacks or self._subscribers:
            for r in rows:
                self._notes.append(MetricEvent(r.trial_id, r.kind, r.index, r.value, _loads(r.value_json)))

    def _on_log(self, env: EnvState, chunk: pb.LogChunk) -> None:
        if self._service is not None and self._service.shares_filesystem and env.id.startswith("env-"):
            return
        t = self._own_trial(env, chunk.trial_id, "log output")
        stream = _STREAM_NAMES.get(chunk.stream)
        if t is None or stream is None:
            return
        path = self.experiment_dir / "trials" / t.id / f"{stream}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        size = path.stat().st_size if path.exists() else 0
        # Chunks come in order (replays may repeat one): an offset past the end would
        # leave a hole, and a huge one would make a huge sparse file.
        if chunk.offset > size or chunk.offset + len(chunk.data) > MAX_TRIAL_LOG_BYTES:
            if not t.log_refused:
                t.log_refused = True
                log.warning(
                    "environment %s: refused %s output of trial %s at offset %d (file has %d bytes, limit %d)",
                    env.id, stream, t.id, chunk.offset, size, MAX_TRIAL_LOG_BYTES,
                )
            return
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.seek(chunk.offset)
            f.write(chunk.data)

    def _on_trial_ended(self, env: EnvState, m: pb.TrialEnded) -> None:
        t = self._own_trial(env, m.trial_id, "an end")
        if t is None or t.status.terminal:
            return
        t.exit_code = m.exit_code if m.has_exit_code else None
        t.signal = m.signal or None
        t.stderr_tail = m.stderr_tail
        t.ended_at = m.ended_at or time.time()
        if m.outcome == pb.TRIAL_OUTCOME_SUCCEEDED:
            new, reason = TrialStatus.SUCCEEDED, ""
        elif m.outcome == pb.TRIAL_OUTCOME_CANCELED and t.cancel_status is not None:
            new, reason = t.cancel_status, t.reason
        elif m.outcome == pb.TRIAL_OUTCOME_LOST and t.cancel_status is None:
            # Gone with its environment, like a trial on a lost agent: retried within
            # maxTrialRetries whether or not failed trials are retried.
            assert self.store is not None
            self.store.update_trial(t.id, exit_code=t.exit_code, signal=t.signal, ended_at=t.ended_at)
            self._lose_trials(env, m.reason or "its environment was stopped", keep=env.holders - {t.id})
            return
        else:
            new, reason = TrialStatus.FAILED, m.reason or "the trial failed"
        if t.status is TrialStatus.WAITING and new is not TrialStatus.FAILED and new not in (
            TrialStatus.USER_CANCELED, TrialStatus.SYS_CANCELED
        ):
            new = TrialStatus.FAILED if new is TrialStatus.SUCCEEDED else TrialStatus.USER_CANCELED
        assert self.store is not None
        self.store.update_trial(
            t.id, exit_code=t.exit_code, signal=t.signal, stderr_tail=t.stderr_tail, ended_at=t.ended_at
        )
        self._release(env, t, still_in_use=m.gpus_still_in_use)
        if (
            new is TrialStatus.FAILED
            and t.cancel_status is None
            and self.config.retry_failed_trials
            and t.attempts <= self.config.max_trial_retries
            and not self._stopping
        ):
            t.ended_at = None
            self._retry(t, f"it failed ({reason})")
        else:
            self._trial_to(t, new, reason)
        if env.single_use:
            self._shutdown_env(env, drain=True, reason="its trial ended (reuse mode is off)")

    def _on_heartbeat(self, env: EnvState, hb: pb.Heartbeat) -> None:
        samples = hb.gpus
        if samples or env.gpus:
            self._gpus_sampled(env, hb, samples)
        if hb.draining and not env.draining:
            env.draining = True
            if env.status in (EnvStatus.READY, EnvStatus.BUSY):
                self._env_to(env, EnvStatus.DRAINING, "the agent is draining (an operator stopped it)")
                self._flush_notes()

    def _gpus_sampled(self, env: EnvState, hb: pb.Heartbeat, samples: Sequence[pb.GpuSample]) -> None:
        totals = {g.uuid: g.memory_total_bytes for g in env.gpus}
        env.gpu_usage = gpu_usage = {}
        seen: dict[str, set[str]] = {}
        usage: dict[str, dict[str, int]] = {}
        memory_used: dict[str, int] = {}
        foreign = set()
        for s in samples:
            uuid, used = s.uuid, s.memory_used_bytes
            memory_used[uuid] = used
            gpu_usage[uuid] = (s.utilization_percent, used, totals.get(uuid, 0))
            if not s.processes:
                continue
            for p in s.processes:
                if p.trial_id:
                    seen.setdefault(uuid, set()).add(p.trial_id)
                    per = usage.setdefault(uuid, {})
                    per[p.trial_id] = per.get(p.trial_id, 0) + p.used_memory_bytes
                else:
                    foreign.add(uuid)
        env.gpu_seen = seen
        was_foreign = {g.uuid for g in env.gpus if g.foreign_busy}
        released = scheduler.gpu_sampled(env.gpus, seen, foreign=foreign, memory_used=memory_used, usage=usage)
        for uuid, tid in released:
            log.info("environment %s: GPU %s released by ended trial %s (its processes left the GPU)", env.id, uuid, tid)
        if samples:
            self._record_gpu_samples(env, hb)
        if released or was_foreign != foreign:
            self._schedule()

    def _record_gpu_samples(self, env: EnvState, hb: pb.Heartbeat) -> None:
        """Keep a GPU sample of ``env`` every GPU_SAMPLE_INTERVAL_S, and whenever the set of
        trials on its GPUs changed, so short trials have samples too."""
        now = time.monotonic()
        if now - env.gpu_recorded_at < GPU_SAMPLE_INTERVAL_S and [g.holders for g in env.gpus] == env.gpu_recorded_holders:
            return
        env.gpu_recorded_at, env.gpu_recorded_holders = now, [set(g.holders) for g in env.gpus]
        holders = {g.uuid: g.holders for g in env.gpus}
        at = time.time()
        # Stored by the monitor, a tick's samples of every environment in one transaction.
        self._gpu_rows.extend(
            GpuSampleRow(
                at, env.id, s.uuid, s.utilization_percent, s.memory_used_bytes, env.gpu_usage[s.uuid][2],
                tuple(sorted(holders.get(s.uuid, set()) | env.gpu_seen.get(s.uuid, set()))),
            )
            for s in hb.gpus
        )

    def _store_gpu_samples(self) -> None:
        if self._gpu_rows and self.store is not None:
            rows, self._gpu_rows = self._gpu_rows, []
            try:
                self.store.add_gpu_samples(rows)
            except (sqlite3.Error, OSError) as e:
                # Samples only: the monitor goes on, and the next tick's are stored anew.
                log.warning("could not store %d GPU samples: %s", len(rows), e)

    # ---- placing trials ----------------------------------------------------------------

    def _gpu_policy(self, env_id: str) -> tuple[int, bool]:
        """GPU sharing for one environment: the platform's per-machine values, else the
        experiment's."""
        return self._ts.gpu_sharing(self._service.gpu_policy(env_id) if self._service is not None else (None, None))

    def _capacity_views(self) -> list[scheduler.EnvCapacity]:
        views = []
        for env in self._envs.values():
            accepting = (
                env.status in (EnvStatus.READY, EnvStatus.BUSY)
                and env.link is not None
                and not env.draining
                and not env.shutdown_sent
                and not (env.single_use and env.used)
            )
            views.append(
                scheduler.EnvCapacity(
                    env_id=env.id,
                    trial_slots=env.trial_slots,
                    holders=env.holders,
                    gpus=env.gpus,
                    use_active_gpu=env.use_active_gpu,
                    accepting=accepting,
                )
            )
        return views

    def _pass_soon(self) -> None:
        """Place waiting trials and top up environments as soon as the current burst of work
        yields: a burst of submits or agent messages costs one scheduling pass, not one
        each, and a trial submitted to an idle agent does not wait for the monitor's tick."""
        if not self._pass_pending:
            self._pass_pending = True
            asyncio.get_running_loop().call_soon(self._scheduling_pass)

    def _scheduling_pass(self) -> None:
        self._pass_pending = False
        try:
            self._schedule()
            self._reconcile()
        except Exception:
            log.exception("scheduling pass failed; the monitor will try again")
        self._flush_notes()

    def _schedule(self) -> None:
        if not self._queue or self._stopping:
            return
        running = sum(len(e.holders) for e in self._envs.values())
        now = time.monotonic()
        demands = [
            scheduler.Demand(tid, self._trials[tid].gpu_number, self._trials[tid].gpu_memory)
            for tid in self._queue
            if self._trials[tid].not_before <= now
        ]
        decision = scheduler.place(
            demands,
            self._capacity_views(),
            max_running=self.config.trial_concurrency,
            running=running,
            policy=self._ts.placement,
        )
        placed = set()
        for p in decision.placements:
            t = self._trials[p.trial_id]
            env = self._envs[p.env_id]
            t.env_id, t.gpu_uuids, t.gpu_indices = p.env_id, p.gpu_uuids, p.gpu_indices
            t.attempts += 1
            t.waiting_reason = f"starting on {env.id}"
            placed.add(t.id)
            if env.single_use:
                env.used = True
            assert self.store is not None
            self.store.update_trial(
                t.id, environment_id=env.id, gpu_indices_json=json.dumps(list(p.gpu_indices)),
                gpu_uuids_json=json.dumps(list(p.gpu_uuids)), attempts=t.attempts,
            )
            if env.status is EnvStatus.READY:
                self._env_to(env, EnvStatus.BUSY, f"trial {t.id} placed")
            self._send_start(env, t)
        if placed:
            self._queue = [tid for tid in self._queue if tid not in placed]
        for tid, reason in decision.waiting.items():
            self._trials[tid].waiting_reason = reason

    def _send_start(self, env: EnvState, t: TrialState) -> None:
        assert self._service is not None and env.link is not None and self.store is not None
        env_vars = dict(self.config.trial_env)
        env_vars.update(t.env_overrides)
        max_s = self.config.max_trial_duration or 0.0
        env.link.send(
            pb.CoordinatorMessage(
                start_trial=pb.StartTrial(
                    trial_id=t.id,
                    sequence_id=t.seq,
                    command=t.command,
                    parameters_json=json.dumps(t.parameters),
                    env=env_vars,
                    gpu_indices=list(t.gpu_indices),
                    gpu_uuids=list(t.gpu_uuids),
                    working_directory=self._service.working_directory(),
                    max_duration_s=float(max_s),
                    experiment_id=self.experiment_id,
                    attempt=t.attempts,
                    first_metric_index=self.store.next_metric_index(t.id) if t.attempts > 1 else 0,
                )
            )
        )

    def _release(
        self, env: EnvState, t: TrialState, *, processes_gone: bool = False, still_in_use: Iterable[str] = ()
    ) -> None:
        """The trial no longer takes a slot of ``env``. Its GPUs are released too, except
        those on which the agent still sees its processes (``still_in_use``, from its
        TrialEnded): they stay held until a heartbeat shows them gone. ``processes_gone``:
        the whole environment is gone, release everything."""
        env.holders.discard(t.id)
        scheduler.trial_ended(env.gpus, t.id, {} if processes_gone else {u: {t.id} for u in still_in_use})
        if env.status is EnvStatus.BUSY and not env.holders:
            self._env_to(env, EnvStatus.READY, f"trial {t.id} ended")

    def _never_fits(self, gpus: int, memory: int = 0) -> str:
        if gpus == 0:
            return ""
        offered = self._gpus_offered()
        if offered is not None and gpus > offered:
            return (
                f"trial asks for {gpus} GPU{'' if gpus == 1 else 's'} but no environment offers more than {offered}; "
                f"lower trialGpuNumber or add GPUs (gpuIndices/simulatedGpus)"
            )
        if memory:
            registered = [e for e in self._envs.values() if e.instance_id and not e.status.terminal and e.gpus]
            big = [sum(1 for g in e.gpus if not g.memory_total_bytes or g.memory_total_bytes >= memory) for e in registered]
            if registered and max(big) < gpus:
                largest = max(g.memory_total_bytes for e in registered for g in e.gpus)
                return (
                    f"trial asks for {gpus} GPU(s) with {memory / 2**30:.1f} GiB each but no environment has "
                    f"{gpus} GPU(s) that large (the largest has {largest / 2**30:.1f} GiB); lower trialGpuMemory"
                )
        return ""

    def _refuse_unfittable(self) -> None:
        """Once every environment has registered, fail queued trials that can never run."""
        if not self._queue:
            return  # nothing to refuse: skip the walk over every environment (one per agent joining)
        if any(e.status in (EnvStatus.REQUESTED, EnvStatus.STARTING) for e in self._envs.values()):
            return
        for tid in list(self._queue):
            t = self._trials[tid]
            why = self._never_fits(t.gpu_number, t.gpu_memory)
            if why:
                self._queue.remove(tid)
                self._trial_to(t, TrialStatus.FAILED, f"refused: {why}")

    def _gpus_offered(self) -> int | None:
        registered = [len(e.gpus) for e in self._envs.values() if e.instance_id and not e.status.terminal]
        if registered:
            return max(registered)
        simulated = self._ts.simulated_gpus
        if simulated:
            indices = self._ts.gpu_indices
            return min(simulated, len(indices)) if indices else simulated
        return None

    # ---- environments ------------------------------------------------------------------

    def _live_envs(self) -> list[EnvState]:
        return [e for e in self._envs.values() if not e.status.terminal]

    def _new_env(self, env_id: str, *, platform: str, status: EnvStatus) -> EnvState:
        env = EnvState(
            id=env_id,
            status=status,
            single_use=not self._reuse,
            trial_slots=1 if not self._reuse else self._ts.trial_slots_per_environment(self.config.trial_concurrency),
            requested_at=time.monotonic(),
        )
        self._envs[env_id] = env
        assert self.store is not None
        self.store.insert_env(env_id, platform, status.value)
        return env

    def _wanted_new_envs(self) -> int:
        live = self._live_envs()
        if self._reuse:
            want = max(1, self._ts.effective_environment_count(self.config.trial_concurrency))
            return want - len(live)
        # One environment per trial: as many as waiting trials need, within trialConcurrency.
        fresh = [e for e in live if not e.used and not e.shutdown_sent]
        busy = sum(1 for e in live if e.used and e.holders)
        room = self.config.trial_concurrency - busy - len(fresh)
        return min(len(self._queue) - len(fresh), room)

    def _reconcile(self) -> None:
        if self._stopping or not self._started or self._env_error:
            return
        limit = max(3, 2 * self.config.trial_concurrency)
        for _ in range(max(0, self._wanted_new_envs())):
            if self._failed_starts >= limit:
                self._give_up_envs(limit)
                return
            self._env_counter += 1
            env = self._new_env(f"env-{self._env_counter}", platform=self._service.platform if self._service else "?", status=EnvStatus.REQUESTED)
            self._spawn(self._start_env(env))

    def _give_up_envs(self, limit: int) -> None:
        last = next((e.reason for e in reversed(list(self._envs.values())) if e.status is EnvStatus.FAILED), "")
        self._env_error = f"{limit} environments in a row failed to start; last: {last}"
        log.error("%s", self._env_error)
        for tid in list(self._queue):
            self._queue.remove(tid)
            self._trial_to(self._trials[tid], TrialStatus.FAILED, f"no environment could be started: {last}")
        self._flush_notes()

    async def _start_env(self, env: EnvState) -> None:
        assert self._service is not None
        args: list[str] = []
        if self._ts.gpu_indices:
            args += ["--gpu-indices", ",".join(str(i) for i in self._ts.gpu_indices)]
        if self._ts.simulated_gpus:
            args += ["--simulated-gpus", str(self._ts.simulated_gpus)]
        args += ["--reconnect-window", str(self.config.coordinator.reconnect_window)]
        if self.tls_fingerprint:
            args += ["--tls-fingerprint", self.tls_fingerprint]  # not a secret: argv is fine
        request = EnvironmentRequest(
            env_id=env.id,
            experiment_id=self.experiment_id,
            coordinator_address=self.address,
            token=self._token,
            agent_args=tuple(args),
            reuse=self._reuse,
        )
        try:
            result = await self._service.start(request)
        except Exception as e:  # a service must return errors, but one bug must not kill the loop
            log.exception("environment service %s raised on start", self._service.platform)
            result = type("R", (), {"error": f"{type(e).__name__}: {e}", "platform_id": ""})()
        if env.status is not EnvStatus.REQUESTED:
            return
        if result.error:
            self._failed_starts += 1
            self._env_to(env, EnvStatus.FAILED, result.error)
        else:
            env.platform_id = result.platform_id
            assert self.store is not None
            self.store.update_env(env.id, platform_id=result.platform_id)
            self._env_to(env, EnvStatus.STARTING, f"started ({result.platform_id})")
        self._reconcile()
        self._flush_notes()

    def _shutdown_env(self, env: EnvState, *, drain: bool, reason: str, grace_s: float = CANCEL_GRACE_S) -> None:
        if env.shutdown_sent:
            return
        env.shutdown_sent = True
        if env.link is not None:
            env.link.send(pb.CoordinatorMessage(shutdown=pb.Shutdown(drain=drain, grace_s=grace_s, reason=reason)))
        if env.status in (EnvStatus.READY, EnvStatus.BUSY):
            self._env_to(env, EnvStatus.DRAINING, reason)
        self._check_now = True
        self._changed.set()

    def _lose_trials(self, env: EnvState, reason: str, keep: set[str]) -> None:
        """The trials placed on ``env`` are gone with it: retry or fail each."""
        for tid in sorted(env.holders - keep, key=lambda i: self._trials[i].seq):
            t = self._trials[tid]
            self._release(env, t, processes_gone=True)
            if t.status.terminal:
                continue
            if t.cancel_status is not None:
                self._trial_to(t, t.cancel_status, t.reason)
            elif t.attempts <= self.config.max_trial_retries:
                self._retry(t, f"environment lost ({reason})")
            else:
                self._trial_to(t, TrialStatus.FAILED, f"environment lost: {reason}")

    def _retry(self, t: TrialState, why: str) -> None:
        """Put a trial back at the head of the queue, to be placed after a backoff."""
        t.env_id, t.gpu_uuids, t.gpu_indices = None, (), ()
        delay = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** (t.attempts - 1))
        t.not_before = time.monotonic() + delay
        t.waiting_reason = f"waiting: retry {t.attempts} of {self.config.max_trial_retries} after {why}"
        if t.status is TrialStatus.RUNNING:
            self._trial_to(t, TrialStatus.WAITING, f"{why}; retry {t.attempts} of {self.config.max_trial_retries} in {delay:g} s")
        self._queue.insert(0, t.id)

    async def _monitor_loop(self) -> None:
        settings = self.config.coordinator
        interval = min(0.5, settings.heartbeat_interval)
        checked_at = 0.0
        while True:
            # Not asyncio.wait_for: before Python 3.12 it swallows a cancel that arrives as
            # the event is set (stop() does both), and stop() would wait on this loop forever.
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({changed}, timeout=interval)
            finally:
                changed.cancel()
            self._changed.clear()
            # A poll asks the platform about every environment: once per tick, or at once
            # when an agent's stream closed, not on every change (a thousand agents joining
            # would cost a million looks).
            if self._check_now or time.monotonic() - checked_at >= interval:
                self._check_now = False
                checked_at = time.monotonic()
                try:
                    await self._check_envs(settings.agent_lost_timeout * self._beat_scale)
                except Exception:
                    log.exception("checking environments failed; will try again")
            self._schedule()
            self._reconcile()
            self._flush_notes()
            self._store_gpu_samples()

    async def _check_envs(self, lost_after: float) -> None:
        now = time.monotonic()
        live = self._live_envs()
        if not live or self._service is None:
            return
        seen = await self._service.poll([e.id for e in live])
        for env in live:
            if env.status.terminal:
                continue
            obs = seen.get(env.id)
            ended = obs is not None and obs.state in ("exited", "failed")
            if env.status in (EnvStatus.REQUESTED, EnvStatus.STARTING):
                if ended:
                    self._failed_starts += 1
                    assert obs is not None
                    self._env_to(env, EnvStatus.FAILED, f"agent did not register: {obs.detail}")
                    # What the platform still holds for it (a pod that cannot pull its image
                    # keeps its node's GPUs) goes now, not when the experiment ends.
                    self._spawn(self._service.stop(env.id))
                elif env.status is EnvStatus.STARTING and obs is not None and obs.state == "starting":
                    # Still queued on the platform (a pending Slurm job, an unscheduled pod):
                    # waiting there is the platform's business, so the agent's start clock
                    # runs from when the platform runs it.
                    env.requested_at = now
                    if obs.detail and obs.detail != env.reason:
                        env.reason = obs.detail
                        assert self.store is not None
                        self.store.update_env(env.id, reason=obs.detail)
                elif env.status is EnvStatus.STARTING and now - env.requested_at > AGENT_START_TIMEOUT_S:
                    self._failed_starts += 1
                    self._env_to(env, EnvStatus.FAILED, f"agent did not register within {AGENT_START_TIMEOUT_S:.0f} s")
                    self._spawn(self._service.stop(env.id))
                continue
            if ended and env.link is None:
                assert obs is not None
                # Asked to stop, or drained by an operator: stopped. A platform that says the
                # job failed (preempted, say: its agent may have been draining on the
                # platform's own signal) gets the last word.
                if env.shutdown_sent or (env.status is EnvStatus.DRAINING and obs.state != "failed"):
                    self._lose_trials(env, obs.detail, keep=set())
                    self._env_to(env, EnvStatus.STOPPED, obs.detail or "agent exited")
                else:
                    self._lose_trials(env, obs.detail, keep=set())
                    self._env_to(env, EnvStatus.FAILED, obs.detail or "agent exited")
            elif env.status is not EnvStatus.LOST and now - env.last_seen > lost_after:
                # First timer: the agent is unreachable. Nothing new goes to it, but its
                # trials may well be running still; it can come back and carry on.
                self._env_to(env, EnvStatus.LOST, f"agent unreachable: no heartbeat for {now - env.last_seen:.1f} s")
            elif env.status is EnvStatus.LOST and now - env.last_seen > self.config.coordinator.trial_lost_timeout * self._beat_scale:
                # Second timer: give its trials up (retry or fail) and replace it.
                reason = f"no heartbeat for {now - env.last_seen:.1f} s"
                self._lose_trials(env, reason, keep=set())
                self._env_to(env, EnvStatus.FAILED, f"agent lost: {reason}")
                if env.link is not None:
                    env.link.close()
                self._spawn(self._service.stop(env.id, 0.0))

    # ---- state changes -----------------------------------------------------------------

    def _trial_to(self, t: TrialState, new: TrialStatus, reason: str) -> None:
        check_trial(t.status, new)
        old = t.status
        t.status = new
        if new.terminal or reason:
            t.reason = reason
        fields: dict[str, Any] = {"status": new.value, "reason": t.reason}
        if new.terminal:
            t.ended_at = t.ended_at or time.time()
            fields["ended_at"] = t.ended_at
            t.done.set()
        assert self.store is not None
        with self.store.transaction():
            self.store.update_trial(t.id, **fields)
            self.store.record("trial", t.id, old.value, new.value, reason)
        log.info("trial %s: %s -> %s%s", t.id, old.value, new.value, f" ({reason})" if reason else "")
        self._notes.append(StatusEvent(t.info(), old))
        self._changed.set()

    def _env_to(self, env: EnvState, new: EnvStatus, reason: str) -> None:
        check_env(env.status, new)
        old = env.status
        env.status = new
        env.reason = reason
        assert self.store is not None
        with self.store.transaction():
            self.store.update_env(env.id, status=new.value, reason=reason, ended_at=time.time() if new.terminal else None)
            self.store.record("environment", env.id, old.value, new.value, reason)
        log.info("environment %s: %s -> %s (%s)", env.id, old.value, new.value, reason)
        self._changed.set()

    def _flush_notes(self) -> None:
        notes, self._notes = self._notes, []
        for note in notes:
            callbacks = self._metric_callbacks if isinstance(note, MetricEvent) else self._status_callbacks
            for cb in callbacks:
                try:
                    result = cb(note)  # type: ignore[arg-type]
                    if asyncio.iscoroutine(result):
                        self._spawn(result)
                except Exception:
                    log.exception("a %s callback raised; ignored", type(note).__name__)
            for q in self._subscribers:
                q.put_nowait(note)

    # ---- helpers -----------------------------------------------------------------------

    def _trial_state(self, trial_id: str) -> TrialState:
        try:
            return self._trials[trial_id]
        except KeyError:
            raise KeyError(f"no trial {trial_id!r} in experiment {self.experiment_id}") from None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._changed.clear()
            await self._changed.wait()


def _new_id(n: int) -> str:
    alphabet = "abcdefghijkmnpqrstuvwxyz23456789"
    return "".join(secrets.choice(alphabet) for _ in range(n))


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw
