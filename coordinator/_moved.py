"""Old module paths, from before the coordinator was split into packages by layer.

``trialkeeper.coordinator.configrules`` is now ``trialkeeper.coordinator.config.rules``, and
so on: code written against the old paths (plug-ins, scripts, pickles) keeps importing, and
gets the very module object of the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

_PACKAGE = __name__.rpartition(".")[0]

# old name -> new name, both under trialkeeper.coordinator
MOVED = {
    "algorithms": "search.algorithms",
    "assessors": "search.assessors",
    "checks": "transport.checks",
    "cli_views": "cli.views",
    "configrules": "config.rules",
    "configwalk": "config.walk",
    "envrules": "engine.environments",
    "events": "engine.events",
    "metricstore": "store.metrics",
    "model": "engine.model",
    "nniadvisors": "search.nniadvisors",
    "nnialgos": "search.nnialgos",
    "nniconfig": "config.nni",
    "optunasearch": "search.optunasearch",
    "platformconfig": "config.platform",
    "policy": "engine.policy",
    "readmodel": "read.model",
    "readpages": "read.pages",
    "search.objectives": "config.objectives",
    "redacted": "config.redacted",
    "rows": "engine.rows",
    "scheduler": "engine.scheduler",
    "searchspace": "search.space",
    "server": "transport.server",
    "states": "engine.states",
    "tls": "transport.tls",
    "tuners": "search.tuners",
    "waiting": "engine.waiting",
    "wire": "transport.wire",
    "services._aml_sdk": "services.aml.sdk",
    "services._dlc_sdk": "services.dlc.sdk",
    "services._k8s_objects": "services.kubernetes.objects",
    "services._ray_node": "services.ray.node",
    "services._remote_agent": "services.remote.agent_main",
    "services._remote_helper": "services.remote.helper",
    "services._remote_machine": "services.remote.machine",
    "services._ssh": "services.remote.ssh",
    "services.aml_config": "services.aml.config",
    "services.dlc_config": "services.dlc.config",
    "services.kubernetes_config": "services.kubernetes.config",
    "services.ray_config": "services.ray.config",
    "services.remote_config": "services.remote.config",
}
# The old ``config``, ``store``, ``search``, ``cli`` and ``engine`` modules are packages now,
# and ``services.remote`` (and ``kubernetes``, ``ray``, ``aml``, ``dlc``) folders: those whose
# names were public hand them on from their ``__init__``.


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, rest = fullname.partition(_PACKAGE + ".")
        if prefix or rest not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{_PACKAGE}.{MOVED[spec.name[len(_PACKAGE) + 1:]]}")
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module is the new one, already run."""


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
