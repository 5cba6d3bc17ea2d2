"""One machine of the remote platform's ``machineList``: its SSH link, and getting it ready.

A `Machine` runs the helper there over SSH (``helper_setup.py`` and ``helper.py``, sent as
one script: one JSON request in, one JSON answer out), checks the Python and the trialkeeper
there, or installs this coordinator's own trialkeeper into a per-experiment virtualenv
(``bootstrap``), and uploads and unpacks the code archive. Everything that can go wrong on
the machine is a `MachineError`, which says whether trying again later may help. The
environment service (``remote``) decides which machine takes which environment and what to
do when one fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.metadata
import json
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .config import RemoteConfig, RemoteMachineConfig

if TYPE_CHECKING:
    from .._codedir import PackedCode
    from .ssh import SshConnection

log = logging.getLogger(__name__)

REMOTE_ROOT = "trialkeeper-experiments"
# The helper is sent as one script: its set-up part first, then its entry, which runs it.
_HELPER = (Path(__file__).with_name("helper_setup.py"), Path(__file__).with_name("helper.py"))
_BOOT = "import sys;exec(compile(sys.stdin.buffer.read(int(sys.argv[1])),'trialkeeper-remote','exec'))"
_T = TypeVar("_T")


class MachineError(Exception):
    """A machine cannot be used now; ``permanent`` when trying again will not help."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass
