"""Contract harness for `platform: aml`, against the fake adapter of tests/fake_cloud_sdks.py.

The fake stands where azureml-core's adapter stands and runs each run's command as a local
process, so the agents are real and dial the test's endpoint. No Azure subscription is
needed, nor azureml-core itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_cloud_sdks import aml_installed, aml_section

PLATFORMS: tuple[str, ...] = ("aml",)


@pytest.fixture(scope="session")
def aml_training_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Installs the fake for the session; every run it still holds is killed at the end."""
    with aml_installed(tmp_path_factory.mktemp("contract-aml")) as _fake:

        def make(platform: str, tmp_path: Path) -> dict[str, Any]:
            assert platform in PLATFORMS, platform
            return aml_section(reuseMode=True)

        yield make
