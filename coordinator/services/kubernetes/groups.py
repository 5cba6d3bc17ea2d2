"""One Kubernetes object for a group of environments: a PyTorchJob with a Master and a
Worker per other member (``jobPerTrial``), each replica running one agent.

The Workers share one pod template, so every replica runs the same command: a shell picks
the replica's environment id from the ``RANK`` the training operator gives its pod (0 for
the Master, 1.. for the Workers) out of the group's members, in order, and runs the agent
as that environment. Pure functions, no API calls, as in ``objects``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from .objects import Kind

PLACEHOLDER = "@ENV_ID@"


def member_command(argv: Sequence[str], members: Sequence[str]) -> list[str]:
    """``sh -c`` running ``argv`` (an agent's, with :data:`PLACEHOLDER` where its environment
    id goes) as the member whose index is the pod's ``RANK``."""
    words = []
    for word in argv:
        parts = [shlex.quote(p) if p else "" for p in word.split(PLACEHOLDER)]
        words.append('"$TRIALKEEPER_MEMBER"'.join(parts) if PLACEHOLDER in word else shlex.quote(word))
    script = (
        f"set -- {' '.join(shlex.quote(m) for m in members)}; "
        'shift "${RANK:?the training operator sets RANK}" && '
        'TRIALKEEPER_MEMBER="${1:?RANK is beyond the group}" && '
        f"exec {' '.join(words)}"
    )
    return ["sh", "-c", script]


def group_job(kind: Kind, body: dict[str, Any], members: Sequence[str]) -> dict[str, Any]:
    """``body`` (a PyTorchJob with one Master, from ``objects.workload``) made the group's:
    the same pod as a Worker for each member after the first, annotated with the members."""
    if kind.plural != "pytorchjobs":
        raise ValueError(f"a {kind.kind} cannot hold a group of environments")
    specs = body["spec"]["pytorchReplicaSpecs"]
    master = specs["Master"]
    if len(members) > 1:
        specs["Worker"] = {**master, "replicas": len(members) - 1}
    notes = body["metadata"].setdefault("annotations", {})
    notes[MEMBERS_ANNOTATION] = ",".join(members)
    return body


MEMBERS_ANNOTATION = "trialkeeper/group-members"
