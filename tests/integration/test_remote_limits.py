"""A remote agent (over real sshd) ends what its trial left outside its process group."""

from __future__ import annotations

from pathlib import Path

from conftest import run_async
from test_agent_limits import DAEMONS, run_daemons_trial
from test_remote import Lab, _code_dir, _config, _no_processes_left, _parse, lab  # noqa: F401 - lab: the fixture
from trialkeeper.coordinator.core import Coordinator


def test_a_remote_trials_daemons_are_ended_with_it(tmp_path: Path, lab: Lab) -> None:  # noqa: F811
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    _code_dir(tmp_path, script=DAEMONS)
    data = _config(tmp_path, lab, [lab.entry(0)], trialCommand=f"python3 trial.py {pids_dir}", trialConcurrency=1)
    config = _parse(data, tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            await run_daemons_trial(c, pids_dir)

    run_async(body)
    _no_processes_left(lab)
