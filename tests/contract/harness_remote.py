"""Contract harness for `platform: remote`: one real OpenSSH server on 127.0.0.1 as the machine.

The server (see tests/sshd.py) is started once per session with a home of its own; agents
started over SSH run there with this interpreter, which has trialkeeper installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd import SshdUnavailable, make_credentials, start_machine

PLATFORMS: tuple[str, ...] = ("remote",)


@pytest.fixture(scope="session")
def remote_training_service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Brings up sshd once per session; gives a section with that one machine, key login."""
    base = tmp_path_factory.mktemp("contract-sshd")
    try:
        creds = make_credentials(base / "credentials")
        machine = start_machine("m1", base, creds)
    except SshdUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"the remote contract tests need sshd and could not start it: {e}")
        pytest.skip(f"sshd cannot run here: {e}")
    known_hosts = base / "known_hosts"
    known_hosts.write_text(machine.known_hosts_line + "\n")

    def section(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        entry: dict[str, Any] = {"host": machine.host, "port": machine.port, "user": creds.user, "pythonPath": sys.executable}
        # A password login is much cheaper than decrypting the passphrase-protected key,
        # and every fresh service (each sweep) logs in anew.
        if creds.password:
            entry["password"] = creds.password
        else:
            entry.update(sshKeyFile=str(creds.key_file), sshPassphrase=creds.passphrase)
        return {"platform": "remote", "reuseMode": True, "knownHostsFile": str(known_hosts), "machineList": [entry]}

    try:
        yield section
    finally:
        machine.stop()
