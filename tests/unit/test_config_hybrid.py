"""`trainingService` as a list of platform sections (NNI's hybrid mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trialkeeper.coordinator.config.experiment import ConfigError, config_to_dict, parse_config
from trialkeeper.coordinator.services.hybrid_config import HybridConfig
from trialkeeper.coordinator.services.local_config import LocalConfig
from trialkeeper.coordinator.services.slurm_config import SlurmConfig


def _parse(tmp_path: Path, training_service: Any, **top: Any) -> Any:
    return parse_config(
        {"trialCommand": "python trial.py", "trialConcurrency": 2, "trainingService": training_service, **top}, tmp_path
    )


def _issues(tmp_path: Path, training_service: Any, **top: Any) -> list[str]:
    with pytest.raises(ConfigError) as e:
        _parse(tmp_path, training_service, **top)
    return [str(i) for i in e.value.issues]


def test_a_list_is_read_as_hybrid_with_each_section_its_own(tmp_path: Path) -> None:
    cfg = _parse(tmp_path, [
        {"platform": "local", "environmentCount": 2, "gpuIndices": [0]},
        {"platform": "slurm", "reuseMode": False, "partition": "gpu"},
    ])
    ts = cfg.training_service
    assert isinstance(ts, HybridConfig) and ts.platform == "hybrid"
    local, slurm = ts.sections()
    assert isinstance(local, LocalConfig) and local.environment_count == 2 and local.gpu_indices == [0]
    assert isinstance(slurm, SlurmConfig) and slurm.reuse_mode is False and slurm.partition == "gpu"
    # No preference given: the order of the list.
    assert ts.preferred_platforms() == ("local", "slurm")


def test_snake_case_and_the_mapping_form_with_a_preference(tmp_path: Path) -> None:
    cfg = parse_config({
        "trial_command": "python trial.py", "trial_concurrency": 1,
        "training_service": {
            "platform": "hybrid", "trial_platforms": ["slurm", "local"],
            "platforms": [{"platform": "local"}, {"platform": "slurm"}],
        },
    }, tmp_path)
    assert cfg.training_service.preferred_platforms() == ("slurm", "local")


def test_a_single_platform_is_its_own_only_section(tmp_path: Path) -> None:
    ts = _parse(tmp_path, {"platform": "local"}).training_service
    assert ts.sections() == (ts,) and ts.preferred_platforms() == ("local",)


def test_the_stored_form_parses_back_to_the_same_config(tmp_path: Path) -> None:
    cfg = _parse(tmp_path, [{"platform": "local"}, {"platform": "slurm", "environmentCount": 3}])
    again = parse_config(config_to_dict(cfg), tmp_path)
    assert again.training_service == cfg.training_service


@pytest.mark.parametrize(
    ("training_service", "expected"),
    [
        (
            [{"platform": "local", "environmentCount": -1}],
            "trainingService[0].environmentCount: expected a non-negative integer",
        ),
        ([{"platform": "local"}, {"platform": "nope"}], "trainingService[1].platform: unknown platform 'nope'"),
        ([{"platform": "local"}, {"platform": "slurm", "bogus": 1}], "trainingService[1].bogus"),
        ([], "trainingService: expected at least one platform section"),
        ([{"platform": "local"}, {"platform": "local"}], "trainingService[1].platform: 'local' is already section 0"),
        (
            [{"platform": "hybrid", "platforms": [{"platform": "local"}]}],
            "trainingService[0].platform: a hybrid section cannot",
        ),
        (
            {"platform": "hybrid", "platforms": [{"platform": "local"}], "trialPlatforms": ["slurm"]},
            "trainingService.trialPlatforms[0]: 'slurm' has no section here; one of: local",
        ),
        (
            {"platform": "hybrid", "platforms": [{"platform": "local"}], "trialPlatforms": ["local", "local"]},
            "trainingService.trialPlatforms[1]: 'local' is listed twice",
        ),
    ],
)
def test_bad_sections_are_named_where_the_user_wrote_them(tmp_path: Path, training_service: Any, expected: str) -> None:
    issues = _issues(tmp_path, training_service)
    assert any(i.startswith(expected) for i in issues), issues


def test_nni_manager_ip_is_where_the_coordinator_listens(tmp_path: Path) -> None:
    # NNI 3.0 needs nniManagerIp with a list of platforms (it cannot guess one for a mix).
    hybrid = [{"platform": "local"}, {"platform": "slurm"}]
    cfg = _parse(tmp_path, hybrid, nniManagerIp="10.0.0.5")
    assert cfg.coordinator.address == "10.0.0.5:0"
    assert _parse(tmp_path, hybrid, nni_manager_ip="fd00::5").coordinator.address == "[fd00::5]:0"
    (both,) = _issues(tmp_path, hybrid, nniManagerIp="10.0.0.5", coordinator={"address": "0.0.0.0:7000"})
    assert both.startswith("nniManagerIp: give nniManagerIp or coordinator.address"), both
    assert parse_config(config_to_dict(cfg), tmp_path).coordinator == cfg.coordinator
    for bad in ("10.0.0.5:80", "two words", ""):
        (issue,) = _issues(tmp_path, hybrid, nniManagerIp=bad)
        assert issue.startswith("nniManagerIp: expected a host name or IP address") and repr(bad) in issue, issue
