"""Contract harness for FrameworkController, against the fake API server of tests/fake_k8s.py.

CI cannot build FrameworkController: no registry serves its source (the Go module proxy
answers 403 for its module), so the fake plays its part, running
each pod's container command as a local process with this interpreter first on PATH.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_k8s import running, section

PLATFORMS: tuple[str, ...] = ("frameworkcontroller",)


@pytest.fixture(scope="session")
def frameworkcontroller_training_service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Starts the fake API server once per session; every pod it runs is killed at the end."""
    if importlib.util.find_spec("kubernetes") is None:
        pytest.skip("the kubernetes client is not installed (pip install 'trialkeeper[k8s]')")
    with running(tmp_path_factory.mktemp("contract-frameworkcontroller")) as fake:

        def make(platform: str, tmp_path: Path) -> dict[str, Any]:
            assert platform in PLATFORMS, platform
            return {"reuseMode": True, **section(fake, platform, tmp_path)}

        yield make
