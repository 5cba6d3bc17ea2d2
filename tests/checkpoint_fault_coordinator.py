"""Agents that keep their files to themselves, and a coordinator run in a process of its own,
for the checkpoint fault tests (tests/integration/test_checkpoint_faults.py).

:class:`OwnDiskAgents` is the local platform with one difference: its agents do not see the
experiment's directory. Each works in a directory of its own (``<agents>/<env>``) and
``shares_filesystem`` is False, so Welcome names no checkpoint directory and the agents
upload their checkpoints over the stream (and stream their logs), as agents on other
machines do; a trial continued on another agent downloads its checkpoint. Everything else
(launch, adopt after a restart, stop, sweep) is the local platform's.

Run as a script, it is a coordinator that a test can kill -9 and start again::

    python checkpoint_fault_coordinator.py run|resume SPEC

SPEC is a JSON file: ``config`` (the experiment's config as a dict), ``code`` (its code
directory), ``exp`` (the experiment directory), ``agents`` (where agents work; "" runs the
local platform itself), ``params`` (the one trial's parameters), ``result`` (where the
outcome is written). ``run`` submits the trial and writes ``{"trial": id}`` to ``result``,
then waits for the trial's end; ``resume`` carries the experiment on (Coordinator.resume).
Both write ``{"trial", "status", "reason"}`` to ``result`` once the trial ended, stop the
coordinator and exit 0. Its log goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.services._launch import agent_argv, agent_environment, with_environment, write_tls_cert
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.lifecycle import PlatformError
from trialkeeper.coordinator.services.local import LocalEnvironmentService, _Agent

WAIT_S = 120.0


class OwnDiskAgents(LocalEnvironmentService):
    """Local agents that each work in ``<agents>/<env>`` and see nothing of the coordinator's
    files; an agent's log is ``<experiment>/envs/<env>/agent.log`` as on the local platform."""

    shares_filesystem = False

    def __init__(self, experiment_dir: Path, code_directory: Path, agents: Path) -> None:
        super().__init__(experiment_dir, code_directory)
        self.agents = agents

    async def launch(self, record: _Agent, request: EnvironmentRequest) -> str:
        env_dir = self.experiment_dir / "envs" / request.env_id
        env_dir.mkdir(parents=True, exist_ok=True)
        workdir = self.agents / request.env_id
        workdir.mkdir(parents=True, exist_ok=True)
        cert = write_tls_cert(env_dir, request.tls_cert_pem)
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform, python=self.python,
                          workdir=str(workdir), tls_cert=cert, agent_args=request.agent_args)
        env = with_environment(agent_environment(request.token, request.experiment_id, request.env_id))
        try:
            with open(env_dir / "agent.log", "ab") as out:  # noqa: ASYNC230 - once per agent
                record.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                    start_new_session=True,
                )
        except OSError as e:
            raise PlatformError(f"could not start the agent with {self.python}: {e}") from None
        return f"pid {record.proc.pid}"


def agent_log(experiment_dir: Path, env_id: str) -> str:
    path = experiment_dir / "envs" / env_id / "agent.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


async def _main(mode: str, spec: dict[str, Any]) -> None:
    exp, result = Path(spec["exp"]), Path(spec["result"])
    config = parse_config(spec["config"], Path(spec["code"]))
    service = OwnDiskAgents(exp, Path(spec["code"]), Path(spec["agents"])) if spec["agents"] else None
    if mode == "run":
        c = Coordinator(config, experiment_dir=exp, service=service)
        await c.start()
        trial_id = (await c.submit(spec["params"])).id
        _write(result, {"trial": trial_id})
    else:
        trial_id = json.loads(result.read_text())["trial"]
        c = Coordinator.resume(exp, config=config, service=service)
        await c.start()
    try:
        info = await c.wait(trial_id, WAIT_S)
        _write(result, {"trial": trial_id, "status": info.status.value, "reason": info.reason})
    finally:
        await c.stop()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("run", "resume"):
        sys.exit(f"usage: {sys.argv[0]} run|resume SPEC")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_main(sys.argv[1], json.loads(Path(sys.argv[2]).read_text())))
