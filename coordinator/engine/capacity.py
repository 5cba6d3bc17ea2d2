"""What the scheduler sees of the fleet: each environment's capacity (its slots, GPUs and
whether it takes trials now), refreshed only for the environments that changed, and the most
GPUs one environment offers, recomputed only when an environment's status or agent changed.

The fleet (fleet.py) owns the environments and tells this index what changed; the engine
takes the changed environments for the waiting trials' index. Nothing here does I/O."""

from __future__ import annotations

from collections.abc import Mapping

from . import environments, scheduler
from .model import EnvState
from .policy import Policy
from .states import EnvStatus

__all__ = ["Capacity"]


class Capacity:
    """The scheduler's view of ``envs`` (the fleet's own dict, read as it grows)."""

    def __init__(self, envs: Mapping[str, EnvState], policy: Policy) -> None:
        self._envs = envs
        self._policy = policy
        # Platforms that could not be prepared: their environments (adopted on a resume)
        # take no trial, which would find no code there.
        self._unprepared = {p.name for p in policy.platforms if p.unusable}
        self._views: dict[str, scheduler.EnvCapacity] = {}
        self._stale: set[str] = set()  # views to bring up to date
        self._changed: set[str] = set()  # handed to the waiting trials' index
        # Bumped when an environment's status or agent changes: what gpus_offered() answered
        # holds until then (every submit asks; a walk over 10,000 environments was quadratic).
        self._generation = 0
        self._offered: tuple[tuple[int, int], int | None] | None = None

    def changed(self, env_id: str) -> None:
        """What ``env_id`` can take may have changed (a slot or GPU freed, its agent came or
        went, its status moved): the next pass looks at it."""
        self._stale.add(env_id)
        self._changed.add(env_id)

    def status_changed(self, env_id: str) -> None:
        """``env_id``'s status or agent changed: what it offers is asked anew."""
        self._generation += 1
        self.changed(env_id)

    def take_changed(self) -> set[str]:
        """The environments whose capacity may have changed since the last take."""
        changed = self._changed
        if changed:  # most takes find nothing: no new container for those
            self._changed = set()
        return changed

    def views(self) -> Mapping[str, scheduler.EnvCapacity]:
        """What the scheduler places on, up to date."""
        views = self._views
        if len(views) != len(self._envs):
            for env in self._envs.values():
                if env.id not in views:
                    views[env.id] = scheduler.EnvCapacity(env.id, env.trial_slots, env.holders,
                                                          platform=self._policy.counted_as(env.platform))
                    self.changed(env.id)
        for env_id in self._stale:
            _refresh(views[env_id], self._envs[env_id], self._unprepared)
        self._stale = set()
        return views

    def gpus_offered(self) -> int | None:
        """The most GPUs one environment offers (see environments.gpus_offered)."""
        stamp = (len(self._envs), self._generation)
        if self._offered is None or self._offered[0] != stamp:
            self._offered = (stamp, environments.gpus_offered(self._envs.values(), self._policy))
        return self._offered[1]


def _refresh(view: scheduler.EnvCapacity, env: EnvState, unprepared: set[str]) -> None:
    """What the scheduler sees of ``env``, brought up to date."""
    view.holders, view.gpus, view.use_active_gpu = env.holders, env.gpus, env.use_active_gpu
    view.accepting = (
        env.status in (EnvStatus.READY, EnvStatus.BUSY)
        and env.link is not None
        and not env.draining
        and not env.shutdown_sent
        and not (env.single_use and env.used)
        and env.platform not in unprepared  # trials there would find no code
    )
