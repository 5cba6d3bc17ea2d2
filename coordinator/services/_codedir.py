"""Packing the trial code directory for upload, and building a wheel of trialkeeper itself.

The code directory is packed once per experiment, honouring ``.nniignore`` and
``.trialkeeperignore`` (gitignore syntax, matched by pathspec). The archive is named by a
hash of what it holds (paths, modes, contents), so a machine that already has it is not
sent it again. Limits on file count and total size are checked before anything is packed
or sent; exceeding them is an error that names the biggest offenders.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import logging
import os
import stat
import tarfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pathspec

log = logging.getLogger(__name__)

IGNORE_FILES = (".nniignore", ".trialkeeperignore")
_MB = 1024 * 1024


class CodeDirError(ValueError):
    """The code directory cannot be uploaded as it is (too big, unreadable)."""


@dataclass(frozen=True)
class CodeEntry:
    relpath: str  # posix, relative to the code directory
    path: Path
    size: int
    mode: int
    is_dir: bool = False
    link_target: str | None = None


@dataclass(frozen=True)
class PackedCode:
    """An archive of the code directory, named by the hash of its content."""

    archive: Path
    digest: str  # hex sha256 of the content (not of the archive bytes)
    files: int
    bytes: int
    withheld: tuple[str, ...] = ()  # files left out because they hold a secret

    @property
    def short(self) -> str:
        return self.digest[:16]


def scan(code_dir: Path, *, exclude: tuple[Path, ...] = ()) -> list[CodeEntry]:
    """Every entry of ``code_dir`` that is not ignored, directories before their contents.

    ``exclude`` holds absolute paths never packed (the experiment directory, when it lies
    inside the code directory, must not ship its own store).
    """
    spec = _ignore_spec(code_dir)
    excluded = {os.path.normpath(p) for p in exclude}
    out: list[CodeEntry] = []
    for root, dirs, files in os.walk(code_dir):
        rel_root = os.path.relpath(root, code_dir)
        rel_root = "" if rel_root == "." else rel_root.replace(os.sep, "/")
        keep = []
        for d in sorted(dirs):
            full = os.path.join(root, d)
            rel = f"{rel_root}/{d}" if rel_root else d
            if os.path.normpath(full) in excluded or spec.match_file(rel + "/"):
                continue
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                out.append(CodeEntry(rel, Path(full), 0, st.st_mode, link_target=os.readlink(full)))
                continue
            out.append(CodeEntry(rel, Path(full), 0, st.st_mode, is_dir=True))
            keep.append(d)
        dirs[:] = keep
        for f in sorted(files):
            full = os.path.join(root, f)
            rel = f"{rel_root}/{f}" if rel_root else f
            if os.path.normpath(full) in excluded or spec.match_file(rel):
                continue
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                out.append(CodeEntry(rel, Path(full), 0, st.st_mode, link_target=os.readlink(full)))
            elif stat.S_ISREG(st.st_mode):
                out.append(CodeEntry(rel, Path(full), st.st_size, st.st_mode))
            # sockets, fifos and devices cannot be shipped: left out
    return out


def check_limits(entries: list[CodeEntry], code_dir: Path, max_files: int, max_bytes: int) -> None:
    """Raise CodeDirError naming the biggest offenders when the limits are exceeded."""
    files = [e for e in entries if not e.is_dir]
    total = sum(e.size for e in files)
    problems = []
    if len(files) > max_files:
        per_dir = Counter(_top(e.relpath) for e in files)
        worst = ", ".join(f"{name} ({n} files)" for name, n in per_dir.most_common(5))
        problems.append(f"it has {len(files)} files, more than the limit of {max_files}; most files: {worst}")
    if total > max_bytes:
        per_top: Counter[str] = Counter()
        for e in files:
            per_top[_top(e.relpath)] += e.size
        biggest_files = sorted(files, key=lambda e: e.size, reverse=True)[:5]
        problems.append(
            f"it holds {_mb(total)}, more than the limit of {_mb(max_bytes)}; "
            f"largest: {', '.join(f'{n} ({_mb(s)})' for n, s in per_top.most_common(5))}; "
            f"largest files: {', '.join(f'{e.relpath} ({_mb(e.size)})' for e in biggest_files)}"
        )
    if problems:
        raise CodeDirError(
            f"the trial code directory {code_dir} is too big to upload: {'; '.join(problems)}. "
            "Add what trials do not need to its .nniignore (gitignore syntax), or raise "
            "trainingService.maxCodeDirFiles / maxCodeDirSizeMb"
        )


def pack(
    code_dir: Path,
    dest_dir: Path,
    *,
    max_files: int,
    max_bytes: int,
    exclude: tuple[Path, ...] = (),
    secrets: tuple[str, ...] = (),
) -> PackedCode:
    """Check the limits, then write ``code-<hash>.tar.gz`` into ``dest_dir``.

    A file that contains one of ``secrets`` (an experiment config with the SSH password,
    kept beside the code as NNI users often do) is left out, with a warning: secrets are
    not copied to the machines.
    """
    try:
        entries = scan(code_dir, exclude=exclude)
    except OSError as err:
        raise CodeDirError(f"cannot read the trial code directory {code_dir}: {err}") from err
    check_limits(entries, code_dir, max_files, max_bytes)
    needles = tuple(s.encode() for s in secrets if s)
    digest = hashlib.sha256()
    kept: list[CodeEntry] = []
    withheld: list[str] = []
    for e in entries:
        if e.link_target is None and not e.is_dir:
            file_hash, has_secret = _file_digest(e.path, needles)
            if has_secret:
                withheld.append(e.relpath)
                continue
        digest.update(f"{e.relpath}\0{stat.S_IMODE(e.mode):o}\0".encode())
        if e.link_target is not None:
            digest.update(b"L" + e.link_target.encode() + b"\0")
        elif e.is_dir:
            digest.update(b"D\0")
        else:
            digest.update(b"F" + file_hash + b"\0")
        kept.append(e)
    if withheld:
        log.warning(
            "not uploading %s from %s: it holds a password or passphrase of the config "
            "(add it to .nniignore to silence this)", ", ".join(withheld), code_dir,
        )
    entries = kept
    hexdigest = digest.hexdigest()
    dest_dir.mkdir(parents=True, exist_ok=True)
    archive = dest_dir / f"code-{hexdigest[:16]}.tar.gz"
    if not archive.exists():
        tmp = archive.with_suffix(f".tmp{os.getpid()}")
        try:
            with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
                for e in entries:
                    info = tar.gettarinfo(str(e.path), arcname=e.relpath)
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    if info.isreg():
                        with open(e.path, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
            os.replace(tmp, archive)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise CodeDirError(f"cannot pack the trial code directory {code_dir}: {err}") from err
    files = [e for e in entries if not e.is_dir]
    return PackedCode(archive, hexdigest, len(files), sum(e.size for e in files), tuple(withheld))


def build_self_wheel(dest_dir: Path) -> Path:
    """A wheel of the trialkeeper this process runs (sources as they are, not as released).

    Built from the imported packages, so it works for an editable checkout and an installed
    release alike, and needs neither a build backend nor an index. The bytes depend only
    on the files, so the same code gives the same wheel (and the same upload name).
    """
    import trialkeeper.agent
    import trialkeeper.coordinator
    import trialkeeper.protos

    dist = importlib.metadata.distribution("trialkeeper")
    version = dist.version
    files: list[tuple[str, bytes]] = []
    for package in (trialkeeper.agent, trialkeeper.coordinator, trialkeeper.protos):
        root = Path(next(iter(package.__path__)))
        prefix = PurePosixPath(*package.__name__.split("."))
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in sorted(filenames):
                if not name.endswith((".py", ".pyi", ".proto", "py.typed")):
                    continue
                full = Path(dirpath) / name
                rel = full.relative_to(root).as_posix()
                files.append((str(prefix / rel), full.read_bytes()))
    dist_info = f"trialkeeper-{version}.dist-info"
    metadata = dist.read_text("METADATA") or f"Metadata-Version: 2.1\nName: trialkeeper\nVersion: {version}\n"
    files.append((f"{dist_info}/METADATA", metadata.encode()))
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files.append((f"{dist_info}/entry_points.txt", entry_points.encode()))
    wheel_meta = "Wheel-Version: 1.0\nGenerator: trialkeeper\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files.append((f"{dist_info}/WHEEL", wheel_meta.encode()))
    record = io.StringIO()
    for name, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{name},sha256={digest},{len(data)}\n")
    record.write(f"{dist_info}/RECORD,,\n")
    files.append((f"{dist_info}/RECORD", record.getvalue().encode()))
    content = hashlib.sha256()
    for name, data in files:
        content.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    dest_dir.mkdir(parents=True, exist_ok=True)
    # A valid wheel name, with the content hash as its build tag: same code, same file.
    wheel = dest_dir / f"trialkeeper-{version}-0x{content.hexdigest()[:16]}-py3-none-any.whl"
    if not wheel.exists():
        tmp = wheel.with_suffix(f".tmp{os.getpid()}")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in files:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)
        os.replace(tmp, wheel)
    return wheel


def _ignore_spec(code_dir: Path) -> pathspec.PathSpec:
    lines: list[str] = []
    for name in IGNORE_FILES:
        try:
            lines += (code_dir / name).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError) as e:
            raise CodeDirError(f"cannot read {code_dir / name}: {e}") from e
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _file_digest(path: Path, needles: tuple[bytes, ...] = ()) -> tuple[bytes, bool]:
    """The file's sha256, and whether any of ``needles`` occurs in it."""
    h = hashlib.sha256()
    found = False
    keep = max((len(n) for n in needles), default=1) - 1
    tail = b""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            if needles and not found:
                window = tail + block
                found = any(n in window for n in needles)
                tail = window[-keep:] if keep else b""
    return h.digest(), found


def _top(relpath: str) -> str:
    head, sep, _ = relpath.partition("/")
    return head + "/" if sep else head


def _mb(n: int) -> str:
    return f"{n / _MB:.1f} MB"
