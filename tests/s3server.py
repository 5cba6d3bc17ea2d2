"""A real S3 API on 127.0.0.1 for tests: moto's server (its S3 and IAM backends, served over
HTTP by werkzeug), which boto3 talks to as it talks to AWS: signed requests, multipart uploads,
listings, error documents.

Credentials are checked. The server starts with ``INITIAL_NO_AUTH_ACTION_COUNT=3`` and spends
those three unauthenticated actions on itself: an IAM user, a policy allowing it ``s3:*``, and
an access key for it. From then on every request must be signed with that key, so a wrong key
is refused with ``InvalidAccessKeyId`` and a wrong secret with ``SignatureDoesNotMatch``, as
AWS refuses them.

The server runs in the background, not as a descendant of the test process (whose leak check
would flag it): ``python s3server.py DIR`` forks, the child starts the server and tells its
parent the port and the key, and the parent prints that and exits. The server ends when the
test process closes its end of the pipe on the server's standard input (also when the test
process dies) and by :meth:`S3Server.stop`. Its request log is ``DIR/s3server.log``.

Use: the ``s3_server`` fixture below (import it into a test module), or :func:`acquire_server`
and :func:`release_server` to share the session's one server. Each test makes buckets of its
own with :meth:`S3Server.new_bucket`. A process that should reach it (an agent) gets
:attr:`S3Server.env`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

START_TIMEOUT_S = 60.0  # importing moto and boto3 on a loaded 2-core machine
STOP_TIMEOUT_S = 10.0
REGION = "us-east-1"
SETUP_ACTIONS = 3  # create_user, put_user_policy, create_access_key: the unauthenticated ones


class S3Unavailable(Exception):
    """The S3 server cannot be started here; the message says why."""


@dataclass
class S3Server:
    """A running server: where it listens, the one key it accepts, how to end it."""

    endpoint: str  # "http://127.0.0.1:PORT"
    access_key_id: str
    secret_access_key: str = field(repr=False)
    pid: int
    directory: Path
    region: str = REGION
    _lifeline: int = field(default=-1, repr=False)  # our end of the pipe on the server's stdin

    @property
    def env(self) -> dict[str, str]:
        """The variables a process needs to reach this server through boto3's default chain."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, **overrides: str) -> Any:
        """A boto3 S3 client of the test process for this server (``overrides``: other
        ``aws_access_key_id`` / ``aws_secret_access_key`` to present)."""
        import boto3
        import botocore.config

        args = {
            "endpoint_url": self.endpoint,
            "region_name": self.region,
            "aws_access_key_id": self.access_key_id,
            "aws_secret_access_key": self.secret_access_key,
            **overrides,
        }
        config = botocore.config.Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2})
        return boto3.session.Session().client("s3", config=config, **args)

    def new_bucket(self, stem: str = "tk") -> str:
        """A fresh empty bucket of a name no other test uses."""
        name = f"{stem}-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` in ``bucket``: key -> size."""
        found: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found.update({o["Key"]: int(o["Size"]) for o in page.get("Contents", ())})
        return found

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.directory / "s3server.log").read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """End the server (the end of its standard input, then SIGKILL) and wait until it is gone."""
        if self._lifeline >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lifeline)
            self._lifeline = -1
        if not _gone_within(self.pid, STOP_TIMEOUT_S):
            with contextlib.suppress(psutil.Error):
                psutil.Process(self.pid).kill()
            _gone_within(self.pid, STOP_TIMEOUT_S)


