"""The bodies of the Kubernetes operator workloads, as the real operators take them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from trialkeeper.coordinator.config.experiment import ConfigError, parse_config
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.kubernetes.groups import (
    MEMBERS_ANNOTATION,
    PLACEHOLDER,
    group_job,
    index_variable,
    member_command,
)
from trialkeeper.coordinator.services.kubernetes.objects import (
    kind_of,
    object_name,
    observe,
    template_pod,
    workload,
)


def _section(tmp_path: Path, platform: str, **fields: object) -> object:
    data = {"trialCommand": "x", "trialConcurrency": 1,
            "trainingService": {"platform": platform, "image": "registry.example/tk:1", **fields}}
    return parse_config(data, tmp_path).training_service


def test_an_adaptdl_template_is_checked_as_the_pod_it_makes(tmp_path: Path) -> None:
    config = _section(tmp_path, "adl", tolerations=[{"key": "gpu", "operator": "Exists"}])
    kind = kind_of(config)  # type: ignore[arg-type]
    # AdaptDL's CRD keeps the template as free-form JSON: the server would not check it.
    assert not kind.checks_template
    body = workload(kind, config, EnvironmentRequest("env-1", "exp1", "127.0.0.1:9", "t"), "tk-exp1-env-1",  # type: ignore[arg-type]
                    ["python", "-m", "trialkeeper.agent"])
    pod = template_pod(body)
    assert (pod["kind"], pod["metadata"]["name"]) == ("Pod", "tk-exp1-env-1")
    assert pod["metadata"]["labels"] == body["spec"]["template"]["metadata"]["labels"]
    assert pod["spec"] is body["spec"]["template"]["spec"] and pod["spec"]["tolerations"][0]["key"] == "gpu"
    assert pod["spec"]["containers"][0]["name"] == "main"


def test_the_operators_whose_schemas_check_their_templates_need_no_dry_run(tmp_path: Path) -> None:
    for platform, fields in (("kubeflow", {"operator": "tfjob"}), ("kubeflow", {}), ("kubernetes", {})):
        assert kind_of(_section(tmp_path, platform, **fields)).checks_template, platform  # type: ignore[arg-type]
    # AdaptDL's and FrameworkController's CRDs keep the pod template as free-form JSON.
    for platform in ("adl", "frameworkcontroller"):
        assert not kind_of(_section(tmp_path, platform)).checks_template, platform  # type: ignore[arg-type]


def test_an_adaptdl_job_says_what_it_waits_for_and_why_it_failed(tmp_path: Path) -> None:
    kind = kind_of(_section(tmp_path, "adl"))  # type: ignore[arg-type]
    # As AdaptDL's controller and allocator write the status.
    assert observe(kind, {"status": {"phase": "Pending"}}) == (
        "starting",
        "waiting for AdaptDL's scheduler to place it on a node",
    )
    assert observe(kind, {"status": {"phase": "Starting", "allocation": ["node-1"], "group": 0}})[0] == "starting"
    assert observe(kind, {"status": {"phase": "Running", "allocation": ["node-1"]}}) == ("running", "")
    assert observe(kind, {"status": {"phase": "Succeeded", "allocation": None}}) == ("exited", "")
    failed = {"phase": "Failed", "reason": "PodFailure", "message": "tk-x-env-1-0-0 Failed"}
    assert observe(kind, {"status": failed}) == ("failed", "PodFailure: tk-x-env-1-0-0 Failed")


def test_framework_names_take_frameworkcontrollers_form_and_a_dry_run_checks_its_template(tmp_path: Path) -> None:
    # Its CRD takes ^[a-z0-9]{1,63}$ for Frameworks and task roles: no '-', unlike Kubernetes.
    config = _section(tmp_path, "frameworkcontroller")
    kind = kind_of(config)  # type: ignore[arg-type]
    plain = re.compile(r"[a-z0-9]{1,50}")
    names = {object_name(e, v, kind) for e, v in (("exp1", "env-1"), ("exp1", "env-11"), ("Exp_1", "env-1"),
                                                  ("e" * 80, "env-1"), ("e" * 80, "env-2"), ("---", "_"))}
    assert len(names) == 6 and all(plain.fullmatch(n) for n in names), names
    assert object_name("exp1", "env-1", kind) == "tkexp1env1"
    assert object_name("exp1", "env-1") == "tk-exp1-env-1"  # other kinds keep their dashes
    body = workload(kind, config, EnvironmentRequest("env-1", "exp1", "127.0.0.1:9", "t"), "tkexp1env1",  # type: ignore[arg-type]
                    ["python", "-m", "trialkeeper.agent"])
    assert not kind.checks_template
    pod = template_pod(body)
    assert pod["spec"] is body["spec"]["taskRoles"][0]["task"]["pod"]["spec"]
    with pytest.raises(ConfigError, match=r"taskRoleName.*lowercase letters and digits only"):
        _section(tmp_path, "frameworkcontroller", taskRoleName="task-role")


def test_a_group_is_one_pytorchjob_with_a_master_and_a_worker_per_other_member(tmp_path: Path) -> None:
    config = _section(tmp_path, "kubeflow", jobPerTrial=True)
    kind = kind_of(config)  # type: ignore[arg-type]
    members = ("env-1", "env-2", "env-3")
    request = EnvironmentRequest("env-1", "exp1", "127.0.0.1:9", "t", group_members=members)
    argv = member_command(["python", "-m", "trialkeeper.agent", "--environment-id", PLACEHOLDER], members)
    body = group_job(kind, workload(kind, config, request, "tk-exp1-env-1", argv), members)  # type: ignore[arg-type]
    specs = body["spec"]["pytorchReplicaSpecs"]
    assert {r: s["replicas"] for r, s in specs.items()} == {"Master": 1, "Worker": 2}
    assert specs["Worker"]["template"] == specs["Master"]["template"]  # every replica picks its member by RANK
    assert specs["Master"]["template"]["spec"]["containers"][0]["command"] == argv
    assert body["metadata"]["annotations"][MEMBERS_ANNOTATION] == "env-1,env-2,env-3"
    fc = _section(tmp_path, "frameworkcontroller", jobPerTrial=True)
    fc_kind = kind_of(fc)  # type: ignore[arg-type]
    argv = member_command(["python", "--environment-id", PLACEHOLDER], members, index_variable(fc_kind))
    framework = group_job(fc_kind, workload(fc_kind, fc, request, "tkexp1env1", argv), members)  # type: ignore[arg-type]
    (role,) = framework["spec"]["taskRoles"]
    assert role["taskNumber"] == 3 and "FC_TASK_INDEX" in role["task"]["pod"]["spec"]["containers"][0]["command"][2]
    # One task failing fails the Framework (the group ends as one); it completes once all have.
    assert role["frameworkAttemptCompletionPolicy"] == {"minFailedTaskCount": 1, "minSucceededTaskCount": -1}
    with pytest.raises(ValueError, match="TFJob cannot hold a group"):
        tf = kind_of(_section(tmp_path, "kubeflow", operator="tfjob"))  # type: ignore[arg-type]
        group_job(tf, {}, members)


def test_each_replica_runs_the_agent_of_the_member_its_rank_names(tmp_path: Path) -> None:
    members = ("env-1", "env-2")
    odd = f"/share/x y/envs/{PLACEHOLDER}/'q'"
    command = member_command(["printf", "%s\\n", "--environment-id", PLACEHOLDER, "--workdir", odd, "a b"], members)
    for rank, member in enumerate(members):
        out = subprocess.run(command, env={"RANK": str(rank), "PATH": os.environ["PATH"]}, capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert out.splitlines() == ["--environment-id", member, "--workdir", f"/share/x y/envs/{member}/'q'", "a b"]
    # A pod the operator gave no RANK (or one beyond the group) runs no agent, and says why.
    path = {"PATH": os.environ["PATH"]}
    no_rank = subprocess.run(command, env=path, capture_output=True, text=True, timeout=30, check=False)
    assert no_rank.returncode != 0 and "its operator sets RANK" in no_rank.stderr
    beyond = subprocess.run(command, env={"RANK": "2", **path}, capture_output=True, timeout=30, check=False)
    assert beyond.returncode != 0 and beyond.stdout == b"" and b"RANK is beyond the group" in beyond.stderr


def test_one_job_per_trial_takes_the_pytorchjob_operator(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="jobPerTrial"):
        _section(tmp_path, "kubeflow", operator="tfjob", jobPerTrial=True)
    assert _section(tmp_path, "kubeflow", jobPerTrial=True).job_per_trial  # type: ignore[attr-defined]
