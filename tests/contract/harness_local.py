"""Contract harness for `platform: local`: agents are processes on this machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PLATFORMS: tuple[str, ...] = ("local",)


@pytest.fixture
def local_training_service() -> Callable[[str, Path], dict[str, Any]]:
    """Nothing to bring up: the section is all the platform needs."""

    def section(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        return {"platform": "local", "reuseMode": True}

    return section