def _gone_within(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` has ended (a zombie counts: it is init's to reap, not ours)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def start_server(directory: Path) -> S3Server:
    """Start a server whose files live in ``directory``; S3Unavailable saying why not."""
    try:
        import moto  # noqa: F401 - only to say clearly that it is missing
    except ImportError as e:
        raise S3Unavailable(f"moto is not installed (pip install -e '.[dev]'): {e}") from e
    directory.mkdir(parents=True, exist_ok=True)
    read_end, lifeline = os.pipe()
    try:
        launcher = subprocess.run(
            [sys.executable, __file__, str(directory)],
            stdin=read_end, capture_output=True, text=True, timeout=START_TIMEOUT_S + 10, check=False,
        )
    except subprocess.TimeoutExpired as e:
        os.close(lifeline)
        raise S3Unavailable(f"the S3 server's launcher did not finish in {START_TIMEOUT_S + 10:.0f} s") from e
    finally:
        os.close(read_end)
    lines = launcher.stdout.strip().splitlines()
    if launcher.returncode != 0 or not lines:
        os.close(lifeline)
        log = (directory / "s3server.log")
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise S3Unavailable(f"the S3 server did not start: {launcher.stderr.strip()} {tail}".strip())
    hello = json.loads(lines[-1])
    return S3Server(
        endpoint=f"http://127.0.0.1:{hello['port']}",
        access_key_id=hello["access_key_id"],
        secret_access_key=hello["secret_access_key"],
        pid=int(hello["pid"]),
        directory=directory,
        _lifeline=lifeline,
    )


_shared: S3Server | None = None
_shared_error: S3Unavailable | None = None
_users = 0


def acquire_server(base: Callable[[], Path]) -> S3Server:
    """The session's server, started on first use under ``base()``; pair with
    :func:`release_server`. A failed start is remembered and raised again."""
    global _shared, _shared_error, _users
    if _shared_error is not None:
        raise _shared_error
    if _shared is None:
        try:
            _shared = start_server(base())
        except S3Unavailable as e:
            _shared_error = e
            raise
    _users += 1
    return _shared


def release_server() -> None:
    """Give the session's server back; the last user stops it."""
    global _shared, _users
    _users -= 1
    if _users > 0 or _shared is None:
        return
    _shared.stop()
    _shared = None


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The session's S3 server; fails under CI (``CI`` set) and skips elsewhere when it
    cannot start."""
    try:
        server = acquire_server(lambda: tmp_path_factory.mktemp("s3server"))
    except S3Unavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"the object-storage tests need moto's S3 server and could not start it: {e}")
        pytest.skip(f"the S3 server cannot run here: {e}")
    try:
        yield server
    finally:
        release_server()


# ---- the server's side: `python s3server.py DIR` ---------------------------------------------


def _launch(directory: Path) -> int:
    """Fork the server off; print what it reports (one JSON line) and exit 0, or 1 if it
    failed or said nothing within START_TIMEOUT_S."""
    hello_read, hello_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(hello_read)
        os.setsid()
        code = 1
        try:
            code = _serve(directory, hello_write)
        except BaseException:  # noqa: BLE001 - into the server's log, then the exit status
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(hello_write)
    ready, _, _ = select.select([hello_read], [], [], START_TIMEOUT_S)
    hello = os.read(hello_read, 65536).decode() if ready else ""
    if not hello.strip():
        print(f"the S3 server said nothing within {START_TIMEOUT_S:.0f} s; see {directory / 's3server.log'}",
              file=sys.stderr)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        return 1
    print(hello.strip())
    return 0


def _serve(directory: Path, hello: int) -> int:
    log = os.open(directory / "s3server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_ACTIONS)  # moto reads it on import
    import boto3
    import botocore.config
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    endpoint = f"http://127.0.0.1:{port}"
    config = botocore.config.Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 1})
    iam = boto3.session.Session().client(
        "iam", endpoint_url=endpoint, region_name=REGION, config=config,
        aws_access_key_id="setup", aws_secret_access_key="setup",
    )
    iam.create_user(UserName="trialkeeper-tests")
    iam.put_user_policy(
        UserName="trialkeeper-tests", PolicyName="s3",
        PolicyDocument=json.dumps({"Version": "2012-10-17",
                                   "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}),
    )
    key = iam.create_access_key(UserName="trialkeeper-tests")["AccessKey"]
    os.write(hello, (json.dumps({
        "pid": os.getpid(), "port": port,
        "access_key_id": key["AccessKeyId"], "secret_access_key": key["SecretAccessKey"],
    }) + "\n").encode())
    os.close(hello)
    try:
        while sys.stdin.buffer.read(65536):  # until the test process closes its end, or dies
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_launch(Path(sys.argv[1])))
