"""Several platforms behind one service: each environment lives on one of them.

The coordinator says on which platform to start an environment (``request.platform``);
from then on its id is routed to that platform's service for ``poll``, ``stop`` and GPU
policy. After a restart the coordinator assigns each stored environment its platform again
(:meth:`HybridEnvironmentService.assign`) before it adopts it. A platform that cannot be
prepared (an unreachable machine, a missing SDK) answers every start with why, so that the
others keep the experiment going; only when none can be prepared does ``prepare`` raise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from .base import EnvironmentRequest, EnvironmentService, Observation, StartResult
from .hybrid_config import HybridConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config.experiment import ExperimentConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["HybridEnvironmentService"]


class HybridEnvironmentService(EnvironmentService[HybridConfig]):
    """One service per platform section, in the config's order."""

    platform: ClassVar[str] = "hybrid"

    def __init__(self, members: dict[str, EnvironmentService[Any]]) -> None:
        if not members:
            raise ValueError("a hybrid service needs at least one platform")
        self.members = members
        self._routes: dict[str, str] = {}  # env id -> platform
        self._broken: dict[str, str] = {}  # platform -> why it could not be prepared

    @classmethod
    def from_config(cls, config: ExperimentConfig, platform: HybridConfig, experiment_dir: Path) -> Self:
        from . import create_service

        # Each platform's service sees the experiment as if it ran on that platform alone.
        return cls({
            section.platform: create_service(dataclasses.replace(config, training_service=section), experiment_dir)
            for section in platform.platforms
        })

    def assign(self, env_id: str, platform: str) -> None:
        """Route ``env_id`` to ``platform`` (after a restart, before ``adopt``)."""
        if platform in self.members:
            self._routes[env_id] = platform

    def platform_of(self, env_id: str) -> str | None:
        return self._routes.get(env_id)

    def broken(self) -> dict[str, str]:
        """Platforms that could not be prepared, with why."""
        return dict(self._broken)

    def _member(self, env_id: str) -> EnvironmentService[Any] | None:
        name = self._routes.get(env_id)
        return None if name is None else self.members[name]

    def working_directory(self) -> str:
        """The first usable platform's: each platform's own is what its trials are told."""
        usable = [m for n, m in self.members.items() if n not in self._broken]
        return usable[0].working_directory()

    async def prepare(self) -> None:
        names = list(self.members)
        results = await asyncio.gather(*(self.members[n].prepare() for n in names), return_exceptions=True)
        for name, result in zip(names, results):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                self._broken[name] = f"{type(result).__name__}: {result}"
                log.error("platform %s cannot be used: %s", name, self._broken[name])
        if len(self._broken) == len(self.members):
            raise RuntimeError(
                "no platform could be prepared: " + "; ".join(f"{n}: {why}" for n, why in self._broken.items())
            )

    def _choose(self, requested: str) -> str:
        if requested:
            return requested
        # A request that names no platform (a caller that does not know of several): the
        # usable platform holding the fewest environments, the first on a tie.
        load = {n: 0 for n in self.members if n not in self._broken} or {n: 0 for n in self.members}
        for name in self._routes.values():
            if name in load:
                load[name] += 1
        return min(load, key=lambda n: load[n])

    async def start(self, request: EnvironmentRequest) -> StartResult:
        name = self._routes.get(request.env_id) or self._choose(request.platform)
        member = self.members.get(name)
        if member is None:
            return StartResult(error=f"no platform {name!r} here; platforms: {', '.join(self.members)}")
        if name in self._broken:
            return StartResult(error=f"platform {name} could not be prepared: {self._broken[name]}")
        self._routes[request.env_id] = name
        return await member.start(dataclasses.replace(request, platform=name))

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        seen = {env_id: Observation("unknown") for env_id in env_ids if env_id not in self._routes}
        by_platform: dict[str, list[str]] = {}
        for env_id in env_ids:
            if env_id in self._routes:
                by_platform.setdefault(self._routes[env_id], []).append(env_id)
        # A platform that raises tells nothing of its environments this time; their agents'
        # timers still run.
        answers = await _each({n: self.members[n].poll(ids) for n, ids in by_platform.items()}, "poll")
        for name, answer in answers.items():
            seen.update((env_id, obs) for env_id, obs in answer.items() if env_id in by_platform[name])
        return seen

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        member = self._member(env_id)
        if member is not None:
            await member.stop(env_id, grace_s)

    def gpu_policy(self, env_id: str) -> tuple[int | None, bool | None]:
        member = self._member(env_id)
        return (None, None) if member is None else member.gpu_policy(env_id)

    def adopt(self, env_id: str, platform_id: str) -> None:
        member = self._member(env_id)
        if member is not None:
            member.adopt(env_id, platform_id)

    async def ready_adopted(self, experiment_id: str) -> None:
        await _each(
            {n: m.ready_adopted(experiment_id) for n, m in self.members.items() if n not in self._broken},
            "ready_adopted",
        )

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        found = await _each({n: m.sweep(experiment_id, keep=keep) for n, m in self.members.items()}, "sweep")
        # Platforms on one machine may both find an environment: each is named once.
        return sorted({env_id for removed in found.values() for env_id in removed})

    async def close(self) -> None:
        await _each({n: m.close() for n, m in self.members.items()}, "close")


async def _each(calls: dict[str, Awaitable[T]], what: str) -> dict[str, T]:
    """Await every platform's call at once; the answers of those that did not raise (one
    that did is logged: a service must return errors as data, and the others go on)."""
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    answers: dict[str, T] = {}
    for name, result in zip(calls, results):
        if isinstance(result, Exception):
            log.error("platform %s raised on %s: %s", name, what, result, exc_info=result)
        elif isinstance(result, BaseException):
            raise result
        else:
            answers[name] = result
    return answers
