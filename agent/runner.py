"""Runs trials as child processes and turns what they do into events for the session.

Each trial gets a directory ``<workdir>/trials/<trial id>/`` with ``parameter.json``,
``stdout.log``, ``stderr.log`` and ``output/``. The trial runs in its own process group,
with ``CUDA_VISIBLE_DEVICES`` set to the GPUs it was given. Metrics arrive as datagrams on
the agent's Unix socket (see :mod:`trialkeeper.agent.trial`), are checked (:mod:`.results`), numbered per
trial and handed to the session in order. Datagrams need no connection to be accepted, so
once a trial's process tree is gone everything it sent is already queued on the socket:
the runner drains it before reporting the end, and no report can arrive late.
Results that trials written for NNI print are read from ``stdout.log`` (:mod:`.nnicompat`),
the rest of it before the end is reported. A trial's checkpoints (its directory, the one it
continues from, its saves, asked on the same socket) are the keeper's (:mod:`.checkpoints`); a trial of
NNI's PBT tuner saves by leaving its files there as it exits 0 (:func:`.nnicompat.pbt_dirs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import nnicompat, processes, rendezvous, results, trialfiles
from . import trial as sdk
from .attribution import Attribution
from .checkpoints import CheckpointKeeper, CheckpointLink, CheckpointUnavailable
from .codecopy import copy_tree, prune_copy
from .metric_socket import MetricSocket
from .trialfiles import TRIAL_CODE_DIR, TrialSpec
from .warm import WarmProcess, WarmStarter

log = logging.getLogger(__name__)

LOG_CHUNK_BYTES = 256 * 1024
# The coordinator keeps at most this much of each stream of a trial (its own limit, 1 GiB):
# what lies beyond is not offered for sending.
MAX_STREAMED_LOG_BYTES = 1 << 30
STDERR_TAIL_BYTES = 4096
# How long a trial killed by a signal waits for the agent's own stop signal before it is
# reported as a failure of the trial (see TrialRunner.host_stopping).
HOST_SIGNAL_GRACE_S = 0.3
# How long a trial's end waits for its copy of the code to be pruned (see codecopy.prune_copy).
PRUNE_WAIT_S = 2.0
# How long what a trial left outside its process group gets between SIGTERM and SIGKILL.
STRAY_GRACE_S = 2.0
# How often orphans that ended on their own are reaped.
REAP_INTERVAL_S = 1.0


@dataclass(frozen=True)
class TrialResult:
    trial_id: str
    outcome: str  # succeeded | failed | canceled | timed_out | lost | paused
    exit_code: int | None
    signal: int
    reason: str
    stderr_tail: str
    started: bool
    ended_at: float
    attempt: int = 0


class RunnerEvents(CheckpointLink):
    """What the runner tells the session. All calls happen on the event loop thread."""

    def trial_started(self, trial_id: str, pid: int, started_at: float, address: str = "", port: int = 0) -> None: ...

    def metrics(
        self, trial_id: str, kind: str, first_index: int, values: list[float], value_jsons: list[str] | None
    ) -> None:
        """Results of a trial numbered from ``first_index``; ``value_jsons`` None where each
        value's JSON is the repr of its number (a float)."""

    def log(self, trial_id: str, stream: str, path: Path, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of a trial's ``path`` are ready to be sent;
        the receiver reads them from the file when it sends them."""

    def trial_ended(self, result: TrialResult) -> None: ...


class _Trial:
    def __init__(self, spec: TrialSpec, directory: Path) -> None:
        self.spec = spec
        self.dir = directory
        # Started cold (a child of the agent) or forked by the warm template: one interface.
        self.proc: asyncio.subprocess.Process | WarmProcess | None = None
        self.exited: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.cancel_reason: str | None = None
        self.outcome_if_canceled = "canceled"
        self.metric_index = spec.first_metric_index
        self.final_reported = False
        self.rank_noted = False  # rank > 0 of a multi-node trial: told its results are ignored
        self.log_offsets = {"stdout": 0, "stderr": 0}
        # Results of trials written for NNI, printed on their stdout.
        self.nni_lines = nnicompat.NniStdoutScanner(directory / "stdout.log")
        # A trial of NNI's PBT (rank 0): what it leaves in its checkpoint directory is saved at this step.
        self.saves_left: int | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


class TrialRunner:
    """Starts, watches and cancels the trials of one agent."""

    def __init__(
        self,
        workdir: Path,
        events: RunnerEvents,
        *,
        socket_name: str,
        log_interval_s: float = 0.5,
        base_env: dict[str, str] | None = None,
        copy_working_directory: bool = False,
        stream_logs: bool = True,
        preload: tuple[str, ...] = (),
        node_address: str = "127.0.0.1",
    ) -> None:
        self.workdir = workdir
        self.node_address = node_address  # where the other nodes of a multi-node trial reach this one
        # False where the coordinator reads the trials' log files in place (--logs-shared).
        self.stream_logs = stream_logs
        self.events = events
        # A path, or "@name" in the abstract namespace (see socket_name).
        self.socket_name = socket_name
        self.log_interval_s = log_interval_s
        self.base_env = dict(os.environ if base_env is None else base_env)
        # Each trial runs in its own copy of its working directory, <trial dir>/code.
        self.copy_working_directory = copy_working_directory
        self._trials: dict[str, _Trial] = {}
        self._attribution = Attribution()
        self._sock: MetricSocket | None = None
        self._log_task: asyncio.Task[None] | None = None
        self._reap_task: asyncio.Task[None] | None = None
        self.idle = asyncio.Event()
        # Set once the agent was signalled to stop: a trial that dies of a signal after
        # that went down with its environment (the platform signals every process of it).
        self.host_stopping = asyncio.Event()
        self.idle.set()
        # Whether orphans of the trials are reparented to the agent (see _end_strays).
        self.subreaper = False
        self._spawning = 0  # trials being started, whose root's pid is not known yet
        # Python trials are forked from a template that imported these (trialPreload).
        self.preload = tuple(preload)
        self._warm: WarmStarter | None = None
        self.checkpoints = CheckpointKeeper(workdir, events)

    # ---- lifecycle -------------------------------------------------------------------

    async def open(self) -> None:
        why_not = processes.become_subreaper()
        self.subreaper = why_not is None
        if why_not:
            log.info("processes that leave a trial's process group outlive it: %s", why_not)
        else:
            self._reap_task = asyncio.create_task(processes.reap_forever(self._own_children, REAP_INTERVAL_S))
        sock = MetricSocket(self.socket_name)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_readable)
        self._log_task = asyncio.create_task(self._tail_logs_forever())
        if self.preload:
            self._warm = WarmStarter(
                list(self.preload), trialfiles.template_env(self.base_env), str(self.workdir / "warm-template.log")
            )
            self._warm.prime()  # imported before the first trial arrives

    async def close(self, grace_s: float = 5.0) -> None:
        await self.cancel_all("agent is shutting down", grace_s)
        await self._end_strays(None)
        await self.checkpoints.close()
        if self._warm is not None:
            await self._warm.close()
        for task in (self._log_task, self._reap_task):
            if task:
                task.cancel()
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    @property
    def running_ids(self) -> list[str]:
        return list(self._trials)

    def running_pids(self) -> dict[int, str]:
        return {t.pid: tid for tid, t in list(self._trials.items()) if t.pid is not None}

    def attribute(self, pids: Iterable[int]) -> dict[int, str]:
        """Which trial each of ``pids`` (say, the processes NVML lists on a GPU) belongs to.

        A pid belongs to a trial when it is the trial's root, in its process group, or a
        descendant of its root. Attributions are remembered for a while, so that a process
        NVML still lists a moment after it exited keeps counting as the trial's. Safe to
        call from a worker thread.
        """
        return self._attribution.attribute(pids, self.running_pids())

    def knows(self, trial_id: str) -> bool:
        return trial_id in self._trials

    # ---- starting --------------------------------------------------------------------

    def start(self, spec: TrialSpec) -> None:
        """Start a trial; its start or its failure to start arrives as an event."""
        directory = self.workdir / "trials" / spec.trial_id
        if spec.node_rank:  # the other ranks of a multi-node trial keep their files beside rank 0's
            directory = directory / f"rank{spec.node_rank}"
        t = _Trial(spec, directory)
        self._trials[spec.trial_id] = t
        self.idle.clear()
        t.task = asyncio.create_task(self._run(t), name=f"trial-{spec.trial_id}")

    async def _run(self, t: _Trial) -> None:
        spec = t.spec
        try:
            checkpoint_env = await self.checkpoints.open_trial(spec.trial_id, spec.attempt, spec.checkpoint)
        except CheckpointUnavailable as e:
            self._end(t, "failed", None, 0, str(e), False)
            return
        if t.cancel_reason is not None:  # canceled (or paused) while its checkpoint came
            self._end(t, t.outcome_if_canceled, None, 0, t.cancel_reason, False)
            return
        pbt = nnicompat.pbt_dirs(spec.parameters_json, checkpoint_env.get(sdk.ENV_CHECKPOINT_DIR, ""), spec.node_rank)
        if pbt is not None:  # on every rank: NNI's own paths are only names, never directories to write
            t.spec = spec = dataclasses.replace(spec, parameters_json=pbt.parameters_json)
            t.saves_left = pbt.step
        held = None
        if spec.nodes > 1 and spec.node_rank == 0:  # held until the trial's process starts, which binds it
            held = rendezvous.HeldPort()
            t.spec = spec = dataclasses.replace(spec, master_addr=self.node_address, master_port=held.port)
        try:
            env, cwd = trialfiles.prepare(spec, t.dir, self.base_env, self.socket_name, checkpoint_env)
        except OSError as e:
            self._end(t, "failed", None, 0, f"could not prepare the trial directory: {e}", False)
            return
        if self.copy_working_directory and spec.working_directory:
            target = t.dir / TRIAL_CODE_DIR
            try:
                await asyncio.to_thread(copy_tree, Path(spec.working_directory), target)
            except OSError as e:
                self._end(t, "failed", None, 0, f"could not copy {spec.working_directory} into {target}: {e}", False)
                return
            cwd = str(target)
        if not os.path.isdir(cwd):
            self._end(t, "failed", None, 0, f"working directory {cwd} does not exist", False)
            return
        argv = processes.command_argv(spec.command)
        self._spawning += 1
        if held is not None:
            held.release()
        try:
            with open(t.dir / "stdout.log", "ab") as out, open(t.dir / "stderr.log", "ab") as err:  # noqa: ASYNC230 - local files, opened once per trial
                t.proc = await self._spawn(argv, cwd, env, out.fileno(), err.fileno())
        except FileNotFoundError:
            self._end(t, "failed", None, 0, f"command not found: {argv[0]}", False)
            return
        except PermissionError:
            self._end(t, "failed", None, 0, f"command is not executable: {argv[0]}", False)
            return
        except OSError as e:
            self._end(t, "failed", None, 0, f"could not start {argv[0]}: {e}", False)
            return
        finally:
            self._spawning -= 1
        if self._warm is not None and self._warm.refused:
            _note(t, f"started cold: {self._warm.refused}")
        self.events.trial_started(spec.trial_id, t.proc.pid, time.time(), spec.master_addr if held else "",
                                  spec.master_port if held else 0)
        log.info("trial %s started (pid %d, gpus %r)", spec.trial_id, t.proc.pid, spec.gpu_indices)
        timer = None
        if spec.max_duration_s > 0:
            timer = asyncio.get_running_loop().call_later(
                spec.max_duration_s,
                self._time_out,
                spec.trial_id,
            )
        if t.cancel_reason is not None:
            # Canceled while it was being started: it did start, so it is reported, then ended.
            asyncio.create_task(self._kill_tree(t, 5.0))
        returncode = await t.proc.wait()
        t.exited.set_result(returncode)
        if timer:
            timer.cancel()
        # Whatever the trial left behind in its process group goes with it.
        if processes.group_alive(t.proc.pid):
            await processes.terminate_tree(t.proc.pid, t.proc.pid, 2.0)
        await self._end_strays(spec.trial_id)
        # Every datagram the tree sent is in the socket's queue now that the tree is gone,
        # and every line it printed in its stdout log.
        self._on_readable()
        self._read_nni_lines(t, final=True)
        self._flush_logs(t)
        # Its saves go before its end, so that a trial stopped mid-save continues from it.
        await self.checkpoints.settle(spec.trial_id)
        if returncode == 0 and t.cancel_reason is None and t.saves_left is not None:
            await self._save_left(t, t.saves_left)
        if returncode < 0 and t.cancel_reason is None and not self.host_stopping.is_set():
            # A platform taking the environment down (scancel, a pod deleted) signals all of
            # its processes at once: give the agent's own signal a moment to be seen, so the
            # trial is reported lost with its environment rather than failed.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.host_stopping.wait(), HOST_SIGNAL_GRACE_S)
        if self.copy_working_directory and spec.working_directory and not self.host_stopping.is_set():
            # Before the end is reported, so an agent told to stop next has pruned it too;
            # a copy that takes long to walk (a big tree on NFS) goes on being pruned
            # meanwhile rather than hold the report back.
            prune = asyncio.ensure_future(
                asyncio.to_thread(prune_copy, Path(spec.working_directory), t.dir / TRIAL_CODE_DIR)
            )
            try:
                await asyncio.wait_for(asyncio.shield(prune), PRUNE_WAIT_S)
            except asyncio.TimeoutError:
                prune.add_done_callback(lambda f: f.cancelled() or f.exception())
            except OSError as e:
                log.warning("trial %s: could not prune its copy of the code: %s", spec.trial_id, e)
        self._finish(t, returncode)

    async def _spawn(
        self, argv: list[str], cwd: str, env: dict[str, str], out: int, err: int
    ) -> asyncio.subprocess.Process | WarmProcess:
        """Fork the trial from the warm template where it can be, else start it cold."""
        if self._warm is not None:
            proc = await self._warm.start(argv, cwd, env, out, err)
            if proc is not None:
                return proc
        return await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
        )

    async def _end_strays(self, trial_id: str | None) -> None:
        """End the processes of ``trial_id`` (None: of every trial) that escaped its process
        group, say a daemon that double-forked and called setsid: with the agent as their
        subreaper they are its children now. One whose environment names no trial (cleared,
        or unreadable) is taken when no other trial runs."""
        if not self.subreaper:
            return
        def pick(marker: str | None) -> bool:
            # Asked on the event loop as the strays are chosen, so a trial started
            # meanwhile counts as one that runs.
            alone = all(tid == trial_id for tid in self._trials)
            return trial_id is None or marker == trial_id or (marker is None and alone)

        count = await processes.end_strays(pick, self._own_children, STRAY_GRACE_S)
        if count:
            log.info("trial %s: ended %d process(es) it left outside its process group", trial_id or "(any)", count)

    def _own_children(self) -> set[int] | None:
        if self._spawning:
            return None
        own = set(self.running_pids())
        template = self._warm.template_pid if self._warm is not None else None
        if template is not None:
            own.add(template)  # the agent's child, but no stray: never ended nor reaped as one
        return own

    async def _save_left(self, t: _Trial, step: int) -> None:
        """Before its end is reported: the next trial may start from this checkpoint."""
        try:
            why = await self.checkpoints.save_left(t.spec.trial_id, step, t.metric_index)
        except Exception as e:  # its end is reported whatever became of the save
            log.exception("trial %s: what it left in its checkpoint directory could not be saved", t.spec.trial_id)
            why = str(e) or type(e).__name__
        if why:
            _note(t, f"what it left in save_checkpoint_dir was not saved as its checkpoint: {why}")

    def _time_out(self, trial_id: str) -> None:
        t = self._trials.get(trial_id)
        if t and t.cancel_reason is None:
            t.outcome_if_canceled = "timed_out"
            self.cancel(trial_id, 5.0, f"ran past its max duration of {t.spec.max_duration_s:g} s")

    def _finish(self, t: _Trial, returncode: int) -> None:
        signum = -returncode if returncode < 0 else 0
        code = returncode if returncode >= 0 else None
        if t.cancel_reason is not None:
            outcome, reason = t.outcome_if_canceled, t.cancel_reason
        elif returncode == 0 and (paused := self.checkpoints.paused_reason(t.spec.trial_id)):
            outcome, reason = "paused", paused
        elif returncode == 0:
            outcome, reason = "succeeded", ""
        elif signum and self.host_stopping.is_set():
            outcome = "lost"
            reason = f"killed by signal {signum} ({processes.signal_name(signum)}) as its environment was stopped"
        elif signum:
            outcome, reason = "failed", f"killed by signal {signum} ({processes.signal_name(signum)})"
        elif returncode == 127:
            outcome, reason = "failed", "exit code 127: command not found"
        elif 128 < returncode <= 128 + 64:
            name = processes.signal_name(returncode - 128)
            outcome, reason = "failed", f"exit code {returncode} (its command was likely killed by {name})"
        else:
            outcome, reason = "failed", f"exit code {returncode}"
        self._end(t, outcome, code, signum, reason, True)

    def _end(
        self, t: _Trial, outcome: str, code: int | None, signum: int, reason: str, started: bool
    ) -> None:
        result = TrialResult(
            attempt=t.spec.attempt,
            trial_id=t.spec.trial_id,
            outcome=outcome,
            exit_code=code,
            signal=signum,
            reason=reason,
            stderr_tail=trialfiles.tail(t.dir / "stderr.log", STDERR_TAIL_BYTES),
            started=started,
            ended_at=time.time(),
        )
        self._trials.pop(t.spec.trial_id, None)
        self.checkpoints.close_trial(t.spec.trial_id)
        if not self._trials:
            self.idle.set()
        log.info("trial %s ended: %s %s", t.spec.trial_id, outcome, reason)
        self.events.trial_ended(result)

    # ---- cancelling ------------------------------------------------------------------

    def cancel(self, trial_id: str, grace_s: float, reason: str, outcome: str = "") -> bool:
        """Stop a trial; it ends ``outcome`` (default: canceled, or paused when a pause ran out)."""
        t = self._trials.get(trial_id)
        if t is None:
            return False
        if t.cancel_reason is None:
            t.cancel_reason = reason or "canceled"
            t.outcome_if_canceled = outcome or t.outcome_if_canceled
            if t.proc is not None:
                asyncio.create_task(self._kill_tree(t, grace_s))
            else:
                self.checkpoints.abort(trial_id, t.cancel_reason)
        return True

    def pause(self, trial_id: str, grace_s: float, reason: str) -> bool:
        """Its next save tells it to end (outcome paused); past ``grace_s`` it is stopped."""
        t = self._trials.get(trial_id)
        if t is None or t.cancel_reason is not None:
            return False
        if t.proc is None:  # not started yet: it continues later from the checkpoint it was to start from
            t.outcome_if_canceled = "paused"
            return self.cancel(trial_id, 5.0, f"paused before it started: {reason}")
        log.info("trial %s: asked to pause within %g s: %s", trial_id, grace_s, reason)
        return self.checkpoints.pause(trial_id, grace_s, reason, lambda why: self._pause_overdue(t, why))

    def _pause_overdue(self, t: _Trial, why: str) -> None:
        if not t.exited.done() and t.cancel_reason is None:
            t.outcome_if_canceled = "paused"
            self.cancel(t.spec.trial_id, 5.0, why)

    async def _kill_tree(self, t: _Trial, grace_s: float) -> None:
        assert t.proc is not None
        await processes.terminate_tree(t.proc.pid, t.proc.pid, grace_s, t.exited)

    async def cancel_all(self, reason: str, grace_s: float, outcome: str = "") -> None:
        for trial_id in list(self._trials):
            self.cancel(trial_id, grace_s, reason, outcome)
        await self.wait_idle(grace_s + 15.0)

    async def wait_idle(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # ---- metrics ---------------------------------------------------------------------

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.receive()
            except OSError as e:
                log.warning("metric socket: %s", e)
                return
            if data is None:
                return
            try:
                self._ingest(data)
            except Exception:
                # Whatever a trial sends, the socket keeps being read and the trial's end reported.
                log.exception("a metric datagram could not be handled and was refused: %r", data[:200])

    def _ingest(self, data: bytes) -> None:
        d = results.decode(data)
        if d is None:
            log.warning("an unreadable metric datagram was refused: %r", data[:200])
            return
        t = self._trials.get(d.trial_id) if isinstance(d.trial_id, str) else None
        if t is None:
            log.warning("a metric for unknown trial %r was refused", d.trial_id)
            return
        kind, values = d.kind, d.values
        if kind == "checkpoint":
            self._checkpoint(t, d.message.get("step"), d.message.get("reply"))
        elif values is None:
            self._accept(t, kind, d.value)
        elif type(values) is not list:
            _note(t, f"{kind} results refused: 'values' must be a list, got {type(values).__name__}")
        elif kind == "intermediate" and results.plain_run(values):
            # What a trial reporting floats in a tight loop sends: handed on as one run.
            index = t.metric_index
            t.metric_index += len(values)
            self.events.metrics(t.spec.trial_id, kind, index, values, None)
        else:
            for item in values:  # each refused or accepted alone, in order
                self._accept(t, kind, item)

    def _checkpoint(self, t: _Trial, step: object, reply: object) -> None:
        if not isinstance(reply, str) or not (reply.startswith(sdk.ABSTRACT_PREFIX) or os.path.isabs(reply)):
            _note(t, "a save_checkpoint without an address to answer it at was refused")
            return
        self._read_nni_lines(t)  # results it printed before the save count before it
        self.checkpoints.request_save(t.spec.trial_id, step, reply, t.metric_index)

    def _read_nni_lines(self, t: _Trial, final: bool = False) -> None:
        try:
            for line in t.nni_lines.scan(final=final):
                if line.problem:
                    _note(t, f"refused {line.problem}")
                elif line.kind:
                    self._accept(t, line.kind, line.value)
        except Exception:  # whatever a trial prints, its end is still reported
            log.exception("trial %s: could not read the NNI results on its stdout", t.spec.trial_id)

    def _accept(self, t: _Trial, kind: object, value: object) -> None:
        """Check a result however it came and hand it on, numbered in the trial's order."""
        if t.spec.node_rank:  # a multi-node trial's results are its rank 0's: said once
            if not t.rank_noted:
                t.rank_noted = True
                _note(t, f"{kind} result ignored: results are taken from rank 0, this is rank {t.spec.node_rank}")
            return
        accepted = results.check(kind, value, t.final_reported)
        if isinstance(accepted, str):
            _note(t, f"{kind} result refused: {accepted}")
            return
        if kind == "final":
            t.final_reported = True
        index = t.metric_index
        t.metric_index += 1
        self.events.metrics(t.spec.trial_id, str(kind), index, [accepted.number],
                            None if accepted.raw is None else [accepted.raw])

    # ---- logs ------------------------------------------------------------------------

    async def _tail_logs_forever(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval_s)
            for t in list(self._trials.values()):
                self._read_nni_lines(t)
                self._flush_logs(t)

    def _flush_logs(self, t: _Trial) -> None:
        # Only offsets are handed on, never the bytes: the session reads them from the file
        # when it sends them, so a trial writing gigabytes costs the agent no memory.
        if not self.stream_logs:
            return
        for stream in ("stdout", "stderr"):
            path = t.dir / f"{stream}.log"
            offset = t.log_offsets[stream]
            try:
                size = min(path.stat().st_size, MAX_STREAMED_LOG_BYTES)
            except FileNotFoundError:
                continue  # not started yet (its checkpoint still coming, say): nothing to send
            except OSError as e:
                log.warning("trial %s: cannot read %s: %s", t.spec.trial_id, path, e)
                continue
            while offset < size:
                length = min(LOG_CHUNK_BYTES, size - offset)
                self.events.log(t.spec.trial_id, stream, path, offset, length)
                offset += length
            t.log_offsets[stream] = offset


def _note(t: _Trial, message: str) -> None:
    trialfiles.note(t.dir, t.spec.trial_id, message)
