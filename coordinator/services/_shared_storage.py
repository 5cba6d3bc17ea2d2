"""Shared storage (``sharedStorage``): an NFS export or an Azure Blob container that every
environment mounts, so the trial code is copied there once and trial outputs land there.

Each environment's bootstrap mounts the storage at ``remoteMountPoint`` before it starts
its agent (``mount -t nfs`` or ``blobfuse``, with ``sudo -n`` when not root). A mount that
fails ends the environment with exit status ``MOUNT_FAILED`` and the mount's own error
output, so the platform reports the job failed and the coordinator shows why.

The storage account key never stands in a command: the mount step reads it from a shell
expression the platform fills in at run time (OpenPAI's job secrets, a 0600 file), writes
it with the shell's builtin ``printf`` into a 0600 blobfuse config file, and removes the
file once the container is mounted. Every message that could echo it is redacted.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.experiment import SharedStorageConfig

MOUNT_FAILED = 97
ROOT = "trialkeeper"
KEY_ENV = "TRIALKEEPER_STORAGE_KEY"
BLOBFUSE_TMP = "/mnt/resource/trialkeeper-blobfuse"
LOCAL_MOUNT_TIMEOUT_S = 120.0


class SharedStorageError(ValueError):
    """The shared storage cannot be used from this machine (not mounted, mount failed)."""


@dataclass(frozen=True)
class StorageLayout:
    """Where one experiment's files lie on the storage, seen from here and from the environments."""

    local_root: Path
    remote_root: str

    @property
    def local_code(self) -> Path:
        return self.local_root / "code"

    @property
    def remote_code(self) -> str:
        return f"{self.remote_root}/code"

    def local_env(self, env_id: str) -> Path:
        return self.local_root / "envs" / env_id

    def remote_env(self, env_id: str) -> str:
        return f"{self.remote_root}/envs/{env_id}"


def layout(config: SharedStorageConfig, experiment_dir: Path) -> StorageLayout:
    return layout_on(config.local_mount_point, config.remote_mount_point, experiment_dir)


def layout_on(local: Path, remote: str, experiment_dir: Path) -> StorageLayout:
    """``<mount point>/trialkeeper/<experiment dir name>-<hash of its path>``, both sides."""
    digest = hashlib.sha256(str(experiment_dir.resolve()).encode()).hexdigest()[:8]
    sub = f"{ROOT}/{experiment_dir.name}-{digest}"
    return StorageLayout(local / sub, f"{remote.rstrip('/')}/{sub}")


def describe(config: SharedStorageConfig) -> str:
    if config.storage_type == "NFS":
        return f"NFS {config.nfs_server}:{config.exported_directory}"
    return f"Azure Blob container {config.storage_account_name}/{config.container_name}"


def mount_step(config: SharedStorageConfig, mount_point: str, *, key_expr: str = f'"${KEY_ENV}"') -> str:
    """Shell lines that mount the storage at ``mount_point`` or exit ``MOUNT_FAILED`` saying why.

    ``key_expr`` is a shell word that expands to the account key at run time (Azure Blob
    only); the key itself is never part of the returned text."""
    mp = shlex.quote(mount_point)
    lines = [
        'tk_sudo=""',
        '[ "$(id -u)" = 0 ] || ! command -v sudo >/dev/null 2>&1 || tk_sudo="sudo -n"',
    ]
    if config.storage_type == "NFS":
        source = shlex.quote(f"{config.nfs_server}:{config.exported_directory}")
        mount = f"$tk_sudo mkdir -p {mp} && $tk_sudo mount -t nfs {source} {mp}"
        cleanup = ""
    else:
        cfg = '"${TMPDIR:-/tmp}/trialkeeper-blobfuse-$$.cfg"'
        lines.append(
            f"(umask 077 && printf 'accountName %s\\naccountKey %s\\ncontainerName %s\\n' "
            f"{shlex.quote(config.storage_account_name or '')} {key_expr} "
            f"{shlex.quote(config.container_name or '')} > {cfg})"
        )
        mount = (
            f"$tk_sudo mkdir -p {mp} {BLOBFUSE_TMP} && $tk_sudo blobfuse {mp} --tmp-path={BLOBFUSE_TMP} "
            f"--config-file={cfg} -o attr_timeout=240 -o entry_timeout=240 -o negative_timeout=120 -o allow_other"
        )
        cleanup = f"; rm -f {cfg}"
    what = shlex.quote(f"trialkeeper: mounting the shared storage ({describe(config)}) at {mount_point} failed: ")
    lines.append(
        f'tk_mount_out=$({mount} 2>&1); tk_mount_rc=$?{cleanup}\n'
        f'if [ $tk_mount_rc -ne 0 ]; then echo {what}"$tk_mount_out" >&2; exit {MOUNT_FAILED}; fi'
    )
    return "\n".join(lines)


def redact(text: str, config: SharedStorageConfig | None) -> str:
    key = config.storage_account_key if config is not None else None
    return text.replace(key, "***") if key else text


def ensure_local(config: SharedStorageConfig) -> None:
    """Make the storage visible at ``localMountPoint``: mount it (``nnimount``) or check
    that the user did (``usermount``). Raises SharedStorageError saying what failed."""
    local = config.local_mount_point
    if config.local_mounted == "nnimount":
        env = dict(os.environ)
        if config.storage_account_key:
            env[KEY_ENV] = config.storage_account_key
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", mount_step(config, str(local))], env=env, stdin=subprocess.DEVNULL,
                capture_output=True, timeout=LOCAL_MOUNT_TIMEOUT_S, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SharedStorageError(
                redact(f"sharedStorage: cannot mount {describe(config)} at {local}: {e}", config)
            ) from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).decode("utf-8", "replace").strip()
            raise SharedStorageError(
                redact(f"sharedStorage: {said or f'mount exited with status {done.returncode}'}", config)
            )
    if not local.is_dir():
        raise SharedStorageError(
            f"sharedStorage.localMountPoint {local} is not a directory: mount {describe(config)} there "
            "(localMounted: usermount) or let trialkeeper mount it (localMounted: nnimount)"
        )


def write_private(path: Path, data: bytes) -> None:
    """A file only its owner can read (a token, a key), written without a moment at 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)
