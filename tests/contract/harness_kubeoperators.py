"""Contract harness for the Kubernetes operator platforms on the real cluster of tests/kube:
Kubeflow (a PyTorchJob, run by Kubeflow's training operator) and AdaptDL (an AdaptDLJob, run
by AdaptDL's scheduler), both real and started for the session (tests/kube/operators.py);
the stand-in kubelet runs the pods they create as local processes, so the agents are real
and dial the test's endpoint. FrameworkController has its own harness, on the fake."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kube.cluster import KubeCluster, section

PLATFORMS: tuple[str, ...] = ("kubeflow", "adl")
MARKS = (pytest.mark.kube,)


@pytest.fixture(scope="session")
def kubeoperators_training_service(
    kube_cluster: KubeCluster, kubeflow_operator: Any, adaptdl_scheduler: Any,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    def make(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        # AdaptDL's allocator places a preemptible job when it is created, a fixed-size one
        # only in its optimisation pass, once a minute: longer than an agent may take here.
        extra = {"adaptive": True} if platform == "adl" else {}
        return {"reuseMode": True, **section(kube_cluster, platform, tmp_path, **extra)}

    yield make
