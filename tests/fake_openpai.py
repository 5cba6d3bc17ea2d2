"""A fake OpenPAI REST server (API v2) on 127.0.0.1 that really runs the jobs as local processes.

Endpoints, as OpenPAI's rest-server documents them and trialkeeper calls them:

* ``POST /rest-server/api/v2/jobs`` (``Content-Type: text/yaml``): submit a job protocol
  (version 2). Validated: name, type, prerequisites, task roles (instances, docker image
  reference, ``resourcePerInstance`` cpu/memoryMB/gpu as integers, commands), the virtual
  cluster, the storage configs named by the ``teamwise_storage`` runtime plugin, and every
  ``<% $secrets.x %>`` reference. A name already used by the user is a 409.
* ``GET /rest-server/api/v2/jobs?username=U``: the user's jobs (summaries with ``state``).
* ``GET /rest-server/api/v2/jobs/{user}~{name}``: one job with ``jobStatus``.
* ``GET /rest-server/api/v2/jobs/{user}~{name}/config``: the protocol, secrets masked.
* ``PUT /rest-server/api/v2/jobs/{user}~{name}/executionType``: ``{"value": "STOP"}``.

Every call needs ``Authorization: Bearer <token>`` of a known user; errors come back as
OpenPAI's ``{"code": ..., "message": ...}``. A job runs as ``/bin/sh`` on a script of its
commands, secrets substituted, with PATH led by this Python's bin directory (the "image"
has trialkeeper installed) and a marker in its environment by which all its processes are
found and killed (a container's cgroup). A storage config is a local directory mounted at
its own path. States: WAITING until started, RUNNING, then SUCCEEDED/FAILED by exit code,
STOPPING/STOPPED when stopped. Tests can fail, stop or delete a job from outside.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import psutil
import yaml

MARKER = "FAKE_CLUSTER_JOB"
STOP_GRACE_S = 3.0
_SECRET_REF = re.compile(r"<%\s*\$secrets\.([A-Za-z0-9_]+)\s*%>")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,63}")


# ---- a job as local processes (shared with tests/fake_dlts.py) ---------------------------


@dataclass
class ProcessJob:
    """One job's script run as a process group of its own, found by its marker."""

    uid: str
    sandbox: Path
    proc: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    killed: bool = False
    created: float = field(default_factory=time.time)
    completed: float | None = None

    def run(self, script: str, env: dict[str, str], path_prefix: tuple[str, ...] = ()) -> None:
        self.sandbox.mkdir(parents=True, exist_ok=True)
        file = self.sandbox / "job.sh"
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
        with os.fdopen(fd, "w") as f:
            f.write(script)
        full = {
            "PATH": os.pathsep.join(
                [*path_prefix, str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
            ),
            "HOME": str(self.sandbox),
            "TMPDIR": str(self.sandbox),
            MARKER: self.uid,
            **env,
        }
        with open(self.sandbox / "job.log", "ab") as out:
            self.proc = subprocess.Popen(["/bin/sh", str(file)], env=full, cwd=self.sandbox, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._wait, name=f"fake-job-{self.uid[:8]}", daemon=True).start()

    def _wait(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        self.completed = time.time()
        self.exit_code = code

    @property
    def running(self) -> bool:
        return self.proc is not None and self.exit_code is None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = (self.sandbox / "job.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])

    def pids(self) -> list[int]:
        return job_processes(self.uid)

    def kill(self, grace_s: float = 0.0) -> None:
        """SIGTERM the job's processes, wait out ``grace_s``, then SIGKILL what is left."""
        self.killed = True
        if grace_s > 0:
            procs = [p for p in map(_proc, self.pids()) if p is not None]
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.terminate()
            # Not psutil.wait_procs: it would reap the job's shell, whose exit code _wait reads.
            deadline = time.monotonic() + grace_s
            while any(_alive(p) for p in procs) and time.monotonic() < deadline:
                time.sleep(0.02)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        while self.proc is not None and self.exit_code is None and time.monotonic() < deadline:
            time.sleep(0.01)


def job_processes(uid: str) -> list[int]:
    """Live processes carrying the job's marker: its "cgroup"."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARKER) == uid:
                out.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class FakeHttpServer:
    """A ThreadingHTTPServer on 127.0.0.1:0 that hands each request to ``handle``."""

    def __init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self.lock = threading.RLock()
        self.requests: list[tuple[str, str]] = []  # (method, path) without the query

    def handle(self, method: str, path: str, query: dict[str, str], headers: Any, body: bytes) -> tuple[int, Any]:
        raise NotImplementedError

    def error_body(self, e: HttpError) -> Any:
        return {"code": e.code, "message": e.message}

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # never log (queries hold passwords)
                pass

            def _any(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                fake.requests.append((self.command, url.path))
                try:
                    status, answer = fake.handle(self.command, unquote(url.path), query, self.headers, raw)
                except HttpError as e:
                    status, answer = e.status, fake.error_body(e)
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(answer, bytes) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name=type(self).__name__, daemon=True).start()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"


# ---- OpenPAI -------------------------------------------------------------------------------


@dataclass
class PaiJob:
    user: str
    name: str
    protocol: dict[str, Any]
    run: ProcessJob
    state: str = "WAITING"
    stopped_by: str = ""
    diagnostics: str = ""


class FakeOpenPai(FakeHttpServer):
    """The server: ``start()``/``stop()`` it (stopping kills every job), or use ``running()``."""

    def __init__(self, root: Path, *, users: dict[str, str] | None = None,
                 virtual_clusters: tuple[str, ...] = ("default",)) -> None:
        super().__init__()
        self.root = root
        self.users = users or {"alice": uuid.uuid4().hex}  # user -> token
        self.virtual_clusters = virtual_clusters
        self.storages: dict[str, Path] = {}  # storage config name -> directory, mounted at its path
        self.path_prefix: tuple[str, ...] = ()  # directories put first on every job's PATH
        self.jobs: dict[tuple[str, str], PaiJob] = {}
        self.submitted: list[str] = []  # every protocol as received (YAML text)

    # ---- what tests use ---------------------------------------------------------------

    def add_storage(self, name: str, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        self.storages[name] = directory
        return directory

    def job(self, name: str) -> PaiJob:
        with self.lock:
            return next(j for (_, n), j in self.jobs.items() if n == name)

    def fail_job(self, name: str) -> None:
        """The job's container dies (node lost, OOM): it is FAILED, not by trialkeeper."""
        job = self.job(name)
        job.run.kill()
        job.diagnostics = "container killed outside trialkeeper"

    def stop_outside(self, name: str) -> None:
        """Someone stops the job in the web portal."""
        job = self.job(name)
        job.stopped_by = "portal"
        job.run.kill(STOP_GRACE_S)

    def delete_job(self, name: str) -> None:
        """The job vanishes (cleaned up by an administrator)."""
        job = self.job(name)
        job.run.kill()
        with self.lock:
            del self.jobs[(job.user, job.name)]

    def stop(self) -> None:
        self.shutdown()
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            job.run.kill()

    # ---- the API ------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], headers: Any, body: bytes) -> tuple[int, Any]:
        user = self._user(headers.get("Authorization", ""))
        prefix = "/rest-server/api/v2/jobs"
        if not path.startswith(prefix):
            raise HttpError(404, "NotFoundError", f"{path} not found")
        rest = path[len(prefix):].strip("/")
        if rest == "" and method == "POST":
            return self._submit(user, headers.get("Content-Type", ""), body)
        if rest == "" and method == "GET":
            return 200, self._list(query.get("username"))
        parts = rest.split("/")
        owner, _, name = parts[0].partition("~")
        job = self.jobs.get((owner, name))
        if job is None:
            raise HttpError(404, "NoJobError", f"Job {parts[0]} is not found.")
        if len(parts) == 1 and method == "GET":
            return 200, self._detail(job)
        if parts[1:] == ["config"] and method == "GET":
            masked = copy.deepcopy(job.protocol)
            if "secrets" in masked:
                masked["secrets"] = "******"
            return 200, masked
        if parts[1:] == ["executionType"] and method == "PUT":
            if owner != user:
                raise HttpError(403, "ForbiddenUserError", f"User {user} is not allowed to do operation in {parts[0]}.")
            return self._execution(job, body)
        raise HttpError(404, "NotFoundError", f"{method} {path} not found")

    def _user(self, auth: str) -> str:
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        for user, known in self.users.items():
            if token and token == known:
                return user
        raise HttpError(401, "UnauthorizedUserError", "Guest is not allowed to do this operation.")

    def _submit(self, user: str, content_type: str, body: bytes) -> tuple[int, Any]:
        if not content_type.startswith(("text/yaml", "application/x-yaml", "application/json")):
            raise HttpError(415, "UnsupportedMediaTypeError", f"unsupported content type {content_type!r}")
        text = body.decode("utf-8", "replace")
        try:
            protocol = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise HttpError(400, "InvalidProtocolError", f"Job protocol is not valid YAML: {e}") from None
        self.submitted.append(text)
        problems = validate_protocol(protocol, self.virtual_clusters, set(self.storages))
        if problems:
            raise HttpError(400, "InvalidProtocolError", "; ".join(problems))
        name = protocol["name"]
        with self.lock:
            if (user, name) in self.jobs:
                raise HttpError(409, "ConflictJobError", f"Job name {name} already exists.")
            uid = uuid.uuid4().hex
            job = PaiJob(user, name, protocol, ProcessJob(uid, self.root / "jobs" / f"{name}-{uid[:8]}"))
            self.jobs[(user, name)] = job
        role_name, role = next(iter(protocol["taskRoles"].items()))
        secrets = protocol.get("secrets") or {}
        script = "\n".join(_SECRET_REF.sub(lambda m: str(secrets[m.group(1)]), c) for c in role["commands"]) + "\n"
        env = {"PAI_JOB_NAME": f"{user}~{name}", "PAI_USER_NAME": user, "PAI_CURRENT_TASK_ROLE_NAME": role_name,
               "PAI_TASK_INDEX": "0"}
        try:
            job.run.run(script, env, self.path_prefix)
            job.state = "RUNNING"
        except OSError as e:
            job.state, job.diagnostics = "FAILED", f"cannot start the container: {e}"
        return 202, {"status": 202, "message": f"Update job {name} for user {user} successfully."}

    def _execution(self, job: PaiJob, body: bytes) -> tuple[int, Any]:
        try:
            value = json.loads(body or b"{}").get("value")
        except (ValueError, AttributeError):
            value = None
        if value not in ("STOP", "START"):
            raise HttpError(400, "BadRequestError", 'executionType must be {"value": "STOP"} or {"value": "START"}')
        if value == "STOP" and self._state(job) in ("WAITING", "RUNNING"):
            job.stopped_by = job.user
            job.state = "STOPPING"
            threading.Thread(target=job.run.kill, args=(STOP_GRACE_S,), daemon=True).start()
        return 202, {"status": 202, "message": f"Execute job {job.name} successfully."}

    def _state(self, job: PaiJob) -> str:
        run = job.run
        if job.state in ("WAITING", "FAILED") and run.proc is None:
            return job.state
        if run.exit_code is None:
            return "STOPPING" if job.stopped_by else "RUNNING"
        if job.stopped_by:
            return "STOPPED"
        return "SUCCEEDED" if run.exit_code == 0 else "FAILED"

    def _summary(self, job: PaiJob) -> dict[str, Any]:
        role = next(iter(job.protocol["taskRoles"].values()))
        return {
            "name": job.name,
            "username": job.user,
            "state": self._state(job),
            "subState": self._state(job),
            "executionType": "STOP" if job.stopped_by else "START",
            "retries": 0,
            "createdTime": int(job.run.created * 1000),
            "completedTime": int(job.run.completed * 1000) if job.run.completed else None,
            "appExitCode": job.run.exit_code,
            "virtualCluster": (job.protocol.get("defaults") or {}).get("virtualCluster", "default"),
            "totalGpuNumber": role["resourcePerInstance"]["gpu"],
            "totalTaskNumber": role["instances"],
            "totalTaskRoleNumber": len(job.protocol["taskRoles"]),
        }

    def _list(self, username: str | None) -> list[dict[str, Any]]:
        with self.lock:
            jobs = [j for j in self.jobs.values() if username is None or j.user == username]
        return [self._summary(j) for j in jobs]

    def _detail(self, job: PaiJob) -> dict[str, Any]:
        summary = self._summary(job)
        state = summary["state"]
        diag = job.diagnostics or (job.run.log_tail() if state == "FAILED" else "")
        return {
            "name": job.name,
            "jobStatus": {
                **summary,
                "appExitDiagnostics": diag,
                "appExitType": "USER_FAILURE" if state == "FAILED" else None,
            },
            "taskRoles": {r: {"taskRoleStatus": {"name": r}} for r in job.protocol["taskRoles"]},
        }


def validate_protocol(p: object, virtual_clusters: tuple[str, ...], storages: set[str]) -> list[str]:
    """What OpenPAI's protocol validation would refuse in a job trialkeeper submits."""
    if not isinstance(p, dict):
        return ["the job protocol must be a mapping"]
    out = []
    if p.get("protocolVersion") not in (2, "2"):
        out.append("protocolVersion must be 2")
    if not isinstance(p.get("name"), str) or not _NAME.fullmatch(p["name"]):
        out.append(f"name {p.get('name')!r} must match [A-Za-z0-9_-]+")
    if p.get("type") != "job":
        out.append("type must be 'job'")
    images = {
        x.get("name")
        for x in p.get("prerequisites") or []
        if isinstance(x, dict) and x.get("type") == "dockerimage" and isinstance(x.get("uri"), str) and x["uri"]
    }
    if not images:
        out.append("prerequisites must list a dockerimage with a name and a uri")
    secrets = p.get("secrets") or {}
    if not isinstance(secrets, dict) or not all(isinstance(v, str) for v in secrets.values()):
        out.append("secrets must map names to strings")
        secrets = {}
    roles = p.get("taskRoles")
    if not isinstance(roles, dict) or not roles:
        return [*out, "taskRoles must map at least one task role"]
    for name, role in roles.items():
        if not isinstance(role, dict):
            out.append(f"taskRoles.{name} must be a mapping")
            continue
        if not isinstance(role.get("instances"), int) or role["instances"] < 1:
            out.append(f"taskRoles.{name}.instances must be a positive integer")
        if role.get("dockerImage") not in images:
            out.append(f"taskRoles.{name}.dockerImage must name a dockerimage prerequisite")
        res = role.get("resourcePerInstance")
        if not isinstance(res, dict) or not all(isinstance(res.get(k), int) and not isinstance(res.get(k), bool)
                                                for k in ("cpu", "memoryMB", "gpu")):
            out.append(f"taskRoles.{name}.resourcePerInstance needs integer cpu, memoryMB and gpu")
        elif res["cpu"] < 1 or res["memoryMB"] < 1 or res["gpu"] < 0:
            out.append(f"taskRoles.{name}.resourcePerInstance: cpu and memoryMB must be positive, gpu non-negative")
        commands = role.get("commands")
        if not isinstance(commands, list) or not commands or not all(isinstance(c, str) for c in commands):
            out.append(f"taskRoles.{name}.commands must be a non-empty list of strings")
            continue
        for ref in (m.group(1) for c in commands for m in _SECRET_REF.finditer(c)):
            if ref not in secrets:
                out.append(f"taskRoles.{name}.commands refer to an undefined secret {ref!r}")
    vc = (p.get("defaults") or {}).get("virtualCluster", "default")
    if vc not in virtual_clusters:
        out.append(f"virtual cluster {vc!r} does not exist")
    for plugin in ((p.get("extras") or {}).get("com.microsoft.pai.runtimeplugin") or []):
        if isinstance(plugin, dict) and plugin.get("plugin") == "teamwise_storage":
            for name in (plugin.get("parameters") or {}).get("storageConfigNames") or []:
                if name not in storages:
                    out.append(f"storage config {name!r} does not exist")
    return out


@contextlib.contextmanager
def running(root: Path) -> Iterator[FakeOpenPai]:
    """A started fake; on exit every job it runs is killed."""
    fake = FakeOpenPai(root)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def section(fake: FakeOpenPai, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A `trainingService` section for this fake, as a user writes it.

    The storage config's directory is under ``tmp_path`` and mounted in the jobs at its own
    path, so ``localStorageMountPoint`` and ``containerStorageMountPoint`` are the same."""
    user, token = next(iter(fake.users.items()))
    share = fake.add_storage(f"nfs-{uuid.uuid4().hex[:6]}", tmp_path / "pai-share")
    name = next(n for n, d in fake.storages.items() if d == share)
    out: dict[str, Any] = {
        "platform": "openpai",
        "host": fake.url,
        "username": user,
        "token": token,
        "dockerImage": "registry.example/trialkeeper:test",
        "virtualCluster": "default",
        "storageConfigName": name,
        "localStorageMountPoint": str(share),
        "containerStorageMountPoint": str(share),
        "trialCpuNumber": 1,
        "trialMemorySize": "1GiB",
        "pollInterval": 0.3,
    }
    out.update(extra)
    return out


# ---- leak checks shared by the platform tests ----------------------------------------------


SECRET_FILES = frozenset({".token", "token", "storage.key"})  # 0600 files that hold a secret by design


def leaks_in_files(secrets: dict[str, str], root: Path) -> list[str]:
    """``what in path`` for every secret found in any file under ``root`` (the store, every
    log), besides the 0600 files meant to hold one; such a file readable by others is a leak too."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.name in SECRET_FILES:
            if path.stat().st_mode & 0o077:
                found.append(f"{path} is readable by others")
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        found += [f"{what} in {path}" for what, value in secrets.items() if value.encode() in data]
    return found


def leaks_in_processes(secrets: dict[str, str]) -> list[str]:
    """``what in pid: cmdline`` for every secret in the arguments of a process this test started
    (its descendants, which include every fake job's processes)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        found += [f"{what} in pid {p.pid}: {cmd[:200]}" for what, value in secrets.items() if value in cmd]
    return found
