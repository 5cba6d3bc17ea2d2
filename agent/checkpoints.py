"""The agent's checkpoint keeper: each trial's live checkpoint directory, the checkpoint a
trial continues from, and its saves.

A trial writes its state into its live directory (``TRIALKEEPER_CHECKPOINT_DIR``) and calls
``trial.save_checkpoint(step)``, which asks the agent through the metric socket. The keeper
renames the live directory away whole (the snapshot: whole or absent, no copy) and gives the
trial a new empty one at the same path, then keeps the files where the coordinator can have
them:

- shared storage (the coordinator's ``checkpoint_dir`` holds the experiment's marker file):
  the live directory already lies there, ``<dir>/<trial>/live-<attempt>-<random>``; the
  snapshot is renamed to ``<dir>/<trial>/<step>`` and CheckpointSaved says so;
- object storage (``checkpoint_storage``): the snapshot goes to the local cache, is uploaded
  under ``<prefix>/<experiment>/<trial>/<step>``, and CheckpointSaved names its URL;
- otherwise the snapshot goes to the local cache and its files up the stream as numbered
  chunks, then CheckpointSaved.

The local cache is ``<workdir>/checkpoint-cache/<trial>/<step>/`` with ``<step>.json`` beside
it (its digest and files); only a trial's newest copy is kept. (Not ``checkpoints``: a local
agent's work dir is its experiment's directory, whose ``checkpoints`` is the coordinator's.)
The save is answered once the Ack covering CheckpointSaved arrives (or a CheckpointRefused
came first): ``{"ok": true, "pause": bool}`` or ``{"ok": false, "error": reason}``.

A trial continued from a checkpoint gets its files in its new live directory before it
starts: from the local cache when a copy with the same digest is there, else from shared
storage, else from object storage, else downloaded over the stream (FetchCheckpoint), resumed
where it stopped after a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import checkpoint_files as cf
from . import trial as sdk
from .checkpoint_files import CheckpointFilesError, FileEntry, Manifest

log = logging.getLogger(__name__)

CACHE_DIR = "checkpoint-cache"
# How long a save waits for the coordinator to record it (the SDK's own default deadline).
ACK_WAIT_S = float(sdk.DEFAULT_CHECKPOINT_TIMEOUT_S)
# A download from the coordinator fails when no part of it arrived for this long while connected.
DOWNLOAD_STALL_S = 600.0
_STALL_CHECK_S = 5.0
# Steps are stored as SQLite integers.
MAX_STEP = (1 << 63) - 1
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointRef:
    """The checkpoint a trial continues from (StartTrial.checkpoint)."""

    trial_id: str  # the trial that saved it
    step: int
    metric_index: int
    location: str
    digest: str
    size_bytes: int
    files: tuple[FileEntry, ...]


@dataclass(frozen=True)
class SavedCheckpoint:
    trial_id: str
    step: int
    metric_index: int
    manifest: Manifest
    location: str
    saved_at: float


class CheckpointLink:
    """What the keeper needs of the session; all calls happen on the event loop thread."""

    def checkpoint_upload(self, trial_id: str, step: int, directory: Path, files: Sequence[FileEntry]) -> None:
        """Send the files (under ``directory``) up as numbered chunks, read when sent."""

    async def checkpoint_send_direct(
        self, trial_id: str, step: int, directory: Path, files: Sequence[FileEntry]
    ) -> set[str]:
        """Send what files it can straight to the coordinator's bulk port; the paths sent."""
        return set()

    def checkpoint_saved(self, saved: SavedCheckpoint) -> asyncio.Future[str | None]:
        """Send CheckpointSaved; the future gives None once acknowledged (recorded), or the
        reason of a CheckpointRefused that came first."""
        raise NotImplementedError

    def fetch_checkpoint(self, trial_id: str, step: int, path: str, offset: int) -> None:
        """Ask the coordinator for a checkpoint's chunks from (path, offset) on."""


class CheckpointUnavailable(Exception):
    """The checkpoint a trial is to continue from cannot be had; the message says why."""


class _Refused(Exception):
    """A save refused; the message is what the trial's CheckpointError says."""


