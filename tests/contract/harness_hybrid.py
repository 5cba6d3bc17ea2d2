"""Contract harness for a mix of platforms (`trainingService` as a list): local agents and a
remote machine over a real sshd on 127.0.0.1, behind one service.

The contract's requests name no platform, so the service puts each new environment on the
platform holding the fewest: env-1 on local, env-2 on remote, and a sweep covers both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PLATFORMS: tuple[str, ...] = ("hybrid",)


@pytest.fixture(scope="session")
def hybrid_training_service(
    remote_training_service: Callable[[str, Path], dict[str, Any]],
) -> Callable[[str, Path], dict[str, Any]]:
    """The remote harness's machine (sshd, started once per session) beside local agents."""

    def section(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        return {
            "platform": "hybrid",
            "platforms": [{"platform": "local", "reuseMode": True}, remote_training_service("remote", tmp_path)],
        }

    return section
