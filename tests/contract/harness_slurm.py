"""Contract harness for `platform: slurm`: a real single-node Slurm cluster (see tests/slurm.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from slurm import SlurmUnavailable, acquire_cluster, release_cluster

PLATFORMS: tuple[str, ...] = ("slurm",)


@pytest.fixture(scope="session")
def slurm_training_service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Brings up munged, slurmctld and slurmd once per session; gives the section for them."""
    try:
        cluster = acquire_cluster(lambda: tmp_path_factory.mktemp("slurm-cluster"))
    except SlurmUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"the Slurm tests need slurm-wlm and munge and could not start them: {e}")
        pytest.skip(f"Slurm cannot run here: {e}")

    def section(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        return {"platform": "slurm", "partition": cluster.partition, "pollInterval": "0.5s"}

    try:
        yield section
    finally:
        release_cluster()
