"""The platform registry: built-in entries, plug-ins found through their entry points
(installed for real, as a distribution on the path of a fresh interpreter), and the
platform fields the core reads of every section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from trialkeeper.coordinator.config.platform import GpuSharing, TrainingServiceConfig
from trialkeeper.coordinator.platforms import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    Platform,
    PlatformLoadError,
)
from trialkeeper.coordinator.services.base import EnvironmentService
from trialkeeper.coordinator.services.local_config import LocalConfig
from trialkeeper.coordinator.services.remote.config import RemoteConfig, RemoteMachineConfig
from trialkeeper.coordinator.services.slurm_config import SlurmConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_builtin_platform_names_its_config_and_service(name: str) -> None:
    entry = BUILTIN[name]
    config = entry.config_class()
    assert config.PLATFORM == name
    service = entry.service_class()
    assert issubclass(service, EnvironmentService)
    # Built from a config by its own from_config, not the base's refusal.
    assert service.from_config.__func__ is not EnvironmentService.from_config.__func__  # type: ignore[attr-defined]


def test_a_platform_that_names_nothing_is_refused_clearly() -> None:
    with pytest.raises(PlatformLoadError, match="not of the form 'module:attr'"):
        Platform("x", "no_colon", "a:b").config_class()
    with pytest.raises(PlatformLoadError, match="has no 'Nope'"):
        Platform("x", "trialkeeper.coordinator.config.platform:Nope", "a:b").config_class()
    with pytest.raises(PlatformLoadError, match="is not an EnvironmentService"):
        Platform("local", "a:b", "trialkeeper.coordinator.services.local_config:LocalConfig").service_class()
    with pytest.raises(TypeError, match="PLATFORM is 'local', registered as 'x'"):
        Platform("x", "trialkeeper.coordinator.services.local_config:LocalConfig", "a:b").config_class()


def test_sections_without_gpu_fields_read_the_defaults() -> None:
    slurm = SlurmConfig()
    assert (slurm.gpu_indices, slurm.simulated_gpus, slurm.placement) == (None, 0, "pack")
    assert slurm.gpu_sharing() == GpuSharing(1, False)
    local = LocalConfig(gpu_indices=[1, 3], simulated_gpus=2, placement="spread",
                        max_trial_number_per_gpu=3, use_active_gpu=True)
    assert (local.gpu_indices, local.simulated_gpus, local.placement) == ([1, 3], 2, "spread")
    assert local.gpu_sharing() == GpuSharing(3, True)


def test_gpu_sharing_takes_the_environments_own_values_first() -> None:
    local = LocalConfig(max_trial_number_per_gpu=3, use_active_gpu=True)
    assert local.gpu_sharing((2, None)) == GpuSharing(2, True)
    assert local.gpu_sharing((None, False)) == GpuSharing(3, False)
    machines = [RemoteMachineConfig(host="a", user="u", max_trial_number_per_gpu=4, use_active_gpu=True),
                RemoteMachineConfig(host="b", user="u", max_trial_number_per_gpu=2)]
    remote = RemoteConfig(machine_list=machines)
    # Experiment-wide, per machine values can only narrow it.
    assert remote.gpu_sharing() == GpuSharing(2, False)
    assert remote.gpu_sharing((4, True)) == GpuSharing(4, True)


def test_every_section_answers_what_the_core_reads() -> None:
    for name in ("gpu_indices", "simulated_gpus", "max_trial_number_per_gpu", "use_active_gpu", "placement"):
        assert isinstance(getattr(TrainingServiceConfig, name), property), name


_PLUGIN = '''
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from trialkeeper.coordinator.config.rules import POSITIVE_INT
from trialkeeper.coordinator.config.platform import TrainingServiceConfig
from trialkeeper.coordinator.platforms import Platform
from trialkeeper.coordinator.services.base import EnvironmentRequest, EnvironmentService, Observation, StartResult


@dataclass(frozen=True, kw_only=True)
class AcmeConfig(TrainingServiceConfig):
    PLATFORM: ClassVar[str] = "acme"
    queue: str = "default"
    gpus_per_job: int = field(default=1, metadata=POSITIVE_INT)
    max_trial_number_per_gpu: int = field(default=1, metadata=POSITIVE_INT)


class AcmeService(EnvironmentService[AcmeConfig]):
    platform = "acme"

    def __init__(self, queue: str, experiment_dir: Path) -> None:
        self.queue, self.experiment_dir = queue, experiment_dir

    @classmethod
    def from_config(cls, config, platform: AcmeConfig, experiment_dir: Path) -> "AcmeService":
        return cls(platform.queue, experiment_dir)

    def working_directory(self) -> str:
        return "."

    async def start(self, request: EnvironmentRequest) -> StartResult:
        return StartResult(error="the test plug-in starts nothing")

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        return {env_id: Observation("unknown") for env_id in env_ids}

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        return None


PLATFORM = Platform("acme", config="acme_plugin:AcmeConfig", service="acme_plugin:AcmeService")
'''

_OLD_PLUGIN = '''
from dataclasses import dataclass
from typing import ClassVar

from trialkeeper.coordinator.config.experiment import TrainingServiceConfig, register_training_service
from acme_plugin import AcmeService


@register_training_service
@dataclass(frozen=True, kw_only=True)
class OldConfig(TrainingServiceConfig):
    PLATFORM: ClassVar[str] = "oldacme"
    queue: str = "old"


def create(config, experiment_dir):
    return AcmeService(config.training_service.queue, experiment_dir)
'''

_CHECKS = '''
import json, sys
from pathlib import Path
from trialkeeper.coordinator.config.experiment import ConfigError, TRAINING_SERVICES, parse_config
from trialkeeper.coordinator.services import create_service

base = Path(sys.argv[1])
out = {}

def parse(section):
    return parse_config({"trialCommand": "true", "trialConcurrency": 1, "trainingService": section}, base)

cfg = parse({"platform": "acme", "queue": "gpu", "gpusPerJob": 2})
out["acme_section"] = [type(cfg.training_service).__name__, cfg.training_service.queue]
out["others_loaded"] = sorted(m for m in ("oldstyle_plugin", "broken_plugin") if m in sys.modules)
service = create_service(cfg, base / "exp")
out["acme_service"] = [type(service).__name__, service.queue]
try:
    parse({"platform": "acme", "gpusPerJob": 0})
except ConfigError as e:
    out["acme_error"] = str(e)
old = parse({"platform": "oldacme"})
out["old"] = [type(old.training_service).__name__, create_service(old, base).queue]
try:
    parse({"platform": "broken"})
except ConfigError as e:
    out["broken"] = str(e)
try:
    parse({"platform": "noconfig"})
except ConfigError as e:
    out["noconfig"] = str(e)
local = parse({"platform": "local"})
out["local"] = type(local.training_service).__module__
out["names"] = list(TRAINING_SERVICES)
print(json.dumps(out))
'''


def _install(site: Path) -> None:
    """A distribution on `site` whose entry points name the platforms, as pip leaves one."""
    (site / "acme_plugin.py").write_text(textwrap.dedent(_PLUGIN))
    (site / "oldstyle_plugin.py").write_text(textwrap.dedent(_OLD_PLUGIN))
    (site / "broken_plugin.py").write_text("raise RuntimeError('this plug-in is broken')\n")
    (site / "noconfig_plugin.py").write_text("def create(config, experiment_dir):\n    raise AssertionError\n")
    info = site / "acme_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "acme = acme_plugin:PLATFORM\n"
        "oldacme = oldstyle_plugin:create\n"
        "broken = broken_plugin:PLATFORM\n"
        "noconfig = noconfig_plugin:create\n"
        "local = broken_plugin:PLATFORM\n"  # a built-in platform of the same name wins
    )


def test_plugins_register_through_entry_points(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _CHECKS, str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["acme_section"] == ["AcmeConfig", "gpu"]
    assert report["others_loaded"] == []  # naming acme imports no other plug-in
    assert report["acme_service"] == ["AcmeService", "gpu"]
    assert report["acme_error"] == "trainingService.gpusPerJob: expected a positive integer, got 0"
    assert report["old"] == ["OldConfig", "old"]
    assert report["broken"] == (
        "trainingService.platform: platform 'broken': plug-in broken_plugin:PLATFORM cannot be loaded: "
        "this plug-in is broken"
    )
    assert report["noconfig"] == (
        "trainingService.platform: platform 'noconfig': its plug-in registered no config class "
        "(point its entry point at a Platform, or register the class with register_training_service)"
    )
    assert report["local"] == "trialkeeper.coordinator.services.local_config"
    assert report["names"][: len(BUILTIN)] == list(BUILTIN)
    assert {"acme", "oldacme", "broken"} <= set(report["names"])
    assert report["names"].count("local") == 1
