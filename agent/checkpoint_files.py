"""The files of a checkpoint: their manifest and digest, and moving them about safely.

A checkpoint is a directory of regular files (and the directories that hold them). Its
manifest lists each file by its relative, '/'-separated path, size and mode, sorted by path;
its digest is ``sha256:<hex>`` over, for each file in manifest order, the path (UTF-8), a NUL
byte, the size in decimal, a NUL byte, then the file's bytes. Empty directories are not part
of a checkpoint. Symbolic links, devices, pipes and sockets are refused with the path that
holds one: a checkpoint is copied, uploaded and downloaded across machines, where a link
would point elsewhere or outside the directory.

Plain blocking file operations, no asyncio: the keeper (:mod:`.checkpoints`) calls them in
worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# Bytes of one file of a checkpoint in one message, up or down (the protocol's limit).
CHUNK_BYTES = 1 << 20
DIGEST_PREFIX = "sha256:"
# In the experiment's checkpoint directory, holding its id: the directory is shared with us.
MARKER_FILE = ".trialkeeper-experiment"
# Only permission bits travel with a file (no setuid, setgid or sticky bit).
MODE_BITS = 0o777
_READ_BYTES = 4 << 20


class CheckpointFilesError(Exception):
    """A checkpoint's files cannot be taken, placed or trusted; the message says why."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, '/'-separated
    size: int
    mode: int = 0o644


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileEntry, ...]
    digest: str

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)


def path_problem(path: str) -> str:
    """Why ``path`` cannot name a file of a checkpoint ("" when it can): the coordinator's rule."""
    if not path or len(path) > 4096:
        return "an empty or overlong path"
    if path.startswith("/") or "\\" in path or "\0" in path:
        return f"path {path!r} is not relative"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return f"path {path!r} is not a plain relative path"
    return ""


def scan(directory: Path) -> list[FileEntry]:
    """The files under ``directory``, sorted by path. Raises CheckpointFilesError naming the
    first path that cannot be part of a checkpoint."""
    try:
        top = os.lstat(directory)
    except OSError as e:
        raise CheckpointFilesError(f"cannot read {directory}: {e.strerror or e}") from e
    if not stat.S_ISDIR(top.st_mode):
        raise CheckpointFilesError(f"{directory} is not a directory (a symbolic link or a file took its place)")
    found: list[FileEntry] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            with os.scandir(directory / rel_dir if rel_dir else directory) as entries:
                children = list(entries)
        except OSError as e:
            raise CheckpointFilesError(f"cannot list {rel_dir or '.'} in the checkpoint: {e.strerror or e}") from e
        for entry in children:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                raise CheckpointFilesError(f"{rel!r} has a name that is not UTF-8") from None
            if why := path_problem(rel):
                raise CheckpointFilesError(why)
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointFilesError(
                    f"{rel} is a symbolic link: a checkpoint holds regular files only (copy the file it points to)"
                )
            if stat.S_ISDIR(st.st_mode):
                pending.append(rel)
            elif stat.S_ISREG(st.st_mode):
                found.append(FileEntry(rel, st.st_size, stat.S_IMODE(st.st_mode) & MODE_BITS))
            else:
                raise CheckpointFilesError(f"{rel} is not a regular file (a pipe, socket or device)")
    found.sort(key=lambda f: f.path)
    return found


class Digester:
    """The digest of a checkpoint, fed file by file in manifest order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def start_file(self, path: str, size: int) -> None:
        self._h.update(path.encode("utf-8") + b"\0" + str(size).encode() + b"\0")

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return DIGEST_PREFIX + self._h.hexdigest()


def digest_of(directory: Path, files: Sequence[FileEntry]) -> str:
    """The digest of ``files`` as they are under ``directory``; raises CheckpointFilesError
    when one is missing or not of its manifest's size."""
    d = Digester()
    for f in files:
        d.start_file(f.path, f.size)
        seen = 0
        try:
            with open(directory / f.path, "rb") as fh:
                while block := fh.read(_READ_BYTES):
                    seen += len(block)
                    d.update(block)
        except OSError as e:
            raise CheckpointFilesError(f"cannot read {f.path}: {e.strerror or e}") from e
        if seen != f.size:
            raise CheckpointFilesError(f"{f.path} is {seen} bytes, its manifest says {f.size}")
    return d.digest()


def make_manifest(directory: Path, max_bytes: int = 0) -> Manifest:
    """Scan ``directory``, refuse it when larger than ``max_bytes`` (0: no limit), digest it."""
    files = scan_within(directory, max_bytes)
    return Manifest(tuple(files), digest_of(directory, files))


