"""The supply of environments: how many of each platform to ask for, and when to give a
platform up.

The third of the engine's machines, beside the trials' book (``book.py``) and the fleet
(``fleet.py``). It keeps no environment: it is told the live ones and the waiting trials,
and answers which platforms to start environments on; the fleet makes them. It counts the
starts that failed in a row on each platform, and gives a platform up after too many.
Nothing here does I/O or reads a clock.

A platform that **groups environments** (one object per group: a PyTorchJob with a Master
and Workers, a Framework with a task role per node) is asked, in reuse mode, for a group per
waiting trial that has none started for it yet, of as many environments as the trial has
nodes, in queue order while its ``environmentCount`` has room: one instruction with the
group's id and members. The group's environments are held for that trial while it waits
(``multinode.GangRoom``): the gang starts on them as they come up, and no other trial takes them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from .environments import wanted_new
from .model import EnvState
from .policy import PlatformPolicy, Policy
from .waiting import WaitingTrials

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Environments to start, one platform name each, in order; and then, where one is due
    to be given up, its name (asked again once these are started)."""

    starts: list[str] = field(default_factory=list)
    give_up: str = ""
    # Groups to start, each for a waiting trial: (platform, trial id, how many environments).
    groups: list[tuple[str, str, int]] = field(default_factory=list)

    def requests(self) -> list[tuple[str, int, str]]:
        """Every start as (platform, how many, for which trial): groups first, then one each."""
        return [(p, n, t) for p, t, n in self.groups] + [(p, 1, "") for p in self.starts]


def held(live: Sequence[EnvState], queue: WaitingTrials) -> dict[str, str]:
    """The live environments held for a waiting trial, with its id: those of a whole group
    started for it (one that lost a member is not held, and the trial is given another)."""
    members: dict[tuple[str, str], list[str]] = {}
    for e in live:
        if e.group_for and e.group_for in queue:
            members.setdefault((e.group_for, e.group), []).append(e.id)
    return {env_id: trial_id for (trial_id, _), ids in members.items()
            if len(ids) >= queue.demand(trial_id).nodes for env_id in ids}


class Supply:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.started = False
        self.env_error = ""
        # Platforms given up on (too many environments in a row failed to start), with why.
        self.platform_errors: dict[str, str] = {
            p.name: f"could not be prepared: {p.unusable}" for p in policy.platforms if p.unusable
        }
        self._failed_starts: dict[str, int] = {}  # by platform, since its last agent registered

    @property
    def limit(self) -> int:
        """Starts failed in a row after which a platform is given up."""
        return max(3, 2 * self.policy.trial_concurrency)

    def plan(self, live: Sequence[EnvState], waiting: int, queue: WaitingTrials | None = None) -> Plan:
        """What to start now, with ``live`` environments up and ``waiting`` trials waiting
        (``queue``: which, for a platform that groups environments)."""
        plan = Plan()
        if not self.started or self.env_error:
            return plan
        grouped = set(held(live, queue).values()) if queue is not None else set()
        for p in self.policy.platforms:
            if p.name in self.platform_errors:
                continue
            groups = p.reuse and p.groups_environments
            if groups:
                wanted = self._groups(p, live, queue, grouped, plan)
            else:
                wanted = wanted_new(self.policy, p, live, self.platform_errors, waiting)
            if wanted > 0 and self._failed_starts.get(p.name, 0) >= self.limit:
                # The others take over, those before it too: asked again once these start.
                plan.give_up = p.name
                return plan
            plan.starts += [] if groups else [p.name] * max(0, wanted)
        return plan

    def _groups(self, p: PlatformPolicy, live: Sequence[EnvState], queue: WaitingTrials | None,
                grouped: set[str], plan: Plan) -> int:
        """Groups for the waiting trials ``p`` may run that have none (``grouped``), in queue
        order while ``p``'s pool has room; a trial that does not fit stops the walk (a large
        gang is not passed by smaller trials). Returns the environments wanted."""
        room = p.environment_count - sum(1 for e in live if e.platform == p.name)
        wanted = 0
        if queue is None or room <= 0:
            return 0
        for trial_id in queue:
            demand = queue.demand(trial_id)
            if trial_id in grouped or demand.rank(p.name) is None:
                continue
            if demand.nodes > room - wanted:
                break
            wanted += demand.nodes
            grouped.add(trial_id)
            if self._failed_starts.get(p.name, 0) < self.limit:
                plan.groups.append((p.name, trial_id, demand.nodes))
        return wanted

    def start_failed(self, platform: str) -> None:
        self._failed_starts[platform] = self._failed_starts.get(platform, 0) + 1

    def joined(self, platform: str) -> None:
        """An agent of ``platform`` registered: its starts work."""
        self._failed_starts[platform] = 0

    def give_up(self, platform: str, last_failure: str) -> None:
        """Too many of ``platform``'s environments in a row failed to start (the last with
        ``last_failure``): it starts no more. The experiment goes on with the others, and
        ends its trials only when every platform is given up."""
        self.platform_errors[platform] = f"{self.limit} environments in a row failed to start; last: {last_failure}"
        names = [p.name for p in self.policy.platforms]
        alive = [n for n in names if n not in self.platform_errors]
        if len(names) == 1:
            self.env_error = self.platform_errors[platform]
        elif not alive:
            self.env_error = "every platform failed: " + "; ".join(f"{n}: {self.platform_errors[n]}" for n in names)
        log.error("platform %s: %s", platform, self.platform_errors[platform])
