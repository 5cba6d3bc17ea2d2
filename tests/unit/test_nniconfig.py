"""NNI v2 configs taken as they are: every field of NNI's schema honoured or refused by name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from nni_python import nni_python
from trialkeeper.coordinator.config.experiment import ConfigError, parse_config
from trialkeeper.coordinator.config.nni import FIELDS, canonical

REPO = Path(__file__).resolve().parents[2]

# Reads the field names of NNI's own config classes from the installed package.
SCHEMA_SCRIPT = """
import dataclasses, json
from nni.experiment.config import ExperimentConfig
from nni.experiment.config.training_service import TrainingServiceConfig
from nni.experiment.config import training_services as ts
from nni.experiment.config.shared_storage import NfsConfig, AzureBlobConfig
from nni.experiment.config.utils import camel_case
def names(cls):
    return sorted(camel_case(f.name) for f in dataclasses.fields(cls))
base = set(names(TrainingServiceConfig))
out = {"": names(ExperimentConfig), "trainingService": sorted(base),
       "machineList[]": names(ts.RemoteMachineConfig),
       "sharedStorage": sorted(set(names(NfsConfig)) | set(names(AzureBlobConfig)))}
for cls in (ts.LocalConfig, ts.RemoteConfig, ts.OpenpaiConfig, ts.AmlConfig, ts.DlcConfig, ts.KubeflowConfig,
            ts.FrameworkControllerConfig):
    out[cls.__dataclass_fields__["platform"].default] = sorted(set(names(cls)) - base)
