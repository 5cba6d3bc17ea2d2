"""Real OpenSSH servers on 127.0.0.1 that act as remote machines in tests.

Each "machine" is Debian's ``sshd`` with its own config, host key, authorized_keys and
log in a temporary directory, listening on a free port of 127.0.0.1, with ``UsePAM no``
and no systemd. ``SetEnv HOME=...`` gives each one a home of its own, so two servers on
one host behave as two machines that share nothing.

For password logins the server runs in a private mount namespace where ``/etc/shadow`` is
a copy with the test password set for the current user: the real one is never touched.
That needs root (and ``unshare``); without it only key logins are offered, and
:attr:`Credentials.password_unavailable` says why.

The servers daemonize, so they are no descendants of the test process (whose leak check
would flag them); :meth:`Machine.stop` ends each listener and its session processes.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
START_TIMEOUT_S = 15.0


class SshdUnavailable(Exception):
    """sshd cannot be started here; the message says why."""


@dataclass
class Credentials:
    """How tests log in: a passphrase-protected key for everyone, a password where possible."""

    user: str
    key_file: Path
    passphrase: str = field(repr=False)
    password: str | None = field(default=None, repr=False)
    password_unavailable: str = ""


@dataclass
class Machine:
    """One sshd acting as a machine: where it listens, its home, how to check and end it."""

    name: str
    port: int
    home: Path
    directory: Path
    host_key_line: str  # "ssh-ed25519 AAAA..."
    host_fingerprint: str
    pid: int = 0
    host: str = "127.0.0.1"

    @property
    def known_hosts_line(self) -> str:
        return f"[{self.host}]:{self.port} {self.host_key_line}"

    @property
    def log(self) -> Path:
        return self.directory / "sshd.log"

    def processes(self) -> list[psutil.Process]:
        """Live processes of this machine's users' work (agents, trials), sshd aside."""
        marker = str(self.home)
        found = []
        for p in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                if p.info["name"] == "sshd" or (p.info["cmdline"] or [""])[0].startswith("sshd:"):
                    continue
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if marker in " ".join(p.info["cmdline"] or ()):
                    found.append(p)
                    continue
                with contextlib.suppress(psutil.Error, OSError):
                    if p.cwd().startswith(marker):
                        found.append(p)
                        continue
                with contextlib.suppress(psutil.Error, OSError):
                    if p.environ().get("TRIALKEEPER_TRIAL_DIR", "").startswith(marker):
                        found.append(p)
            except (psutil.Error, OSError):
                continue
        return found

    def stop(self) -> None:
        """End the listener, every session it holds, and anything left in this machine's home."""
        procs: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            listener = psutil.Process(self.pid)
            procs = [listener, *listener.children(recursive=True)]
        procs += [p for p in self.processes() if p not in procs]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        alive = _wait_gone(procs, 5.0)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _wait_gone(alive, 5.0)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of ``procs`` runs; those still running after ``timeout``.

    A daemon's zombie counts as gone: it is init's to reap, which can take a while."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def sshd_binary() -> str:
    found = shutil.which("sshd") or next((c for c in SSHD_CANDIDATES if os.access(c, os.X_OK)), None)
    if found is None:
        raise SshdUnavailable("sshd is not installed (Debian: apt-get install openssh-server)")
    return found


