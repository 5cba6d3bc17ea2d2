"""The `trainingService` section for `platform: aml`.

Field names are those NNI users know. Each environment is one Azure ML run of the agent on
`computeTarget`, in `dockerImage` (which must have Python 3 with trialkeeper installed).
The workspace comes from `subscriptionId`/`resourceGroup`/`workspaceName`, or from a
workspace config file (`configFile`, the `config.json` the Azure portal offers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ...config.platform import TrainingServiceConfig
from ...config.rules import NON_EMPTY_STR, POSITIVE_DURATION, POSITIVE_INT, Issues, exists

__all__ = ["AmlConfig"]


@dataclass(frozen=True, kw_only=True)
class AmlConfig(TrainingServiceConfig):
    """`platform: aml`: every environment is an Azure ML run that runs one agent."""

    PLATFORM: ClassVar[str] = "aml"
    subscription_id: str | None = field(default=None, metadata=NON_EMPTY_STR)
    resource_group: str | None = field(default=None, metadata=NON_EMPTY_STR)
    workspace_name: str | None = field(default=None, metadata=NON_EMPTY_STR)
    config_file: Path | None = None
    compute_target: str = field(metadata=NON_EMPTY_STR)
    docker_image: str = field(metadata=NON_EMPTY_STR)
    max_trial_number_per_gpu: int = field(default=1, metadata=POSITIVE_INT)
    # How often each job's status is asked of the platform.
    poll_interval: float = field(default=5.0, metadata=POSITIVE_DURATION)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        triple = ("subscription_id", "resource_group", "workspace_name")
        named = [k for k in triple if k in given]
        if "config_file" in given:
            if named:
                return [(named[0], f"give either {names['config_file']} or the workspace's three names, not both")]
            path = values.get("config_file")
            if path is not None and not exists(path):
                return [("config_file", f"{path} does not exist")]
            return []
        return [
            (k, f"required, with {', '.join(names[n] for n in triple if n != k)} (or give {names['config_file']})")
            for k in triple if k not in given
        ]
