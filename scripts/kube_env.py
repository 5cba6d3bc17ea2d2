#!/usr/bin/env python3
"""Real Kubernetes control-plane parts for the tests: build, cache and run them on loopback.

Builds kube-apiserver and kube-controller-manager from the Go modules of a pinned Kubernetes
release (a throw-away module that requires ``k8s.io/kubernetes`` and points each staging module
at its published version, since Kubernetes' own go.mod points them at ./staging), caches the
binaries under ``~/.cache/trialkeeper/kube/<version>/`` and starts Debian's etcd, the API server
and the controller manager on 127.0.0.1 with generated certificates and a bearer token, as
Kubernetes' own envtest does for controller tests.

    scripts/kube_env.py build            # build (or reuse) the binaries; ~13 min cold on 2 cores
    scripts/kube_env.py path             # print the cache folder; exit 1 when not built
    scripts/kube_env.py run [--dir D]    # start everything, print the kubeconfig, run until ^C

The build takes a lock file so that concurrent callers (CI's background build and a test
fixture, two worktrees) build once: the second waits for the first and reuses its result.
Binaries are written to a temporary folder and renamed into place, so a cache folder that
exists is complete.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The Kubernetes release built and tested; its staging modules are published as v0.<minor>.<patch>.
KUBE_VERSION = "v1.35.4"
BINARIES = ("kube-apiserver", "kube-controller-manager")
# Each binary's main package: Kubernetes' own cmd/<name>/<name>.go, less its log-format plug-ins.
_MAINS = {
    "kube-apiserver": ("k8s.io/kubernetes/cmd/kube-apiserver/app", "app.NewAPIServerCommand()"),
    "kube-controller-manager": (
        "k8s.io/kubernetes/cmd/kube-controller-manager/app",
        "app.NewControllerManagerCommand()",
    ),
}
# Jobs, foreground and cascading deletes, each namespace's `default` ServiceAccount (pods are
# refused without it) and its kube-root-ca.crt ConfigMap (the service-account volume reads it).
# persistentvolumeclaim-protection-controller releases a deleted claim once no pod uses it
# (the API server gives every claim its finalizer): AdaptDL's checkpoint claims need it.
CONTROLLERS = ("job-controller", "garbage-collector-controller", "namespace-controller",
               "serviceaccount-controller", "root-ca-certificate-publisher-controller",
               "persistentvolumeclaim-protection-controller")
GO_PROXY_MOD = "https://proxy.golang.org/k8s.io/kubernetes/@v/{version}.mod"
BUILD_COMMAND = f"{Path(__file__).resolve()} build"
ETCD_PACKAGE = "etcd-server"


class KubeEnvError(RuntimeError):
    """The environment cannot be built or started; the message says why and what to run."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trialkeeper" / "kube"


def binaries_dir(version: str = KUBE_VERSION) -> Path:
    return cache_root() / version


def built(version: str = KUBE_VERSION) -> bool:
    folder = binaries_dir(version)
    return all(os.access(folder / name, os.X_OK) for name in BINARIES)


def _staging_modules(version: str, timeout: float = 60.0) -> list[str]:
    """The modules Kubernetes' go.mod replaces with ./staging folders, read from the Go proxy."""
    with urllib.request.urlopen(GO_PROXY_MOD.format(version=version), timeout=timeout) as reply:
        text = reply.read().decode()
    modules = []
    for line in text.splitlines():
        parts = line.replace("replace", " ").split()
        if len(parts) == 3 and parts[1] == "=>" and parts[2].startswith("./staging/"):
            modules.append(parts[0])
    if not modules:
        raise KubeEnvError(f"k8s.io/kubernetes {version}'s go.mod names no staging modules")
    return modules


def _write_module(folder: Path, version: str) -> None:
    staging = "v0." + version.removeprefix("v1.")
    lines = ["module trialkeeper.local/kubebuild", "", "go 1.25", ""]
    lines.append(f"require k8s.io/kubernetes {version}")
    lines.append("")
    lines += [f"replace {mod} => {mod} {staging}" for mod in _staging_modules(version)]
    (folder / "go.mod").write_text("\n".join(lines) + "\n")
    for name, (package, command) in _MAINS.items():
        main = folder / "cmd" / name
        main.mkdir(parents=True)
        (main / "main.go").write_text(textwrap.dedent(f"""\
            package main

            import (
            \t"os"

            \t"k8s.io/component-base/cli"
            \t"{package}"
            )

            func main() {{ os.Exit(cli.Run({command})) }}
            """))


