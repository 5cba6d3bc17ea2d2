"""Trial and environment lifecycles: each a table of legal transitions.

Every edge says what triggers it. A transition outside the table is a bug and raises.
"""

from __future__ import annotations

import enum


class IllegalTransition(RuntimeError):
    """A state change the lifecycle table does not allow."""


class TrialStatus(str, enum.Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    USER_CANCELED = "USER_CANCELED"
    EARLY_STOPPED = "EARLY_STOPPED"
    SYS_CANCELED = "SYS_CANCELED"
    # Saved a checkpoint and ended its process to free its slot: continued later, anywhere.
    PAUSED = "PAUSED"

    @property
    def terminal(self) -> bool:
        return self not in (TrialStatus.WAITING, TrialStatus.RUNNING, TrialStatus.PAUSED)


class EnvStatus(str, enum.Enum):
    REQUESTED = "REQUESTED"
    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    LOST = "LOST"

    @property
    def terminal(self) -> bool:
        # LOST is not terminal: the agent may come back before its trials are given up.
        return self is EnvStatus.STOPPED or self is EnvStatus.FAILED


T = TrialStatus
TRIAL_TRANSITIONS: dict[tuple[TrialStatus, TrialStatus], str] = {
    (T.WAITING, T.RUNNING): "the agent reported the trial process running",
    (T.WAITING, T.FAILED): "the trial could not start, or cannot fit anywhere",
    (T.WAITING, T.USER_CANCELED): "canceled before it started",
    (T.WAITING, T.SYS_CANCELED): "the experiment ended before it started",
    (T.WAITING, T.EARLY_STOPPED): "an assessor stopped it before it started",
    (T.RUNNING, T.SUCCEEDED): "the trial process exited 0",
    (T.RUNNING, T.FAILED): "non-zero exit, a signal, a timeout, or its environment was lost",
    (T.RUNNING, T.USER_CANCELED): "canceled while running",
    (T.RUNNING, T.EARLY_STOPPED): "stopped by the tuner's assessor",
    (T.RUNNING, T.SYS_CANCELED): "the experiment ended while it ran",
    (T.RUNNING, T.WAITING): "its environment was lost and a retry is allowed",
    (T.RUNNING, T.PAUSED): "it saved a checkpoint and ended, asked to pause",
    (T.WAITING, T.PAUSED): "paused before it ran",
    (T.PAUSED, T.WAITING): "continued, from its last checkpoint",
    (T.PAUSED, T.USER_CANCELED): "canceled while paused",
    (T.PAUSED, T.SYS_CANCELED): "the experiment ended while it was paused",
    (T.PAUSED, T.EARLY_STOPPED): "a search stopped it while it was paused",
}

E = EnvStatus
ENV_TRANSITIONS: dict[tuple[EnvStatus, EnvStatus], str] = {
    (E.REQUESTED, E.STARTING): "the environment service accepted the start",
    (E.REQUESTED, E.FAILED): "the environment service could not start it",
    (E.REQUESTED, E.STOPPED): "no longer wanted before it started",
    (E.STARTING, E.READY): "its agent registered",
    (E.STARTING, E.FAILED): "the platform reports it failed, or the agent never registered",
    (E.STARTING, E.STOPPED): "no longer wanted before its agent registered",
    (E.READY, E.BUSY): "a trial was placed on it",
    (E.BUSY, E.READY): "its last trial ended",
    (E.READY, E.DRAINING): "told to take no new trials",
    (E.BUSY, E.DRAINING): "told to take no new trials",
    (E.DRAINING, E.STOPPED): "its agent exited after draining",
    (E.READY, E.STOPPED): "stopped",
    (E.BUSY, E.STOPPED): "stopped",
    (E.READY, E.LOST): "its agent went silent past the lease",
    (E.BUSY, E.LOST): "its agent went silent past the lease",
    (E.DRAINING, E.LOST): "its agent went silent past the lease",
    (E.READY, E.FAILED): "the platform reports it ended unexpectedly",
    (E.BUSY, E.FAILED): "the platform reports it ended unexpectedly",
    (E.DRAINING, E.FAILED): "the platform reports it ended unexpectedly",
    (E.LOST, E.READY): "its agent came back within the window",
    (E.LOST, E.BUSY): "its agent came back within the window, its trials still running",
    (E.LOST, E.DRAINING): "its agent came back within the window, still draining",
    (E.LOST, E.FAILED): "its agent stayed silent past the trial-lost timeout; its trials are lost",
    (E.LOST, E.STOPPED): "stopped while its agent was silent",
}


def check_trial(old: TrialStatus, new: TrialStatus) -> None:
    if (old, new) not in TRIAL_TRANSITIONS:
        raise IllegalTransition(f"trial cannot go from {old.value} to {new.value}")


def check_env(old: EnvStatus, new: EnvStatus) -> None:
    if (old, new) not in ENV_TRANSITIONS:
        raise IllegalTransition(f"environment cannot go from {old.value} to {new.value}")
