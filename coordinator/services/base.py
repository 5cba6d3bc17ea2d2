"""The environment-service contract: how the coordinator gets environments on a platform.

A service knows one platform. It starts an environment (something that runs one agent),
reports what it observes about the environments it started, and stops them. The
coordinator owns the lifecycle; a service only acts and observes.

The contract every service keeps (and the contract test suite, ``tests/contract``, checks
on every platform through a real agent dialing a real gRPC endpoint):

* ``start`` is idempotent per ``request.env_id``: starting the same id twice, one after the
  other or at the same time, starts one environment and answers the same ``platform_id``
  (non-empty: ``trialkeeper envs`` shows it). It returns once the platform accepted the
  request, not once the agent is up.
* Errors are returned as data (``StartResult.error``, ``Observation.state == "failed"``
  with the reason in ``detail``), never raised into the coordinator's loop. An agent that
  cannot run (a bad option, a missing interpreter) is one such error.
* ``poll`` reports every environment the service started and has not forgotten; an id it
  does not know is reported as ``"unknown"``. Once an agent has registered, its
  environment is ``"running"``; once it ended, ``"exited"`` or ``"failed"``.
* ``stop`` is idempotent and returns once the environment's processes are gone or the
  platform accepted the stop; stopping an unknown id is a no-op. The coordinator has
  asked the agent to shut down over its stream before; ``grace_s`` is how long the
  agent may take before it is killed.
* The experiment token reaches the agent through its environment or a 0600 file, never
  its argv.
* Every environment a service starts is findable on the platform afterwards by the
  experiment id alone (a job name prefix, a label, a marker file), so that ``sweep`` can
  find and remove what a crashed coordinator left behind.
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from ..config.platform import TrainingServiceConfig

# What a platform says of an environment is the core's word (plain data it decides on),
# handed on here for services and plug-ins.
from ..engine.events import Observation, ObservedState  # noqa: F401

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config.experiment import ExperimentConfig


# The ids the coordinator gives the environments it starts.
_STARTED_ENV_ID = re.compile(r"env-[0-9]+")


def env_id_in_name(name: str, prefix: str) -> str | None:
    """The environment id in a platform job's name made as ``prefix`` + id, or None for a
    name that is not: with experiment ids free to hold dashes, "tk-ab-" must not take
    "tk-ab-cd-env-1", a job of experiment "ab-cd"."""
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    return rest if _STARTED_ENV_ID.fullmatch(rest) else None

@dataclass(frozen=True)
class EnvironmentRequest:
    """Everything a service needs to start one environment."""

    env_id: str
    experiment_id: str
    coordinator_address: str
    token: str
    # Extra command-line arguments for ``trialkeeper agent`` (GPU options, TLS pin).
    agent_args: tuple[str, ...] = ()
    reuse: bool = True
    # With TLS on, agent_args carry --tls-fingerprint (the pin). A service may also hand
    # the agent the certificate itself (PEM) as --tls-cert, an equivalent pin.
    tls_cert_pem: bytes | None = None
    # The platform to start it on, for a service that spans several (hybrid); '' for others.
    platform: str = ""
    # The environments of the group it is the first of (``start_group``), its own id first:
    # a platform that groups environments starts one object for them all.
    group_members: tuple[str, ...] = ()


@dataclass(frozen=True)
class StartResult:
    """The platform's answer to a start: its own id for the environment, or an error."""

    platform_id: str = ""
    error: str | None = None


#: The type of a service's `trainingService` section.
PlatformConfig = TypeVar("PlatformConfig", bound=TrainingServiceConfig)