def scan_within(directory: Path, max_bytes: int = 0) -> list[FileEntry]:
    """:func:`scan`, refused when larger than ``max_bytes`` (0: no limit)."""
    files = scan(directory)
    size = sum(f.size for f in files)
    if max_bytes and size > max_bytes:
        raise CheckpointFilesError(
            f"the checkpoint is {size} bytes, more than the experiment's maxCheckpointSize ({max_bytes} bytes)"
        )
    return files


def manifest_problem(files: Sequence[FileEntry], size_bytes: int) -> str:
    """Why a manifest received cannot be trusted to write files from ("" when it can)."""
    paths = [f.path for f in files]
    for p in paths:
        if why := path_problem(p):
            return why
    if len(set(paths)) != len(paths):
        return "it names a file twice"
    if sum(f.size for f in files) != size_bytes:
        return "its files' sizes do not add up to its size"
    return ""


def check_sizes(directory: Path, files: Sequence[FileEntry]) -> None:
    """Each of ``files`` is a regular file of its size under ``directory``."""
    for f in files:
        try:
            st = os.lstat(directory / f.path)
        except OSError as e:
            raise CheckpointFilesError(f"{f.path} is missing: {e.strerror or e}") from e
        if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
            raise CheckpointFilesError(f"{f.path} is not a file of {f.size} bytes")


def _no_links_between(root: Path, rel: str) -> None:
    # A source planted with a link (on shared storage, say) must not make us read elsewhere.
    here = root
    for part in rel.split("/"):
        here = here / part
        if os.path.islink(here):
            raise CheckpointFilesError(f"{rel} goes through a symbolic link in {root}")


def copy_files(source: Path, target: Path, files: Sequence[FileEntry]) -> None:
    """Copy ``files`` from ``source`` into the empty directory ``target`` (shutil.copy2, which
    takes the kernel's fast paths), then check their sizes."""
    for f in files:
        _no_links_between(source, f.path)
        dst = target / f.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy2(source / f.path, dst, follow_symlinks=False)
        except OSError as e:
            raise CheckpointFilesError(f"cannot copy {f.path}: {e.strerror or e}") from e
    check_sizes(target, files)


