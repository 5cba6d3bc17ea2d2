"""Contract harness for `platform: remote`: one real OpenSSH server on 127.0.0.1 as the machine.

The server (see tests/sshd.py) is started once per session with a home of its own; agents
started over SSH run there with this interpreter, which has trialkeeper installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd import Credentials, Machine, one_machine

PLATFORMS: tuple[str, ...] = ("remote",)


@pytest.fixture(scope="session")
def remote_training_service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Brings up sshd once per session; gives a section with that one machine, key login."""
    with one_machine(tmp_path_factory.mktemp("contract-sshd"), "the remote contract tests") as (
        machine,
        creds,
        known_hosts,
    ):
        yield _section(machine, creds, known_hosts)


def _section(machine: Machine, creds: Credentials, known_hosts: Path) -> Callable[[str, Path], dict[str, Any]]:
    def section(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        entry: dict[str, Any] = {
            "host": machine.host,
            "port": machine.port,
            "user": creds.user,
            "pythonPath": sys.executable,
        }
        # A password login is much cheaper than decrypting the passphrase-protected key,
        # and every fresh service (each sweep) logs in anew.
        if creds.password:
            entry["password"] = creds.password
        else:
            entry.update(sshKeyFile=str(creds.key_file), sshPassphrase=creds.passphrase)
        return {"platform": "remote", "reuseMode": True, "knownHostsFile": str(known_hosts), "machineList": [entry]}

    return section
