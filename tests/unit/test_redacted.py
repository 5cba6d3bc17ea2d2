"""Secrets the stored config holds as ``***``: found, filled from the environment where
they are trialEnv variables, and otherwise named in a refusal."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from trialkeeper.coordinator.config.experiment import ExperimentConfig, config_to_dict, parse_config
from trialkeeper.coordinator.config.redacted import (
    SecretsMissing,
    fill_redacted,
    find_redacted,
    restore_redacted,
)
from trialkeeper.coordinator.core import Coordinator, CoordinatorError
from trialkeeper.coordinator.store.store import Store

WANDB = "wandb-0123456789abcdef"
BASE: dict[str, Any] = {"trialCommand": "python3 t.py", "trialConcurrency": 1}
LOCAL = {"platform": "local"}


def _stored(tmp_path: Path, **data: Any) -> tuple[ExperimentConfig, Any]:
    """A parsed config and its record as the store keeps it (redacted, through JSON)."""
    cfg = parse_config({**BASE, **data}, tmp_path)
    return cfg, json.loads(json.dumps(config_to_dict(cfg, redact=True)))


def _platforms(tmp_path: Path) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Platform sections with secrets, and the fields the stored config redacts."""
    key = tmp_path / "id_ed25519"
    key.write_text("not a real key")
    return {
        "remote": (
            {"platform": "remote", "machineList": [
                {"host": "a", "user": "u", "password": "pw-a"},
                {"host": "b", "user": "u", "sshKeyFile": str(key), "sshPassphrase": "pp-b"},
            ]},
            ["trainingService.machineList[0].password", "trainingService.machineList[1].sshPassphrase"],
        ),
        "openpai": (
            {"platform": "openpai", "host": "https://pai.example", "username": "u", "token": "pai-tok",
             "dockerImage": "i", "virtualCluster": "default", "storageConfigName": "s",
             "localStorageMountPoint": str(tmp_path), "containerStorageMountPoint": "/mnt"},
            ["trainingService.token"],
        ),
        "dlts": (
            {"platform": "dlts", "dashboard": "https://d.example/", "cluster": "c", "team": "t",
             "email": "e@x", "password": "dlts-pw", "image": "i"},
            ["trainingService.password"],
        ),
        "dlc": (
            {"platform": "dlc", "image": "i", "jobType": "PyTorchJob", "podCount": 1, "ecsSpec": "ecs.x",
             "region": "cn-hangzhou", "workspaceId": "1", "nasDataSourceId": "nas",
             "localStorageMountPoint": str(tmp_path), "containerStorageMountPoint": "/mnt",
             "accessKeyId": "LTAIid", "accessKeySecret": "dlc-secret"},
            ["trainingService.accessKeyId", "trainingService.accessKeySecret"],
        ),
        # A toleration's `key` reads as a secret to the redaction rule, so it is lost too.
        "kubernetes": (
            {"platform": "kubernetes", "image": "i",
             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            ["trainingService.tolerations[0].key"],
        ),
    }


def _put(data: Any, path: tuple[str | int, ...], value: Any) -> None:
    for step in path[:-1]:
        data = data[step]
    data[path[-1]] = value


def _get(data: Any, path: tuple[str | int, ...]) -> Any:
    for step in path:
        data = data[step]
    return data


@pytest.mark.parametrize("platform", ["remote", "openpai", "dlts", "dlc", "kubernetes"])
def test_every_value_the_stored_config_redacts_is_found(tmp_path: Path, platform: str) -> None:
    section, fields = _platforms(tmp_path)[platform]
    cfg, stored = _stored(
        tmp_path,
        trainingService=section,
        trialEnv={"WANDB_API_KEY": WANDB, "HOME": "/root", "PATTERN": "***"},
        tuner={"name": "random", "classArgs": {"api_key": "tuner-key", "seed": 1}},
    )
    found = find_redacted(stored)
    assert [r.where for r in found] == [*fields, "tuner.classArgs.api_key", "trialEnv.WANDB_API_KEY"]
    assert [r.variable for r in found] == [None] * (len(fields) + 1) + ["WANDB_API_KEY"]
    # Putting the real value back at each place found gives the whole config back: no
    # redacted value is left out. `PATTERN: ***` was written by the user and stays.
    plain = json.loads(json.dumps(config_to_dict(cfg)))
    for r in found:
        _put(stored, r.path, _get(plain, r.path))
    assert stored == plain


def test_trial_env_secrets_are_taken_from_the_environment(tmp_path: Path) -> None:
    cfg, stored = _stored(
        tmp_path,
        trainingService=LOCAL,
        trialEnv={"WANDB_API_KEY": WANDB, "HF_TOKEN": "hf-token-value", "HOME": "/root", "PATTERN": "***"},
    )
    before = json.dumps(stored)
    restored = restore_redacted(stored, {"WANDB_API_KEY": WANDB, "HF_TOKEN": "hf-token-value", "OTHER": "x"})
    assert json.dumps(stored) == before  # the record itself is left as it is
    again = parse_config(restored, tmp_path)
    assert again == dataclasses.replace(cfg, search_space_file=None)
    assert again.trial_env == {"WANDB_API_KEY": WANDB, "HF_TOKEN": "hf-token-value", "HOME": "/root", "PATTERN": "***"}


def test_missing_secrets_are_named_each_with_how_to_give_it(tmp_path: Path) -> None:
    section, _ = _platforms(tmp_path)["remote"]
    _, stored = _stored(
        tmp_path,
        trainingService=section,
        trialEnv={"WANDB_API_KEY": WANDB, "HF_TOKEN": "hf-token-value"},
        tuner={"name": "random", "classArgs": {"api_key": "tuner-key"}},
    )
    with pytest.raises(SecretsMissing) as raised:
        restore_redacted(stored, {"HF_TOKEN": "hf-token-value"})
    text = str(raised.value)
    assert "\n" not in text
    assert (
        "trialEnv WANDB_API_KEY: set it in the environment of `trialkeeper resume`, "
        "or pass the config file with --config FILE"
        in text
    )
    assert (
        "trainingService.machineList[0].password, trainingService.machineList[1].sshPassphrase, "
        "tuner.classArgs.api_key: pass the config file with --config FILE"
    ) in text
    assert "HF_TOKEN" not in text  # the environment gave it
    for secret in (WANDB, "hf-token-value", "pw-a", "pp-b", "tuner-key"):
        assert secret not in text
    # Platform secrets are never read from the environment, even under a matching name.
    environ = {"WANDB_API_KEY": WANDB, "HF_TOKEN": "x", "password": "pw-a", "api_key": "k"}
    left = fill_redacted(stored, environ).missing
    assert [r.where for r in left] == [
        "trainingService.machineList[0].password",
        "trainingService.machineList[1].sshPassphrase",
        "tuner.classArgs.api_key",
    ]


def test_coordinator_resume_fills_or_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config({**BASE, "trainingService": LOCAL, "trialEnv": {"WANDB_API_KEY": WANDB}}, tmp_path)
    exp = tmp_path / "exp"
    store = Store.in_dir(exp)
    store.create_experiment("e1", None, config_to_dict(cfg, redact=True))
    store.close()
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(CoordinatorError, match="trialEnv WANDB_API_KEY: set it in the environment"):
        Coordinator.resume(exp)
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    assert Coordinator.resume(exp).config.trial_env == {"WANDB_API_KEY": WANDB}
    # A config given replaces the stored one, and the environment is not consulted.
    monkeypatch.delenv("WANDB_API_KEY")
    assert Coordinator.resume(exp, config=cfg).config.trial_env == {"WANDB_API_KEY": WANDB}


def test_a_database_password_in_a_storage_url_is_stored_redacted_and_named_on_resume(tmp_path: Path) -> None:
    _, stored = _stored(
        tmp_path,
        trainingService=LOCAL,
        optunaStorage="postgresql+psycopg2://tk:db-pw-123@db.example:5432/studies",
        tuner={"name": "optuna", "classArgs": {"storage": "mysql://root:root-pw@localhost/optuna"}},
    )
    assert stored["optunaStorage"] == "postgresql+psycopg2://tk:***@db.example:5432/studies"
    assert stored["tuner"]["classArgs"]["storage"] == "mysql://root:***@localhost/optuna"
    assert "db-pw-123" not in json.dumps(stored) and "root-pw" not in json.dumps(stored)
    assert [item.where for item in find_redacted(stored)] == ["tuner.classArgs.storage", "optunaStorage"]
    with pytest.raises(SecretsMissing, match=r"tuner\.classArgs\.storage, optunaStorage: pass the config file"):
        restore_redacted(stored, {})
    # A URL without a password is no secret: it is stored as written and resumes as it is.
    cfg, plain = _stored(tmp_path, trainingService=LOCAL, optunaStorage=f"sqlite:///{tmp_path / 'o.db'}")
    assert plain["optunaStorage"] == f"sqlite:///{tmp_path / 'o.db'}"
    assert find_redacted(plain) == []
    assert parse_config(restore_redacted(plain, {}), tmp_path).optuna_storage == cfg.optuna_storage
