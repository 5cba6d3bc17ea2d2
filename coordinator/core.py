"""The coordinator that users embed: starts environments, accepts agents, places trials,
stores everything.

A facade. What to do is decided by the engine (``engine.py``, pure), carried out by the
shell (``shell.py``), and spoken to agents by the transport (``server.py``, ``wire.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .config.experiment import ExperimentConfig, config_to_dict
from .config.platform import TrainingServiceConfig
from .engine import submits
from .engine.checkpoints import ContinueRequested, PauseRequested, SavesHeard
from .engine.engine import CANCEL_GRACE_S, Engine
from .engine.events import CancelRequested, StopCompleted, StopRequested, TrialSubmitted, UpdateRequested
from .engine.model import TrialInfo
from .engine.policy import Policy
from .engine.states import EnvStatus, TrialStatus
from .platforms import checkpoint_root, policy_of
from .read.listening import Listening
from .read.model import CheckpointInfo, EnvSnapshot, ReadModel
from .services import create_service
from .services.base import EnvironmentRequest, EnvironmentService
from .services.hybrid import HybridEnvironmentService
from .shell import Shell
from .store.checkpointfiles import CheckpointFiles
from .store.lock import ExperimentLock
from .store.reads import StoreReader
from .store.store import Store
from .transport import tls as tls_identity
from .transport.bulk import BulkReceiver
from .transport.server import Servicer, listen

log = logging.getLogger(__name__)

UPDATED_META = "updated_limits"  # the store's meta entry of the limits changed while running
LIMITS = ("trial_concurrency", "max_trial_number", "max_experiment_duration")  # what `update` may change
# How long a trial's save waits, at most, for the checkpoint listeners that asked to judge it (hold_saves).
SAVE_HOLD_S = 2.0

# The stored statuses of the environments a resume takes back (one asked for but never
# answered is failed instead).
_TAKEN_BACK = frozenset(
    s.value for s in EnvStatus if not s.terminal and s is not EnvStatus.REQUESTED
)


class CoordinatorError(RuntimeError):
    """Root of the coordinator's errors."""


class TrialRefused(CoordinatorError, ValueError):
    """A submitted trial can never run here (it asks for more environments than are kept)."""


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