def _run_shown(cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Run a build step, showing a line of progress every 30 s (and its output's tail if it fails)."""
    started = last = time.monotonic()
    print(f"+ {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for count, line in enumerate(proc.stdout, 1):
        tail = (tail + [line.rstrip()])[-40:]
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            print(f"  [{last - started:5.0f} s] {count} steps, now {line.strip()[:100]}",
                  file=sys.stderr, flush=True)
    if proc.wait() != 0:
        print("\n".join(tail), file=sys.stderr, flush=True)
        raise KubeEnvError(f"{' '.join(cmd)} failed with exit status {proc.returncode}")


def build(version: str = KUBE_VERSION, *, wait_s: float = 3600.0) -> Path:
    """Build (or reuse) the binaries of ``version``; returns their folder.

    Holds ``<cache>/<version>.lock`` while building, so a second caller waits up to ``wait_s``
    for the first and then finds the folder complete.
    """
    folder = binaries_dir(version)
    if built(version):
        return folder
    if shutil.which("go") is None:
        raise KubeEnvError("no Go toolchain on PATH (needed to build kube-apiserver)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{version}.lock", "w") as lock:
        deadline = time.monotonic() + wait_s
        announced = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise KubeEnvError(f"another build of {version} held the lock over {wait_s:.0f} s")
                if not announced:
                    print(f"waiting for another build of Kubernetes {version} to finish",
                          file=sys.stderr, flush=True)
                    announced = True
                time.sleep(2)  # polling a lock another process holds; there is nothing to wait on
        if built(version):
            return folder
        started = time.monotonic()
        print(f"building kube-apiserver and kube-controller-manager {version} "
              "(about 13 min cold on 2 cores, seconds when Go's build cache is warm)",
              file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="kubebuild-", dir=folder.parent) as tmp:
            work = Path(tmp)
            _write_module(work, version)
            env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
            _run_shown(["go", "mod", "tidy"], work, env)
            out = work / "bin"
            for name in BINARIES:
                _run_shown(["go", "build", "-v", "-trimpath", "-ldflags", "-s -w",
                            "-o", str(out / name), f"./cmd/{name}"], work, env)
            if folder.exists():
                shutil.rmtree(folder)
            out.rename(folder)
        print(f"built {version} in {time.monotonic() - started:.0f} s into {folder}",
              file=sys.stderr, flush=True)
    return folder



# ---- running it ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_certificates(folder: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1/localhost signed by it, and the key pair
    service-account tokens are signed with."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    def pem_key(key: object) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,  # type: ignore[attr-defined]
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trialkeeper test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    serving = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
               .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.SubjectAlternativeName(names), critical=False)
               .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
               .sign(ca_key, hashes.SHA256()))
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "apiserver.crt").write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    (folder / "apiserver.key").write_bytes(pem_key(key))
    (folder / "sa.key").write_bytes(pem_key(sa_key))
    (folder / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


# Everything that creates, replaces or deletes objects is recorded with its request body, so
# tests can tell what was sent (a token in a pod spec, say) after the objects are gone.
_AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Request
  verbs: [create, update, patch, delete]
  resources: [{group: ""}, {group: batch}, {group: kubeflow.org},
              {group: frameworkcontroller.microsoft.com}, {group: adaptdl.petuum.com}]
- level: None
"""


def spawn_detached(argv: list[str], log_file: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    """Start ``argv`` in the background, no child of ours (test processes check that their
    children are gone at the end of each test), in a session of its own; its psutil.Process."""
    launched = subprocess.run(
        ["/bin/sh", "-c", 'setsid "$@" </dev/null >>"$KUBE_ENV_LOG" 2>&1 & echo $!', "sh", *argv],
        env=dict(env if env is not None else os.environ, KUBE_ENV_LOG=str(log_file)),
        cwd=cwd, capture_output=True, text=True, timeout=30, check=True)
    import psutil  # a test dependency; building needs only the standard library

    return psutil.Process(int(launched.stdout.strip()))


@dataclass
class ControlPlane:
    """etcd, kube-apiserver and kube-controller-manager on 127.0.0.1, in ``root``.

    ``start()`` returns once the processes are started; ``wait_ready()`` waits until the API
    server answers /readyz and namespace ``default`` has its ServiceAccount (pods are refused
    before). ``stop()`` ends all three (SIGTERM, then SIGKILL after a few seconds).
    """

    root: Path
    version: str = KUBE_VERSION
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    port: int = 0
    procs: dict[str, Any] = field(default_factory=dict)  # name -> psutil.Process

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.root / "pki" / "ca.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.root / "audit.log"

    def log_file(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def start(self) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise KubeEnvError(f"no etcd on PATH: apt-get install {ETCD_PACKAGE}")
        if not built(self.version):
            raise KubeEnvError(f"kube-apiserver {self.version} is not built: run {BUILD_COMMAND}")
        bins = binaries_dir(self.version)
        pki = self.root / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        _write_certificates(pki)
        (self.root / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        (self.root / "audit-policy.yaml").write_text(_AUDIT_POLICY)
        self.port = self.port or _free_port()
        self.write_kubeconfig(self.kubeconfig)
        etcd_port, peer_port = _free_port(), _free_port()
        self._spawn("etcd", [
            etcd, "--name", "trialkeeper", "--data-dir", str(self.root / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"trialkeeper=http://127.0.0.1:{peer_port}",
            # Without it the API server's watches fail after 3 s ("Too large resource version").
            "--experimental-watch-progress-notify-interval=500ms",
            "--unsafe-no-fsync", "--log-level", "warn",
        ])
        self._spawn("kube-apiserver", [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--cert-dir={pki}", f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--token-auth-file={self.root / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
            f"--audit-policy-file={self.root / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--audit-log-mode=blocking",
        ])
        self._spawn("kube-controller-manager", [
            str(bins / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={_free_port()}", f"--cert-dir={self.root / 'cm-certs'}",
            "--controllers=" + ",".join(CONTROLLERS),
            f"--root-ca-file={self.ca_file}",
        ])

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.procs[name] = spawn_detached(argv, self.log_file(name))

    def write_kubeconfig(self, path: Path, *, namespace: str = "default", server: str = "") -> Path:
        """A kubeconfig for the admin token; ``server`` (a proxy's URL, say) instead of ours."""
        path.write_text(textwrap.dedent(f"""\
            apiVersion: v1
            kind: Config
            clusters:
            - name: trialkeeper-test
              cluster: {{server: "{server or self.url}", certificate-authority: "{self.ca_file}"}}
            users:
            - name: admin
              user: {{token: "{self.token}"}}
            contexts:
            - name: trialkeeper-test
              context: {{cluster: trialkeeper-test, user: admin, namespace: {namespace}}}
            current-context: trialkeeper-test
            """))
        return path

    def request(self, method: str, path: str, body: object = None, *, timeout: float = 10.0,
                content_type: str = "application/json") -> tuple[int, dict]:
        """One call to the API server: (HTTP status, decoded answer); never raises for a status."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type, "Accept": "application/json"})
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
                status, raw = answer.status, answer.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else {}
        except ValueError:
            return status, {"message": raw.decode(errors="replace")}

    def failed(self) -> str:
        """Which process has ended, with the end of its log ("" when all run)."""
        for name, proc in self.procs.items():
            if not _alive(proc):
                tail = self.log_file(name).read_text(errors="replace").splitlines()[-15:]
                return f"{name} has exited:\n" + "\n".join(tail)
        return ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the API server serves and pods can be created in namespace ``default``."""
        deadline = time.monotonic() + timeout
        why = "not started"
        while time.monotonic() < deadline:
            dead = self.failed()
            if dead:
                raise KubeEnvError(dead)
            try:
                status, _ = self.request("GET", "/readyz", timeout=5)
                if status == 200:
                    status, _ = self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=5)
                    if status == 200:
                        return
                    why = "namespace default has no ServiceAccount yet"
                else:
                    why = f"/readyz answered {status}"
            except OSError as e:  # not listening yet
                why = f"{type(e).__name__}: {e}"
            time.sleep(0.2)  # polling another process's readiness: nothing to wait on here
        raise KubeEnvError(f"the control plane was not ready within {timeout:.0f} s: {why}")

    def stop(self, grace_s: float = 10.0) -> None:
        import psutil

        # The controller manager and the API server first, etcd (their storage) last.
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.procs.get(name)
            if proc is None or not _alive(proc):
                continue
            with contextlib.suppress(psutil.Error):
                proc.terminate()
            _, alive = psutil.wait_procs([proc], timeout=grace_s)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=grace_s)


