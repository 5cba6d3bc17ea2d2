"""A real Slurm cluster of two nodes in a temporary directory, for tests.

Debian's ``munged``, ``slurmctld`` and ``slurmd`` run with a generated munge key,
``slurm.conf`` and ``cgroup.conf`` of their own: free ports on 127.0.0.1, two nodes
(:data:`NODES`), each one ``slurmd`` of its own on this machine (``slurmd -N <node>``, its
own port, spool directory, pid and log file: Debian's slurmd runs several per host), each
with this machine's CPUs and memory, so that a job of ``--nodes=2`` runs, ``proctrack/linuxproc`` and
``task/none`` (no cgroups needed), ``select/cons_tres`` and no accounting storage. The
partition lets jobs share CPUs (``OverSubscribe=FORCE``) so that a 2-core machine can run
a few agents at once. ``SLURM_CONF`` points the client commands at it.

The daemons run in the background (not as descendants of the test process, whose leak
check would flag them) and are ended by their pid files in :meth:`SlurmCluster.stop`.
Starting needs root (slurmd starts jobs as their users); :class:`SlurmUnavailable` says
why a cluster cannot start here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
COMMAND_TIMEOUT_S = 20.0
PARTITION = "debug"
DAEMONS = ("munged", "slurmctld", "slurmd")
NODES = ("node-1", "node-2")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo")


class SlurmUnavailable(Exception):
    """A Slurm cluster cannot be started here; the message says why."""


@dataclass
class SlurmCluster:
    """A running cluster: its directory, config and the environment to use it."""

    directory: Path
    conf: Path
    partition: str = PARTITION

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing at the cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=check
        )

    def jobs(self, name_prefix: str = "") -> list[tuple[str, str, str]]:
        """(job id, name, state) of the jobs pending, running or completing."""
        out = self.command("squeue", "--noheader", "--format=%i|%j|%T").stdout
        rows = [tuple(line.strip().split("|", 2)) for line in out.splitlines() if line.strip()]
        return [(r[0], r[1], r[2]) for r in rows if len(r) == 3 and r[1].startswith(name_prefix)]

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the daemons' logs, for failure messages."""
        parts = []
        for name in ("slurmctld.log", *(f"slurmd-{n}.log" for n in NODES)):
            with contextlib.suppress(OSError):
                text = (self.directory / "log" / name).read_text(errors="replace").splitlines()
                parts.append(f"--- {name}\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, then end the daemons (by their pid files) and wait for them."""
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.command("scancel", "--user", str(os.getuid()), check=False)
        _wait(lambda: not self._jobs_or_empty(), 15.0)
        procs = []
        for pid_file in (*(f"slurmd-{n}.pid" for n in NODES), "slurmctld.pid", "munge/munged.pid"):
            pid = _read_pid(self.directory / pid_file)
            if pid is None:
                continue
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.name() in DAEMONS:
                    procs.append(p)
                    p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=STOP_TIMEOUT_S)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5.0)

    def _jobs_or_empty(self) -> list[tuple[str, str, str]]:
        try:
            return self.jobs()
        except (subprocess.SubprocessError, OSError):
            return []


