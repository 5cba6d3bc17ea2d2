"""Which GPUs a Slurm job's agent is told to use: the shell lines of ``slurm_script`` run by
``sh`` in a given environment, with an ``nvidia-smi`` on PATH that lists a node's GPUs. A
group's task is an srun step: its own GPUs are SLURM_STEP_GPUS, not the whole job's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import service_from_config, write_script
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.slurm import SlurmEnvironmentService
from trialkeeper.coordinator.services.slurm_script import _GPU_SELECTION


def _node(tmp_path: Path, gpus: int) -> dict[str, str]:
    """An environment whose ``nvidia-smi -L`` lists ``gpus`` GPUs, as on a node whose GPUs
    are not fenced off by cgroups (or, fewer, on one that shows the job only its own)."""
    fake = write_script(tmp_path, "nvidia-smi", "#!/bin/sh\n" + "".join(f"echo 'GPU {i}'\n" for i in range(gpus)))
    fake.chmod(0o755)
    return {"PATH": f"{tmp_path}:/usr/bin:/bin"}


@pytest.mark.parametrize(
    ("node_gpus", "slurm_env", "expected"),
    [
        (4, {"SLURM_JOB_GPUS": "1,3"}, "--gpu-indices 1,3"),  # a job's batch script: the job's
        (4, {"SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}, "--gpu-indices 2,3"),  # a task: its step's
        (4, {"CUDA_VISIBLE_DEVICES": "2"}, "--gpu-indices 2"),  # neither set: what Slurm's GPU plugin set
        (2, {"SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}, ""),  # fenced: NVML shows only its own
        (4, {}, ""),
    ],
    ids=["job", "step", "cuda-visible-devices", "fenced", "none"],
)
def test_the_agent_is_told_its_own_gpus(
    tmp_path: Path, node_gpus: int, slurm_env: dict[str, str], expected: str
) -> None:
    env = {**_node(tmp_path, node_gpus), **slurm_env}
    out = subprocess.run(["sh", "-c", _GPU_SELECTION + '\necho "$@"'], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out.strip() == expected


def _service(tmp_path: Path, **section: Any) -> SlurmEnvironmentService:
    config = parse_config(
        {"trialCommand": "python3 trial.py", "trialCodeDirectory": str(tmp_path), "trialConcurrency": 1,
         "trainingService": {"platform": "slurm", **section}},
        tmp_path,
    )
    return service_from_config(SlurmEnvironmentService, config, tmp_path / "exp")


def _request(env_id: str) -> EnvironmentRequest:
    return EnvironmentRequest(env_id=env_id, experiment_id="gpu", coordinator_address="127.0.0.1:9", token="t0ken")


def test_a_gpu_job_passes_the_pick_on_to_its_agent(tmp_path: Path) -> None:
    service = _service(tmp_path, gpusPerNode=2)
    script = service.scripts.script(_request("env-1"), tmp_path)
    assert "#SBATCH --gpus-per-node=2\n" in script and "--no-gpu" not in script and script.endswith('"$@"\n')
    assert _GPU_SELECTION in script


def test_each_task_of_a_group_job_gives_its_agent_its_steps_gpus(tmp_path: Path) -> None:
    """The group's task script run as rank 1 of a step given GPUs 2,3 of a job holding 0-3:
    rank 1's agent (here a stand-in Python that writes down its argv) is told 2,3."""
    python = write_script(tmp_path, "python", '#!/bin/sh\nprintf "%s\\n" "$@"\n')
    python.chmod(0o755)
    service = _service(tmp_path, jobPerTrial=True, gpusPerNode=2, pythonInterpreter=str(python))
    request = dataclasses.replace(_request("env-1"), group_members=("env-1", "env-2"))
    _, task = service.scripts.group_script(request, tmp_path / "exp" / "envs" / "env-1")
    assert task.count(_GPU_SELECTION) == 2, task
    env = {**_node(tmp_path, 4), "SLURM_PROCID": "1", "SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}
    done = subprocess.run(["sh", "-c", task], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "exp" / "envs" / "env-2" / "agent.log").read_text().splitlines()
    assert argv[argv.index("--environment-id") + 1] == "env-2", argv
    assert argv[-2:] == ["--gpu-indices", "2,3"], argv
    assert not os.path.exists(tmp_path / "exp" / "envs" / "env-1" / "agent.log")
