"""Contract harness for `platform: procjobs`, the plug-in of tests/procjobs.py written against
the job base (one environment is one job; the plug-in implements submit, observe, kill and
list_jobs only).

It joins as a real plug-in does: a distribution's metadata naming its registry entry
(``procjobs:PLATFORM``) under the entry-point group ``trialkeeper.environment_services`` is
put on ``sys.path`` for the session, and ``create_service`` finds the platform there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import procjobs
import pytest
from trialkeeper.coordinator.services import ENTRY_POINT_GROUP

PLATFORMS: tuple[str, ...] = (procjobs.NAME,)


@pytest.fixture(scope="session")
def jobplugin_training_service(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, Path], dict[str, Any]]]:
    """Installs the plug-in's entry point for the session; the section names a state
    directory per test, where its jobs are recorded."""
    site = tmp_path_factory.mktemp("jobplugin-site")
    info = site / "trialkeeper_procjobs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trialkeeper-procjobs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{procjobs.NAME} = procjobs:PLATFORM\n")
    sys.path.append(str(site))

    def make(platform: str, tmp_path: Path) -> dict[str, Any]:
        assert platform in PLATFORMS, platform
        return {"platform": platform, "reuseMode": True, "stateDirectory": str(tmp_path / "procjobs-state")}

    try:
        yield make
    finally:
        sys.path.remove(str(site))
