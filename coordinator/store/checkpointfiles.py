"""The experiment's checkpoint directory: the files of the checkpoints the store records.

Layout under the root (``<experiment dir>/checkpoints``): ``<trial>/<step>/`` holds a
checkpoint's files. An upload lands in ``<trial>/.incoming-<step>/`` chunk by chunk, each
written before the message that carried it is acknowledged, and becomes ``<trial>/<step>/``
by one rename once the agent says it is whole and every file has its size. Agents that see
this directory through shared storage write ``<trial>/<step>/`` themselves (by rename too).
A checkpoint is whole or absent; one the store does not record is garbage that removal and
``trialkeeper clean`` take away. ``.trialkeeper-experiment`` holds the experiment's id: an
agent that finds it knows it sees this very directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from ..engine.checkpoints import CHUNK_BYTES, Checkpoint, CheckpointData, CheckpointFile, path_problem

log = logging.getLogger(__name__)

MARKER = ".trialkeeper-experiment"


class CheckpointFilesError(Exception):
    """A checkpoint's files cannot be read (removed, truncated, on object storage)."""


class CheckpointFiles:
    def __init__(self, root: Path, experiment_id: str) -> None:
        self.root = root
        self.experiment_id = experiment_id

    def mark(self) -> None:
        """Create the directory and its marker (agents sharing it look for it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / MARKER
        if not marker.exists() or marker.read_text().strip() != self.experiment_id:
            tmp = self.root / f"{MARKER}.tmp"
            tmp.write_text(self.experiment_id + "\n")
            os.replace(tmp, marker)

    def dir_of(self, trial_id: str, step: int) -> Path:
        return self.root / trial_id / str(step)

    def incoming_dir(self, trial_id: str, step: int) -> Path:
        return self.root / trial_id / f".incoming-{step}"

    # ---- uploads ---------------------------------------------------------------------------

    def write_chunk(self, trial_id: str, step: int, path: str, offset: int, data: bytes) -> None:
        """Write a piece of an upload. Pieces come in order (a replay may repeat one); one
        past the end of its file would leave a hole and is dropped, loudly."""
        if path_problem(path) or path_problem(trial_id):
            return
        target = self.incoming_dir(trial_id, step) / path
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            size = target.stat().st_size if target.exists() else 0
            if offset > size:
                log.warning("trial %s: checkpoint %d: piece of %s at %d past its end (%d); dropped",
                            trial_id, step, path, offset, size)
                return
            # A file's first piece starts it anew: what an earlier, interrupted upload of the
            # same step left there goes (a replay resends every piece after it too).
            with open(target, "r+b" if size and offset else "wb") as f:
                f.seek(offset)
                f.write(data)
        except OSError as e:  # the save is refused when the files do not add up
            log.warning("trial %s: could not write checkpoint %d (%s): %s", trial_id, step, path, e)

    def finish(self, trial_id: str, step: int, files: tuple[CheckpointFile, ...]) -> str:
        """Make ``<trial>/<step>/`` the whole checkpoint the agent described; returns what is
        wrong ("" when it is whole). Written through shared storage it is there already."""
        if path_problem(trial_id):
            return f"trial id {trial_id!r} cannot name a directory"
        final, incoming = self.dir_of(trial_id, step), self.incoming_dir(trial_id, step)
        try:
            if incoming.exists():
                if _missing(incoming, files):
                    return f"the coordinator did not get all of it: {_missing(incoming, files)}"
                _drop_extra(incoming, files)  # left by an earlier, interrupted upload of the step
                if final.exists():  # saved again at the same step: the new one replaces it
                    shutil.rmtree(final)
                os.replace(incoming, final)
            elif not final.exists() and files:
                return "the coordinator did not get any of it"
            else:
                final.mkdir(parents=True, exist_ok=True)
            missing = _missing(final, files)
            return f"its files are not all there: {missing}" if missing else ""
        except OSError as e:
            return f"the coordinator could not keep it: {e}"

    def digest(self, c: Checkpoint) -> str:
        """The digest of a checkpoint's files here, as agents take it (raises OSError)."""
        from trialkeeper.agent.checkpoint_files import CheckpointFilesError as Unreadable
        from trialkeeper.agent.checkpoint_files import FileEntry, digest_of

        try:
            return digest_of(self.dir_of(c.trial_id, c.step), [FileEntry(f.path, f.size, f.mode) for f in c.files])
        except Unreadable as e:
            raise OSError(str(e)) from e

    # ---- downloads -------------------------------------------------------------------------

    async def pieces(self, trial_id: str, c: Checkpoint, path: str, offset: int) -> AsyncIterator[CheckpointData]:
        """The pieces of a checkpoint from file ``path`` (and ``offset``) on, in the order of
        its files, read as they are sent; the last one says so."""
        if c.location:
            raise CheckpointFilesError(f"it is in object storage ({c.location}); read it from there")
        directory = self.dir_of(c.trial_id, c.step)
        names = [f.path for f in c.files]
        start = names.index(path) if path in names else 0
        offset = offset if path in names else 0
        todo = c.files[start:]
        if not todo:
            yield CheckpointData(trial_id, c.step, "", 0, b"", True)
            return
        for n, f in enumerate(todo):
            at = offset if n == 0 else 0
            while True:
                data = await asyncio.to_thread(_read, directory / f.path, at, CHUNK_BYTES)
                if len(data) < min(CHUNK_BYTES, f.size - at):
                    raise CheckpointFilesError(f"{f.path} of the checkpoint at step {c.step} is shorter than it was")
                end = at + len(data) >= f.size
                yield CheckpointData(trial_id, c.step, f.path, at, data, end and n == len(todo) - 1)
                at += len(data)
                if end:
                    break

    # ---- removal ---------------------------------------------------------------------------

    async def remove(self, c: Checkpoint) -> None:
        """Remove a checkpoint's files, wherever they are; what cannot be removed is logged."""
        try:
            if c.location:
                from trialkeeper.agent.objectstore import ObjectStore

                await asyncio.to_thread(lambda: ObjectStore.from_url(c.location).delete(c.location))
            else:
                await asyncio.to_thread(shutil.rmtree, self.dir_of(c.trial_id, c.step), True)
        except Exception as e:  # noqa: BLE001 - a checkpoint left behind costs space, nothing else
            log.warning("could not remove checkpoint %d of trial %s: %s", c.step, c.trial_id, e)


