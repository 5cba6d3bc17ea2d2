"""The supply of environments: how many of each platform to ask for, and when to give a
platform up.

The third of the engine's machines, beside the trials' book (``book.py``) and the fleet
(``fleet.py``). It keeps no environment: it is told the live ones and the waiting trials,
and answers which platforms to start environments on; the fleet makes them. It counts the
starts that failed in a row on each platform, and gives a platform up after too many.
Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from .environments import wanted_new
from .model import EnvState
from .policy import Policy

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Environments to start, one platform name each, in order; and then, where one is due
    to be given up, its name (asked again once these are started)."""

    starts: list[str] = field(default_factory=list)
    give_up: str = ""


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

    def plan(self, live: Sequence[EnvState], waiting: int) -> Plan:
        """What to start now, with ``live`` environments up and ``waiting`` trials waiting."""
        plan = Plan()
        if not self.started or self.env_error:
            return plan
        for p in self.policy.platforms:
            if p.name in self.platform_errors:
                continue
            wanted = wanted_new(self.policy, p, live, self.platform_errors, waiting)
            if wanted > 0 and self._failed_starts.get(p.name, 0) >= self.limit:
                # The others take over, those before it too: asked again once these start.
                plan.give_up = p.name
                return plan
            plan.starts += [p.name] * max(0, wanted)
        return plan

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