def start_cluster(base: Path) -> SlurmCluster:
    """Start munged, slurmctld and a slurmd per node under ``base``; wait until the nodes are idle."""
    missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd needs root to start jobs")
    directory = base / "slurm"
    for sub in ("munge", "state", "log", *(f"spool-{n}" for n in NODES)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    (directory / "munge").chmod(0o755)
    key_dir = directory / "munge-key"
    key_dir.mkdir(mode=0o700)
    key = key_dir / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    conf = directory / "slurm.conf"
    conf.write_text(_slurm_conf(directory))
    # Nothing is constrained through cgroups (task/none, proctrack/linuxproc).
    (directory / "cgroup.conf").write_text(
        "CgroupPlugin=autodetect\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n"
    )
    cluster = SlurmCluster(directory, conf)
    try:
        _daemon(cluster, [
            _exe("munged"), "--force", f"--key-file={key}",
            f"--socket={directory / 'munge' / 'munge.socket'}",
            f"--pid-file={directory / 'munge' / 'munged.pid'}",
            f"--log-file={directory / 'log' / 'munged.log'}",
            f"--seed-file={directory / 'munge' / 'munged.seed'}",
        ])
        _daemon(cluster, [_exe("slurmctld")])
        _wait_for(lambda: _answers(cluster, "scontrol", "ping"), cluster, "slurmctld never answered")
        for node in NODES:
            _daemon(cluster, [_exe("slurmd"), "-N", node])
        _wait_for(lambda: _node_idle(cluster), cluster, "the nodes never became idle")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _slurm_conf(directory: Path) -> str:
    cpus = os.cpu_count() or 1
    memory_mb = max(1, psutil.virtual_memory().total // 2**20 - 256)
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} CPUs={cpus}"
        f" RealMemory={memory_mb} State=UNKNOWN" for n in NODES
    )
    return f"""\
ClusterName=trialkeeper-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={directory / 'munge' / 'munge.socket'}
CredType=cred/munge
StateSaveLocation={directory / 'state'}
SlurmdSpoolDir={directory / 'spool-%n'}
SlurmctldPidFile={directory / 'slurmctld.pid'}
SlurmdPidFile={directory / 'slurmd-%n.pid'}
SlurmctldLogFile={directory / 'log' / 'slurmctld.log'}
SlurmdLogFile={directory / 'log' / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MinJobAge=600
MailProg=/bin/true
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:16
"""


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _daemon(cluster: SlurmCluster, argv: list[str]) -> None:
    """Run a daemon that forks into the background; fail with its log if it cannot start."""
    proc = subprocess.run(argv, env=cluster.env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise SlurmUnavailable(
            f"{Path(argv[0]).name} did not start: {(proc.stderr or proc.stdout).strip()}\n{cluster.log_tail()}"
        )


def _answers(cluster: SlurmCluster, *argv: str) -> bool:
    try:
        return cluster.command(*argv, check=False).returncode == 0
    except (subprocess.SubprocessError, OSError):
        return False


def _node_idle(cluster: SlurmCluster) -> bool:
    try:
        out = cluster.command("sinfo", "--noheader", "--format=%t", check=False).stdout
    except (subprocess.SubprocessError, OSError):
        return False
    return out.strip() == "idle"


def _wait_for(predicate: Callable[[], object], cluster: SlurmCluster, message: str) -> None:
    if not _wait(predicate, START_TIMEOUT_S):
        raise SlurmUnavailable(f"{message} within {START_TIMEOUT_S:g} s\n{cluster.log_tail()}")


def _wait(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- one cluster per test session ----------------------------------------------------------

_shared: SlurmCluster | None = None
_shared_error: SlurmUnavailable | None = None
_users = 0
_saved_conf: str | None = None


def acquire_cluster(base: Callable[[], Path]) -> SlurmCluster:
    """The session's cluster, started on first use under ``base()``; pair with :func:`release_cluster`.

    Every session-scoped fixture that needs Slurm (the integration tests, the contract
    harness) shares one cluster: starting one costs seconds and they must not compete
    for the node. ``SLURM_CONF`` is exported while any user holds it, so that services
    and the commands they spawn reach it. A failed start is remembered and raised again.
    """
    global _shared, _shared_error, _users, _saved_conf
    if _shared_error is not None:
        raise _shared_error
    if _shared is None:
        try:
            _shared = start_cluster(base())
        except SlurmUnavailable as e:
            _shared_error = e
            raise
        _saved_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(_shared.conf)
    _users += 1
    return _shared


def release_cluster() -> None:
    """Give the session's cluster back; the last user stops it and restores ``SLURM_CONF``."""
    global _shared, _users
    _users -= 1
    if _users > 0 or _shared is None:
        return
    _shared.stop()
    _shared = None
    if _saved_conf is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = _saved_conf
