"""The dashboard's context page's answer: the stored config with no secret in it (even one a
store kept unredacted), the search space, tuner, assessor and platforms, and the limits."""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from conftest import run_async
from trialkeeper.coordinator.store.store import Store
from trialkeeper.coordinator.ui.server import build_app

CONFIG = {
    "trialCommand": "python train.py", "trialConcurrency": 2, "maxTrialNumber": 5, "maxExperimentDuration": 7200.0,
    "searchSpace": {
        "lr": {"_type": "loguniform", "_value": [1e-4, 0.1]}, "opt": {"_type": "choice", "_value": ["a", "b"]},
    },
    "tuner": {"name": "TPE", "classArgs": {"optimize_mode": "maximize"}},
    "assessor": {"className": "mine:Stopper", "classArgs": {"apiKey": "plain-key"}},
    # As an older store might hold them: not redacted.
    "trialEnv": {"API_TOKEN": "tok-123", "MODE": "fast"}, "optunaStorage": "postgresql://me:pw-456@db/optuna",
    "trainingService": {"platform": "hybrid", "platforms": [
        {"platform": "local", "gpuIndices": None},
        {"platform": "remote", "machineList": [{"host": "h1", "user": "u", "password": "pw-789"}]},
    ]},
}


def test_the_context_shows_the_config_without_secrets_and_what_it_runs_with(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "ctx", CONFIG)
    store.close()

    async def body() -> None:
        async with TestClient(TestServer(build_app(tmp_path, token="t0ken", open_reads=True))) as client:
            answer = await client.get("/api/context")
            assert answer.status == 200
            text = await answer.text()
            c = json.loads(text)
        for secret in ("tok-123", "pw-456", "pw-789", "plain-key"):
            assert secret not in text, secret
        assert c["config"]["trialEnv"] == {"API_TOKEN": "***", "MODE": "fast"}
        assert c["config"]["optunaStorage"] == "postgresql://me:***@db/optuna"
        assert c["redacted"] == [
            "assessor.classArgs.apiKey", "trialEnv.API_TOKEN", "optunaStorage",
            "trainingService.platforms[1].machineList[0].password",
        ]
        assert c["search_space"] == [
            {"name": "lr", "type": "loguniform", "values": [1e-4, 0.1]},
            {"name": "opt", "type": "choice", "values": ["a", "b"]},
        ]
        assert c["tuner"] == {"name": "TPE", "builtin": True, "class_args": {"optimize_mode": "maximize"}}
        assert c["assessor"] == {"name": "mine:Stopper", "builtin": False, "class_args": {"apiKey": "***"}}
        assert [p["platform"] for p in c["platforms"]] == ["local", "remote"]
        assert c["platforms"][0]["settings"] == {}  # what is not set is left out
        assert c["limits"] == {"trialConcurrency": 2, "maxTrialNumber": 5, "maxExperimentDuration": 7200.0}
        assert c["trial"]["trialCommand"] == "python train.py"
        assert c["actions"] is False and c["actions_why"]

    run_async(body)
