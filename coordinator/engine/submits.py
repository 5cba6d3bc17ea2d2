"""What a trial submitted through the embedding API may ask for, checked before it is queued."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .model import TrialState
from .policy import Policy, gang_bound


def checked_platforms(policy: Policy, platforms: Any) -> tuple[str, ...]:
    """``platforms`` as the trial's preference, or ValueError naming what would do."""
    allowed = tuple(platforms or ())
    known = [p.name for p in policy.platforms]
    unknown = [p for p in allowed if p not in known]
    if unknown or len(set(allowed)) != len(allowed) or isinstance(platforms, str):
        raise ValueError(
            f"platforms must be a list of distinct platforms of this experiment ({', '.join(known)}), "
            f"got {platforms!r}"
        )
    return allowed


def checked_fork(trials: Mapping[str, TrialState], checkpoint_from: str | None) -> None:
    if checkpoint_from is not None and (checkpoint_from not in trials or trials[checkpoint_from].checkpoint is None):
        raise ValueError(f"checkpoint_from: trial {checkpoint_from!r} has saved no checkpoint to start from")


def checked_command(command: Any, default: str) -> str:
    """``command``, or ``default`` (the config's trialCommand) when None or "", or TypeError."""
    if command is not None and not isinstance(command, str):
        raise TypeError(f"command must be a string (a shell command line), got {command!r}")
    return command or default


def checked_env(env: Any) -> dict[str, str]:
    """``env``, the trial's own environment variables, or TypeError."""
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError(f"env must be a mapping of variable names to strings, got {env!r}")
    return dict(env)


def checked_nodes(policy: Policy, nodes: Any) -> int:
    """``nodes`` (None: the config's trialNodes), or ValueError."""
    n = policy.trial_nodes if nodes is None else nodes
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    return n


def checked_duration(max_duration: Any) -> float:
    """A trial's own time limit in seconds (None: the experiment's, 0 here), or ValueError."""
    if max_duration is None:
        return 0.0
    ok = isinstance(max_duration, (int, float)) and not isinstance(max_duration, bool)
    if not ok or not math.isfinite(max_duration) or max_duration <= 0:
        raise ValueError(f"max_duration must be a number of seconds > 0, got {max_duration!r}")
    return float(max_duration)


def never_gangs(policy: Policy, nodes: int, platforms: tuple[str, ...]) -> str:
    """Why a trial of ``nodes`` environments could never start here ("" if it could): see
    :func:`policy.gang_bound`, over the platforms it may use."""
    names = platforms or policy.preference()
    across = policy.gang_across_platforms
    most = gang_bound(nodes, [p.environment_count for p in policy.platforms if p.name in names and p.reuse], across)
    if most is None:
        return ""
    return (
        f"a trial of {nodes} nodes needs {nodes} environments at once, but the experiment keeps at most "
        f"{most}{'' if across else ' of one platform'} in reuse mode; "
        f"lower nodes or raise environmentCount"
    )
