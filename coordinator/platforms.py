"""The platform registry: `trainingService.platform` -> its config class and its service.

Each platform is named once, here (built-in) or by its plug-in's entry point, with its
config class and service class given as "module:attr" strings: parsing a config imports
the one platform it names, and creating its service imports that service (and its SDK)
alone.

A plug-in registers under the entry-point group `trialkeeper.environment_services`, the
entry point's name being the platform's name. It points at a `Platform`:

    [project.entry-points."trialkeeper.environment_services"]
    acme = "trialkeeper_acme:PLATFORM"

    PLATFORM = Platform("acme", config="trialkeeper_acme:AcmeConfig",
                        service="trialkeeper_acme:AcmeService")

The older form still works: the entry point names a factory `(config, experiment_dir) ->
EnvironmentService`, and its module registers its config class with
`register_training_service` when imported. A built-in platform of the same name wins.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import typing
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from .config.platform import TrainingServiceConfig
from .config.walk import register_variants, specs
from .engine.policy import PlatformPolicy, Policy

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "TRAINING_SERVICES",
    "Platform",
    "PlatformLoadError",
    "factory",
    "platform",
    "platform_names",
    "register_training_service",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "trialkeeper.environment_services"

# (config, experiment directory) -> its EnvironmentService: a plug-in of the older form.
Factory = Callable[[Any, Path], Any]

# The contract every service implements, named as the services are: the registry is below
# the config and the services, and imports neither.
_SERVICE_BASE = "trialkeeper.coordinator.services.base:EnvironmentService"


class PlatformLoadError(ImportError):
    """A platform whose config class or service cannot be imported (a broken plug-in,
    a "module:attr" that names nothing)."""


def _load(target: str, what: str) -> Any:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PlatformLoadError(f"{what} {target!r} is not of the form 'module:attr'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a plug-in's module may fail in any way
        raise PlatformLoadError(f"{what} {target!r}: cannot import {module_name}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PlatformLoadError(f"{what} {target!r}: {module_name} has no {attr!r}") from None


@dataclass(frozen=True)
class Platform:
    """One platform: the name `trainingService.platform` gives it, its config class (a
    frozen kw_only dataclass subclass of TrainingServiceConfig whose PLATFORM is `name`)
    and its service (a subclass of EnvironmentService), each as "module:attr"."""

    name: str
    config: str
    service: str

    def config_class(self) -> type[TrainingServiceConfig]:
        """The config class, imported now; PlatformLoadError when it is not one."""
        cls = _load(self.config, f"platform {self.name!r}: config")
        _check_config_class(cls, self.name)
        return typing.cast(type[TrainingServiceConfig], cls)

    def service_class(self) -> type[Any]:
        """The service class (an EnvironmentService), imported now (with its SDK)."""
        base = _load(_SERVICE_BASE, "the service contract")
        cls = _load(self.service, f"platform {self.name!r}: service")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PlatformLoadError(f"platform {self.name!r}: {self.service} is not an EnvironmentService")
        return cls


def _builtin(name: str, config: str, service: str) -> Platform:
    package = f"{__package__}.services"
    return Platform(name, f"{package}.{config}", f"{package}.{service}")


_KUBERNETES = "kubernetes.service:KubernetesEnvironmentService"  # one service, four operators

#: The built-in platforms, each named here once.
BUILTIN: dict[str, Platform] = {
    p.name: p
    for p in (
        _builtin("local", "local_config:LocalConfig", "local:LocalEnvironmentService"),
        _builtin("remote", "remote.config:RemoteConfig", "remote.service:RemoteEnvironmentService"),
        _builtin("slurm", "slurm_config:SlurmConfig", "slurm:SlurmEnvironmentService"),
        _builtin("kubernetes", "kubernetes.config:KubernetesConfig", _KUBERNETES),
        _builtin("kubeflow", "kubernetes.config:KubeflowConfig", _KUBERNETES),
        _builtin("frameworkcontroller", "kubernetes.config:FrameworkControllerConfig", _KUBERNETES),
        _builtin("adl", "kubernetes.config:AdlConfig", _KUBERNETES),
        _builtin("ray", "ray.config:RayConfig", "ray.service:RayEnvironmentService"),
        _builtin("openpai", "openpai_config:OpenPaiConfig", "openpai:OpenPaiEnvironmentService"),
        _builtin("dlts", "dlts_config:DltsConfig", "dlts:DltsEnvironmentService"),
        _builtin("aml", "aml.config:AmlConfig", "aml.service:AmlEnvironmentService"),
        _builtin("dlc", "dlc.config:DlcConfig", "dlc.service:DlcEnvironmentService"),
        # Several of the above at once: NNI's `trainingService` given as a list.
        _builtin("hybrid", "hybrid_config:HybridConfig", "hybrid:HybridEnvironmentService"),
    )
}

# Config classes registered by `register_training_service` (plug-ins of the older form,
# and tests), and factories of such plug-ins, by platform name.
_registered: dict[str, type[TrainingServiceConfig]] = {}
_factories: dict[str, Factory] = {}
_from_entry_points: dict[str, Platform | None] = {}


@functools.cache
def _entry_points() -> dict[str, metadata.EntryPoint]:
    # Read once per process: scanning every installed distribution costs milliseconds.
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _entry_point(name: str) -> metadata.EntryPoint | None:
    found = _entry_points().get(name)
    if found is None:
        # Not there when first read: a distribution may have been put on the path since.
        _entry_points.cache_clear()
        found = _entry_points().get(name)
    return found


def platform_names() -> list[str]:
    """Every platform a config may name: built-in, registered, then installed plug-ins."""
    names = dict.fromkeys([*BUILTIN, *_registered])
    names.update(dict.fromkeys(_entry_points()))
    return list(names)


def _plugin(name: str) -> Platform | None:
    """The installed plug-in of this name, loaded once; None when there is none."""
    if _from_entry_points.get(name) is None:
        ep = _entry_point(name)
        found: Platform | None = None
        if ep is not None:
            try:
                loaded = ep.load()
            except Exception as e:  # a plug-in may fail in any way; the others must not
                raise PlatformLoadError(f"platform {name!r}: plug-in {ep.value} cannot be loaded: {e}") from e
            if isinstance(loaded, Platform):
                if loaded.name != name:
                    raise PlatformLoadError(f"platform {name!r}: plug-in {ep.value} declares platform {loaded.name!r}")
                found = loaded
            elif callable(loaded):
                _factories[name] = loaded  # the older form: its import registered its config
            else:
                raise PlatformLoadError(f"platform {name!r}: plug-in {ep.value} is neither a Platform nor a factory")
        _from_entry_points[name] = found
    return _from_entry_points[name]


def platform(name: str) -> Platform | None:
    """The platform registered as `name` (built-in first, then plug-ins), or None."""
    # A plug-in's entry point is loaded even when its config class was registered already
    # (its module imported by hand): for the older form, that is where its factory is.
    return BUILTIN[name] if name in BUILTIN else _plugin(name)


def config_class(name: str) -> type[TrainingServiceConfig]:
    """The config class of platform `name`: KeyError when none is known by that name,
    PlatformLoadError when it cannot be imported."""
    if name in BUILTIN:
        return BUILTIN[name].config_class()
    if name in _registered:
        return _registered[name]
    found = _plugin(name)
    if found is not None:
        return found.config_class()
    if name in _registered:  # an older plug-in registered it on import
        return _registered[name]
    if name in _factories:
        raise PlatformLoadError(
            f"platform {name!r}: its plug-in registered no config class (point its entry point at a "
            "Platform, or register the class with register_training_service)"
        )
    raise KeyError(name)


class _ConfigClasses(MutableMapping[str, type[TrainingServiceConfig]]):
    """Platform name -> config class, importing a platform's config only when asked for it."""

    def __getitem__(self, name: str) -> type[TrainingServiceConfig]:
        return config_class(name)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return name in BUILTIN or name in _registered or _entry_point(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(platform_names())

    def __len__(self) -> int:
        return len(platform_names())

    def __setitem__(self, name: str, cls: type[TrainingServiceConfig]) -> None:
        if cls.__dict__.get("PLATFORM") != name:
            raise ValueError(f"{cls.__qualname__}.PLATFORM is not {name!r}")
        register_training_service(cls)

    def __delitem__(self, name: str) -> None:
        del _registered[name]


TRAINING_SERVICES: MutableMapping[str, type[TrainingServiceConfig]] = _ConfigClasses()
register_variants(TrainingServiceConfig, "platform", TRAINING_SERVICES, list_form=("hybrid", "platforms"))

_TS = TypeVar("_TS", bound=type[TrainingServiceConfig])


def _check_config_class(cls: object, name: str | None) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, TrainingServiceConfig)):
        raise TypeError(f"{cls!r} is not a dataclass subclass of TrainingServiceConfig")
    platform_name = cls.__dict__.get("PLATFORM")
    if not isinstance(platform_name, str) or not platform_name:
        raise TypeError(f"{cls.__qualname__} must declare its own PLATFORM: ClassVar[str]")
    if name is not None and platform_name != name:
        raise TypeError(f"{cls.__qualname__}.PLATFORM is {platform_name!r}, registered as {name!r}")
    # Refuse field types the walker cannot validate now, rather than at parse time.
    specs(typing.cast(type, cls))


