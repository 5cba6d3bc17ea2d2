"""``trialkeeper agent``: start an agent by hand or from an environment service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from trialkeeper.protos.wire import TOKEN_ENV

log = logging.getLogger("trialkeeper.agent")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="address of the coordinator to dial")
    parser.add_argument("--environment-id", required=True, metavar="ID", help="the environment this agent serves")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="where trial directories go (default: ~/.trialkeeper/agents/ENVIRONMENT_ID)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help=f"file holding the experiment token (default: the {TOKEN_ENV} environment variable)",
    )
    parser.add_argument("--platform", default="local", help="platform name reported to the coordinator")
    parser.add_argument("--reconnect-window", type=float, default=60.0, metavar="SECONDS",
                        help="how long to keep trying to reach a lost coordinator before stopping trials and exiting")
    parser.add_argument("--copy-working-directory", action="store_true",
                        help="run each trial in its own copy of its working directory (<trial dir>/code), "
                        "so that trials cannot disturb each other through the files they write")
    parser.add_argument("--logs-shared", action="store_true",
                        help="the coordinator reads the trials' log files where the agent writes them "
                        "(an environment on its file system): do not stream them")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="keep a template process that imported MODULE (repeatable) and fork each "
                        "Python trial from it (the experiment's trialPreload)")
    parser.add_argument("--gpu-indices", metavar="LIST", help="expose only these GPUs, e.g. 0,2")
    parser.add_argument("--simulated-gpus", type=int, default=0, metavar="N",
                        help="report N simulated GPUs instead of real ones (tests and benchmarks only)")
    parser.add_argument("--no-gpu", action="store_true", help="report no GPUs")
    parser.add_argument("--tls-fingerprint", metavar="SHA256",
                        help="SHA-256 fingerprint of the coordinator's certificate: fetch it, check it "
                        "and trust only it (enables TLS)")
    parser.add_argument("--tls-cert", type=Path, metavar="PEM",
                        help="coordinator certificate to trust (enables TLS); an alternative pin")
    parser.add_argument("--tls-server-name",
                        help="name to check the coordinator certificate against (default: trialkeeper-coordinator)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _token(args: argparse.Namespace) -> str:
    if args.token_file:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise SystemExit(f"trialkeeper agent: cannot read --token-file: {e}") from e
    else:
        token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"trialkeeper agent: no token: set {TOKEN_ENV} or pass --token-file")
    return token


def _tls_pin(args: argparse.Namespace) -> tuple[bytes | None, str | None]:
    """The certificate to trust (from --tls-cert) and the fingerprint to pin, checked."""
    from .tls import certificate_fingerprint, normalize_fingerprint

    fingerprint = None
    if args.tls_fingerprint is not None:
        try:
            fingerprint = normalize_fingerprint(args.tls_fingerprint)
        except ValueError as e:
            raise SystemExit(f"trialkeeper agent: --tls-fingerprint: {e}") from None
    if args.tls_cert is None:
        return None, fingerprint
    try:
        cert = args.tls_cert.read_bytes()
        got = certificate_fingerprint(cert)
    except (OSError, ValueError) as e:
        raise SystemExit(f"trialkeeper agent: --tls-cert {args.tls_cert}: {e}") from None
    if fingerprint is not None and got != fingerprint:
        raise SystemExit(
            f"trialkeeper agent: --tls-cert {args.tls_cert} has fingerprint {got}, not the "
            f"--tls-fingerprint {fingerprint}"
        )
    return cert, None


def _indices(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(p) for p in text.split(",") if p.strip() != ""]
    except ValueError:
        raise SystemExit(f"trialkeeper agent: --gpu-indices expects numbers like 0,2, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from .gpu import GpuProbe
    from .session import AgentOptions

    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s agent[%(process)d] %(name)s: %(message)s",
    )
    token = _token(args)
    os.environ.pop(TOKEN_ENV, None)  # trials must not inherit the experiment's credentials
    workdir = args.workdir or Path.home() / ".trialkeeper" / "agents" / args.environment_id
    workdir.mkdir(parents=True, exist_ok=True)
    held = hold_environment(workdir, args.environment_id)  # for this process's life
    if isinstance(held, str):
        print(f"trialkeeper agent: {held}", file=sys.stderr)
        return 2
    tls_cert, tls_fingerprint = _tls_pin(args)
    probe = GpuProbe(
        visible_indices=_indices(args.gpu_indices),
        simulated=args.simulated_gpus,
        enabled=not args.no_gpu,
    )
    options = AgentOptions(
        coordinator=args.coordinator,
        environment_id=args.environment_id,
        token=token,
        workdir=workdir,
        platform=args.platform,
        reconnect_window_s=args.reconnect_window,
        copy_working_directory=args.copy_working_directory,
        probe=probe,
        tls_root_cert=tls_cert,
        tls_server_name=args.tls_server_name,
        tls_fingerprint=tls_fingerprint,
        stream_logs=not args.logs_shared,
        preload=tuple(args.preload),
    )
    return asyncio.run(_main(options))


def hold_environment(workdir: Path, environment_id: str) -> int | str:
    """Take the lock of ``environment_id`` in ``workdir`` (its open descriptor, held until the
    process ends, ``kill -9`` included); or say which agent holds it. A second agent of one
    environment in one work dir would take the first one's metric socket and trial directories
    from it before the coordinator refuses it."""
    import fcntl

    path = workdir / f".agent-{environment_id}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return (f"another agent of environment {environment_id} runs in {workdir} (pid {holder}): "
                "give each agent its own --environment-id, or stop that one first")
    except OSError as e:  # a file system without locks: nothing to hold, nothing to refuse
        log.warning("cannot lock %s (%s): a second agent of %s here would not be refused", path, e, environment_id)
        return fd
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


async def _main(options: AgentOptions) -> int:  # type: ignore[name-defined]  # noqa: F821
    from .session import AgentSession

    session = AgentSession(options)
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal() -> None:
        nonlocal signals_seen
        signals_seen += 1
        session.request_stop(drain=signals_seen == 1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return await session.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trialkeeper agent",
        description="Run trials for a trialkeeper coordinator. The first SIGTERM/SIGINT drains "
        "(running trials finish), a second one stops them: lost with the environment, they run again elsewhere.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