print(json.dumps(out))
"""


def nni_schema() -> dict[str, list[str]]:
    proc = subprocess.run(
        [str(nni_python()), "-c", SCHEMA_SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_field_of_nnis_schema_has_a_status_here() -> None:
    schema = nni_schema()
    listed = {(f.scope, f.name) for f in FIELDS}
    missing = [(scope, name) for scope, names in schema.items() for name in names if (scope, name) not in listed]
    assert not missing, missing
    # And nothing listed that NNI does not have (a typo would hide a real field).
    extra = [(f.scope, f.name) for f in FIELDS if f.name not in schema.get(f.scope, [])]
    assert not extra, extra


def test_the_manual_table_lists_every_field() -> None:
    section = (REPO / "docs" / "nni.md").read_text()
    for f in FIELDS:
        scope = f"{f.scope}." if f.scope else ""
        assert f"| `{scope}{f.name}` | {f.status.value} |" in section, (f.scope, f.name)


def _parse(data: dict[str, Any], tmp_path: Path) -> Any:
    return parse_config(data, tmp_path)


def _errors(data: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, tmp_path)
    return {issue.path: issue.message for issue in info.value.issues}


NNI_LOCAL = {
    "experimentName": "mnist",
    "experimentType": "hpo",
    "searchSpace": {"lr": {"_type": "loguniform", "_value": [0.0001, 0.1]}},
    "trialCommand": "python3 mnist.py",
    "trialCodeDirectory": ".",
    "trialGpuNumber": 0,
    "trialConcurrency": 2,
    "maxExperimentDuration": "1h",
    "maxTrialDuration": "1.5m",
    "maxTrialNumber": 10,
    "useAnnotation": False,
    "debug": False,
    "logLevel": "info",
    "experimentWorkingDirectory": "~/nni-experiments",
    "tuner": {"name": "random"},
    "trainingService": {
        "platform": "local",
        "useActiveGpu": False,
        "maxTrialNumberPerGpu": 1,
        "gpuIndices": "0,1",
        "reuseMode": False,
    },
}


def test_an_nni_local_config_as_nni_documents_it(tmp_path: Path) -> None:
    config = _parse(NNI_LOCAL, tmp_path)
    assert (config.max_experiment_duration, config.max_trial_duration) == (3600.0, 90.0)
    assert config.training_service.gpu_indices == [0, 1] and config.training_service.reuse_mode is False
    assert config.log_level == "info"


@pytest.mark.parametrize("spelling", ["trial_concurrency", "TrialConcurrency", "TRIAL_CONCURRENCY", "trialconcurrency"])
def test_keys_in_any_case_with_or_without_underscores(tmp_path: Path, spelling: str) -> None:
    data = {k: v for k, v in NNI_LOCAL.items() if k != "trialConcurrency"} | {spelling: 3}
    data["trainingService"] = {"PLATFORM": "local", "use_active_gpu": True, "GpuIndices": 1}
    config = _parse(data, tmp_path)
    assert config.trial_concurrency == 3
    assert config.training_service.use_active_gpu is True and config.training_service.gpu_indices == [1]


def test_gpu_indices_as_list_int_and_string(tmp_path: Path) -> None:
    for given, expected in (([0, 2], [0, 2]), (3, [3]), ("0,1", [0, 1])):
        data = NNI_LOCAL | {"trainingService": {"platform": "local", "gpuIndices": given}}
        assert _parse(data, tmp_path).training_service.gpu_indices == expected


def test_trial_settings_in_the_training_service_are_the_experiments(tmp_path: Path) -> None:
    data = {k: v for k, v in NNI_LOCAL.items() if k not in ("trialCommand", "trialGpuNumber")}
    data["trainingService"] = {
        "platform": "local",
        "trialCommand": "python3 other.py",
        "trialGpuNumber": 0,
        "nniManagerIp": "127.0.0.1",
    }
    config = _parse(data, tmp_path)
    assert config.trial_command == "python3 other.py"
    assert config.coordinator.address == "127.0.0.1:0"


# NNI's hybrid mode as NNI's docs write it: each service with NNI's per-service fields.
NNI_HYBRID_SERVICES = [
    {"platform": "local", "trialCommand": "python3 trial.py", "nniManagerIp": "127.0.0.1", "useActiveGpu": False,
     "maxTrialNumberPerGpu": 2, "gpuIndices": "0,1", "reuseMode": True, "trialGpuNumber": 0},
    {"Platform": "remote", "trial_command": "python3 trial.py", "nniManagerIp": "127.0.0.1", "reuseMode": False,
     "machineList": [{"host": "h", "user": "u", "password": "p", "pythonPath": "/opt/venv/bin", "gpuIndices": 1}]},
]


def test_an_nni_hybrid_config_with_per_service_fields(tmp_path: Path) -> None:
    data = {k: v for k, v in NNI_LOCAL.items() if k not in ("trialCommand", "trialGpuNumber")}
    config = _parse(data | {"trainingService": NNI_HYBRID_SERVICES}, tmp_path)
    assert config.trial_command == "python3 trial.py" and config.trial_gpu_number == 0
    assert config.coordinator.address == "127.0.0.1:0"
    local, remote = config.training_service.platforms
    assert (local.gpu_indices, local.max_trial_number_per_gpu, local.reuse_mode) == ([0, 1], 2, True)
    assert remote.reuse_mode is False and remote.coordinator_address == "127.0.0.1"
    assert remote.machine_list[0].gpu_indices == [1] and remote.machine_list[0].python_path == "/opt/venv/bin"
    # This project's own form of a mix takes NNI's per-service fields the same way.
    mine = _parse(data | {"trainingService": {"platform": "hybrid", "platforms": NNI_HYBRID_SERVICES}}, tmp_path)
    assert mine.training_service == config.training_service and mine.trial_command == "python3 trial.py"


def test_services_of_a_hybrid_config_that_differ_in_trial_settings_are_refused(tmp_path: Path) -> None:
    first, second = NNI_HYBRID_SERVICES
    data = NNI_LOCAL | {
        "trainingService": [
            first | {"trialCommand": "python3 a.py"},
            {k: v for k, v in second.items() if k != "trial_command"},
        ]
    }
    errors = _errors(data, tmp_path)
    # The remote service would run the top level's command, the local one its own.
    assert "every platform runs the experiment's one trialCommand" in errors["trialCommand"], errors
    assert "trainingService[0].trialCommand" in errors["trialCommand"]
    gpus = _errors(NNI_LOCAL | {"trainingService": [first, second | {"trialGpuNumber": 1}]}, tmp_path)
    assert "trialGpuNumber" in gpus["trainingService[1].trialGpuNumber"], gpus
    refused = _errors(
        NNI_LOCAL | {"trainingService": [first, {"platform": "openpai", "openpaiConfigFile": "x.yml"}]}, tmp_path
    )
    assert "NNI's openpaiConfigFile is not supported" in refused["trainingService[1].openpaiConfigFile"], refused


def test_shared_storage_with_a_platform_that_would_not_mount_it_is_refused(tmp_path: Path) -> None:
    shared = {"storageType": "NFS", "localMountPoint": str(tmp_path), "remoteMountPoint": "/mnt/r",
              "localMounted": "usermount", "nfsServer": "10.0.0.5", "exportedDirectory": "/exports/tk"}
    for service in ({"platform": "local"}, NNI_HYBRID_SERVICES):
        errors = _errors(NNI_LOCAL | {"trainingService": service, "sharedStorage": shared}, tmp_path)
        assert (
            "do not mount it here" in errors["sharedStorage"] and "remove sharedStorage" in errors["sharedStorage"]
        ), errors


def test_nni_manager_ip_is_where_agents_dial(tmp_path: Path) -> None:
    data = NNI_LOCAL | {
        "nniManagerIp": "127.0.0.1",
        "trainingService": {
            "platform": "remote",
            "machineList": [{"host": "h", "user": "u", "password": "p", "pythonPath": "/opt/venv/bin"}],
        },
    }
    config = _parse(data, tmp_path)
    assert config.coordinator.address == "127.0.0.1:0"
    assert config.training_service.coordinator_address == "127.0.0.1"
    assert config.training_service.machine_list[0].python_path == "/opt/venv/bin"
    both = _errors(data | {"coordinator": {"address": "0.0.0.0:5000"}}, tmp_path)
    assert "not both" in both["nniManagerIp"]


def test_debug_means_log_level_debug(tmp_path: Path) -> None:
    data = {k: v for k, v in NNI_LOCAL.items() if k != "logLevel"} | {"debug": True}
    assert _parse(data, tmp_path).log_level == "debug"
    assert "one of fatal" in _errors(NNI_LOCAL | {"logLevel": "loud"}, tmp_path)["logLevel"]


@pytest.mark.parametrize(
    "change,where,words",
    [
        ({"experimentType": "nas"}, "experimentType", "nni.nas"),
        ({"useAnnotation": True}, "useAnnotation", "nni.get_next_parameter()"),
        ({"tunerGpuIndices": [0]}, "tunerGpuIndices", "CUDA_VISIBLE_DEVICES"),
        ({"tuner_gpu_indices": "0"}, "tuner_gpu_indices", "CUDA_VISIBLE_DEVICES"),
        (
            {
                "trainingService": {
                    "platform": "openpai",
                    "host": "h",
                    "username": "u",
                    "token": "t",
                    "openpaiConfigFile": "x.yml",
                }
            },
            "trainingService.openpaiConfigFile",
            "trialCpuNumber",
        ),
        (
            {"trainingService": {"platform": "kubeflow", "image": "i", "ps": {"replicas": 1}}},
            "trainingService.ps",
            "one pod",
        ),
        (
            {"trainingService": {"platform": "kubeflow", "worker": {"replicas": 2}}},
            "trainingService.worker.replicas",
            "one pod",
        ),
        (
            {
                "trainingService": {
                    "platform": "frameworkcontroller",
                    "image": "i",
                    "storage": {"storageType": "azureStorage"},
                }
            },
            "trainingService.storage",
            "persistentVolumeClaim",
        ),
    ],
)
def test_nni_fields_without_a_counterpart_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], where: str, words: str
) -> None:
    errors = _errors(NNI_LOCAL | change, tmp_path)
    assert where in errors and words in errors[where], errors


def test_nnis_kubeflow_and_frameworkcontroller_roles_are_the_pod(tmp_path: Path) -> None:
    role = {
        "command": "python3 mnist.py",
        "gpuNumber": 1,
        "cpuNumber": 2,
        "memorySize": 8192,
        "dockerImage": "msranni/nni:latest",
    }
    base = {k: v for k, v in NNI_LOCAL.items() if k not in ("trialCommand", "trialGpuNumber")}
    storage = {"storageType": "nfs", "server": "10.0.0.1", "path": "/exports/nni"}
    kubeflow = _parse(
        base
        | {
            "trainingService": {
                "platform": "kubeflow",
                "operator": "tf-operator",
                "apiVersion": "v1",
                "storage": storage,
                "worker": role | {"replicas": 1, "codeDirectory": "."},
            }
        },
        tmp_path,
    )
    fc = _parse(
        base
        | {
            "trainingService": {
                "platform": "frameworkcontroller",
                "storage": storage,
                "taskRoles": [
                    role
                    | {
                        "name": "worker",
                        "taskNumber": 1,
                        "frameworkAttemptCompletionPolicy": {"minFailedTaskCount": 1, "minSucceedTaskCount": 1},
                    }
                ],
            }
        },
        tmp_path,
    )
    for config in (kubeflow, fc):
        ts = config.training_service
        assert config.trial_command == "python3 mnist.py"
        assert (ts.image, ts.gpu_number, ts.cpu_number, ts.memory_size) == ("msranni/nni:latest", 1, 2.0, 8192 * 2**20)
        assert (ts.nfs.server, ts.nfs.path) == ("10.0.0.1", "/exports/nni")
    assert kubeflow.training_service.operator == "tfjob" and fc.training_service.task_role_name == "worker"
    twice = _errors(
        NNI_LOCAL | {"trainingService": {"platform": "kubeflow", "worker": role | {"command": "python3 b.py"}}},
        tmp_path,
    )
    assert "give it once" in twice["trainingService.worker.command"]


def test_openpai_memory_sizes_keep_nnis_meaning(tmp_path: Path) -> None:
    service = {
        "platform": "openpai",
        "host": "https://pai",
        "username": "u",
        "token": "t",
        "trialCpuNumber": 1,
        "storageConfigName": "s",
        "dockerImage": "img",
        "localStorageMountPoint": str(tmp_path),
        "containerStorageMountPoint": "/mnt",
    }
    for given, expected in ((1024, 1024 * 2**20), ("2gb", 2 * 2**30), ("512MB", 512 * 2**20)):
        data = NNI_LOCAL | {"trainingService": service | {"trialMemorySize": given}}
        assert _parse(data, tmp_path).training_service.trial_memory_size == expected


def test_a_trialkeeper_config_comes_through_unchanged(tmp_path: Path) -> None:
    data = {"trial_command": "python3 t.py", "trial_concurrency": 1, "training_service": {"platform": "local"}}
    config = _parse(data, tmp_path)
    assert config.log_level is None and config.coordinator.address == "127.0.0.1:0"
    assert canonical("maxTrialNumber_Per_GPU") == "maxtrialnumberpergpu"