class Machine:
    index: int
    config: RemoteMachineConfig
    conn: SshConnection
    label: str
    # Shared by all machines of a service: the threads that run the blocking SSH calls,
    # and the record of every file sent, as (machine label, remote path).
    pool: concurrent.futures.Executor
    uploads: list[tuple[str, str]]
    setup: asyncio.Future[None] | None = None
    error: str = ""
    permanent: bool = False
    failures: int = 0
    retry_at: float = 0.0
    python: str = ""  # the Python that runs agents there (absolute)
    exp_dir: str = ""
    dial: str = ""
    connecting: asyncio.Future[None] | None = None  # the early connect begun by prepare()

    @classmethod
    def from_config(cls, index: int, m: RemoteMachineConfig, config: RemoteConfig, *,
                    pool: concurrent.futures.Executor, uploads: list[tuple[str, str]]) -> Machine:
        from .ssh import SshConnection, SshTarget

        return cls(
            index=index,
            config=m,
            label=m.label,
            conn=SshConnection(
                SshTarget(
                    host=m.host, port=m.port, user=m.user, password=m.password,
                    key_file=m.ssh_key_file, passphrase=m.ssh_passphrase,
                    known_hosts=config.known_hosts_file,
                    accept_unknown_host_key=config.accept_unknown_host_keys,
                    timeout=config.ssh_timeout,
                )
            ),
            pool=pool,
            uploads=uploads,
        )

    @property
    def broken(self) -> bool:
        return bool(self.error)

    # ---- setting up -------------------------------------------------------------------

    async def set_up(self, experiment_id: str, code: PackedCode, wheel: Path | None) -> None:
        """Connect, check the Python and trialkeeper there (or install it from ``wheel``),
        upload and unpack the code."""
        from .ssh import SshError

        connecting, self.connecting = self.connecting, None
        try:
            await (connecting or self.ssh(self.conn.connect))
        except SshError as e:
            raise MachineError(str(e), permanent=e.permanent) from None
        info = await self.probe(python_command(self.config.python_path))
        root = f"{info['home'].rstrip('/')}/{REMOTE_ROOT}"
        self.exp_dir = f"{root}/{experiment_id}"
        if wheel is not None:
            remote_wheel = f"{root}/.cache/{wheel.name}"
            await self.upload(wheel, remote_wheel)
            venv = f"{self.exp_dir}/venv-{info['hostname']}"
            made = await self.helper(
                "bootstrap", {"wheel": remote_wheel, "venv": venv}, python=info["python"], timeout=300
            )
            agent_info = await self.probe(shlex.quote(made["python"]), bootstrapped=True)
            self.python = made["python"]
            log.info("%s: trialkeeper %s installed into %s", self.label, agent_info.get("trialkeeper"), venv)
        else:
            self.check_trialkeeper(info)
            self.python = info["python"]
        archive = f"{root}/.cache/{code.archive.name}"
        await self.upload(code.archive, archive)
        await self.helper("extract", {"archive": archive, "dest": f"{self.exp_dir}/code/{code.short}"})

    async def probe(self, python_cmd: str, *, bootstrapped: bool = False) -> dict[str, Any]:
        configured = self.config.python_path or "python3"
        try:
            info = await self.helper("probe", {}, python_cmd=python_cmd, timeout=60)
        except MachineError as e:
            if e.permanent:
                raise
            raise MachineError(str(e), permanent=False) from None
        version = tuple(info.get("version", (0, 0, 0)))
        if version < (3, 10):
            raise MachineError(
                f"{self.label}: {info.get('python')} is Python {'.'.join(map(str, version))}; trialkeeper needs "
                "3.10 or newer: set pythonPath to a newer Python there",
                permanent=True,
            )
        if bootstrapped and info.get("import_error"):
            reqs = " ".join(shlex.quote(r) for r in _requirements())
            raise MachineError(
                f"{self.label}: trialkeeper was installed into {info.get('python')}, but it cannot run: "
                f"{info['import_error']}. Its dependencies must be importable by {configured}; install them "
                f"there with: {configured} -m pip install {reqs}",
                permanent=True,
            )
        return info

    def check_trialkeeper(self, info: dict[str, Any]) -> None:
        """Refuse a trialkeeper there (per ``info`` from the probe) that agents cannot use."""
        from trialkeeper.agent import __version__
        from trialkeeper.protos.wire import PROTOCOL_VERSION

        python = info.get("python", "python3")
        hint = (
            f"install it there ({python} -m pip install 'trialkeeper=={__version__}') or set "
            "trainingService.bootstrap: true to have this coordinator install itself into a "
            "virtualenv on the machine"
        )
        theirs = info.get("trialkeeper")
        if not theirs:
            raise MachineError(
                f"{self.label}: trialkeeper is not importable by {python} "
                f"({info.get('import_error', 'not found')}); {hint}",
                permanent=True,
            )
        if info.get("protocol") != PROTOCOL_VERSION or theirs.split(".")[:2] != __version__.split(".")[:2]:
            raise MachineError(
                f"{self.label}: {python} has trialkeeper {theirs} (protocol {info.get('protocol')}), but this "
                f"coordinator is {__version__} (protocol {PROTOCOL_VERSION}); {hint}",
                permanent=True,
            )
        if info.get("import_error"):
            raise MachineError(
                f"{self.label}: trialkeeper {theirs} is installed for {python} but cannot run: {info['import_error']}; "
                f"install its dependencies there ({python} -m pip install 'trialkeeper=={__version__}')",
                permanent=True,
            )
        if theirs != __version__:
            log.warning("%s: trialkeeper %s there, %s here; same protocol, going on", self.label, theirs, __version__)

    async def upload(self, local: Path, remote: str) -> None:
        from .ssh import SshError

        try:
            sent = await self.ssh(self.conn.upload, local, remote)
        except SshError as e:
            raise MachineError(str(e), permanent=e.permanent) from None
        if sent:
            self.uploads.append((self.label, remote))
            log.info("%s: uploaded %s (%.1f MB)", self.label, remote, local.stat().st_size / 1e6)

    # ---- talking to it ----------------------------------------------------------------

    async def ssh(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, a blocking call on the connection, run in the shared pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args))

    async def helper(self, op: str, args: dict[str, Any], *, python: str | None = None,
                     python_cmd: str | None = None, stdin: bytes = b"", timeout: float = 60.0) -> dict[str, Any]:
        """The answer of `helper.py`'s ``op`` run there by ``python`` (default: the
        agents' Python, or the configured one on a machine not set up) or by the shell
        command ``python_cmd``."""
        from .ssh import SshError

        script = b"\n".join(part.read_bytes() for part in _HELPER)
        if python_cmd is None and not (python or self.python):
            python_cmd = python_command(self.config.python_path)
        command = python_cmd or shlex.quote(python or self.python)
        payload = json.dumps({"op": op, **args})
        full = f"{command} -c {shlex.quote(_BOOT)} {len(script)} {shlex.quote(payload)}"
        try:
            result = await self.ssh(functools.partial(self.conn.run, full, stdin=script + stdin, timeout=timeout))
        except SshError as e:
            raise MachineError(str(e), permanent=e.permanent) from None
        lines = result.stdout.decode("utf-8", "replace").strip().splitlines()
        try:
            answer = json.loads(lines[-1]) if lines else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            err = result.stderr.decode("utf-8", "replace").strip().splitlines()
            why = err[-1] if err else (lines[-1] if lines else "no output")
            if op == "probe":
                configured = self.config.python_path or "python3"
                raise MachineError(
                    f"{self.label}: cannot run Python with pythonPath {configured!r} (exit {result.rc}: {why}); set "
                    f"machineList[{self.index}].pythonPath to the Python 3.10+ (or its bin directory) that runs "
                    "trials there",
                    permanent=True,
                )
            raise MachineError(f"{self.label}: remote {op} failed (exit {result.rc}): {why}", permanent=False)
        if "error" in answer:
            raise MachineError(
                f"{self.label}: remote {op} failed: {answer['error']}", permanent=op in ("probe", "bootstrap")
            )
        return answer


def python_command(python_path: str | None) -> str:
    """The shell command that runs the configured ``pythonPath`` (default ``python3``)."""
    if not python_path:
        return "python3"
    # NNI's pythonPath is a bin directory put first on PATH; a path to the executable
    # works too.
    p = shlex.quote(python_path)
    return (
        f'p={p}; if [ -d "$p" ]; then PATH="$p:$PATH"; export PATH; '
        f'if [ -x "$p/python3" ]; then p="$p/python3"; else p="$p/python"; fi; fi; "$p"'
    )


def _requirements() -> list[str]:
    try:
        reqs = importlib.metadata.requires("trialkeeper") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r for r in reqs if "extra ==" not in r]
