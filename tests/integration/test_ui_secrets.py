"""No secret in any page or answer of the dashboard of a remote experiment: its machines'
SSH password and key passphrase, a cloud key handed to the trials, the experiment's token.

The experiment runs for real on two OpenSSH servers on 127.0.0.1 (tests/sshd.py); where sshd
cannot start the test skips with the reason, and in CI (``CI`` set) it fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import wait_until
from dashboard import every_answer, get_json, live_experiment
from test_remote import Lab, lab  # noqa: F401 - the two machines, a fixture

WAIT_S = 90.0
CLOUD_KEY = "aws-secret-Zq8vT3kP0xR6wN2m"


@pytest.mark.slow
def test_no_secret_of_a_remote_config_in_any_page_or_answer(tmp_path: Path, lab: Lab) -> None:  # noqa: F811
    (tmp_path / ".nniignore").write_text("exp/\ngates/\n")  # the code is this directory: not the experiment
    machines = [lab.entry(0), lab.entry(1, auth=lab.second_auth())]
    secrets = [*lab.secrets(), CLOUD_KEY]
    assert lab.creds.passphrase in secrets  # key logins need it; a password too where this host allows one
    with live_experiment(
        tmp_path,
        trials=3,  # the third waits at its gate: the experiment (and its dashboard) lives on
        concurrency=2,
        trialCommand=f"{sys.executable} trial.py",
        trainingService={
            "platform": "remote",
            "reuseMode": True,
            "knownHostsFile": str(lab.known_hosts),
            "machineList": machines,
        },
        trialEnv={"AWS_SECRET_ACCESS_KEY": CLOUD_KEY},
    ) as (served, gates):
        url = served.url
        # Both trials running on the machines, their environments connected: every answer has
        # something to tell.
        wait_until(
            lambda: get_json(url + "/api/experiment")["trials"].get("RUNNING") == 2, timeout=WAIT_S, message="2 running"
        )
        running = every_answer(url)
        envs = json.loads(running["/api/environments"])["environments"]
        assert envs and all(e["platform"] == "remote" for e in envs)
        gates.release(0)
        gates.release(1)
        wait_until(
            lambda: get_json(url + "/api/experiment")["trials"].get("SUCCEEDED") == 2,
            timeout=WAIT_S,
            message="2 succeeded",
        )
        ended = every_answer(url)
        assert b"trial output for x" in b"".join(body for path, body in ended.items() if "stream=stdout" in path)
        token = served.token
    leaks = [
        (when, path, secret[:6] + "...")
        for when, answers in (("running", running), ("ended", ended))
        for path, body in answers.items()
        for secret in (*secrets, token)
        if secret.encode() in body
    ]
    assert leaks == []