def make_credentials(directory: Path) -> Credentials:
    """A fresh ed25519 client key with a passphrase, and a password if this host allows it."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    directory.mkdir(parents=True, exist_ok=True)
    passphrase = "tk-pp-" + secrets.token_hex(8)
    key = ed25519.Ed25519PrivateKey.generate()
    key_file = directory / "client_ed25519"
    key_file.write_bytes(
        key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.BestAvailableEncryption(passphrase.encode()))
    )
    key_file.chmod(0o600)
    public = key.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH)
    (directory / "authorized_keys").write_bytes(public + b" trialkeeper-test\n")
    user = pwd.getpwuid(os.getuid()).pw_name
    creds = Credentials(user=user, key_file=key_file, passphrase=passphrase)
    why = _password_unavailable()
    if why:
        creds.password_unavailable = why
        return creds
    password = "tk-pw-" + secrets.token_hex(12)
    hashed = _sha512_crypt(password)
    if hashed is None:
        creds.password_unavailable = "neither openssl nor Python's crypt module can hash a password here"
        return creds
    lines = []
    for line in Path("/etc/shadow").read_text().splitlines():
        parts = line.split(":")
        if parts and parts[0] == user and len(parts) > 1:
            parts[1] = hashed
        lines.append(":".join(parts))
    shadow = directory / "shadow"
    shadow.write_text("\n".join(lines) + "\n")
    shadow.chmod(0o600)
    creds.password = password
    return creds


@contextlib.contextmanager
def one_machine(base: Path, purpose: str) -> Iterator[tuple[Machine, Credentials, Path]]:
    """One machine with its credentials and a known_hosts file naming it, stopped on exit.
    Where sshd cannot start, the test fails under CI (``CI`` set) and is skipped elsewhere."""
    import pytest

    try:
        creds = make_credentials(base / "credentials")
        machine = start_machine("m1", base, creds)
    except SshdUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"{purpose} need sshd and could not start it: {e}")
        pytest.skip(f"sshd cannot run here: {e}")
    known_hosts = base / "known_hosts"
    known_hosts.write_text(machine.known_hosts_line + "\n")
    try:
        yield machine, creds, known_hosts
    finally:
        machine.stop()


def start_machine(name: str, base: Path, creds: Credentials) -> Machine:
    """Start one sshd "machine" under ``base/name``; raise SshdUnavailable saying why not."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    sshd = sshd_binary()
    directory = base / name
    home = directory / "home"
    home.mkdir(parents=True, exist_ok=True)
    host_key = ed25519.Ed25519PrivateKey.generate()
    key_path = directory / "ssh_host_ed25519_key"
    key_path.write_bytes(host_key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()))
    key_path.chmod(0o600)
    public = host_key.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH).decode()
    if os.getuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    last_error = ""
    for _ in range(3):  # a free port can be taken between choosing and binding it
        port = _free_port()
        config = directory / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress 127.0.0.1:{port}",
                    f"HostKey {key_path}",
                    f"PidFile {directory / 'sshd.pid'}",
                    f"AuthorizedKeysFile {base / 'credentials' / 'authorized_keys'}",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin yes",
                    f"PasswordAuthentication {'yes' if creds.password else 'no'}",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "Subsystem sftp internal-sftp",
                    f"SetEnv HOME={home}",
                    "MaxSessions 50",
                    "MaxStartups 50",
                    "LogLevel VERBOSE",
                    "",
                ]
            )
        )
        (directory / "sshd.pid").unlink(missing_ok=True)
        check = subprocess.run([sshd, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30, check=False)
        if check.returncode != 0:
            raise SshdUnavailable(f"sshd refuses its test config: {check.stderr.strip() or check.stdout.strip()}")
        argv = [sshd, "-f", str(config), "-E", str(directory / "sshd.log")]
        if creds.password:
            shadow = base / "credentials" / "shadow"
            argv = [
                "unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount --bind "$1" /etc/shadow && shift && exec "$@"', "sh", str(shadow), *argv,
            ]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if run.returncode != 0:
            last_error = (run.stderr or run.stdout).strip()
            if "Address already in use" in last_error or "Bind to port" in last_error:
                continue
            raise SshdUnavailable(f"sshd did not start: {last_error} (see {directory / 'sshd.log'})")
        pid = _wait_listening(directory, port)
        if pid:
            return Machine(name, port, home, directory, public, _fingerprint(public), pid)
        last_error = _tail(directory / "sshd.log") or "it never listened"
        if "Address already in use" not in last_error:
            break
    raise SshdUnavailable(f"sshd did not come up on 127.0.0.1: {last_error}")


def _password_unavailable() -> str:
    if os.getuid() != 0:
        return "password logins need root (sshd reads a private /etc/shadow in its own mount namespace)"
    if shutil.which("unshare") is None:
        return "password logins need unshare (util-linux)"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        return f"password logins need a private mount namespace: unshare -m failed: {probe.stderr.decode().strip()}"
    return ""


def _sha512_crypt(password: str) -> str | None:
    if shutil.which("openssl"):
        run = subprocess.run(
            ["openssl", "passwd", "-6", "-stdin"], input=password.encode(), capture_output=True, timeout=30, check=False
        )
        if run.returncode == 0 and run.stdout.startswith(b"$6$"):
            return run.stdout.decode().strip()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # type: ignore[import-not-found]  # removed in Python 3.13
    except ImportError:
        return None
    return str(crypt.crypt(password, crypt.mksalt(crypt.METHOD_SHA512)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(directory: Path, port: int) -> int:
    """The listener's pid once it writes its pid file and answers with an SSH banner, or 0."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pid_file = directory / "sshd.pid"
    while time.monotonic() < deadline:
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            pid = 0
        if pid:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
                s.settimeout(2.0)
                if s.recv(64).startswith(b"SSH-"):
                    return pid
        # The daemon is a grandchild we cannot wait on; its pid file and port are the signal.
        time.sleep(0.05)
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    return 0


def _fingerprint(public_line: str) -> str:
    import base64
    import hashlib

    blob = base64.b64decode(public_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