class Coordinator(Listening):
    """Runs an experiment's trials on the environments its config describes.

    Use it as ``async with Coordinator(config) as c:`` or call :meth:`start` and
    :meth:`stop`. Submit parameter sets with :meth:`submit`; hear of results through
    :meth:`on_metric` / :meth:`on_status` / :meth:`on_checkpoint` callbacks or the :meth:`events`
    iterator (``read/listening.py``).
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
        self._token = secrets.token_urlsafe(32)
        #: SHA-256 of the certificate agents pin when ``coordinator.tls`` is on, else None.
        self.tls_fingerprint: str | None = None
        self._resuming = False
        self._started = False
        self._stopping = False
        self._stopped: asyncio.Future[None] | None = None
        self._last_envs: tuple[EnvSnapshot, ...] = ()
        self._fail_stop: asyncio.Task[None] | None = None
        self._server: Any = None
        self._bulk: BulkReceiver | None = None
        self.store: Store | None = None
        self._lock: ExperimentLock | None = None
        self._engine: Engine | None = None
        self._shell: Shell | None = None
        self._save_hold_s = 0.0
        Listening.__init__(self)

    # ---- lifecycle -----------------------------------------------------------------------------

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
        Without it, redacted ``trialEnv`` variables are taken from ``os.environ``; any other
        redacted secret, or a variable missing there, raises CoordinatorError naming each.
        """
        experiment_dir = Path(experiment_dir).resolve()
        store = StoreReader.in_dir(experiment_dir)
        try:
            exp = store.experiment()
            stored = ReadModel(store).stored_config()  # None when unreadable
            updated = json.loads(store.meta(UPDATED_META) or "{}")  # as `trialkeeper update` left them
        finally:
            store.close()
        if exp is None:
            raise CoordinatorError(f"{experiment_dir} holds no experiment to resume")
        if config is None:
            from .config.redacted import stored_config_for

            try:
                config = replace(stored_config_for(stored, experiment_dir, os.environ), **updated)
            except ValueError as e:
                raise CoordinatorError(str(e)) from e
        c = cls(config, experiment_dir=experiment_dir, experiment_id=exp["id"], service=service)
        c._resuming = True
        return c

    def _platforms(self, service: EnvironmentService) -> list[tuple[TrainingServiceConfig, EnvironmentService]]:
        """Each platform's section with its service: several for a hybrid experiment."""
        sections = self.config.training_service.sections()
        if isinstance(service, HybridEnvironmentService):
            return [(s, service.members[s.platform]) for s in sections]
        return [(sections[0], service)]

    def _policy(self, service: EnvironmentService) -> Policy:
        broken = service.broken() if isinstance(service, HybridEnvironmentService) else {}
        sections = self._platforms(service)
        root = checkpoint_root(self.experiment_dir, [m for _, m in sections])
        return policy_of(self.config, self.experiment_id, sections, broken, self.experiment_dir, root)

    def _gpu_sharing(self, env_id: str, platform: str) -> tuple[int, bool]:
        """(maxTrialNumberPerGpu, useActiveGpu) of one environment of ``platform``: as its
        platform sets them for it (per machine), else as its section does."""
        assert self._service is not None
        for ts, member in self._platforms(self._service):
            if ts.platform == platform or len(self.config.training_service.sections()) == 1:
                sharing = ts.gpu_sharing(member.gpu_policy(env_id))
                return sharing.max_trials_per_gpu, sharing.use_active_gpu
        return 1, False

    def _request_for(self, env_id: str) -> EnvironmentRequest:
        assert self._engine is not None
        platform = self._engine.envs[env_id].platform
        sections = self.config.training_service.sections()
        ts = next((s for s in sections if s.platform == platform), sections[0])
        args: list[str] = []
        if ts.gpu_indices:
            args += ["--gpu-indices", ",".join(str(i) for i in ts.gpu_indices)]
        if ts.simulated_gpus:
            args += ["--simulated-gpus", str(ts.simulated_gpus)]
        args += ["--reconnect-window", str(self.config.coordinator.reconnect_window)]
        for module in self.config.trial_preload:
            args += ["--preload", module]
        if self.tls_fingerprint:
            args += ["--tls-fingerprint", self.tls_fingerprint]  # not a secret: argv is fine
        return EnvironmentRequest(
            env_id=env_id, experiment_id=self.experiment_id, coordinator_address=self.address, token=self._token,
            agent_args=tuple(args), reuse=bool(ts.reuse_mode),
            platform=platform if len(sections) > 1 else "",
        )

    def _restore(self, engine: Engine, store: Store, service: EnvironmentService) -> None:
        """The engine as the store left it; each platform takes back its live environments
        first, so that what it sets for each (GPU sharing per machine) reaches the engine."""
        trial_rows, env_rows, checkpoint_rows = store.trials(), store.envs(), store.checkpoints(kept=False)
        sharing = {}
        for r in env_rows:
            if r["status"] not in _TAKEN_BACK:
                continue
            platform = str(r.get("platform") or "")
            if isinstance(service, HybridEnvironmentService):
                service.assign(r["id"], platform)  # each platform takes back its own
            if r["platform_id"]:
                service.adopt(r["id"], r["platform_id"])
            sharing[r["id"]] = self._gpu_sharing(r["id"], platform)
        assert self._shell is not None
        self._shell.apply(engine.restore(
            trial_rows, env_rows, sharing, checkpoint_rows, now=time.monotonic(), wall=time.time()
        ))
        store.set_experiment_status("RUNNING", "resumed")

    async def start(self) -> None:
        """Open the store, start the gRPC server and the first environments."""
        self.experiment_dir.mkdir(parents=True, exist_ok=True)
        # One coordinator a directory, held until stop() (DirectoryInUse names the other).
        lock = self._lock = ExperimentLock.acquire(self.experiment_dir)
        try:
            await self._start()
        except BaseException:
            lock.release()
            raise

    async def _start(self) -> None:
        self.store = store = Store.in_dir(self.experiment_dir)
        token_file = self.experiment_dir / ".token"
        bind = self.config.coordinator.address
        if self._resuming:
            try:
                self._token = token_file.read_text().strip()
            except OSError as e:
                raise CoordinatorError(f"cannot resume: the experiment's token file is unreadable: {e}") from e
            bind = store.meta("bound_address") or bind
        else:
            if store.experiment() is not None:
                raise CoordinatorError(f"{self.experiment_dir} already holds an experiment; choose another directory")
            store.create_experiment(
                self.experiment_id, self.config.experiment_name, config_to_dict(self.config, redact=True)
            )
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._token)
        if self._service is None:
            self._service = create_service(self.config, self.experiment_dir)
        service = self._service
        await service.prepare()  # before the policy: a service knows its working directory then
        root = checkpoint_root(self.experiment_dir, [m for _, m in self._platforms(service)])
        files = CheckpointFiles(root, self.experiment_id)
        policy = self._policy(service)
        settings = self.config.coordinator
        if settings.checkpoint_port and not settings.tls:  # uploads' bytes straight to disk, not by the stream
            self._bulk = BulkReceiver(self._token, files.incoming_dir, self._placed_on, policy.max_checkpoint_bytes)
            policy = dataclasses.replace(policy, checkpoint_data_port=self._bulk.start(bind.rsplit(":", 1)[0]))
        self._engine = engine = Engine(policy)
        self._shell = shell = Shell(
            engine, store, service, self.experiment_dir, self._request_for,
            gpu_sharing_for=lambda env_id: self._gpu_sharing(env_id, engine.envs[env_id].platform),
            checkpoints=files,
        )
        self._listen(engine, shell)
        engine.save_hold_s = self._save_hold_s
        shell.on_failure = self._failed
        shell.checkpoints.mark()
        if self._resuming:
            self._restore(engine, store, service)
            shell.digest_missing()
            await service.ready_adopted(self.experiment_id)  # before the server: no trial is placed yet
            await shell.sweep_orphans()
        settings = self.config.coordinator
        # With TLS, agents are launched with the certificate's fingerprint and pin it.
        identity = tls_identity.load_or_create(self.experiment_dir) if settings.tls else None
        self.tls_fingerprint = identity.fingerprint if identity else None
        self._server, port, bind = await listen(bind, settings.address, Servicer(shell, self._token),
                                                identity.key_cert if identity else None)  # resumed: the old port
        store.set_meta("bound_address", f"{bind.rsplit(':', 1)[0]}:{port}")
        host = settings.address.rsplit(":", 1)[0]
        if settings.advertise_address:
            self.address = settings.advertise_address
        else:
            if host in ("", "0.0.0.0", "[::]"):
                host = socket.gethostname()
            self.address = f"{host}:{port}"
        store.set_coordinator_address(self.address)
        self._started = True
        log.info("experiment %s: coordinator listening on %s; directory %s", self.experiment_id, self.address,
                 self.experiment_dir)
        shell.start_monitor(min(0.5, settings.heartbeat_interval))
        shell.apply(engine.start(now=time.monotonic(), wall=time.time()))

    def _failed(self, reason: str) -> None:
        # A background task died: end the experiment with the reason rather than hang it.
        self._fail_stop = asyncio.get_running_loop().create_task(self.stop(status="FAILED", reason=reason))
        self._fail_stop.add_done_callback(_log_stop_failure)  # retrieved: said once, not at exit

    async def stop(
        self, grace_s: float = CANCEL_GRACE_S, *, status: str = "DONE", reason: str = "", pause_trials: bool = False
    ) -> None:
        """Cancel what still runs, stop every environment, close the server and store.
        ``pause_trials``: pause the trials instead (those that do not checkpoint within
        pauseGracePeriod are canceled), and leave the experiment STOPPED, to be resumed."""
        if pause_trials:
            grace_s, status = max(grace_s, self.config.pause_grace_period), "STOPPED" if status == "DONE" else status
        if self._stopped is not None:
            await asyncio.shield(self._stopped)  # a stop is under way: return once it is done
            return
        if not self._started:
            return
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            await self._stop(grace_s, status, reason, pause_trials)
        finally:
            self._stopped.set_result(None)
            self._stopped = None

    async def _stop(self, grace_s: float, status: str, reason: str, pause: bool) -> None:
        self._stopping = True
        shell, engine, service, store = self._shell, self._engine, self._service, self.store
        assert shell is not None and engine is not None and service is not None and store is not None
        if shell.failure and status == "DONE":
            status, reason = "FAILED", shell.failure
        shell.drain_inbox()
        shell.handle(StopRequested(grace_s, pause))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                shell.until(lambda: all(e.link is None for e in engine.envs.values()), or_failure=False), grace_s + 10
            )
        await asyncio.gather(*(service.stop(e.id, 2.0) for e in engine.envs.values()), return_exceptions=True)
        shell.drain_inbox()
        shell.handle(StopCompleted())
        await shell.stop_monitor()
        await service.close()
        if self._server:
            await self._server.stop(1.0)
        if self._bulk is not None:
            self._bulk.close()
        await shell.close()
        try:
            store.set_experiment_status(status, reason, ended=True)
        except (sqlite3.Error, OSError) as e:  # a full disk: the reason was said when it failed
            log.error("could not store the experiment's end (%s): %s", status, e)
        self._last_envs = ReadModel(store).environments()
        store.close()
        if self._lock is not None:
            self._lock.release()
        self._started = False

    # ---- the embedding API ---------------------------------------------------------------------

    def _running(self) -> tuple[Engine, Shell]:
        if not self._started or self._stopping or self._shell is None or self._engine is None:
            raise CoordinatorError("the coordinator is not running")
        if self._shell.failure:
            raise CoordinatorError(f"the experiment cannot go on: {self._shell.failure}")
        return self._engine, self._shell

    async def submit(
        self,
        parameters: dict[str, Any],
        *,
        command: str | None = None,
        gpu_number: int | None = None,
        gpu_memory: int | None = None,
        env: dict[str, str] | None = None,
        platforms: list[str] | None = None,
        checkpoint_from: str | None = None,
        nodes: int | None = None,
        max_duration: float | None = None,
    ) -> TrialHandle:
        """Queue a trial with these parameters; returns at once with its handle.

        ``command``, ``gpu_number`` and ``gpu_memory`` (bytes each GPU must have free)
        override the config for this trial; ``platforms`` names the platforms it may run
        on, most preferred first (default: the config's ``trialPlatforms``, else every
        platform in the order of ``trainingService``); one asking more GPUs than any environment
        has ends FAILED, saying so. ``checkpoint_from``: a trial whose newest checkpoint
        this one starts from (a search continuing another's work). ``nodes``: environments it
        runs on at once (default: ``trialNodes``; more than are kept raises :class:`TrialRefused`).
        ``max_duration``: its own time limit in seconds (default: ``maxTrialDuration``).
        """
        engine, shell = self._running()
        if not isinstance(parameters, dict):
            raise TypeError(f"parameters must be a dict, got {type(parameters).__name__}")
        try:
            params = json.loads(json.dumps(parameters, allow_nan=False))  # NaN is no JSON: a trial could not read it
        except (TypeError, ValueError) as e:
            raise TypeError(f"parameters must be JSON-serialisable: {e}") from e
        gpus = self.config.trial_gpu_number if gpu_number is None else gpu_number
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
            raise ValueError(f"gpu_number must be an integer >= 0, got {gpus!r}")
        memory = self.config.trial_gpu_memory if gpu_memory is None else gpu_memory
        if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
            raise ValueError(f"gpu_memory must be a number of bytes >= 0, got {memory!r}")
        allowed = submits.checked_platforms(engine.policy, platforms)
        submits.checked_fork(engine.trials, checkpoint_from)
        n, limit = submits.checked_nodes(engine.policy, nodes), submits.checked_duration(max_duration)
        refusal = submits.never_gangs(engine.policy, n, allowed)
        if refusal:
            raise TrialRefused(refusal)
        trial_id = _new_id(6)
        while trial_id in engine.trials:
            trial_id = _new_id(6)
        shell.handle(TrialSubmitted(
            trial_id, params, submits.checked_command(command, self.config.trial_command), gpus, memory,
            submits.checked_env(env), platforms=allowed, checkpoint_from=checkpoint_from or "", nodes=n,
            max_duration=limit,
        ))
        shell.pass_soon()
        return TrialHandle(self, trial_id)

    async def cancel(
        self, trial_id: str, *, reason: str = "canceled by the user", status: TrialStatus = TrialStatus.USER_CANCELED
    ) -> None:
        """Cancel a trial; a running one gets SIGTERM, then SIGKILL after the grace period."""
        self._trial_state(trial_id)
        assert self._shell is not None
        self._shell.handle(CancelRequested(trial_id, reason, status))

    async def early_stop(self, trial_id: str, reason: str = "stopped early by the assessor") -> None:
        """Stop a running trial because it is not promising (EARLY_STOPPED)."""
        await self.cancel(trial_id, reason=reason, status=TrialStatus.EARLY_STOPPED)

    async def pause(self, trial_id: str, *, reason: str = "paused by the user") -> None:
        """Pause a trial: a running one saves a checkpoint at its next save_checkpoint and
        ends (PAUSED; past pauseGracePeriod without one it is stopped, and continues from its
        last checkpoint or, having none, is canceled); a waiting one is held back."""
        self._trial_state(trial_id)
        assert self._shell is not None
        self._shell.handle(PauseRequested(trial_id, reason))

    def hold_saves(self, hold_s: float = SAVE_HOLD_S) -> None:
        """The :meth:`on_checkpoint` listeners decide on a trial at its save (pause it at a rung,
        say): from now on a trial's save_checkpoint is answered only once :meth:`saves_heard` says
        what they decided is carried out, so that a pause decided on the save (or on the results
        before it) lands at that save. ``hold_s`` seconds at most: a stuck listener stalls no trial."""
        if not 0 < hold_s <= 60:
            raise ValueError(f"hold_s must be more than 0 and at most 60 seconds, got {hold_s!r}")
        self._save_hold_s = hold_s
        if self._engine is not None:
            self._engine.save_hold_s = hold_s

    def saves_heard(self) -> None:
        """What the checkpoint listeners decided on the saves published so far is carried out
        (a pause sent): those saves are answered now (see :meth:`hold_saves`)."""
        if self._shell is not None and not self._shell.closed:
            self._shell.handle(SavesHeard())

    async def resume_trial(self, trial_id: str, *, parameters: dict[str, Any] | None = None,
                           checkpoint_from: str = "") -> None:
        """Continue a PAUSED trial, anywhere, ahead of the waiting ones, from its last checkpoint (or the newest
        of trial ``checkpoint_from``), with new ``parameters`` if given. Raises ValueError when it is not paused."""
        info = self._trial_state(trial_id)
        if info.status is not TrialStatus.PAUSED:
            raise ValueError(f"trial {trial_id} is {info.status.value}, not PAUSED: only a paused trial continues")
        assert self._shell is not None
        self._shell.handle(ContinueRequested(trial_id, parameters and dict(parameters), checkpoint_from))
        self._shell.pass_soon()

    async def update(self, **limits: Any) -> None:
        """Change trial_concurrency, max_trial_number or max_experiment_duration now; a resume keeps them."""
        if set(limits) - set(LIMITS) or any(type(v) not in (int, float) or v <= 0 for v in limits.values()):
            raise ValueError(f"only {', '.join(LIMITS)} may change, each to a number above 0; got {limits}")
        shell = self._running()[1]
        assert self.store is not None and self._service is not None
        self.config = replace(self.config, **limits)
        self.store.set_meta(UPDATED_META, json.dumps({k: getattr(self.config, k) for k in LIMITS}))
        shell.handle(UpdateRequested(self._policy(self._service)))

    def checkpoints(self, trial_id: str) -> list[CheckpointInfo]:
        """The checkpoints of a trial that are kept, oldest first."""
        self._trial_state(trial_id)
        assert self.store is not None
        return ReadModel(self.store).checkpoints(trial_id)

    def trial(self, trial_id: str) -> TrialInfo:
        """A snapshot of one trial."""
        return self._trial_state(trial_id)

    def trials(self) -> list[TrialInfo]:
        """Snapshots of every trial, in submission order."""
        if self._engine is None:
            return []
        return [t.info() for t in sorted(self._engine.trials.values(), key=lambda t: t.seq)]

    def live_trials(self) -> list[TrialInfo]:
        """Snapshots of the trials not ended (waiting, running, paused, or being stopped), in
        submission order: what the experiment loop looks at on each pass, without a snapshot
        of every trial that ended."""
        if self._engine is None:
            return []
        return [t.info() for t in sorted(self._engine.live_trials.values(), key=lambda t: t.seq)]

    def environments(self, latest: int | None = None) -> list[EnvSnapshot]:
        """Snapshots of every environment, read from the store: what ``trialkeeper envs``
        shows (after :meth:`stop`, as they were when it stopped); ``latest``: with only each
        one's latest trials (0: none of them, nothing read for them)."""
        if self.store is not None and self._started:
            return list(ReadModel(self.store).environments(latest))
        return list(self._last_envs)

    async def wait(self, trial_id: str, timeout: float | None = None) -> TrialInfo:
        """Wait for one trial to end."""
        info = self._trial_state(trial_id)
        assert self._shell is not None
        if info.status.terminal:
            return info
        done = self._shell.done.setdefault(trial_id, asyncio.Event())
        await asyncio.wait_for(done.wait(), timeout)
        self._raise_failure()
        return self.trial(trial_id)

    async def wait_all(self, timeout: float | None = None) -> list[TrialInfo]:
        """Wait until every submitted trial has ended."""
        assert self._shell is not None and self._engine is not None
        await asyncio.wait_for(self._shell.until(self._engine.all_done), timeout)
        self._raise_failure()
        return self.trials()

    def _raise_failure(self) -> None:
        if self._shell is not None and self._shell.failure:
            raise CoordinatorError(f"the experiment cannot go on: {self._shell.failure}")

    @property
    def environment_error(self) -> str:
        """Why environments can no longer be started, or ''."""
        return self._engine.env_error if self._engine is not None else ""

    @property
    def platform_errors(self) -> dict[str, str]:
        """Platforms that start no more environments (too many in a row failed), with why;
        the experiment goes on with the others."""
        return dict(self._engine.platform_errors) if self._engine is not None else {}

    @property
    def failure(self) -> str:
        """Why the experiment cannot go on (a background task failed), or ''."""
        return self._shell.failure if self._shell is not None else ""

    @property
    def scheduling_passes(self) -> tuple[int, float, float, tuple[tuple[float, int], ...]]:
        """Scheduling passes run so far, the seconds they took in all, and the latest one's."""
        return self._shell.pass_stats if self._shell is not None else (0, 0.0, 0.0, ())

    @property
    def heartbeat_interval(self) -> float:
        """The interval agents heartbeat at now: the configured one, or longer for a fleet
        that would otherwise send more than maxHeartbeatsPerSecond."""
        if self._engine is None:
            return self.config.coordinator.heartbeat_interval
        return self._engine.heartbeat_interval

    def _placed_on(self, env_id: str, trial_id: str) -> bool:  # asked from the bulk port's threads
        t = self._engine.trials.get(trial_id) if self._engine is not None else None
        return t is not None and t.env_id == env_id

    def _trial_state(self, trial_id: str) -> TrialInfo:
        if self._engine is None or trial_id not in self._engine.trials:
            raise KeyError(f"no trial {trial_id!r} in experiment {self.experiment_id}")
        return self._engine.trial_info(trial_id)


def _log_stop_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("stopping the experiment failed: %s", task.exception())


def _new_id(n: int) -> str:
    alphabet = "abcdefghijkmnpqrstuvwxyz23456789"
    return "".join(secrets.choice(alphabet) for _ in range(n))