def _alive(proc: Any) -> bool:
    """Running, and not a zombie waiting for init to reap it."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _run_until_interrupted(version: str, folder: Path | None) -> None:
    build(version)
    with tempfile.TemporaryDirectory(prefix="kube-env-") as tmp:
        plane = ControlPlane((folder or Path(tmp)).resolve(), version)
        plane.root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            plane.start()
            plane.wait_ready()
            print(f"ready in {time.monotonic() - started:.1f} s: {plane.url}\n"
                  f"KUBECONFIG={plane.kubeconfig}  (logs in {plane.root}; ^C stops)", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            plane.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=KUBE_VERSION, help="Kubernetes release (default %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build or reuse the binaries")
    sub.add_parser("path", help="print the binaries' folder; exit status 1 when not built")
    run = sub.add_parser("run", help="start etcd, the API server and the controller manager until ^C")
    run.add_argument("--dir", type=Path, help="their folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.command == "run":
        # Waited for with sigwait; a shell starting us in the background ignores SIGINT, which
        # would discard it rather than leave it pending.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if args.command == "build":
            print(build(args.version))
        elif args.command == "path":
            print(binaries_dir(args.version))
            return 0 if built(args.version) else 1
        elif args.command == "run":
            _run_until_interrupted(args.version, args.dir)
    except KubeEnvError as exc:
        print(f"kube_env: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
