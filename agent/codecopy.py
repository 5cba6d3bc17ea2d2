"""A trial's own copy of its working directory: made before it runs, pruned after it ended."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path


def copy_tree(source: Path, target: Path) -> None:
    if not source.is_dir():
        raise FileNotFoundError(f"working directory {source} does not exist")
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)


def prune_copy(source: Path, target: Path) -> None:
    """Remove from a trial's copy of its working directory what is still as it was copied
    (same size and mtime, which copying keeps), and the directories left empty; what the
    trial wrote or changed stays. A thousand trials need not keep a thousand copies."""
    for dirpath, dirnames, filenames in os.walk(target, topdown=False):
        rel = os.path.relpath(dirpath, target)
        # Symbolic links to directories are listed with the directories, never followed.
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in filenames + links:
            copy, orig = os.path.join(dirpath, name), os.path.join(source, rel, name)
            try:
                c, o = os.lstat(copy), os.lstat(orig)
                if stat.S_ISLNK(c.st_mode):
                    same = stat.S_ISLNK(o.st_mode) and os.readlink(copy) == os.readlink(orig)
                else:
                    same = (
                        stat.S_ISREG(c.st_mode) and stat.S_ISREG(o.st_mode)
                        and (c.st_size, c.st_mtime_ns) == (o.st_size, o.st_mtime_ns)
                    )
                if same:
                    os.unlink(copy)
            except OSError:
                continue
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)  # only when empty
