"""The experiment's placement group on Ray (``placementStrategy``), which every actor goes into.

With a strategy set, the first launch reserves one detached placement group named
``trialkeeper/<experiment id>`` with one bundle per environment the experiment keeps (each
bundle what one actor asks for: its CPUs, GPUs, memory and custom resources), and every
environment's actor is created in it, taking whichever bundle is free (a replaced
environment's actor takes the bundle the lost one left). So the ranks of a multi-node trial
always run in actors of one placement group: ``PACK``/``STRICT_PACK`` keep them on as few
nodes as can hold them (one node for STRICT_PACK), ``SPREAD``/``STRICT_SPREAD`` put them on
different nodes (STRICT_SPREAD: each actor on a node of its own, so the cluster needs as many
nodes as the experiment has environments).

Ray reserves a group whole or not at all: until it can, no actor of the experiment is placed,
and each says what it waits for. The group goes with the experiment's last actor: when the
service closes, or when a sweep finds it left over with no environment kept.

Everything here blocks: the service runs it in its thread pool, under a deadline.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from .cluster import connected_ray

if TYPE_CHECKING:
    from .config import RayConfig

log = logging.getLogger(__name__)

GROUP_PREFIX = "trialkeeper"
# Ray's word for a bundle index left to it: any bundle of the group with room for the actor.
ANY_BUNDLE = -1


def group_name(experiment_id: str, gang: str = "") -> str:
    """The experiment's group, or (``gang``) the group of the environments started as one."""
    return f"{GROUP_PREFIX}/{experiment_id}" + (f"/{gang}" if gang else "")


def bundle(ts: RayConfig) -> dict[str, float]:
    """What one actor asks for, as a bundle (zero amounts left out, as Ray wants them)."""
    amounts = {"CPU": ts.num_cpus, "GPU": ts.num_gpus, **ts.resources}
    if ts.memory:
        amounts["memory"] = float(ts.memory)
    return {name: amount for name, amount in amounts.items() if amount}


def _find(name: str) -> Any:
    """The live placement group of that name (any namespace), or None."""
    ray = connected_ray()
    from ray.util.placement_group import PlacementGroup, placement_group_table

    for group_id, entry in placement_group_table().items():
        if entry.get("name") == name and entry.get("state") != "REMOVED":
            return PlacementGroup(ray.PlacementGroupID.from_hex(group_id))
    return None


class ExperimentGroup:
    """The placement group of one experiment's actors, reserved at the first launch; or
    (``gang``: its first member's id) of one group of environments started for a trial."""

    def __init__(self, ts: RayConfig, size: int, gang: str = "") -> None:
        assert ts.placement_strategy is not None
        self.strategy = ts.placement_strategy
        self.size = size
        self.bundle = bundle(ts)
        self.gang = gang
        self.name = ""
        self.group: Any = None
        self.ready = False
        self.nodes = 0  # alive nodes, as last seen while a STRICT_SPREAD group waits
        self._lock = threading.Lock()  # launches run in parallel threads: one makes the group

    def options(self, experiment_id: str, index: int = ANY_BUNDLE) -> dict[str, Any]:
        """Actor options that place an actor in the group (found again after a resume, or
        made), in bundle ``index`` (by default whichever has room)."""
        ray = connected_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        with self._lock:
            if self.group is None:
                self.name = group_name(experiment_id, self.gang)
                self.group = _find(self.name) or ray.util.placement_group(
                    [dict(self.bundle)] * self.size, strategy=self.strategy, name=self.name, lifetime="detached")
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}

    def check(self) -> None:
        """Whether Ray has reserved the group yet (asks without waiting); while not, for
        STRICT_SPREAD, how many nodes the cluster has."""
        if self.group is not None and not self.ready:
            ray = connected_ray()
            done, _ = ray.wait([self.group.ready()], timeout=0)
            self.ready = bool(done)
            if not self.ready and self.strategy == "STRICT_SPREAD":
                self.nodes = sum(1 for node in ray.nodes() if node.get("Alive"))

    def waiting(self) -> str:
        """What an actor that is not placed yet waits for, while the group is not reserved."""
        if self.group is None or self.ready:
            return ""
        apart = {"STRICT_SPREAD": ", each on a node of its own", "STRICT_PACK": ", all on one node"}
        each = ", ".join(f"{amount:g} {name}" for name, amount in self.bundle.items())
        short = f"; the cluster has {self.nodes} now" if 0 < self.nodes < self.size else ""
        return (f"waiting for Ray to reserve placement group {self.name} ({self.strategy}: "
                f"{self.size} bundles of {each}{apart.get(self.strategy, '')}{short})")

    def remove(self, experiment_id: str = "") -> None:
        """Give the group back (the one this service made or found, else the experiment's, if
        any); a failure is logged, not raised: the group goes with its cluster all the same."""
        try:
            ray = connected_ray()
            group = self.group if self.group is not None else _find(group_name(experiment_id))
            if group is not None:
                ray.util.remove_placement_group(group)
        except Exception as e:  # noqa: BLE001 - Ray's errors, told in a line
            log.warning("cannot remove placement group %s: %s", self.name or group_name(experiment_id), e)
        self.group, self.ready = None, False


def remove_gangs(experiment_id: str) -> None:
    """Give back every placement group of the experiment's groups of environments (those a
    previous coordinator made included); failures are logged, not raised."""
    try:
        ray = connected_ray()
        from ray.util.placement_group import PlacementGroup, placement_group_table

        prefix = group_name(experiment_id, "-")[:-1]
        for group_id, entry in placement_group_table().items():
            if str(entry.get("name", "")).startswith(prefix) and entry.get("state") != "REMOVED":
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
    except Exception as e:  # noqa: BLE001 - Ray's errors, told in a line
        log.warning("cannot remove the placement groups of %s: %s", experiment_id, e)
