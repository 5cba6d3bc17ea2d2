"""NNI's v1 config files run as nnictl 3.0 runs them: converted to v2, said once on stderr,
and printed in the v2 form by `trialkeeper run CONFIG --print-config`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from nni_python import nni_python
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.experiment import ConfigError, load_config, parse_config
from trialkeeper.coordinator.config.nniv1 import to_v2

# NNI's mnist example in its v1 form, as NNI 1.x and 2.x documented it.
MNIST_V1 = """\
authorName: default
experimentName: example_mnist
trialConcurrency: 2
maxExecDuration: 1h
maxTrialNum: 10
trainingServicePlatform: local
searchSpacePath: search_space.json
useAnnotation: false
tuner:
  builtinTunerName: TPE
  classArgs:
    optimize_mode: maximize
assessor:
  builtinAssessorName: Medianstop
  classArgs:
    optimize_mode: maximize
trial:
  command: python3 mnist.py
  codeDir: .
  gpuNum: 0
localConfig:
  useActiveGpu: false
  maxTrialNumPerGpu: 1
  gpuIndices: "0,1"
"""
SPACE = {"lr": {"_type": "choice", "_value": [0.0001, 0.001, 0.01]}}


@pytest.fixture
def v1_file(tmp_path: Path) -> Path:
    (tmp_path / "search_space.json").write_text(json.dumps(SPACE))
    (tmp_path / "config.yml").write_text(MNIST_V1)
    return tmp_path / "config.yml"


def test_a_v1_file_is_converted_and_said_to_be(v1_file: Path) -> None:
    notes: list[str] = []
    config = load_config(v1_file, notes=notes)
    assert config.experiment_name == "example_mnist" and config.trial_concurrency == 2
    assert (config.max_experiment_duration, config.max_trial_number) == (3600.0, 10)
    assert config.search_space == SPACE and config.trial_command == "python3 mnist.py"
    assert config.trial_code_directory == v1_file.parent and config.trial_gpu_number == 0
    assert (config.tuner.name, config.tuner.class_args) == ("TPE", {"optimize_mode": "maximize"})
    assert config.assessor is not None and config.assessor.name == "Medianstop"
    ts = config.training_service
    assert (ts.platform, ts.gpu_indices, ts.max_trial_number_per_gpu) == ("local", [0, 1], 1)
    assert (
        len(notes) == 1
        and "v1" in notes[0]
        and "authorName" in notes[0]
        and str(v1_file) in notes[0]
    )


def test_print_config_prints_the_v2_equivalent(
    v1_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", str(v1_file), "--print-config"]) == 0
    out = capsys.readouterr()
    v2 = yaml.safe_load(out.out)
    assert v2["trainingService"] == {
        "platform": "local",
        "useActiveGpu": False,
        "maxTrialNumberPerGpu": 1,
        "gpuIndices": "0,1",
    }
    assert v2["tuner"] == {"name": "TPE", "classArgs": {"optimize_mode": "maximize"}}
    assert (v2["trialCommand"], v2["searchSpaceFile"], v2["maxExperimentDuration"]) == (
        "python3 mnist.py",
        "search_space.json",
        "1h",
    )
    assert "authorName" not in v2 and "trial" not in v2
    # NNI's TPE and Medianstop are made to be checked; where NNI is not installed, that is
    # said as a note (the config may be run where it is), and the exit status stays 0.
    if importlib.util.find_spec("nni") is None:
        notes = out.err.splitlines()
        assert [n.split(": ")[:3] for n in notes] == [["trialkeeper", "note", "tuner not checked here"],
                                                      ["trialkeeper", "note", "assessor not checked here"]], notes
        assert all("NNI is not installed" in n for n in notes), notes
    else:
        assert out.err == ""
    # The printed form is itself a config that runs the same experiment.
    (v1_file.parent / "v2.yml").write_text(out.out)
    assert load_config(v1_file.parent / "v2.yml") == load_config(v1_file)


def test_run_says_once_that_it_converted_even_when_the_file_is_invalid(
    v1_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1_file.write_text(
        MNIST_V1.replace("  maxTrialNumPerGpu: 1", "  maxTrialNumPerGpu: 1\n  bogus: 3")
    )
    assert cli.main(["run", str(v1_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("NNI's v1 config format, converted to v2") == 1, err
    assert "localConfig.bogus: not a field of NNI's v1 config format" in err


@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        ({"trainingServicePlatform": "adl"}, "trainingServicePlatform", "has no v2 form"),
        ({"multiPhase": True}, "multiPhase", "multi-phase"),
        ({"tuner": {"className": "MyTuner"}}, "tuner", "classFileName"),
        ({"useAnnotation": True}, "useAnnotation", "nni.get_next_parameter()"),
    ],
)
def test_what_cannot_be_converted_is_named(
    tmp_path: Path, change: dict[str, Any], where: str, words: str
) -> None:
    data = yaml.safe_load(MNIST_V1) | {"searchSpacePath": None} | change
    with pytest.raises(ConfigError) as info:
        parse_config(data, tmp_path)
    found = {i.path: i.message for i in info.value.issues}
    assert where in found and words in found[where], found


def test_v1_keys_without_a_platform_say_it_is_v1(tmp_path: Path) -> None:
    data = yaml.safe_load(MNIST_V1)
    del data["trainingServicePlatform"]
    with pytest.raises(ConfigError) as info:
        parse_config(data, tmp_path)
    assert any(
        "NNI's v1 config format" in i.message and "trainingServicePlatform" in i.message
        for i in info.value.issues
    )


SAMPLES: dict[str, dict[str, Any]] = {
    "remote": {
        "authorName": "a",
        "trialConcurrency": 2,
        "maxExecDuration": "2h",
        "maxTrialNum": 4,
        "trainingServicePlatform": "remote",
        "searchSpacePath": "s.json",
        "tuner": {
            "codeDir": "tuners",
            "classFileName": "mytuner.py",
            "className": "MyTuner",
            "classArgs": {"a": 1},
        },
        "trial": {"command": "python3 t.py", "codeDir": ".", "gpuNum": 1},
        "remoteConfig": {"reuse": True},
        "machineList": [
            {
                "ip": "10.0.0.1",
                "port": 22,
                "username": "bob",
                "passwd": "pw",
                "gpuIndices": "0,1",
                "maxTrialNumPerGpu": 2,
                "useActiveGpu": True,
                "pythonPath": "/opt/py/bin",
            },
            {"ip": "10.0.0.2", "username": "bob", "sshKeyPath": "~/.ssh/id_rsa"},
        ],
    },
    "pai": {
        "trialConcurrency": 1,
        "trainingServicePlatform": "pai",
        "nniManagerIp": "10.1.1.1",
        "trial": {
            "command": "python3 t.py",
            "codeDir": ".",
            "gpuNum": 0,
            "cpuNum": 1,
            "memoryMB": 8196,
            "image": "msranni/nni",
            "virtualCluster": "default",
            "nniManagerNFSMountPath": "/mnt",
            "containerNFSMountPath": "/c",
            "paiStorageConfigName": "confignfs",
        },
        "paiConfig": {"userName": "u", "token": "t", "host": "https://pai", "reuse": True},
    },
    "aml": {
        "trialConcurrency": 1,
        "trainingServicePlatform": "aml",
        "logLevel": "debug",
        "debug": True,
        "trial": {"command": "python3 t.py", "codeDir": ".", "image": "msranni/nni"},
        "amlConfig": {
            "subscriptionId": "s",
            "resourceGroup": "g",
            "workspaceName": "w",
            "computeTarget": "c",
            "maxTrialNumPerGpu": 1,
        },
    },
    "kubeflow": {
        "trialConcurrency": 1,
        "trainingServicePlatform": "kubeflow",
        "advisor": {"builtinAdvisorName": "Hyperband", "classArgs": {"R": 9}},
        "trial": {
            "codeDir": ".",
            "worker": {
                "replicas": 1,
                "command": "python3 t.py",
                "gpuNum": 0,
                "cpuNum": 1,
                "memoryMB": 8192,
                "image": "msranni/nni",
            },
        },
        "kubeflowConfig": {
            "operator": "tf-operator",
            "apiVersion": "v1",
            "storage": "nfs",
            "nfs": {"server": "10.0.0.5", "path": "/exports"},
        },
    },
    "local": {
        "authorName": "a",
        "description": "d",
        "trialConcurrency": 1,
        "trainingServicePlatform": "local",
        "multiThread": True,
        "logDir": "/tmp/exps",
        "assessor": {"builtinAssessorName": "Curvefitting", "classArgs": {"epoch_num": 20}},
        "trial": {"command": "python3 t.py", "codeDir": "."},
        "localConfig": {"gpuIndices": "0", "useActiveGpu": True, "maxTrialNumPerGpu": 2},
        "sharedStorage": {
            "storageType": "NFS",
            "localMountPoint": "/l",
            "remoteMountPoint": "/r",
            "nfsServer": "n",
            "exportedDirectory": "/e",
        },
    },
}
# NNI's own converter, run in the interpreter with nni 3.0 (its frameworkcontroller branch
# raises KeyError on every role, so that platform is compared by hand below).
NNI_CONVERT = """
import json, sys
from nni.experiment.config.convert import to_v2
samples = json.loads(sys.stdin.read())
print(json.dumps({name: to_v2(v1) for name, v1 in samples.items()}))
"""


def test_keys_move_as_nnis_own_converter_moves_them() -> None:
    proc = subprocess.run(
        [str(nni_python()), "-c", NNI_CONVERT],
        input=json.dumps(SAMPLES),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout.splitlines()[-1])
    for name, v1 in SAMPLES.items():
        converted = to_v2(v1)
        assert converted.issues == [] and converted.v2 == theirs[name], name


def test_frameworkcontroller_roles_as_nni_meant_them() -> None:
    v1 = {
        "trialConcurrency": 1,
        "trainingServicePlatform": "frameworkcontroller",
        "trial": {
            "codeDir": ".",
            "taskRoles": [
                {
                    "name": "worker",
                    "taskNum": 1,
                    "command": "python3 t.py",
                    "gpuNum": 0,
                    "cpuNum": 1,
                    "memoryMB": 8192,
                    "image": "msranni/nni",
                    "frameworkControllerCompletionPolicy": {
                        "minFailedTaskCount": 1,
                        "minSucceededTaskCount": 1,
                    },
                }
            ],
        },
        "frameworkcontrollerConfig": {
            "serviceAccountName": "fc",
            "storage": "nfs",
            "nfs": {"server": "10.0.0.5", "path": "/exports"},
        },
    }
    converted = to_v2(v1)
    assert converted.issues == []
    assert converted.v2["trainingService"] == {
        "platform": "frameworkcontroller",
        "serviceAccountName": "fc",
        "storage": {"storageType": "nfs", "server": "10.0.0.5", "path": "/exports"},
        "taskRoles": [
            {
                "name": "worker",
                "taskNumber": 1,
                "command": "python3 t.py",
                "gpuNumber": 0,
                "cpuNumber": 1,
                "memorySize": 8192,
                "dockerImage": "msranni/nni",
                "frameworkAttemptCompletionPolicy": {
                    "minFailedTaskCount": 1,
                    "minSucceedTaskCount": 1,
                },
            }
        ],
    }
