"""Contract harness for plain Kubernetes pods: a real API server and controller manager, with
the stand-in kubelet of tests/kube running each pod's container command as a local process,
this interpreter first on PATH, so the agents are real and dial the test's endpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kube.cluster import KubeCluster, section

PLATFORMS: tuple[str, ...] = ("kubernetes",)
MARKS = (pytest.mark.kube,)


@pytest.fixture(scope="session")
def kubernetes_training_service(kube_cluster: KubeCluster) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    def make(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        return {"reuseMode": True, **section(kube_cluster, platform, tmp_path)}

    yield make
