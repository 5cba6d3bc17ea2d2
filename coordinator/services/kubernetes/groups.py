"""One Kubernetes object for a group of environments (``jobPerTrial``): a PyTorchJob with a
Master and a Worker per other member, or a Framework whose one task role has a task per
member; each replica or task runs one agent.

The replicas share one pod template, so every one runs the same command: a shell picks its
environment id out of the group's members, in order, by the index its operator gives the
pod (the training operator's ``RANK``: 0 for the Master, 1.. for the Workers;
FrameworkController's ``FC_TASK_INDEX``), and runs the agent as that environment. Pure
functions, no API calls, as in ``objects``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from .objects import Kind

PLACEHOLDER = "@ENV_ID@"


def index_variable(kind: Kind) -> str:
    """The variable the operator of ``kind`` gives each pod of a group: its member's index."""
    return "FC_TASK_INDEX" if kind.plural == "frameworks" else "RANK"


def member_command(argv: Sequence[str], members: Sequence[str], index: str = "RANK") -> list[str]:
    """``sh -c`` running ``argv`` (an agent's, with :data:`PLACEHOLDER` where its environment
    id goes) as the member whose position is the pod's ``index`` variable."""
    words = []
    for word in argv:
        parts = [shlex.quote(p) if p else "" for p in word.split(PLACEHOLDER)]
        words.append('"$TRIALKEEPER_MEMBER"'.join(parts) if PLACEHOLDER in word else shlex.quote(word))
    script = (
        f"set -- {' '.join(shlex.quote(m) for m in members)}; "
        f'shift "${{{index}:?its operator sets {index}}}" && '
        f'TRIALKEEPER_MEMBER="${{1:?{index} is beyond the group}}" && '
        f"exec {' '.join(words)}"
    )
    return ["sh", "-c", script]


def group_job(kind: Kind, body: dict[str, Any], members: Sequence[str]) -> dict[str, Any]:
    """``body`` (a PyTorchJob with one Master, or a Framework with one task, from
    ``objects.workload``) made the group's: the same pod as a Worker for each member after
    the first, or as a task per member (the Framework fails as one when a task fails, and
    completes once every task has), annotated with the members."""
    if kind.plural == "frameworks":
        role = body["spec"]["taskRoles"][0]
        role["taskNumber"] = len(members)
        role["frameworkAttemptCompletionPolicy"] = {"minFailedTaskCount": 1, "minSucceededTaskCount": -1}
    elif kind.plural == "pytorchjobs":
        specs = body["spec"]["pytorchReplicaSpecs"]
        if len(members) > 1:
            specs["Worker"] = {**specs["Master"], "replicas": len(members) - 1}
    else:
        raise ValueError(f"a {kind.kind} cannot hold a group of environments")
    notes = body["metadata"].setdefault("annotations", {})
    notes[MEMBERS_ANNOTATION] = ",".join(members)
    return body


MEMBERS_ANNOTATION = "trialkeeper/group-members"
