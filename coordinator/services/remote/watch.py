"""What the agents on a machine do, asked over SSH through its helper: the remote
service's observations, and the leftovers of an experiment a sweep finds."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._record import Record, State
from .machine import REMOTE_ROOT, Machine, MachineError, python_command

log = logging.getLogger(__name__)


@dataclass
class Agent(Record):
    """An agent on a machine; ``platform_id`` is ``<machine label> pid <pid>``."""

    machine: Machine | None = None
    pid: int | None = None
    dir: str = ""  # its directory on the machine
    launching: bool = False  # the launch command is under way: a stop waits for it


async def check(m: Machine, agents: Sequence[Agent]) -> dict[str, State]:
    """The state of each of ``agents`` on ``m`` by env id; those the check could not reach
    keep their phase, with why."""
    try:
        seen = await m.helper("status", {"envs": {a.env_id: a.dir for a in agents}}, timeout=30)
    except MachineError as e:
        return {a.env_id: State(a.phase, f"cannot check over SSH: {e}") for a in agents}
    states: dict[str, State] = {}
    for agent in agents:
        st = seen.get(agent.env_id)
        if st is None:
            continue
        if st.get("alive"):
            states[agent.env_id] = State("running", agent.detail)
        elif (state := await _ended(agent, m, st)) is not None:
            states[agent.env_id] = state
    return states


async def _ended(agent: Agent, m: Machine, st: dict[str, Any]) -> State | None:
    """How the agent ended, the trial processes it left stopped; None while they could not
    be stopped for a stop or a sweep (it looks again)."""
    ended = st.get("exit") or {}
    tail = (st.get("log_tail") or "").strip().splitlines()
    last = f"; last agent log line: {tail[-1]}" if tail else ""
    who = f"the agent (pid {agent.pid if agent.pid is not None else st.get('pid')}) on {m.label}"
    if ended.get("code") == 0:
        state = State("succeeded", "agent exited normally")
    elif "code" in ended:
        state = State("failed", f"{who} exited with status {ended['code']}{last}")
    elif ended.get("killed"):
        state = State("stopped", f"{who} was stopped")
    else:
        state = State("failed", (
            f"{who} died without an exit status (killed by a signal such as SIGKILL, or "
            f"by the out-of-memory killer){last}"
        ))
    if not st.get("orphans"):
        return state
    try:
        done = await m.helper("stop", {"grace": 0, "envs": {agent.env_id: agent.dir}}, timeout=30)
    except MachineError as e:
        if agent.stop_requested:
            return None
        return State(state.phase, f"{state.detail}; its trial processes could not be stopped: {e}")
    n = done.get(agent.env_id, {}).get("trial_processes", 0)
    s = "es" if n != 1 else ""
    return State(state.phase, f"{state.detail}; {n} trial process{s} it left were stopped")


async def stop(m: Machine, agent: Agent, grace_s: float) -> None:
    """Stop ``agent`` (after ``grace_s``) and every trial process it left; its phase is
    ``stopped`` once they are all gone."""
    answer = await m.helper("stop", {"grace": grace_s, "envs": {agent.env_id: agent.dir}},
                            timeout=grace_s + 30)
    done = answer.get(agent.env_id, {})
    status = done.get("status") or {}
    if not status.get("alive") and not status.get("orphans"):
        agent.phase = "stopped"
    if done.get("killed_agent") or done.get("trial_processes"):
        log.info(
            "environment %s: stopped on %s (agent killed: %s, trial processes stopped: %s)",
            agent.env_id, m.label, bool(done.get("killed_agent")), done.get("trial_processes", 0),
        )


async def leftovers(m: Machine, experiment_id: str) -> dict[str, str]:
    """env id -> platform id of the agents of ``experiment_id`` on ``m`` that still run or
    left trial processes; none where ``m`` cannot be asked (said in the log)."""
    python = python_command(m.config.python_path)  # no probe of the machine's trialkeeper
    try:
        seen = await m.helper("envs", {"dir": f"~/{REMOTE_ROOT}/{experiment_id}"},
                              python_cmd=python, timeout=60)
    except MachineError as e:
        log.warning("%s: could not list the leftover environments of experiment %s: %s",
                    m.label, experiment_id, e)
        return {}
    return {env_id: f"{m.label} pid {st.get('pid')}" for env_id, st in seen["envs"].items()
            if st.get("alive") or st.get("orphans")}