@dataclass
class _Live:
    trial_id: str
    live: Path
    root: Path  # where its steps go: <shared dir>/<trial> or <cache>/<trial>
    shared: bool
    last_step: int | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tidying: asyncio.Lock = field(default_factory=asyncio.Lock)  # its saves' housekeeping, one at a time
    busy: int = 0  # saves asked and not answered
    preparing: int = 0  # saves whose CheckpointSaved is not sent yet
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    sent: asyncio.Event = field(default_factory=asyncio.Event)
    pause_reason: str = ""  # why the coordinator asked it to pause ("": it did not)
    paused_at: int | None = None  # the step whose save answered "pause"
    pause_deadline: asyncio.Task[None] | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.idle.set()
        self.sent.set()


@dataclass
class _Fetch:
    ref: CheckpointRef
    download: cf.Download
    done: asyncio.Future[None]
    progress: float


class CheckpointKeeper:
    """The checkpoints of one agent's trials."""

    def __init__(self, workdir: Path, link: CheckpointLink) -> None:
        self.cache = workdir / CACHE_DIR
        self.link = link
        self.experiment_id = ""
        self.checkpoint_dir = ""
        self.storage_url = ""
        self.max_bytes = 0
        self._shared: tuple[str, str, Path | None] | None = None
        self._trials: dict[str, _Live] = {}
        self._fetches: dict[str, _Fetch] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reply_sock: socket.socket | None = None

    # ---- settings ----------------------------------------------------------------------

    def configure(self, *, experiment_id: str, checkpoint_dir: str, checkpoint_storage: str, max_bytes: int) -> None:
        """Where checkpoints go, as the coordinator's Welcome says."""
        self.experiment_id = experiment_id
        self.checkpoint_dir = checkpoint_dir
        self.storage_url = checkpoint_storage
        self.max_bytes = max_bytes

    async def shared_root(self) -> Path | None:
        """The experiment's checkpoint directory when this machine sees it (its marker file
        holds the experiment id), else None; checked once per directory."""
        if not self.checkpoint_dir or not self.experiment_id:
            return None
        key = (self.checkpoint_dir, self.experiment_id)
        if self._shared is None or self._shared[:2] != key:
            root, why = await asyncio.to_thread(cf.marked_root, Path(self.checkpoint_dir), self.experiment_id)
            self._shared = (*key, root)
            if root is None:
                log.info("checkpoints go up the stream: %s", why)
            else:
                log.info("checkpoints are kept in %s (shared storage)", root)
        return self._shared[2]

    # ---- a trial's start and end ---------------------------------------------------------

    async def open_trial(self, trial_id: str, attempt: int, ref: CheckpointRef | None) -> dict[str, str]:
        """Make the trial's live directory, with the files of ``ref`` when given; returns the
        environment variables that name it. Raises CheckpointUnavailable."""
        shared = await self.shared_root()
        on_shared = shared is not None and not self.storage_url
        root = (shared if on_shared and shared is not None else self.cache) / trial_id
        live = root / f"live-{attempt}-{uuid.uuid4().hex[:8]}"
        try:
            await asyncio.to_thread(cf.make_live, root, live, not on_shared)
        except OSError as e:
            raise CheckpointUnavailable(f"cannot make its checkpoint directory {live}: {e.strerror or e}") from e
        owned = ref is not None and ref.trial_id == trial_id
        lt = _Live(trial_id, live, root, on_shared, ref.step if owned and ref is not None else None)
        self._trials[trial_id] = lt
        env = {sdk.ENV_CHECKPOINT_DIR: str(live)}
        if ref is not None:
            try:
                await self._materialise(trial_id, ref, live, shared)
            except (CheckpointFilesError, OSError) as e:
                self.close_trial(trial_id)
                reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                raise CheckpointUnavailable(
                    f"cannot get the checkpoint of step {ref.step} of trial {ref.trial_id}: {reason}"
                ) from e
            env[sdk.ENV_CHECKPOINT_STEP] = str(ref.step)
        return env

    async def settle(self, trial_id: str, timeout: float = ACK_WAIT_S) -> None:
        """Wait until every save the trial asked for is sent (or failed): a trial's end is
        reported after its last CheckpointSaved."""
        lt = self._trials.get(trial_id)
        if lt is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(lt.sent.wait(), timeout)

    async def quiet(self, trial_id: str, timeout: float = ACK_WAIT_S) -> None:
        """Wait until no save of the trial waits for its answer."""
        lt = self._trials.get(trial_id)
        if lt is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(lt.idle.wait(), timeout)

    def close_trial(self, trial_id: str) -> None:
        """The trial ended: its live directory goes (in the background)."""
        self.abort(trial_id, "the trial ended")
        lt = self._trials.pop(trial_id, None)
        if lt is not None:
            lt.closed = True
            if lt.pause_deadline is not None:
                lt.pause_deadline.cancel()
            self._background(asyncio.to_thread(cf.remove, lt.live))

    def abort(self, trial_id: str, reason: str) -> None:
        """End the download of the trial's checkpoint, if one is under way."""
        f = self._fetches.get(trial_id)
        if f is not None and not f.done.done():
            f.done.set_exception(CheckpointFilesError(reason))

    async def close(self) -> None:
        for lt in self._trials.values():
            if lt.pause_deadline is not None:
                lt.pause_deadline.cancel()
        for f in self._fetches.values():
            if not f.done.done():
                f.done.set_exception(CheckpointFilesError("the agent is shutting down"))
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for task in tasks:
            task.cancel()
        if self._reply_sock is not None:
            self._reply_sock.close()
            self._reply_sock = None

    # ---- pausing -------------------------------------------------------------------------

    def pause(self, trial_id: str, grace_s: float, reason: str, overdue: Callable[[str], None]) -> bool:
        """Answer the trial's next safe save with "pause"; past ``grace_s`` (and any save under
        way), call ``overdue`` with the reason to stop it, unless it ended."""
        lt = self._trials.get(trial_id)
        if lt is None or lt.pause_reason:
            return lt is not None
        lt.pause_reason = reason or "asked to pause"
        lt.pause_deadline = asyncio.ensure_future(self._pause_deadline(lt, grace_s, overdue))
        return True

    async def _pause_deadline(self, lt: _Live, grace_s: float, overdue: Callable[[str], None]) -> None:
        await asyncio.sleep(grace_s)
        # A save under way when the time is up is let finish: it may be the one that pauses.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(lt.idle.wait(), ACK_WAIT_S)
        if lt.closed:
            return
        if lt.paused_at is None:
            overdue(f"saved no checkpoint within {grace_s:g} s of being asked to pause")
        else:
            overdue(f"did not end within {grace_s:g} s of being asked to pause (its checkpoint of step "
                    f"{lt.paused_at} is saved)")

    def paused_reason(self, trial_id: str) -> str:
        """Why the trial ended paused, when a save told it to ("" otherwise)."""
        lt = self._trials.get(trial_id)
        if lt is None or lt.paused_at is None:
            return ""
        return f"paused after its checkpoint of step {lt.paused_at}: {lt.pause_reason}"

    # ---- continuing from a checkpoint ----------------------------------------------------

    async def _materialise(self, trial_id: str, ref: CheckpointRef, live: Path, shared: Path | None) -> None:
        if why := cf.manifest_problem(ref.files, ref.size_bytes):
            raise CheckpointFilesError(f"its manifest cannot be used: {why}")
        local = self.cache / ref.trial_id / str(ref.step)
        cached = await asyncio.to_thread(cf.cached_digest, local)
        if cached is None and ref.digest:  # its index still being written: its files read now
            cached = await asyncio.to_thread(_digest_if_same, local, ref.files)
        # Its digest not known yet (uploaded a moment ago, the coordinator still reading it):
        # this agent's own copy of that step, file for file.
        if cached == ref.digest or (not ref.digest and await asyncio.to_thread(_same_files, local, ref.files)):
            try:
                await asyncio.to_thread(cf.copy_files, local, live, ref.files)
                log.info("trial %s: continues from step %d, copied from this machine's %s", trial_id, ref.step, local)
                return
            except CheckpointFilesError as e:
                log.warning("trial %s: the local copy %s cannot be used (%s)", trial_id, local, e)
                await asyncio.to_thread(cf.empty_directory, live)
        if "://" in ref.location:
            await self._from_object_storage(trial_id, ref, live)
            return
        if shared is not None:
            source = shared / ref.trial_id / str(ref.step)
            try:
                await asyncio.to_thread(cf.copy_files, source, live, ref.files)
                log.info("trial %s: continues from step %d, copied from %s", trial_id, ref.step, source)
                return
            except CheckpointFilesError as e:
                log.warning("trial %s: %s cannot be used (%s): asking the coordinator for it", trial_id, source, e)
                await asyncio.to_thread(cf.empty_directory, live)
        await self._fetch(trial_id, ref, live)
        log.info("trial %s: continues from step %d, downloaded (%d bytes)", trial_id, ref.step, ref.size_bytes)

    async def _from_object_storage(self, trial_id: str, ref: CheckpointRef, live: Path) -> None:
        url = self.storage_url or ref.location
        await asyncio.to_thread(_with_store, url, lambda store: store.get_dir(ref.location, live, list(_pairs(ref))))
        got = await asyncio.to_thread(cf.digest_of, live, ref.files)
        if ref.digest and got != ref.digest:
            raise CheckpointFilesError(f"downloaded from {ref.location}, its digest is {got}, expected {ref.digest}")
        await asyncio.to_thread(cf.set_modes, live, ref.files)
        log.info("trial %s: continues from step %d, downloaded from %s", trial_id, ref.step, ref.location)

    async def _fetch(self, trial_id: str, ref: CheckpointRef, live: Path) -> None:
        f = _Fetch(ref, cf.Download(live, ref.files, ref.digest), asyncio.get_running_loop().create_future(),
                   time.monotonic())
        self._fetches[trial_id] = f
        try:
            self.link.fetch_checkpoint(trial_id, ref.step, "", 0)
            while not f.done.done():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(f.done), _STALL_CHECK_S)
                if not f.done.done() and time.monotonic() - f.progress > DOWNLOAD_STALL_S:
                    raise CheckpointFilesError(f"no part of it arrived from the coordinator for {DOWNLOAD_STALL_S:g} s")
            f.done.result()
        finally:
            f.download.close()
            if self._fetches.get(trial_id) is f:
                del self._fetches[trial_id]

    def on_chunk(self, trial_id: str, step: int, path: str, offset: int, data: bytes, last: bool) -> None:
        """A chunk of a checkpoint being downloaded (written here, on the event loop: a
        chunk is at most 1 MiB, and not reading the stream meanwhile is its backpressure)."""
        f = self._fetches.get(trial_id)
        if f is None or f.ref.step != step or f.done.done():
            log.debug("trial %s: a checkpoint chunk of step %d nobody waits for was dropped", trial_id, step)
            return
        f.progress = time.monotonic()
        try:
            if f.download.feed(path, offset, data, last):
                f.done.set_result(None)
        except CheckpointFilesError as e:
            f.done.set_exception(e)

    def on_refused(self, trial_id: str, step: int, reason: str) -> None:
        f = self._fetches.get(trial_id)
        if f is not None and f.ref.step == step and not f.done.done():
            f.done.set_exception(CheckpointFilesError(f"the coordinator cannot send it: {reason}"))

    def on_reconnect(self) -> None:
        """A new stream: the downloads under way go on from where they stopped."""
        for trial_id, f in self._fetches.items():
            if not f.done.done():
                path, offset = f.download.position()
                f.progress = time.monotonic()
                self.link.fetch_checkpoint(trial_id, f.ref.step, path, offset)

    # ---- saving --------------------------------------------------------------------------

    def request_save(self, trial_id: str, step: object, reply: str, metric_index: int) -> None:
        """A trial's save_checkpoint(step), asked when it had reported ``metric_index`` results."""
        lt = self._trials.get(trial_id)
        if lt is None:
            self._reply(trial_id, reply, {"ok": False, "error": "the agent has no checkpoint directory for this trial"})
            return
        self._begin(lt)
        self._background(self._save(lt, step, lambda answer: self._reply(trial_id, reply, answer), metric_index))

    async def save_left(self, trial_id: str, step: int, metric_index: int) -> str:
        """Save what an ended trial left in its live directory as its checkpoint (a trial of
        NNI's PBT saves by leaving its files there): "" once recorded, or when it left
        nothing; else why not. Its step follows its own saves, if it made any."""
        lt = self._trials.get(trial_id)
        if lt is None or not await asyncio.to_thread(cf.holds_files, lt.live):
            return ""
        if lt.last_step is not None:
            step = max(step, lt.last_step + 1)
        answers: list[dict[str, object]] = []
        self._begin(lt)
        await self._save(lt, step, answers.append, metric_index)
        return "" if answers and answers[0].get("ok") else str(answers[0].get("error") if answers else "no answer")

    def _begin(self, lt: _Live) -> None:
        lt.busy += 1
        lt.preparing += 1
        lt.idle.clear()
        lt.sent.clear()

    async def _save(self, lt: _Live, step: object, answer_to: Callable[[dict[str, object]], None],
                    metric_index: int) -> None:
        prepared = False

        def sent() -> None:
            nonlocal prepared
            if not prepared:
                prepared = True
                lt.preparing -= 1
                if lt.preparing == 0:
                    lt.sent.set()

        try:
            async with lt.lock:
                try:
                    pause = await self._save_one(lt, step, metric_index, sent)
                    answer: dict[str, object] = {"ok": True, "pause": pause}
                except _Refused as e:
                    log.info("trial %s: checkpoint at step %r refused: %s", lt.trial_id, step, e)
                    answer = {"ok": False, "error": str(e)}
                answer_to(answer)
        finally:
            sent()
            lt.busy -= 1
            if lt.busy == 0:
                lt.idle.set()

    async def _save_one(self, lt: _Live, step: object, metric_index: int, sent: Callable[[], None]) -> bool:
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise _Refused(f"step must be a whole number from 0 to {MAX_STEP}, got {step!r}")
        if lt.last_step is not None and step <= lt.last_step:
            raise _Refused(
                f"step {step} is not after step {lt.last_step}, the trial's last checkpoint: steps must increase"
            )
        if lt.closed:
            raise _Refused("the trial has ended")
        staging = lt.root / f".saving-{step}-{uuid.uuid4().hex[:8]}"
        final = lt.root / str(step)
        # Uploaded: the coordinator takes its digest from the files it got, off the save's way.
        uploaded = not lt.shared and not self.storage_url
        try:
            files, digest = await asyncio.to_thread(_take, lt.live, staging, final, self.max_bytes, not uploaded)
        except _NotTaken as e:
            raise _Refused(f"cannot take the files of {lt.live}: {e.error.strerror or e.error}") from e.error
        except (CheckpointFilesError, OSError) as e:
            where = staging if staging.exists() else final
            raise _Refused(f"{_reason(e)}{await self._give_back(lt, where)}") from e
        manifest = cf.Manifest(tuple(files), digest)
        direct: asyncio.Future[set[str]] | None = None
        if uploaded:
            direct = asyncio.ensure_future(self.link.checkpoint_send_direct(lt.trial_id, step, final, files))
        location = ""
        if self.storage_url and not lt.shared:
            key = f"{self.experiment_id}/{lt.trial_id}/{step}"
            try:
                location = await asyncio.to_thread(
                    _with_store, self.storage_url, lambda store: store.put_dir(final, key, list(_pairs(manifest)))
                )
            except CheckpointFilesError as e:
                raise _Refused(f"cannot upload it to {self.storage_url}: {e}{await self._give_back(lt, final)}") from e
        if not lt.shared:
            if manifest.digest:
                await asyncio.to_thread(cf.write_index, final, manifest)
            if not location:
                took = await direct if direct is not None else set()
                rest = [f for f in manifest.files if f.path not in took]
                if rest or not manifest.files:
                    self.link.checkpoint_upload(lt.trial_id, step, final, rest)
        saved = SavedCheckpoint(lt.trial_id, step, metric_index, manifest, location, time.time())
        answer = self.link.checkpoint_saved(saved)
        sent()
        log.info("trial %s: checkpoint at step %d taken (%d files, %d bytes%s)", lt.trial_id, step,
                 len(manifest.files), manifest.size_bytes, f", {location}" if location else "")
        try:
            refusal = await asyncio.wait_for(asyncio.shield(answer), ACK_WAIT_S)
        except asyncio.TimeoutError:
            raise _Refused(f"the coordinator did not record it within {ACK_WAIT_S:g} s (it may still)") from None
        if refusal is not None:
            if location:
                self._background(asyncio.to_thread(_with_store, self.storage_url, lambda s: s.delete(location)))
            raise _Refused(f"the coordinator refused it: {refusal}{await self._give_back(lt, final)}")
        lt.last_step = step
        if not lt.shared and not manifest.digest:
            # This copy's index, its digest taken once the save is answered: off the way of the bytes
            # (a continue here meanwhile reads the files and compares them).
            self._background(self._tidy(lt, _index_digested, final, files))
        if not lt.shared:
            self._background(self._tidy(lt, cf.drop_older, lt.root, step))
        if lt.pause_reason:
            lt.paused_at = step
        return bool(lt.pause_reason)

    async def _tidy(self, lt: _Live, work: Callable[..., object], *args: Any) -> None:
        """A save's housekeeping, after the saves before it (in order: an earlier save's index,
        written after a later save cleared the older copies, would stay behind)."""
        async with lt.tidying:
            await asyncio.to_thread(work, *args)

    async def _give_back(self, lt: _Live, copy: Path) -> str:
        """Put a refused checkpoint's files back into the live directory (when it is still
        empty and the trial runs); what became of them, for the trial's error."""
        return await asyncio.to_thread(cf.restore, copy, lt.live, not lt.closed)

    def _reply(self, trial_id: str, reply: str, answer: dict[str, object]) -> None:
        try:
            if self._reply_sock is None:
                self._reply_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._reply_sock.setblocking(False)
            self._reply_sock.sendto(json.dumps(answer).encode(), sdk.socket_address(reply))
        except OSError as e:
            log.info("trial %s: its save_checkpoint cannot be answered (%s): it stopped waiting", trial_id, e)

    def _background(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.warning("checkpoint housekeeping failed: %s", _reason(e))


# ---- file work, in worker threads -------------------------------------------------------


def _reason(e: BaseException) -> str:
    return (e.strerror or str(e)) if isinstance(e, OSError) else str(e)


def _pairs(what: CheckpointRef | Manifest) -> list[tuple[str, int]]:
    return [(f.path, f.size) for f in what.files]


def _with_store(url: str, action: Callable[[Any], T]) -> T:
    """``action(store)`` on the object storage at ``url``; its errors as CheckpointFilesError."""
    try:
        from .objectstore import ObjectStore, ObjectStoreError
    except ImportError as e:
        raise CheckpointFilesError(f"object storage {url} cannot be used here: {e}") from e
    try:
        return action(ObjectStore.from_url(url))
    except ObjectStoreError as e:
        raise CheckpointFilesError(str(e)) from e


class _NotTaken(Exception):
    """The live directory's files could not be taken: nothing moved."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _take(live: Path, staging: Path, final: Path, max_bytes: int, digest: bool) -> tuple[list[FileEntry], str]:
    """A save's file work in one trip to a worker thread (each trip costs a save a few tenths of
    a millisecond, more on a loaded machine): take the live files, scan them, place them as
    the step's checkpoint, and their digest when asked ("" when not)."""
    try:
        cf.snapshot(live, staging)
    except OSError as e:
        raise _NotTaken(e) from e
    files = cf.scan_within(staging, max_bytes)
    cf.place(staging, final)
    return files, cf.digest_of(final, files) if digest else ""


def _index_digested(copy: Path, files: list[FileEntry]) -> None:
    cf.write_index(copy, cf.Manifest(tuple(files), cf.digest_of(copy, files)))


def _same_files(copy: Path, files: Sequence[FileEntry]) -> bool:
    try:
        cf.check_sizes(copy, files)
    except CheckpointFilesError:
        return False
    return copy.is_dir()


def _digest_if_same(copy: Path, files: Sequence[FileEntry]) -> str | None:
    """The digest of a local copy whose files are those of ``files`` (None otherwise)."""
    if not _same_files(copy, files):
        return None
    try:
        return cf.digest_of(copy, files)
    except CheckpointFilesError:
        return None
