"""``trialkeeper clean``: what a stopped experiment left behind removed, its environments on
its platforms (each platform's sweep) and the checkpoint directories no longer needed, while
no coordinator of it answers and with the experiment's directory locked."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from ..read.model import ReadModel
from ..store.index import no_experiment, resolve_experiment
from ..store.lock import DirectoryInUse, ExperimentLock

__all__ = ["cmd_clean"]

PROBE_TIMEOUT_S = 5.0
SWEEP_TIMEOUT_S = 300.0


def cmd_clean(args: argparse.Namespace) -> int:
    from ..config.experiment import (
        ConfigError,
        load_config,
        parse_config,
    )
    from ..services import create_service
    from ..store.checkpointfiles import prune_experiment

    exp_dir = resolve_experiment(args.target)
    if exp_dir is None:
        print(f"trialkeeper: {no_experiment(args.target)}", file=sys.stderr)
        return 1
    with ReadModel.open(exp_dir) as model:
        exp = model.experiment()
        stored_config = model.stored_config()
        bound = model.bound_address()
    if exp is None:
        print(f"trialkeeper: {exp_dir} holds no experiment", file=sys.stderr)
        return 1
    if args.config is None and stored_config is None:
        print(
            f"trialkeeper: the experiment's stored config is unreadable ({'; '.join(exp.unreadable)}); "
            "pass it with --config",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(args.config) if args.config else parse_config(dict(stored_config or {}), exp_dir)
    except ConfigError as e:
        print(f"trialkeeper: the experiment's config cannot be used ({e}); pass it with --config", file=sys.stderr)
        return 2
    alive = _coordinator_alive(bound, exp_dir) if bound else ""
    if alive:
        print(
            f"trialkeeper: refusing to clean experiment {exp.id}: {alive}; stop it first (its environments "
            "are its to stop), or clean after it has exited",
            file=sys.stderr,
        )
        return 1

    async def sweep() -> list[str]:
        service = create_service(config, exp_dir)
        try:
            return await asyncio.wait_for(service.sweep(exp.id, keep=()), SWEEP_TIMEOUT_S)
        finally:
            await service.close()

    try:
        # Held while cleaning: a coordinator resumed meanwhile would lose what it adopts.
        with ExperimentLock.acquire(exp_dir):
            removed = asyncio.run(sweep())
            pruned, freed = prune_experiment(exp_dir)
    except DirectoryInUse as e:
        print(f"trialkeeper: refusing to clean experiment {exp.id}: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, asyncio.TimeoutError) as e:
        print(f"trialkeeper: cannot clean experiment {exp.id}: {e}", file=sys.stderr)
        return 1
    platform = ", ".join(s.platform for s in config.training_service.sections())
    if removed:
        print(f"experiment {exp.id}: removed {len(removed)} environment(s) from {platform}: {', '.join(removed)}")
    else:
        print(f"experiment {exp.id}: nothing left to remove on {platform}")
    if pruned:
        print(f"experiment {exp.id}: removed {pruned} checkpoint director(ies) no longer needed ({freed} bytes)")
    return 0


def _coordinator_alive(bound_address: str, exp_dir: Path) -> str:
    """Why a coordinator of this experiment seems alive, or "" when none answers.

    The probe presents the experiment's token with a Register of a protocol no coordinator
    speaks: this experiment's coordinator refuses it as a version mismatch (so it is alive,
    and it joins no environment), another one as a wrong token. A listener that is no
    plain gRPC coordinator (one serving TLS) counts as alive: cleaning under a live
    coordinator would be worse than not cleaning."""
    import socket

    from ..transport.server import probe_coordinator

    host, _, port = bound_address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]"):
        host = "127.0.0.1"
    address = f"{host}:{port}"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except (OSError, ValueError):
        return ""
    try:
        token = (exp_dir / ".token").read_text().strip()
    except OSError:
        token = ""
    answer = probe_coordinator(address, token, PROBE_TIMEOUT_S)
    if answer == "other":
        return ""  # another experiment's coordinator took the port
    if answer == "ours":
        return f"its coordinator answers on {address}"
    return f"something listens on {address}, where its coordinator did"
