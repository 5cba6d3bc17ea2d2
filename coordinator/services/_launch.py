"""How every service starts an agent: its command line, its environment, the code it runs.

Standard library only: ``_ray_node`` imports this on Ray's nodes. The experiment token is
never on a command line: it travels in the agent's environment (:func:`agent_environment`,
``TRIALKEEPER_TOKEN``) or in a 0600 file passed as ``--token-file``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from trialkeeper.protos.wire import ENVIRONMENT_ENV, EXPERIMENT_ENV, TOKEN_ENV

AGENT_MODULE = "trialkeeper.agent"
#: The coordinator's certificate beside an agent's files, for ``--tls-cert``.
TLS_CERT_FILE = "coordinator.pem"


def agent_argv(
    coordinator: str,
    env_id: str,
    platform: str,
    *,
    python: str | None,
    workdir: str | None = None,
    copy_working_directory: bool = False,
    no_gpu: bool = False,
    token_file: str | None = None,
    tls_cert: str | None = None,
    agent_args: Sequence[str] = (),
) -> list[str]:
    """``python -m trialkeeper.agent --coordinator ... --environment-id ...`` and its options.

    ``python=None`` gives the arguments alone, for a launcher that supplies the interpreter
    (the remote helper). ``no_gpu`` is dropped where ``agent_args`` already picks GPUs
    (``--gpu-indices``): an explicit choice of the coordinator wins over the platform's
    default."""
    argv = [python, "-m", AGENT_MODULE] if python is not None else []
    argv += ["--coordinator", coordinator, "--environment-id", env_id, "--platform", platform]
    if workdir is not None:
        argv += ["--workdir", workdir]
    if copy_working_directory:
        # Each trial works in its own copy of the code; the agent's own files persist.
        argv.append("--copy-working-directory")
    if token_file is not None:
        argv += ["--token-file", token_file]
    if tls_cert is not None:
        argv += ["--tls-cert", tls_cert]
    argv += list(agent_args)
    if no_gpu and "--gpu-indices" not in agent_args:
        argv.append("--no-gpu")
    return argv


def agent_environment(token: str, experiment_id: str, env_id: str) -> dict[str, str]:
    """The variables an agent is started with: the token, and whose agent it is (so that
    ``clean`` and the platforms' job listings can tell)."""
    return {TOKEN_ENV: token, EXPERIMENT_ENV: experiment_id, ENVIRONMENT_ENV: env_id}


def with_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with ``extra`` on top, for an agent started from here."""
    return {**os.environ, **extra}


def write_tls_cert(directory: Path, cert_pem: bytes | None) -> str | None:
    """The path of the coordinator's certificate written as ``directory/coordinator.pem``,
    for an agent to pin with ``--tls-cert``; None (and nothing written) when TLS is off."""
    if cert_pem is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    cert = directory / TLS_CERT_FILE
    cert.write_bytes(cert_pem)
    return str(cert)


def log_tail(path: Path, limit: int = 600, lines: int = 1) -> str:
    """The last non-blank line (or ``lines`` lines, joined by `` | ``) of an agent's log that
    is not an INFO or DEBUG line of its own (those say what went well), for a message saying
    why it ended."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return ""
    if size > limit:  # the first line read is the end of one cut short: its start says whether it is quiet
        data = data.partition(b"\n")[2]
    kept = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip() and not _QUIET.match(ln)]
    return " | ".join(kept[-lines:])


# "2026-11-27 16:50:49,250 INFO agent[21372] ...": how the agent logs what went well.
_QUIET = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?:INFO|DEBUG) ")


def copy_code(source: Path, target: Path, exclude: Collection[Path] = ()) -> None:
    """A fresh copy of the trial code at ``target``, without ``exclude`` (the experiment's
    own files, its token among them, where the experiment directory lies inside the code)
    and without ``__pycache__``.

    Copied beside, then swapped in: agents of a resumed experiment may be copying the old
    one at this moment, and must never see a half-written tree."""
    skip = {os.path.normpath(p) for p in exclude}

    def ignore(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or os.path.normpath(os.path.join(directory, n)) in skip}

    fresh = target.with_name(f"{target.name}.new-{os.getpid()}")
    stale = target.with_name(f"{target.name}.old-{os.getpid()}")
    for leftover in (fresh, stale):
        shutil.rmtree(leftover, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, fresh, ignore=ignore, symlinks=True)
    if target.exists():
        target.rename(stale)
    fresh.rename(target)
    shutil.rmtree(stale, ignore_errors=True)