def empty_directory(directory: Path) -> None:
    """Remove what ``directory`` holds, keeping it."""
    with os.scandir(directory) as entries:
        for entry in list(entries):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def is_empty(directory: Path) -> bool:
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def remove(path: Path) -> None:
    """Remove a file or a tree, quietly when it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class Download:
    """Writes a checkpoint that arrives in chunks, files in manifest order, into ``directory``,
    and checks it: each chunk continues where the last stopped (a chunk sent again after a
    reconnect is skipped), sizes match, and the digest over it all is the one expected."""

    def __init__(self, directory: Path, files: Sequence[FileEntry], digest: str) -> None:
        self.directory = directory
        self.files = list(files)
        self.expected = digest
        self.index = 0  # the file being written
        self.offset = 0  # bytes of it written
        self.done = False
        self._digester = Digester()
        self._fh: IO[bytes] | None = None
        self._started = False  # the current file's header went into the digest

    def position(self) -> tuple[str, int]:
        """Where to resume: (path, offset) of the first byte missing."""
        if self.index < len(self.files):
            return self.files[self.index].path, self.offset
        return "", 0

    def feed(self, path: str, offset: int, data: bytes, last: bool) -> bool:
        """Take one chunk; True once the checkpoint is whole and checked."""
        if self.done:
            return True
        target = self._find(path) if path else None
        if target is not None:
            while self.index < target:
                self._finish_file()
            entry = self.files[self.index]
            if offset > self.offset:
                raise CheckpointFilesError(f"{path}: a chunk at offset {offset}, expected {self.offset}")
            skip = self.offset - offset
            if skip < len(data):
                data = data[skip:]
                if self.offset + len(data) > entry.size:
                    raise CheckpointFilesError(f"{path}: more bytes than its {entry.size}")
                self._write(entry, data)
        if last:
            while self.index < len(self.files):
                self._finish_file()
            got = self._digester.digest()
            if self.expected and got != self.expected:  # "": not known yet where it was saved
                raise CheckpointFilesError(f"its digest is {got}, expected {self.expected}")
            self.done = True
        return self.done

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _find(self, path: str) -> int | None:
        for i in range(self.index, len(self.files)):
            if self.files[i].path == path:
                return i
        if any(f.path == path for f in self.files[: self.index]):
            return None  # a chunk of a file already written, sent again: skipped
        raise CheckpointFilesError(f"a chunk of {path!r}, which is not the next file of its manifest")

    def _open(self, entry: FileEntry) -> None:
        if not self._started:
            self._digester.start_file(entry.path, entry.size)
            self._started = True
        if self._fh is None:
            dst = self.directory / entry.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                fh = open(dst, "r+b" if self.offset else "wb")  # noqa: SIM115 - kept open across chunks
                fh.seek(self.offset)
                self._fh = fh
            except OSError as e:
                raise CheckpointFilesError(f"cannot write {entry.path}: {e.strerror or e}") from e

    def _write(self, entry: FileEntry, data: bytes) -> None:
        self._open(entry)
        assert self._fh is not None
        try:
            self._fh.write(data)
        except OSError as e:
            raise CheckpointFilesError(f"cannot write {entry.path}: {e.strerror or e}") from e
        self._digester.update(data)
        self.offset += len(data)

    def _finish_file(self) -> None:
        entry = self.files[self.index]
        if self.offset != entry.size:
            raise CheckpointFilesError(f"{entry.path} ended at {self.offset} bytes of its {entry.size}")
        self._open(entry)  # an empty file is created too
        self.close()
        with contextlib.suppress(OSError):
            os.chmod(self.directory / entry.path, entry.mode & MODE_BITS)
        self.index += 1
        self.offset = 0
        self._started = False


# ---- the keeper's file work (see .checkpoints) ----------------------------------------------


def marked_root(directory: Path, experiment_id: str) -> tuple[Path | None, str]:
    """``directory`` when its marker names ``experiment_id`` (this machine sees the
    experiment's checkpoint directory), else None and why not."""
    marker = directory / MARKER_FILE
    try:
        found = marker.read_text(encoding="utf-8").strip()
    except OSError as e:
        return None, f"{marker} cannot be read on this machine ({e.strerror or e})"
    except UnicodeDecodeError:
        return None, f"{marker} is not text"
    if found != experiment_id:
        return None, f"{marker} names experiment {found[:80]!r}, not {experiment_id!r}"
    return directory, ""


def holds_files(directory: Path) -> bool:
    """Whether anything lies in ``directory`` (False when it is gone)."""
    try:
        with os.scandir(directory) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def make_live(root: Path, live: Path, clean: bool) -> None:
    """Make a trial's empty live directory (``clean``: in the local cache, where what an
    earlier run of the trial left half done is removed first)."""
    root.mkdir(parents=True, exist_ok=True)
    if clean:
        # Left by an earlier run of the trial on this machine that ended with its agent.
        with os.scandir(root) as entries:
            for entry in list(entries):
                if entry.name.startswith(("live-", ".saving-")):
                    remove(Path(entry.path))
    live.mkdir()


def snapshot(live: Path, staging: Path) -> None:
    """Take the live directory's files whole (one rename) and leave it empty at its path."""
    os.rename(live, staging)
    try:
        live.mkdir()
    except OSError:
        os.rename(staging, live)
        raise


def place(staging: Path, final: Path) -> None:
    """Make a taken snapshot the checkpoint directory of its step (one rename)."""
    if final.exists() or final.is_symlink():
        # A copy of the same step that was never recorded (its run ended before the coordinator had it).
        old = final.with_name(f".saving-old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        remove(old)
    os.rename(staging, final)


def restore(copy: Path, live: Path, running: bool) -> str:
    """Put a refused checkpoint's files back into the live directory when it is still empty
    and its trial runs, else remove them; what became of them, for the trial's error."""
    if not copy.exists():
        return " (its files are gone)"
    if running and live.is_dir() and is_empty(live):
        try:
            live.rmdir()
            os.rename(copy, live)
            drop_index(copy)
            return " (its files are back in the checkpoint directory)"
        except OSError:
            live.mkdir(exist_ok=True)
    remove(copy)
    drop_index(copy)
    return " (its files are gone)"


def index_path(copy: Path) -> Path:
    return copy.with_name(f"{copy.name}.json")


def drop_index(copy: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        index_path(copy).unlink()


def write_index(copy: Path, manifest: Manifest) -> None:
    """``<step>.json`` beside a local copy: its digest and files, whole or absent."""
    data = {"digest": manifest.digest, "files": [[f.path, f.size, f.mode] for f in manifest.files]}
    tmp = copy.with_name(f".{copy.name}.json.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, index_path(copy))


def cached_digest(copy: Path) -> str | None:
    """The digest of a local copy, None when there is none."""
    try:
        data = json.loads(index_path(copy).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("digest") if isinstance(data, dict) and copy.is_dir() else None


def drop_older(root: Path, keep: int) -> None:
    """Only the newest local copy of a trial is kept: the copies of steps before ``keep`` go.
    A later step's copy stays: its save may be under way (this runs off the save's lock)."""
    with os.scandir(root) as entries:
        for entry in list(entries):
            name = entry.name.removesuffix(".json")
            if name.isdigit() and int(name) < keep:
                remove(Path(entry.path))


def set_modes(directory: Path, files: Sequence[FileEntry]) -> None:
    for f in files:
        with contextlib.suppress(OSError):
            os.chmod(directory / f.path, f.mode & MODE_BITS)
