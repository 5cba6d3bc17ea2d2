"""Shared storage (`sharedStorage`): the mount step of the environments' bootstrap, the code
on the storage, the failure path and the redaction of the storage account key.

Real NFS or Blob storage cannot be mounted here: fake `mount`, `blobfuse` and `sudo`
executables go first on the PATH of the fake platforms' jobs (and of this process for
`localMounted: nnimount`). The fake `mount` "mounts" by copying the export into the mount
point once; the failing ones print what a real failure prints and exit non-zero.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import QUICKSTART, run_async
from fake_dlts import FakeDlts
from fake_dlts import running as running_dlts
from fake_dlts import section as dlts_section
from fake_openpai import FakeOpenPai, leaks_in_files, leaks_in_processes
from fake_openpai import running as running_pai
from fake_openpai import section as pai_section
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, config_to_dict, parse_config
from trialkeeper.coordinator.services import _shared_storage as storage
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.base import (
    EnvironmentRequest,
    EnvironmentService,
    Observation,
)
from trialkeeper.coordinator.store.store import Store

KEY = "c2VjcmV0LXN0b3JhZ2Uta2V5LXZhbHVl+/AbC=="
WAIT_S = 45.0

# Copies the export ("server:/dir") into the mount point once (a lock directory keeps two
# jobs from copying at once), like a bind mount that the test can see was made.
GOOD_MOUNT = r"""#!/bin/sh
echo "mount $*" >> {log}
for a in "$@"; do src=$dst; dst=$a; done
src=${{src#*:}}
n=0
until mkdir "$dst.lock" 2>/dev/null; do n=$((n+1)); [ $n -gt 600 ] && exit 1; sleep 0.05; done
[ -e "$dst/.mounted" ] || {{ cp -a "$src/." "$dst/" && touch "$dst/.mounted"; }}
rmdir "$dst.lock"
"""
BAD_MOUNT = """#!/bin/sh
echo "mount.nfs: access denied by server while mounting $4" >&2
exit 32
"""
# A blobfuse that fails and, as a careless tool might, prints its config file (key included).
BAD_BLOBFUSE = """#!/bin/sh
for a in "$@"; do case "$a" in --config-file=*) cfg=${a#--config-file=};; esac; done
echo "blobfuse: failed to authenticate with $(cat "$cfg" | tr '\\n' ' ')" >&2
exit 1
"""
SUDO = """#!/bin/sh
[ "$1" = "-n" ] && shift
exec "$@"
"""


def _good_mount(tmp_path: Path) -> str:
    return GOOD_MOUNT.format(log=shlex.quote(str(tmp_path / "mounts.log")))


def _bin(directory: Path, **scripts: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in {"sudo": SUDO, **scripts}.items():
        path = directory / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return directory


@pytest.fixture(scope="module")
def pai(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeOpenPai]:
    with running_pai(tmp_path_factory.mktemp("fake-openpai")) as server:
        yield server


@pytest.fixture(scope="module")
def dlts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeDlts]:
    with running_dlts(tmp_path_factory.mktemp("fake-dlts")) as server:
        yield server


def _nfs(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    export = tmp_path / "export"
    export.mkdir(exist_ok=True)
    return {"storageType": "NFS", "nfsServer": "10.0.0.5", "exportedDirectory": str(export),
            "localMountPoint": str(export), "remoteMountPoint": str(tmp_path / "mnt"), **extra}


def _blob(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    local = tmp_path / "blob-local"
    local.mkdir(exist_ok=True)
    return {
        "storageType": "AzureBlob",
        "storageAccountName": "tkacct",
        "storageAccountKey": KEY,
        "containerName": "trials",
        "localMountPoint": str(local),
        "remoteMountPoint": str(tmp_path / "mnt"),
        **extra,
    }


WRITTEN = "written-by-the-trial.txt"


# A section of a platform that mounts the shared storage, for checks that parse configs only.
DLTS_SECTION = {
    "platform": "dlts",
    "dashboard": "https://dlts.example/",
    "team": "t",
    "email": "a@example.com",
    "password": "pw",
    "image": "img",
}


def _data(tmp_path: Path, ts: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    code = tmp_path / "code"
    if not code.exists():
        shutil.copytree(QUICKSTART, code, ignore=shutil.ignore_patterns("__pycache__", "config.yml"))
    return {
        # The file the trial writes into its working directory shows where that was.
        "searchSpaceFile": "search_space.json",
        "trialCommand": f"python3 train.py && echo mine > {WRITTEN}",
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "trialCodeDirectory": str(code),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize", "seed": 7}},
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 10, "trialLostTimeout": 30},
        "trainingService": ts,
        "sharedStorage": shared,
    }


def _pai_section(pai: FakeOpenPai, tmp_path: Path) -> dict[str, Any]:
    ts = pai_section(pai, tmp_path)
    for key in ("storageConfigName", "localStorageMountPoint", "containerStorageMountPoint"):
        del ts[key]  # the shared storage replaces OpenPAI's own
    return ts


async def _until_ended(service: EnvironmentService, env_id: str) -> Observation:
    deadline = time.monotonic() + WAIT_S
    while (seen := (await service.poll([env_id]))[env_id]).state in ("starting", "running"):
        assert time.monotonic() < deadline, f"{env_id} still {seen}"
        await asyncio.sleep(0.1)
    return seen


# ---- the mount step ------------------------------------------------------------------------


def test_mount_steps_say_what_they_mount_and_never_hold_the_key(tmp_path: Path) -> None:
    nfs = parse_config(_data(tmp_path, DLTS_SECTION, _nfs(tmp_path)), tmp_path / "code").shared_storage
    blob = parse_config(_data(tmp_path, DLTS_SECTION, _blob(tmp_path)), tmp_path / "code").shared_storage
    assert nfs is not None and blob is not None
    step = storage.mount_step(nfs, "/mnt/share")
    assert f"mount -t nfs 10.0.0.5:{tmp_path / 'export'} /mnt/share" in step
    assert f"exit {storage.MOUNT_FAILED}" in step and "sudo -n" in step
    step = storage.mount_step(blob, "/mnt/blob", key_expr='"$(cat /run/key)"')
    assert KEY not in step and '"$(cat /run/key)"' in step
    assert "blobfuse /mnt/blob" in step and "--config-file=" in step and "rm -f" in step
    # The printf that writes the key is the shell's builtin: the key is in no process's arguments.
    assert "printf 'accountName %s\\naccountKey %s\\ncontainerName %s\\n' tkacct" in step


def test_config_checks_and_redacts_the_key(tmp_path: Path) -> None:
    config = parse_config(_data(tmp_path, DLTS_SECTION, _blob(tmp_path)), tmp_path / "code")
    assert config_to_dict(config, redact=True)["sharedStorage"]["storageAccountKey"] == "***"
    assert KEY not in repr(config)
    with pytest.raises(ConfigError) as raised:
        parse_config(
            _data(tmp_path, DLTS_SECTION, _nfs(tmp_path, nfsServer=None, localMounted="nomount")), tmp_path / "code"
        )
    text = str(raised.value)
    assert "sharedStorage.nfsServer: required with storageType NFS" in text
    assert "sharedStorage.localMounted: nomount is not supported" in text


def test_nnimount_mounts_here_and_reports_a_failure_redacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _bin(tmp_path / "good-bin", mount=_good_mount(tmp_path))
    monkeypatch.setenv("PATH", f"{good}{os.pathsep}{os.environ['PATH']}")
    export = tmp_path / "export"
    export.mkdir()
    (export / "hello.txt").write_text("hi")
    shared = _nfs(tmp_path, localMountPoint=str(tmp_path / "here"), localMounted="nnimount")
    config = parse_config(_data(tmp_path, DLTS_SECTION, shared), tmp_path / "code").shared_storage
    assert config is not None
    storage.ensure_local(config)
    assert (tmp_path / "here" / "hello.txt").read_text() == "hi"

    bad = _bin(tmp_path / "bad-bin", blobfuse=BAD_BLOBFUSE)
    monkeypatch.setenv("PATH", f"{bad}{os.pathsep}{os.environ['PATH']}")
    blob = parse_config(_data(tmp_path, DLTS_SECTION, _blob(tmp_path, localMounted="nnimount")), tmp_path / "code")
    assert blob.shared_storage is not None
    with pytest.raises(storage.SharedStorageError) as raised:
        storage.ensure_local(blob.shared_storage)
    assert "failed to authenticate" in str(raised.value) and "accountKey ***" in str(raised.value)
    assert KEY not in str(raised.value)


# ---- on the platforms ----------------------------------------------------------------------


def _run_from_nfs(
    fake: Any,
    section: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[dict[str, Any], Path, list[dict[str, Any]]]:
    """`trialkeeper run` of the quickstart from NFS shared storage on a fake platform whose
    jobs mount with a working `mount`; the config, the experiment directory and its trials,
    all of which succeeded."""
    monkeypatch.setattr(fake, "path_prefix", (str(_bin(tmp_path / "bin", mount=_good_mount(tmp_path))),))
    data = _data(tmp_path, section, _nfs(tmp_path))
    config_file = tmp_path / "code" / "config.yml"
    config_file.write_text(yaml.safe_dump(data))
    exp_dir = tmp_path / "exp"
    rc = cli.main(["run", str(config_file), "--quiet", "--experiment-dir", str(exp_dir)])
    assert rc == 0, capfd.readouterr()
    store = Store.in_dir(exp_dir, readonly=True)
    try:
        trials = store.trials()
    finally:
        store.close()
    assert [t["status"] for t in trials] == ["SUCCEEDED"] * 4, [(t["id"], t["reason"]) for t in trials]
    return data, exp_dir, trials


def test_openpai_quickstart_runs_from_nfs_shared_storage(
    pai: FakeOpenPai, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data, exp_dir, _ = _run_from_nfs(pai, _pai_section(pai, tmp_path), tmp_path, capfd, monkeypatch)
    mounts = (tmp_path / "mounts.log").read_text().splitlines()
    assert mounts == [f"mount -t nfs 10.0.0.5:{tmp_path / 'export'} {tmp_path / 'mnt'}"] * 2, mounts
    # The code was put on the storage once and the trials ran from the mount point.
    layout = storage.layout(parse_config(data, tmp_path / "code").shared_storage, exp_dir)  # type: ignore[arg-type]
    assert (layout.local_code / "train.py").is_file()
    ran = list((tmp_path / "mnt").glob(f"trialkeeper/*/envs/*/trials/*/code/{WRITTEN}"))
    assert len(ran) == 4, ran
    # Each trial's copy of the code went once it ended; what the trial wrote stayed.
    assert not list((tmp_path / "mnt").glob("trialkeeper/*/envs/*/trials/*/code/train.py"))


def test_a_failing_mount_fails_the_openpai_environment_with_its_error(
    pai: FakeOpenPai, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pai, "path_prefix", (str(_bin(tmp_path / "bin", mount=BAD_MOUNT)),))
    service = create_service(
        parse_config(_data(tmp_path, _pai_section(pai, tmp_path), _nfs(tmp_path)), tmp_path / "code"), tmp_path / "exp"
    )
    request = EnvironmentRequest(env_id="env-1", experiment_id="sx1", coordinator_address="127.0.0.1:1", token="tok-1")

    async def body() -> Observation:
        await service.prepare()
        assert (await service.start(request)).error is None
        return await _until_ended(service, "env-1")

    seen = run_async(body)
    assert seen.state == "failed", seen
    assert f"exit code {storage.MOUNT_FAILED}" in seen.detail, seen.detail
    assert "mounting the shared storage (NFS 10.0.0.5:" in seen.detail
    assert "mount.nfs: access denied by server" in seen.detail


def test_a_failing_blob_mount_on_dlts_is_reported_without_the_key(
    dlts: FakeDlts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dlts, "path_prefix", (str(_bin(tmp_path / "bin", blobfuse=BAD_BLOBFUSE)),))
    data = _data(tmp_path, dlts_section(dlts), _blob(tmp_path))
    service = create_service(parse_config(data, tmp_path / "code"), tmp_path / "exp")
    request = EnvironmentRequest(env_id="env-1", experiment_id="sx2", coordinator_address="127.0.0.1:1", token="tok-2")

    async def body() -> Observation:
        await service.prepare()
        assert (await service.start(request)).error is None
        assert leaks_in_processes({"storage key": KEY}) == []
        return await _until_ended(service, "env-1")

    seen = run_async(body)
    assert seen.state == "failed", seen
    assert "mounting the shared storage (Azure Blob container tkacct/trials)" in seen.detail, seen.detail
    assert "accountKey ***" in seen.detail and KEY not in seen.detail
    sent = [b for b in dlts.submitted if b["jobName"] == "tk-sx2-env-1"]
    assert sent and KEY not in str(sent)
    assert leaks_in_files({"storage key": KEY}, tmp_path / "exp") == []


def test_dlts_quickstart_runs_from_nfs_shared_storage(
    dlts: FakeDlts, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, exp_dir, trials = _run_from_nfs(dlts, dlts_section(dlts), tmp_path, capfd, monkeypatch)
    assert len((tmp_path / "mounts.log").read_text().splitlines()) == 2
    assert len(list((tmp_path / "mnt").glob(f"trialkeeper/*/envs/*/trials/*/code/{WRITTEN}"))) == 4
    # The trials ran on the storage, away from the experiment directory: their output was streamed back.
    assert all("held-out accuracy" in (exp_dir / "trials" / t["id"] / "stdout.log").read_text() for t in trials)