def prune(root: Path, kept: set[tuple[str, int]]) -> tuple[int, int]:
    """Remove from an experiment's checkpoint directory what no kept checkpoint (``kept``:
    (trial, step) the store records and has not let go) holds: interrupted uploads and saves,
    trials' live directories, checkpoints replaced or let go. Only for an experiment no
    coordinator runs. Returns (directories removed, bytes freed)."""
    removed = freed = 0
    if not root.is_dir():
        return 0, 0
    for trial_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        for entry in sorted(trial_dir.iterdir()):
            if entry.name.isdigit() and (trial_dir.name, int(entry.name)) in kept:
                continue
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file() and not f.is_symlink())
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed, freed = removed + 1, freed + size
        if not any(trial_dir.iterdir()):
            trial_dir.rmdir()
    return removed, freed


def prune_experiment(experiment_dir: Path, root: Path | None = None) -> tuple[int, int]:
    """:func:`prune` an experiment no coordinator runs, against what its store keeps; and the
    local agents' copies (``checkpoint-cache``), which only their agents used. Returns
    (directories removed, bytes freed)."""
    from .reads import StoreReader

    store = StoreReader.in_dir(experiment_dir)
    try:
        kept = {(r["trial_id"], int(r["step"])) for r in store.checkpoints() if not r["location"]}
    finally:
        store.close()
    removed, freed = prune(root or experiment_dir / "checkpoints", kept)
    cache = experiment_dir / "checkpoint-cache"
    if cache.is_dir():
        freed += sum(f.stat().st_size for f in cache.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(cache, ignore_errors=True)
        removed += 1
    return removed, freed


def _read(path: Path, offset: int, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except OSError as e:
        raise CheckpointFilesError(f"cannot read {path.name}: {e}") from e


def _drop_extra(directory: Path, files: tuple[CheckpointFile, ...]) -> None:
    wanted = {f.path for f in files}
    for p in sorted(directory.rglob("*"), reverse=True):
        rel = p.relative_to(directory).as_posix()
        if p.is_file() and rel not in wanted:
            p.unlink()


def _missing(directory: Path, files: tuple[CheckpointFile, ...]) -> str:
    """The first file not there with its size, described ("" when all are)."""
    for f in files:
        try:
            size = (directory / f.path).stat().st_size
        except OSError:
            return f"{f.path} is missing"
        if size != f.size:
            return f"{f.path} has {size} bytes, not {f.size}"
    return ""
