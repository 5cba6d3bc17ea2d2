"""What a trial's agent is told to start it, and how long the trial may run."""

from __future__ import annotations

from . import events as ev
from .model import TrialState
from .policy import Policy


def time_limit(t: TrialState, policy: Policy) -> float:
    """How long ``t`` may run, in seconds (0: no limit): its own, else maxTrialDuration."""
    return t.max_duration or policy.max_trial_duration_s


def start_message(t: TrialState, policy: Policy, working_directory: str) -> ev.StartTrial:
    """The StartTrial of ``t`` (of its rank 0, for a multi-node trial: the others add their rank)."""
    env_vars = dict(policy.trial_env)
    env_vars.update(t.env_overrides)
    # From a checkpoint, its results go on from what it had reported when it saved.
    saved = t.checkpoint
    return ev.StartTrial(
        trial_id=t.id, sequence_id=t.seq, command=t.command, parameters=t.parameters, env=env_vars,
        gpu_indices=t.gpu_indices, gpu_uuids=t.gpu_uuids,
        max_duration_s=time_limit(t, policy), attempt=t.attempts,
        experiment_id=policy.experiment_id, working_directory=working_directory,
        resumes_metrics=t.attempts > 1 and saved is None, checkpoint=saved,
        first_metric_index=saved.metric_index if saved is not None else 0,
    )
