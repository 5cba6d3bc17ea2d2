"""The `trainingService` section for `platform: ray`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...config.platform import EnvironmentPoolConfig
from ...config.rules import (
    NON_EMPTY_STR,
    POSITIVE_DURATION,
    POSITIVE_INT,
    SIZE,
    Issues,
    rule,
    split_address,
)

_ADDRESS_TEXT = "'auto', 'ray://HOST:PORT' (Ray Client) or 'HOST:PORT' (the head node's GCS)"


def _ray_address(value: object) -> object:
    """Accept the address forms ``ray.init`` does, checking the host:port part."""
    if not isinstance(value, str) or value == "auto":
        return value
    try:
        split_address(value.removeprefix("ray://"), allow_port_zero=False)
    except ValueError as e:
        raise ValueError(f"expected {_ADDRESS_TEXT}: {e}") from None
    return value


_RAY_ADDRESS = rule(_ADDRESS_TEXT, coerce=_ray_address)
_NON_NEGATIVE_NUMBER = rule("a non-negative number", lambda v: v >= 0)
_RESOURCES = rule(
    "a mapping of Ray resource names to non-negative amounts",
    lambda v: all(k.strip() and amount >= 0 for k, amount in v.items()),
)
# Ray's placement group strategies (`placementStrategy`).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_PLACEMENT_STRATEGY = rule(f"one of {', '.join(PLACEMENT_STRATEGIES)}", lambda v: v in PLACEMENT_STRATEGIES)
# Resources set through their own fields; `resources` may not name them again.
_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "memory"})


@dataclass(frozen=True, kw_only=True)
class RayConfig(EnvironmentPoolConfig):
    """Trials run by agents that live in actors of an existing Ray cluster.

    Each environment is one detached, named actor holding `num_cpus`/`num_gpus` (and
    `memory`, `resources`), so Ray's scheduler decides where it runs; the GPUs Ray assigns
    to the actor are the ones the agent hands to trials. The trial code directory is packed
    once and sent to the nodes through Ray's object store, unless `runtimeEnv.working_dir`
    names where Ray fetches the code from instead.
    """

    PLATFORM: ClassVar[str] = "ray"
    address: str = field(metadata=_RAY_ADDRESS)
    # Where the actors are named: `sweep` finds them there by the experiment id.
    namespace: str = field(default="trialkeeper", metadata=NON_EMPTY_STR)
    num_cpus: float = field(default=1.0, metadata=_NON_NEGATIVE_NUMBER)
    num_gpus: float = field(default=0.0, metadata=_NON_NEGATIVE_NUMBER)
    memory: int | None = field(default=None, metadata=SIZE)
    resources: dict[str, float] = field(default_factory=dict, metadata=_RESOURCES)
    runtime_env: dict[str, Any] = field(default_factory=dict)
    use_active_gpu: bool = False
    max_trial_number_per_gpu: int = field(default=1, metadata=POSITIVE_INT)
    # A directory on the Ray nodes for the agents' trial directories and logs
    # (default: `trialkeeper-ray` in the node's temporary directory).
    node_working_directory: str | None = field(default=None, metadata=NON_EMPTY_STR)
    # How long connecting to the cluster, or one request to it, may take.
    ray_timeout: float = field(default=60.0, metadata=POSITIVE_DURATION)
    # Every actor of the experiment in one placement group of this strategy (placement.py).
    placement_strategy: str | None = field(default=None, metadata=_PLACEMENT_STRATEGY)
    # In reuse mode, a placement group of that strategy per multi-node trial instead: its
    # actors started for the trial as it waits, a bundle each.
    placement_group_per_trial: bool = False

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues: Issues = []
        reserved = sorted(_RESERVED_RESOURCES & set(values.get("resources") or {}))
        if reserved:
            issues.append(
                (
                    "resources",
                    (
                        f"give {', '.join(reserved)} through {names['num_cpus']}, "
                        f"{names['num_gpus']} and {names['memory']} instead"
                    ),
                )
            )
        if values.get("placement_strategy") and not (
            values.get("num_cpus") or values.get("num_gpus") or values.get("memory") or values.get("resources")
        ):
            need = f"set {names['num_cpus']} or {names['num_gpus']} above 0"
            issues.append(("placement_strategy", f"a placement group's bundles need a resource: {need}"))
        if values.get("placement_group_per_trial") and not values.get("placement_strategy"):
            need = f"needs {names['placement_strategy']}, the strategy of each trial's group"
            issues.append(("placement_group_per_trial", f"{need}: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"))
        if values.get("placement_group_per_trial") and values.get("reuse_mode", True) is False:
            need = f"needs {names['reuse_mode']}: true (its actors' agents take trial after trial)"
            issues.append(("placement_group_per_trial", f"{need}; set it, or leave this out"))
        working_dir = (values.get("runtime_env") or {}).get("working_dir")
        if working_dir is not None and not isinstance(working_dir, str):
            issues.append(("runtime_env", f"working_dir must be a path or URI string, got {working_dir!r}"))
        return issues