def register_training_service(cls: _TS) -> _TS:
    """Make `cls` the config of `trainingService.platform: cls.PLATFORM`; use as a decorator.

    For plug-ins whose entry point is a factory; a `Platform` needs no call. `cls` must be
    a dataclass subclass of TrainingServiceConfig (frozen and kw_only, like the base) that
    declares `PLATFORM: ClassVar[str]` and uses field types the walker can validate.
    Raises TypeError or ValueError otherwise, or if the name is taken.
    """
    _check_config_class(cls, None)
    name = cls.__dict__["PLATFORM"]
    builtin = BUILTIN.get(name)
    existing = _registered.get(name) or (builtin.config_class() if builtin else None)
    if existing is not None and existing is not cls:
        raise ValueError(f"platform {name!r} is already registered by {existing.__qualname__}")
    if builtin is None:
        _registered[name] = cls
    return cls


def factory(name: str) -> Factory | None:
    """The factory a plug-in of the older form registered for ``name``, if any."""
    return _factories.get(name)


def policy_of(
    config: Any, experiment_id: str, sections: list[tuple[TrainingServiceConfig, Any]], broken: dict[str, str],
    experiment_dir: Path, checkpoint_root: Path,
) -> Policy:
    """What the decision core needs of an experiment's config (an ExperimentConfig) and of
    each platform's section with its service (``broken``: platforms that could not be
    prepared, with why). ``checkpoint_root``: the experiment's checkpoint directory here;
    a platform whose agents see it too writes checkpoints straight into it."""
    settings = config.coordinator

    def platform_policy(ts: TrainingServiceConfig, member: Any) -> PlatformPolicy:
        return PlatformPolicy(
            # A service handed in may run another platform than the section names.
            name=member.platform if len(sections) == 1 else ts.platform, reuse=bool(ts.reuse_mode),
            # Enough for trialConcurrency trials of trialNodes environments each, unless given.
            environment_count=ts.effective_environment_count(config.trial_concurrency * config.trial_nodes),
            trial_slots=ts.trial_slots_per_environment(config.trial_concurrency),
            simulated_gpus=ts.simulated_gpus, gpu_indices=tuple(ts.gpu_indices) if ts.gpu_indices else None,
            shares_filesystem=member.shares_filesystem,
            # A platform that could not be prepared starts nothing, and knows no directory.
            working_directory="" if ts.platform in broken else member.working_directory(),
            unusable=broken.get(ts.platform, ""), gpu_sharing=tuple(ts.gpu_sharing()),
            checkpoint_dir=shared_checkpoint_dir(member, experiment_dir, checkpoint_root),
            groups_environments=bool(getattr(member, "groups_environments", False)),
        )

    ts = config.training_service
    return Policy(
        experiment_id=experiment_id, trial_concurrency=config.trial_concurrency,
        platforms=tuple(platform_policy(s, m) for s, m in sections),
        trial_platforms=tuple(ts.trial_platforms or ()),
        max_trial_retries=config.max_trial_retries, retry_failed_trials=config.retry_failed_trials,
        max_trial_duration_s=float(config.max_trial_duration or 0.0), trial_env=dict(config.trial_env),
        trial_gpu_memory=config.trial_gpu_memory, heartbeat_interval_s=settings.heartbeat_interval,
        max_heartbeats_per_second=settings.max_heartbeats_per_second,
        agent_lost_timeout_s=settings.agent_lost_timeout, trial_lost_timeout_s=settings.trial_lost_timeout,
        placement=ts.placement, checkpoint_storage=config.checkpoint_storage or "",
        max_checkpoint_bytes=config.max_checkpoint_size, checkpoints_per_trial=config.checkpoints_per_trial,
        pause_grace_s=config.pause_grace_period, progress_resets_retries=config.progress_resets_retries,
        checkpoints_after_end=config.checkpoints_after_end,
        trial_nodes=config.trial_nodes, gang_across_platforms=config.gang_across_platforms,
    )


def checkpoint_root(experiment_dir: Path, services: list[Any]) -> Path:
    """The experiment's checkpoint directory on this machine: on the shared storage the
    platforms' agents see, if one does, else in the experiment's directory."""
    for member in services:
        shared = member.shared_checkpoints(experiment_dir)
        if shared is not None:
            return Path(shared[0])
    return experiment_dir / "checkpoints"


def shared_checkpoint_dir(member: Any, experiment_dir: Path, root: Path) -> str:
    """Where ``member``'s agents see the checkpoint directory ``root`` ("": they do not, and
    upload checkpoints to the coordinator)."""
    shared = member.shared_checkpoints(experiment_dir)
    return shared[1] if shared is not None and Path(shared[0]) == root else ""
