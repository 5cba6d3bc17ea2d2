"""An environment's actor on Ray: made, watched and stopped, each call blocking.

:class:`Actor` is what the service keeps of one (its handle, the calls under way, what
they answered); :class:`Actors` makes the actor and asks it to launch its agent, takes in
without waiting what the cluster reported, finds an adopted environment's actor by name,
and stops one. The service (``service.py``) runs each in its thread pool, under a deadline.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..lifecycle import Record
from .cluster import RaySetupError, actor_options, connected_ray, fetch, is_ready
from .node import SETTLE_S, AgentHost

if TYPE_CHECKING:
    from ..base import EnvironmentRequest
    from .config import RayConfig

log = logging.getLogger(__name__)


@dataclass
class Actor(Record):
    """An environment's actor; ``platform_id`` is ``<namespace>/<actor name>``."""

    actor: Any = None  # the ActorHandle
    launched: Any = None  # ObjectRef of launch()/describe(): where the agent runs
    ended: Any = None  # ObjectRef of wait(): how the agent ended
    info: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    released: bool = False  # the actor was killed, freeing its resources

    @property
    def namespace(self) -> str:
        return self.platform_id.partition("/")[0]

    @property
    def name(self) -> str:
        return self.platform_id.partition("/")[2]


class Actors:
    """The blocking Ray calls on the actors of one platform section (``config``)."""

    def __init__(self, config: RayConfig) -> None:
        self.config = config
        self._actor_class: Any = None

    def create(self, env: Actor, request: EnvironmentRequest, placement: dict[str, Any], code: str | None,
               code_ref: Any, linger_s: float) -> None:
        """Make ``env``'s actor (``placement``: options that put it in a placement group) and
        ask it to launch its agent (``code``: the packed code's hash, None for the runtime
        env's working_dir), without waiting."""
        ray = connected_ray()
        if self._actor_class is None:
            self._actor_class = ray.remote(AgentHost)
        ts = self.config
        options = {**actor_options(ts, env.name), **placement}
        try:
            env.actor = self._actor_class.options(**options).remote()
        except ValueError as e:  # the name is taken: an environment of a previous run
            raise RaySetupError(
                f"cannot create Ray actor {env.name!r} in namespace {ts.namespace!r}: {e}"
            ) from e
        spec = {
            "experiment_id": request.experiment_id,
            "env_id": request.env_id,
            "coordinator": request.coordinator_address,
            "agent_args": list(request.agent_args),
            "num_gpus": ts.num_gpus,
            "node_dir": ts.node_working_directory,
            "code": code,
            "linger_s": linger_s,
        }
        env.launched = env.actor.launch.remote(spec, request.token, code_ref)
        env.ended = env.actor.wait.remote()
        log.info("environment %s: Ray actor %s requested", env.env_id, env.name)

    def take_in(self, envs: list[Actor]) -> None:
        """Take in, without waiting, every launch and end the cluster has reported."""
        ray = connected_ray()
        for env in envs:
            if env.adopted and env.actor is None and not env.stop_requested:
                self._attach(env)
        pending: dict[Any, tuple[Actor, str]] = {}
        for env in envs:
            if env.launched is not None and env.info is None:
                pending[env.launched] = (env, "info")
            if env.ended is not None and env.result is None:
                pending[env.ended] = (env, "result")
        if pending:
            refs = list(pending)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
            for ref in ready:
                env, slot = pending[ref]
                setattr(env, slot, fetch(ray, ref))
        for env in envs:
            if env.result is not None and not env.released and env.actor is not None:
                # The agent is gone: free the actor's CPUs and GPUs for the next environment.
                with contextlib.suppress(Exception):
                    ray.kill(env.actor, no_restart=True)
                env.released = True

    def _attach(self, env: Actor) -> None:
        """An adopted environment: find its actor by name and ask it how its agent does."""
        ray = connected_ray()
        try:
            env.actor = ray.get_actor(env.name, namespace=self.config.namespace)
        except ValueError:
            env.result = {"state": "failed", "detail": f"Ray actor {env.name} no longer exists"}
            env.released = True
            return
        env.launched = env.actor.describe.remote()
        env.ended = env.actor.wait.remote()

    def stop(self, env: Actor, grace_s: float) -> None:
        ray = connected_ray()
        actor = env.actor
        if actor is None:  # adopted and not seen yet, or found by a sweep
            try:
                actor = ray.get_actor(env.name, namespace=env.namespace)
            except ValueError:
                env.released = True
                return
        if env.launched is not None:
            # A launch under way finishes first.
            ray.wait([env.launched], timeout=min(5.0, SETTLE_S))
        if env.launched is None or env.info is not None or is_ready(ray, env.launched):
            # Let the agent finish what the coordinator asked of it, then end its whole tree;
            # an actor that was never placed holds no processes and just goes.
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(grace_s), timeout=grace_s + SETTLE_S / 3)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        env.released = True
        log.info("environment %s: Ray actor %s stopped", env.env_id, env.name)