class EnvironmentService(abc.ABC, Generic[PlatformConfig]):
    """One platform's way to start, observe and stop environments.

    Parameterised by its platform's config class (`EnvironmentService[AcmeConfig]`), so
    `from_config` receives that section typed as it is.
    """

    platform: ClassVar[str]
    #: Agents see the coordinator's file system: trial logs are read in place, not streamed.
    shares_filesystem: ClassVar[bool] = False
    #: Starts environments as groups, one object on the platform per group (``start_group``):
    #: in reuse mode each waiting trial is given a group of as many environments as its nodes.
    groups_environments: bool = False

    @classmethod
    def from_config(cls, config: ExperimentConfig, platform: PlatformConfig, experiment_dir: Path) -> Self:
        """The service for an experiment: `config` is the whole experiment, `platform` its
        `trainingService` section (already checked to be this service's config class),
        `experiment_dir` where the experiment keeps its files. Raise for what makes the
        platform unusable (a missing SDK), with what to install or fix.

        Every registered platform's service defines it; one built by hand need not."""
        raise NotImplementedError(f"{cls.__qualname__} cannot be built from a config")

    @abc.abstractmethod
    def working_directory(self) -> str:
        """Where trials of this experiment run, as a path the agent sees (the code dir)."""

    def shared_checkpoints(self, experiment_dir: Path) -> tuple[Path, str] | None:
        """Where this platform's agents see a directory the coordinator sees too, for the
        experiment's checkpoints: (the coordinator's path, the agents' path); None when
        agents upload them. Agents that share the coordinator's file system see its own."""
        if self.shares_filesystem:
            return experiment_dir / "checkpoints", str(experiment_dir / "checkpoints")
        return None

    @abc.abstractmethod
    async def start(self, request: EnvironmentRequest) -> StartResult:
        """Ask the platform for an environment running one agent."""

    async def start_group(self, group: str, requests: Sequence[EnvironmentRequest]) -> list[StartResult]:
        """Ask the platform for the environments of ``requests`` as one group (``group``: its
        id, its first member's id), one answer each in order. By default each on its own."""
        return list(await asyncio.gather(*(self.start(r) for r in requests)))

    @abc.abstractmethod
    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        """What the platform observes about each of ``env_ids``."""

    @abc.abstractmethod
    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        """End the environment and everything its agent started."""

    def gpu_policy(self, env_id: str) -> tuple[int | None, bool | None]:
        """``(maxTrialNumberPerGpu, useActiveGpu)`` for one environment, where the platform
        sets them per machine; ``None`` for either means the section's own value
        (``TrainingServiceConfig.gpu_sharing`` combines the two, in one place)."""
        return None, None

    def adopt(self, env_id: str, platform_id: str) -> None:
        """After a coordinator restart: take charge of an environment a previous
        coordinator of this experiment started (``platform_id`` is what ``start`` returned),
        so that ``poll`` and ``stop`` cover it. By default nothing is adopted and ``poll``
        reports it ``unknown``; its agent is still watched through its heartbeats."""

    async def ready_adopted(self, experiment_id: str) -> None:
        """After a restart, once every environment is adopted and before any trial is placed:
        give the adopted environments what this coordinator's trials need that the previous
        coordinator did not send (the code directory may have changed since). Errors are
        logged, not raised. By default there is nothing to send."""

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        """Find the environments of ``experiment_id`` the platform still holds whose ids are
        not in ``keep``, stop them, and return their ids (``trialkeeper clean``, ``resume``).

        Works from the platform alone (labels, names), not from this service's memory, so a
        fresh service finds what a crashed coordinator started; ``clean`` calls it on a
        service whose ``prepare`` never ran. "Still holds" means something runs or is queued
        there: an environment that ended and left only logs is not returned. Nothing is
        waited for: an orphan's agent has no coordinator to report to, so it is killed.
        Environments of other experiments are never touched. Errors are logged, and the
        environments that could not be removed are left out of the result.

        The default finds nothing: a platform that cannot label what it starts cannot
        clean up after a crash."""
        return []

    async def prepare(self) -> None:
        """Once per experiment, before any start (upload code, check access)."""

    async def close(self) -> None:
        """Release what the service holds; environments are stopped before this."""
