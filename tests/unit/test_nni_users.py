"""What NNI users meet when they bring NNI's configs and algorithms unchanged: PBT accepted
with its defaults (its checkpoints kept on trialkeeper's, no directory needed), useAnnotation refused with
what to write instead, and an unknown host key refused with exactly what to add to the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import paramiko
import pytest
from trialkeeper.coordinator.config.experiment import ConfigError, parse_config
from trialkeeper.coordinator.search.algorithms import create_tuner
from trialkeeper.coordinator.search.tuners import TunerError
from trialkeeper.coordinator.services.remote.ssh import SshError, SshTarget, _HostKeyPolicy

BASE: dict[str, Any] = {
    "trialCommand": "python3 trial.py",
    "trialConcurrency": 1,
    "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
    "trainingService": {"platform": "local"},
}


def _errors(data: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, tmp_path)
    return {issue.path: issue.message for issue in info.value.issues}


@pytest.mark.parametrize(
    ("tuner", "where"),
    [
        ({"name": "PBT", "classArgs": {"optimize_mode": "maximize"}}, "tuner.name"),
        ({"name": "PBTTuner"}, "tuner.name"),
        ({"className": "nni.algorithms.hpo.pbt_tuner.PBTTuner"}, "tuner.className"),
    ],
)
def test_nnis_pbt_without_a_checkpoint_directory_is_accepted_with_its_defaults(
    tmp_path: Path, tuner: dict[str, Any], where: str
) -> None:
    # The experiment gives NNI's PBT its NNI_CHECKPOINT_DIRECTORY (its own directory).
    config = parse_config(BASE | {"tuner": tuner}, tmp_path)
    assert (config.tuner.name or config.tuner.class_name) == (tuner.get("name") or tuner.get("className"))
    assert where.startswith("tuner.")


def test_nnis_pbt_with_a_checkpoint_directory_is_accepted(tmp_path: Path) -> None:
    args = {"optimize_mode": "maximize", "all_checkpoint_dir": str(tmp_path)}
    tuner = {"name": "PBT", "classArgs": args}
    assert parse_config(BASE | {"tuner": tuner}, tmp_path).tuner.name == "PBT"


def test_use_annotation_is_refused_with_what_to_write_instead(tmp_path: Path) -> None:
    message = _errors(BASE | {"useAnnotation": True}, tmp_path)["useAnnotation"]
    assert "nni.tools.annotation" not in message and "expand_annotations" not in message
    assert "nni.get_next_parameter()" in message and "nni.report_final_result" in message


def test_an_unknown_host_key_is_refused_saying_what_to_add_and_that_nni_did_not_check() -> None:
    key = paramiko.ECDSAKey.generate()
    policy = _HostKeyPolicy(SshTarget("gpu1.example", 22, "alice"), "~/.ssh/known_hosts")
    with pytest.raises(SshError) as info:
        policy.missing_host_key(paramiko.SSHClient(), "gpu1.example", key)
    message = str(info.value)
    assert "`acceptUnknownHostKeys: true`" in message and "`knownHostsFile: " in message
    assert "NNI did not" in message and info.value.permanent


# NNI's GridSearch, by its name, is NNI's algorithm: it grids a continuous range from its middle
# on, ever finer, where trialkeeper's own `grid` refuses it.
GRID_SCRIPT = """
import json
from trialkeeper.coordinator.search.algorithms import create_tuner
from nni.algorithms.hpo.gridsearch_tuner import GridSearchTuner
space = {"x": {"_type": "uniform", "_value": [0, 1]}, "k": {"_type": "choice", "_value": [1, 2]}}
ours = create_tuner("GridSearch", None, {}, space)
nni = GridSearchTuner()
nni.update_search_space(space)
print(json.dumps({"ours": [ours.generate_parameters(i) for i in range(10)],
                  "nni": [nni.generate_parameters(i) for i in range(10)]}))
"""
MIXED = {"x": {"_type": "uniform", "_value": [0, 1]}, "k": {"_type": "choice", "_value": [1, 2]}}


def test_nnis_grid_search_by_name_grids_continuous_ranges_as_nni_does() -> None:
    import json
    import subprocess

    from nni_python import nni_python

    proc = subprocess.run([str(nni_python()), "-c", GRID_SCRIPT], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["ours"] == seen["nni"]
    assert seen["ours"][:2] == [{"x": 0.5, "k": 1}, {"x": 0.5, "k": 2}]


def test_grid_search_without_nni_says_what_a_continuous_space_needs() -> None:
    import importlib.util

    if importlib.util.find_spec("nni") is not None:
        pytest.skip("checks the error shown without NNI, and NNI is installed here; runs in a venv without nni (.venv)")
    with pytest.raises(TunerError, match=r"NNI's grid search.*pip install 'trialkeeper\[nni\]'"):
        create_tuner("GridSearch", None, {}, MIXED)
