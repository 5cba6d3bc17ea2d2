"""Fakes of the Azure ML and PAI-DLC adapters that really run each job as a local process.

They stand where ``_aml_sdk.AmlSdkAdapter`` and ``_dlc_sdk.DlcSdkAdapter`` stand (the same
methods, the same specs in, the platform's own status words out) and are installed with
the services' ``set_adapter_factory``. A job "runs" as a subprocess in a sandbox of its own,
with PATH led by this Python's bin directory (the "image" has trialkeeper installed), the
job's environment variables, and a marker in its environment by which every process of
the job is found and killed (as a container's cgroup would hold them).

* Azure ML: the run's snapshot is a copy of ``source_directory``, which is the command's
  working directory; statuses Running, Completed, Failed (with the log's last line as the
  error), CancelRequested/Canceled. Only the fake's compute targets exist.
* PAI-DLC: ``user_command`` runs under ``sh -c``; the NAS data source must be mounted at
  the local directory the fake was told holds it (a container would see it there);
  statuses Running, Succeeded, Failed, Stopping/Stopped. Calls need the access key the
  fake was given.

``fail_outside`` and ``cancel_outside`` end a job as a preempted node or a user in the
portal would, without trialkeeper asking.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from trialkeeper.coordinator.services._cloud_jobs import JobView
from trialkeeper.coordinator.services.aml import service as aml
from trialkeeper.coordinator.services.aml.sdk import TAG_ENVIRONMENT, TAG_EXPERIMENT, AmlRunSpec
from trialkeeper.coordinator.services.dlc import service as dlc
from trialkeeper.coordinator.services.dlc.sdk import DlcJobSpec
from trialkeeper.protos.wire import ENVIRONMENT_ENV, EXPERIMENT_ENV

JOB_MARKER = "FAKE_CLOUD_JOB_ID"
GRACE_S = 2.0


@dataclass
class FakeJob:
    job_id: str
    experiment_id: str
    env_id: str
    sandbox: Path
    status: str
    detail: str = ""
    proc: subprocess.Popen[bytes] | None = None
    ended_by: str = ""  # "", or the status word a cancel or an outside event set

    @property
    def log(self) -> Path:
        return self.sandbox / "job.log"


@dataclass
class _Words:
    running: str
    succeeded: str
    failed: str
    stopping: str
    stopped: str


class FakeCloud:
    """Jobs as local processes; shared by every adapter a factory hands out."""

    WORDS: _Words
    PREFIX = "job"

    def __init__(self, root: Path, *, python: str = sys.executable) -> None:
        self.root = root
        self.python = python
        self.jobs: dict[str, FakeJob] = {}
        self.calls: list[tuple[str, str]] = []  # (method, job id or experiment id)
        self.specs: list[Any] = []  # every spec submitted, for greps
        self.fail_next: dict[str, Exception] = {}  # method -> raised once
        self._lock = threading.RLock()
        self._ids = itertools.count(1)

    # ---- the adapter interface ------------------------------------------------------------

    def connect(self) -> None:
        self._called("connect", "")

    def get(self, job_id: str) -> JobView | None:
        self._called("get", job_id)
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                return None
            self._refresh(job)
            return JobView(job.job_id, job.status, job.detail, job.experiment_id, job.env_id)

    def cancel(self, job_id: str) -> None:
        self._called("cancel", job_id)
        self._end(job_id, self.WORDS.stopped, "")

    def list_jobs(self, experiment_id: str) -> list[JobView]:
        self._called("list_jobs", experiment_id)
        with self._lock:
            found = [j for j in self.jobs.values() if j.experiment_id == experiment_id]
            for job in found:
                self._refresh(job)
            return [JobView(j.job_id, j.status, j.detail, j.experiment_id, j.env_id) for j in found]

    def close(self) -> None:
        self._called("close", "")

    # ---- what a test does to the platform -----------------------------------------------------

    def fail_outside(self, job_id: str, detail: str = "the node was preempted") -> None:
        """The job fails on its own: its processes are killed, its status is the failure's."""
        self._end(job_id, self.WORDS.failed, detail)

    def cancel_outside(self, job_id: str) -> None:
        """Someone cancels the job in the portal."""
        self._end(job_id, self.WORDS.stopped, "")

    def job_of(self, experiment_id: str, env_id: str) -> FakeJob:
        with self._lock:
            return next(j for j in self.jobs.values() if (j.experiment_id, j.env_id) == (experiment_id, env_id))

    def pids(self, job_id: str) -> list[int]:
        return _marked(job_id)

    def running(self, experiment_id: str | None = None) -> list[FakeJob]:
        with self._lock:
            for job in self.jobs.values():
                self._refresh(job)
            return [j for j in self.jobs.values() if j.status in (self.WORDS.running, self.WORDS.stopping)
                    and experiment_id in (None, j.experiment_id)]

    def shutdown(self) -> None:
        """Kill every job still running (the end of a test session)."""
        for job_id in list(self.jobs):
            self._end(job_id, self.WORDS.stopped, "the fake shut down")

    # ---- inside ----------------------------------------------------------------------------

    def _called(self, method: str, what: str) -> None:
        with self._lock:
            self.calls.append((method, what))
            error = self.fail_next.pop(method, None)
        if error is not None:
            raise error

    def _new_job(self, experiment_id: str, env_id: str) -> FakeJob:
        job_id = f"{self.PREFIX}-{next(self._ids):04d}-{os.urandom(3).hex()}"
        sandbox = self.root / job_id
        sandbox.mkdir(parents=True)
        return FakeJob(job_id, experiment_id, env_id, sandbox, self.WORDS.running)

    def _launch(self, job: FakeJob, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        full = {
            "PATH": f"{Path(self.python).parent}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin",
            "HOME": str(job.sandbox),
            JOB_MARKER: job.job_id,
            **env,
        }
        with open(job.log, "ab") as out:
            job.proc = subprocess.Popen(
                argv, cwd=cwd, env=full, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with self._lock:
            self.jobs[job.job_id] = job

    def _refresh(self, job: FakeJob) -> None:
        if job.ended_by or job.proc is None:
            return
        code = job.proc.poll()
        if code is None:
            return
        if code == 0:
            job.status, job.detail = self.WORDS.succeeded, ""
        else:
            job.status, job.detail = self.WORDS.failed, f"exit code {code}: {_last_line(job.log)}"

    def _end(self, job_id: str, status: str, detail: str) -> None:
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                raise KeyError(f"no job {job_id}")
            self._refresh(job)
            if job.status != self.WORDS.running:
                return  # ended already: canceling an ended job changes nothing
            job.status, job.ended_by = self.WORDS.stopping, status
        _kill(job)
        with self._lock:
            job.status, job.detail = status, detail


class FakeAml(FakeCloud):
    """Azure ML behind ``AmlSdkAdapter``'s methods."""

    WORDS = _Words("Running", "Completed", "Failed", "CancelRequested", "Canceled")
    PREFIX = "aml-run"

    def __init__(self, root: Path, *, compute_targets: tuple[str, ...] = ("cpu-cluster",), **kw: Any) -> None:
        super().__init__(root, **kw)
        self.compute_targets = compute_targets

    def submit(self, spec: AmlRunSpec) -> str:
        self._called("submit", spec.display_name)
        self.specs.append(spec)
        if spec.compute_target not in self.compute_targets:
            raise ValueError(
                f"ComputeTargetNotFound: compute target {spec.compute_target!r} not found in the workspace"
            )
        job = self._new_job(spec.tags[TAG_EXPERIMENT], spec.tags[TAG_ENVIRONMENT])
        snapshot = job.sandbox / "wd"
        shutil.copytree(spec.source_directory, snapshot, ignore=shutil.ignore_patterns("__pycache__"))
        self._launch(job, list(spec.command), snapshot, dict(spec.environment_variables))
        return job.job_id


class FakeDlc(FakeCloud):
    """PAI-DLC behind ``DlcSdkAdapter``'s methods; ``client(key_id, secret)`` is one adapter."""

    WORDS = _Words("Running", "Succeeded", "Failed", "Stopping", "Stopped")
    PREFIX = "dlc"

    def __init__(self, root: Path, *, nas: dict[str, Path], access_key: tuple[str, str], **kw: Any) -> None:
        super().__init__(root, **kw)
        self.nas = nas  # data source id -> the local directory that holds that NAS
        self.access_key = access_key

    def client(self, key_id: str, secret: str) -> _DlcClient:
        return _DlcClient(self, (key_id, secret))

    def submit(self, spec: DlcJobSpec) -> str:
        self._called("submit", spec.display_name)
        self.specs.append(spec)
        where = self.nas.get(spec.nas_data_source_id)
        if where is None:
            raise ValueError(f"InvalidDataSource: data source {spec.nas_data_source_id} does not exist")
        if Path(spec.nas_mount_path) != where:
            raise ValueError(f"the fake mounts {spec.nas_data_source_id} only at {where}, not {spec.nas_mount_path}")
        job = self._new_job(spec.envs.get(EXPERIMENT_ENV, ""), spec.envs.get(ENVIRONMENT_ENV, ""))
        self._launch(job, ["/bin/sh", "-c", spec.user_command], job.sandbox, dict(spec.envs))
        return job.job_id


class _DlcClient:
    """One adapter: every call checks the access key, as the API would."""

    def __init__(self, cloud: FakeDlc, key: tuple[str, str]) -> None:
        self._cloud = cloud
        self._key = key

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._cloud, name)
        if name not in ("connect", "submit", "get", "cancel", "list_jobs", "close"):
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            if self._key != self._cloud.access_key:
                raise PermissionError("InvalidAccessKeyId.NotFound: the access key is not valid")
            return method(*args)

        return call


def _kill(job: FakeJob) -> None:
    proc = job.proc
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(GRACE_S)
    pids = _marked(job.job_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=10)


def _marked(job_id: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(JOB_MARKER) == job_id:
                out.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return out


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


# ---- installing them ---------------------------------------------------------------------------


@contextlib.contextmanager
def aml_installed(root: Path) -> Iterator[FakeAml]:
    """A FakeAml every new AmlEnvironmentService uses until the block ends; then its jobs die."""
    fake = FakeAml(root)
    previous = aml.set_adapter_factory(lambda config: fake)
    try:
        yield fake
    finally:
        aml.set_adapter_factory(previous)
        fake.shutdown()


@dataclass
class DlcSetup:
    fake: FakeDlc
    nas: Path
    key_id: str = "LTAI-fake-key-id"
    secret: str = field(default="", repr=False)
    secret_file: Path | None = None


@contextlib.contextmanager
def dlc_installed(root: Path) -> Iterator[DlcSetup]:
    """A FakeDlc every new DlcEnvironmentService uses until the block ends, with a NAS under
    ``root`` and an access key whose secret lies in a 0600 file there."""
    nas = root / "nas"
    nas.mkdir(parents=True, exist_ok=True)
    secret = "dlc-secret-" + os.urandom(12).hex()
    secret_file = root / "access-key-secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    setup = DlcSetup(FakeDlc(root / "jobs", nas={"nas-fake-1": nas}, access_key=("LTAI-fake-key-id", secret)),
                     nas, secret=secret, secret_file=secret_file)
    (root / "jobs").mkdir(exist_ok=True)
    previous = dlc.set_adapter_factory(lambda config, key_id, key_secret: setup.fake.client(key_id, key_secret))
    try:
        yield setup
    finally:
        dlc.set_adapter_factory(previous)
        setup.fake.shutdown()


def aml_section(**extra: Any) -> dict[str, Any]:
    """A `trainingService` section for the fake workspace, as a user writes it."""
    return {
        "platform": "aml",
        "subscriptionId": "00000000-0000-0000-0000-000000000000",
        "resourceGroup": "trialkeeper-test",
        "workspaceName": "trialkeeper-ws",
        "computeTarget": "cpu-cluster",
        "dockerImage": "registry.example/trialkeeper:test",
        "pollInterval": "0.5s",
        **extra,
    }


def dlc_section(setup: DlcSetup, **extra: Any) -> dict[str, Any]:
    """A `trainingService` section for the fake region; the NAS is seen at the same path here
    and in the jobs (the agent is told paths in the job's terms)."""
    return {
        "platform": "dlc",
        "type": "Worker",
        "image": "registry.example/trialkeeper:test",
        "jobType": "PyTorchJob",
        "podCount": 1,
        "ecsSpec": "ecs.c6.large",
        "region": "cn-hangzhou",
        "workspaceId": "ws-fake",
        "nasDataSourceId": "nas-fake-1",
        "localStorageMountPoint": str(setup.nas),
        "containerStorageMountPoint": str(setup.nas),
        "accessKeyId": setup.key_id,
        "accessKeySecretFile": str(setup.secret_file),
        "pollInterval": "0.5s",
        **extra,
    }


# ---- greps for secrets ---------------------------------------------------------------------------


def files_holding(root: Path, secret: str, *, skip: tuple[str, ...] = ()) -> list[Path]:
    """Files under ``root`` (the store, its WAL, every log) whose bytes hold ``secret``."""
    needle = secret.encode()
    found = []
    for path in root.rglob("*"):
        if path.is_file() and path.name not in skip:
            with contextlib.suppress(OSError):
                if needle in path.read_bytes():
                    found.append(path)
    return found


def argv_holding(secret: str) -> list[str]:
    """Command lines of this machine's processes that hold ``secret``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(p.info["cmdline"] or ())
            if secret in line:
                found.append(line)
    return found
