"""Contract harness for `platform: dlc`, against the fake adapter of tests/fake_cloud_sdks.py.

The fake stands where the DLC SDK's adapter stands and runs each job's command as a local
process, so the agents are real and dial the test's endpoint. Its NAS is a directory of the
session; the access key secret lies in a 0600 file the section names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_cloud_sdks import dlc_installed, dlc_section

PLATFORMS: tuple[str, ...] = ("dlc",)


@pytest.fixture(scope="session")
def dlc_training_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Installs the fake for the session; every job it still holds is killed at the end."""
    with dlc_installed(tmp_path_factory.mktemp("contract-dlc")) as setup:

        def make(platform: str, tmp_path: Path) -> dict[str, Any]:
            assert platform in PLATFORMS, platform
            return dlc_section(setup, reuseMode=True)

        yield make
