"""One SSH connection per remote machine (paramiko). Blocking: call it from a thread.

Host keys are verified against known_hosts; an unknown key is refused unless the user
opted in, and then accepted with a warning that shows its fingerprint. A changed key is
always refused. Every network step has a timeout. Errors are `SshError`, whose messages
never hold a secret and say what to do.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import paramiko

log = logging.getLogger(__name__)

DEFAULT_KNOWN_HOSTS = (Path("~/.ssh/known_hosts"), Path("/etc/ssh/ssh_known_hosts"))
# Below OpenSSH's default MaxSessions (10), leaving room for the user's own sessions.
MAX_CHANNELS = 6


class SshError(Exception):
    """Reaching, authenticating to, or running something on a machine failed.

    ``permanent`` errors (authentication, host keys, bad keys) will not go away by trying
    again; the others (refused or timed-out connections) may.
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class SshTarget:
    host: str
    port: int
    user: str
    password: str | None = field(default=None, repr=False)
    key_file: Path | None = None
    passphrase: str | None = field(default=None, repr=False)
    known_hosts: Path | None = None  # None: ~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts
    accept_unknown_host_key: bool = False
    timeout: float = 20.0

    @property
    def label(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}:{self.port}"


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: bytes
    stderr: bytes


def fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as OpenSSH prints it (``SHA256:...``)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, target: SshTarget, sources: str) -> None:
        self.target = target
        self.sources = sources

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        fp = fingerprint(key)
        if not self.target.accept_unknown_host_key:
            scan = f"ssh-keyscan -p {self.target.port} {self.target.host}"
            raise SshError(
                f"{self.target.label}: the host key is unknown ({key.get_name()} {fp}); it is not "
                f"in {self.sources}. trialkeeper checks host keys, which NNI did not, so a config "
                "that worked with NNI needs one of these added under trainingService: "
                "`acceptUnknownHostKeys: true` (trust unknown keys unverified, as NNI did), or "
                "`knownHostsFile: <file>` naming a known_hosts file that holds the key. Or check "
                "the fingerprint with the machine's administrator and add the key to "
                f"~/.ssh/known_hosts (for example `{scan} >> ~/.ssh/known_hosts`, or connect once "
                "with ssh)",
                permanent=True,
            )
        log.warning(
            "%s: accepting an unknown host key %s %s without verification "
            "(acceptUnknownHostKeys is set); add it to known_hosts to have it checked",
            self.target.label, key.get_name(), fp,
        )
        client.get_host_keys().add(hostname, key.get_name(), key)


