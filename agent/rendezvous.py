"""The rendezvous of a multi-node trial, as one node's agent sees it.

A trial that spans N environments runs one process on each, with torchrun's variables:
``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0's environment, as the others reach it),
``WORLD_SIZE`` and ``NNODES`` (N), ``RANK`` and ``NODE_RANK`` (this node's, 0..N-1),
``LOCAL_RANK`` (0) and ``TRIALKEEPER_NODE_RANK``. Rank 0's agent chooses the address and a
free port, and holds the port (a bound socket no one else can take) until it starts the
trial's process, which then binds it; the coordinator hands both on to the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import socket

ENV_NODE_RANK = "TRIALKEEPER_NODE_RANK"
ENV_NODES = "TRIALKEEPER_NODES"
# Set on an agent's machine to the address other nodes reach it at, where the route to the
# coordinator does not tell it (several networks, NAT).
ENV_NODE_ADDRESS = "TRIALKEEPER_NODE_ADDRESS"


def node_address(coordinator: str) -> str:
    """The address other environments reach this one at: ``TRIALKEEPER_NODE_ADDRESS`` if
    set, else this machine's address on the route to the coordinator (``HOST:PORT``), which
    is on the network the environments share; the hostname's if there is no such route."""
    given = os.environ.get(ENV_NODE_ADDRESS, "").strip()
    if given:
        return given
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port or 1)))  # no packet is sent: only the route is looked up
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return socket.gethostname()


class HeldPort:
    """A free TCP port, held by a bound socket until :meth:`release`."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind(("", 0))
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]

    def release(self) -> None:
        """Let the trial's process bind it (just before it starts)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


def environment(*, node_rank: int, nodes: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables of one node's process (none for a single-node trial)."""
    if nodes <= 1:
        return {}
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(nodes),
        "NNODES": str(nodes),
        "RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "LOCAL_RANK": "0",
        ENV_NODE_RANK: str(node_rank),
        ENV_NODES: str(nodes),
    }
