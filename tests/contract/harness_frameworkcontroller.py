"""Contract harness for FrameworkController.

CI cannot build FrameworkController: no registry serves its source (the Go module proxy
answers 403 for its module), so there the fake API server of tests/fake_k8s.py plays its part,
running each pod's container command as a local process with this interpreter first on PATH.
Where a binary of it is given (TRIALKEEPER_FRAMEWORKCONTROLLER, tests/kube/operators.py), the
suite runs on the real cluster of tests/kube with the real controller instead.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_k8s import running
from fake_k8s import section as fake_section
from kube.operators import FRAMEWORKCONTROLLER_ENV

PLATFORMS: tuple[str, ...] = ("frameworkcontroller",)
REAL = bool(os.environ.get(FRAMEWORKCONTROLLER_ENV))
MARKS = (pytest.mark.kube,) if REAL else ()


@pytest.fixture(scope="session")
def frameworkcontroller_training_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """The real cluster and controller where given; else the fake API server, started once per
    session, every pod it runs killed at the end."""
    if importlib.util.find_spec("kubernetes") is None:
        pytest.skip("the kubernetes client is not installed (pip install 'trialkeeper[k8s]')")
    if REAL:
        from kube.cluster import section

        cluster = request.getfixturevalue("kube_cluster")
        request.getfixturevalue("framework_controller")

        def on_cluster(platform: str, tmp_path: Path) -> dict[str, Any]:
            assert platform in PLATFORMS, platform
            return {"reuseMode": True, **section(cluster, platform, tmp_path)}

        yield on_cluster
        return
    with running(tmp_path_factory.mktemp("contract-frameworkcontroller")) as fake:

        def make(platform: str, tmp_path: Path) -> dict[str, Any]:
            assert platform in PLATFORMS, platform
            return {"reuseMode": True, **fake_section(fake, platform, tmp_path)}

        yield make
