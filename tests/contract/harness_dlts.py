"""Contract harness for `platform: dlts`, against the fake dashboard of tests/fake_dlts.py.

One fake serves the whole session; it runs each job's command as local processes with this
interpreter first on PATH, so the agents are real and dial the test's endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_dlts import running, section

PLATFORMS: tuple[str, ...] = ("dlts",)


@pytest.fixture(scope="session")
def dlts_training_service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Starts the fake DLTS dashboard once per session; every job it runs is killed at the end."""
    with running(tmp_path_factory.mktemp("contract-dlts")) as fake:

        def make(platform: str, tmp_path: Path) -> dict[str, Any]:
            assert platform in PLATFORMS, platform
            return {"reuseMode": True, **section(fake)}

        yield make
