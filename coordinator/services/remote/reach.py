"""Whether the agents on the machines can reach the coordinator, and at which address."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence

from .config import RemoteConfig
from .machine import Machine

log = logging.getLogger(__name__)


class RemoteSetupError(ValueError):
    """The experiment cannot use the remote platform as configured (raised before any upload)."""


async def check_reachable(config: RemoteConfig, machines: Sequence[Machine], bind_address: str,
                          advertise_address: str | None) -> None:
    """Refuse, before anything is sent, a coordinator that remote agents cannot reach."""
    if config.coordinator_address or advertise_address:
        return
    from ...config.rules import split_address

    host = split_address(bind_address)[0]
    if not await is_loopback(host):
        return
    remote = [m.label for m in machines if not await is_loopback(m.config.host)]
    if remote:
        raise RemoteSetupError(
            f"the coordinator listens on {bind_address}, which {', '.join(remote)} cannot "
            "reach: set coordinator.address to 0.0.0.0:0 (or an address of this machine they "
            "can reach), or set trainingService.coordinatorAddress if you forward the port "
            "yourself"
        )


class DialAddress:
    """host[:port] the agents on a machine dial; the port is filled in at launch."""

    def __init__(self, config: RemoteConfig, advertise_address: str | None) -> None:
        self.config = config
        self.advertise_address = advertise_address
        self._warned: set[str] = set()

    async def of(self, m: Machine) -> str:
        if self.config.coordinator_address:
            return self.config.coordinator_address
        if self.advertise_address:
            return self.advertise_address
        host = await m.ssh(m.conn.local_address)
        if m.label not in self._warned:
            self._warned.add(m.label)
            log.warning(
                "trainingService.coordinatorAddress is not set: agents on %s will dial %s, this "
                "machine's address on its SSH connection to them; set coordinatorAddress if they "
                "must use another", m.label, host,
            )
        return host


async def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, None), 5.0)
    except (OSError, asyncio.TimeoutError):
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos
    )


def with_port(dial: str, coordinator_address: str) -> str:
    """``dial`` with the coordinator's port when it names only a host."""
    from ...config.rules import split_address

    try:
        split_address(dial, allow_port_zero=False)
        return dial
    except ValueError:
        port = split_address(coordinator_address)[1]
        host = f"[{dial}]" if ":" in dial else dial
        return f"{host}:{port}"