class SshConnection:
    """A lazily (re)connected SSH client to one machine; thread-safe."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._channels = threading.BoundedSemaphore(MAX_CHANNELS)
        self._closed = False

    # ---- connecting ----------------------------------------------------------------

    def connect(self) -> None:
        self._transport()

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            if self._closed:
                raise SshError(f"{self.target.label}: the connection was closed")
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return transport
                self._client.close()
                self._client = None
            self._client = self._open()
            transport = self._client.get_transport()
            assert transport is not None
            transport.set_keepalive(15)
            return transport

    def _open(self) -> paramiko.SSHClient:
        t = self.target
        client = paramiko.SSHClient()
        sources = self._load_host_keys(client)
        client.set_missing_host_key_policy(_HostKeyPolicy(t, sources))
        kwargs: dict[str, object] = {
            "hostname": t.host, "port": t.port, "username": t.user, "timeout": t.timeout,
            "banner_timeout": t.timeout, "auth_timeout": t.timeout, "channel_timeout": t.timeout,
        }
        if t.password is not None:
            kwargs.update(password=t.password, look_for_keys=False, allow_agent=False)
        elif t.key_file is not None:
            kwargs.update(key_filename=str(t.key_file), passphrase=t.passphrase, look_for_keys=False, allow_agent=False)
        try:
            client.connect(**kwargs)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - paramiko raises many kinds; _explain sorts them
            client.close()
            raise self._explain(e) from None
        return client

    def _load_host_keys(self, client: paramiko.SSHClient) -> str:
        files = [self.target.known_hosts] if self.target.known_hosts else list(DEFAULT_KNOWN_HOSTS)
        shown = []
        for f in files:
            path = f.expanduser()
            shown.append(str(path) + ("" if path.exists() else " (missing)"))
            if path.exists():
                try:
                    client.get_host_keys().load(str(path))
                except (OSError, paramiko.SSHException) as e:
                    raise SshError(f"cannot read known hosts file {path}: {e}", permanent=True) from e
        return " or ".join(shown)

    def _explain(self, e: Exception) -> Exception:
        t = self.target
        where = t.label
        if isinstance(e, SshError):
            return e
        if isinstance(e, paramiko.BadHostKeyException):
            return SshError(
                f"{where}: the host key has CHANGED: known_hosts has {fingerprint(e.expected_key)}, "
                f"the server offered {e.key.get_name()} {fingerprint(e.key)}. This may be an attack; "
                f"if the machine was reinstalled, remove the old key (ssh-keygen -R '[{t.host}]:{t.port}') "
                "and add the new one after checking it",
                permanent=True,
            )
        if isinstance(e, paramiko.PasswordRequiredException):
            return SshError(f"{where}: the key {t.key_file} is encrypted: set sshPassphrase", permanent=True)
        if isinstance(e, paramiko.AuthenticationException):
            if t.password is not None:
                what = "the password was refused"
            elif t.key_file is not None:
                what = f"the key {t.key_file} was refused (or its passphrase is wrong)"
            else:
                what = "no key from ssh-agent or ~/.ssh was accepted; set password or sshKeyFile"
            return SshError(f"{where}: authentication as {t.user} failed: {what}", permanent=True)
        if isinstance(e, paramiko.SSHException) and t.key_file is not None and _is_key_problem(e):
            return SshError(f"{where}: cannot use the key {t.key_file}: {e} (wrong sshPassphrase?)", permanent=True)
        if isinstance(e, (socket.timeout, TimeoutError)):
            return SshError(f"{where}: no answer within {t.timeout:g} s (is the machine up and the port open?)")
        if isinstance(e, ConnectionRefusedError) or (
            isinstance(e, paramiko.ssh_exception.NoValidConnectionsError)
            and all(
                isinstance(x, ConnectionRefusedError) or getattr(x, "errno", None) == 111 for x in e.errors.values()
            )
        ):
            return SshError(f"{where}: connection refused (is sshd running and listening on port {t.port}?)")
        if isinstance(e, socket.gaierror):
            return SshError(f"{where}: cannot resolve host {t.host!r}: {e.strerror or e}")
        if isinstance(e, (OSError, EOFError, paramiko.SSHException)):
            return SshError(f"{where}: cannot connect: {type(e).__name__}: {e}")
        return e

    # ---- running commands ----------------------------------------------------------

    def run(self, command: str, *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """Run ``command`` in the user's shell; raise SshError if it cannot, or runs past ``timeout``."""
        with self._channels:
            transport = self._transport()
            try:
                chan = transport.open_session(timeout=self.target.timeout)
            except (paramiko.SSHException, OSError, EOFError) as e:
                self._drop()
                raise SshError(f"{self.target.label}: cannot open an SSH channel: {e}") from None
            try:
                return self._exchange(chan, command, stdin, timeout)
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise SshError(f"{self.target.label}: the SSH session broke: {type(e).__name__}: {e}") from None
            finally:
                chan.close()

    def _exchange(self, chan: paramiko.Channel, command: str, stdin: bytes, timeout: float) -> CommandResult:
        deadline = time.monotonic() + timeout
        chan.settimeout(max(1.0, timeout))
        chan.exec_command(command)
        try:
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
        except OSError:
            pass  # the command ended without reading its input: its status tells why
        out, err = bytearray(), bytearray()
        fd = chan.fileno()
        while True:
            while chan.recv_ready():
                out += chan.recv(65536)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                if not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SshError(f"{self.target.label}: the command did not finish within {timeout:g} s")
            if chan.eof_received:
                chan.status_event.wait(min(remaining, 0.5))  # data is done; the exit status is due
            else:
                select.select([fd], [], [], min(remaining, 0.5))
        return CommandResult(chan.recv_exit_status(), bytes(out), bytes(err))

    # ---- files ---------------------------------------------------------------------

    def upload(self, local: Path, remote: str) -> bool:
        """Put ``local`` at ``remote`` unless a file of that name and size is there.

        Written under a temporary name and renamed, so a half-sent file never takes the
        final (content-addressed) name. Returns whether anything was sent.
        """
        size = local.stat().st_size
        with self._channels:
            transport = self._transport()
            try:
                sftp = paramiko.SFTPClient.from_transport(transport)
                assert sftp is not None
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise SshError(f"{self.target.label}: cannot open SFTP: {e}") from None
            try:
                sftp.get_channel().settimeout(self.target.timeout)  # type: ignore[union-attr]
                try:
                    if sftp.stat(remote).st_size == size:
                        return False
                except OSError:
                    pass
                self._makedirs(sftp, str(PurePosixPath(remote).parent))
                tmp = f"{remote}.part-{uuid.uuid4().hex[:8]}"
                sftp.put(str(local), tmp, confirm=True)
                try:
                    sftp.posix_rename(tmp, remote)
                except OSError:
                    sftp.rename(tmp, remote)  # servers without the posix-rename extension
                return True
            except (OSError, paramiko.SSHException, EOFError) as e:
                raise SshError(f"{self.target.label}: uploading {local.name} to {remote} failed: {e}") from None
            finally:
                sftp.close()

    @staticmethod
    def _makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
        missing = []
        p = PurePosixPath(path)
        while str(p) not in ("/", "."):
            try:
                sftp.stat(str(p))
                break
            except OSError:
                missing.append(p)
                p = p.parent
        for d in reversed(missing):
            try:
                sftp.mkdir(str(d))
            except OSError:
                sftp.stat(str(d))  # made by someone else meanwhile, or a real error

    # ---- the rest ------------------------------------------------------------------

    def local_address(self) -> str:
        """This machine's address on the connection: where the remote can reach us."""
        transport = self._transport()
        return str(transport.sock.getsockname()[0])  # type: ignore[union-attr]

    def _drop(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._client is not None:
                self._client.close()
                self._client = None


def _is_key_problem(e: Exception) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("key", "passphrase", "decrypt", "checkint", "password"))
