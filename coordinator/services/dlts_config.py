"""The `trainingService` section for `platform: dlts`.

The fields are those of NNI's `dltsConfig`: the `dashboard` URL of the DLWorkspace
cluster, its `cluster` id, the `team` (virtual cluster), the user's `email` and
`password`, the `image` jobs run in, and optionally the `gpuType` (asked from the
cluster's metadata when left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..config.platform import EnvironmentPoolConfig
from ..config.rules import NON_EMPTY_STR, NON_NEGATIVE_INT, POSITIVE_DURATION, SECRET, rule

__all__ = ["DltsConfig"]

_URL = rule(
    "an http(s) URL", lambda v: v.startswith(("http://", "https://")) and len(v.split("://", 1)[1].strip("/")) > 0
)
_EMAIL = rule("an email address", lambda v: "@" in v and not any(c.isspace() for c in v))


@dataclass(frozen=True, kw_only=True)
class DltsConfig(EnvironmentPoolConfig):
    """`platform: dlts`: every environment is one DLTS (DLWorkspace) job running one agent."""

    PLATFORM: ClassVar[str] = "dlts"
    MOUNTS_SHARED_STORAGE: ClassVar[bool] = True
    dashboard: str = field(metadata=_URL)
    cluster: str = field(default=".default", metadata=NON_EMPTY_STR)
    team: str = field(metadata=NON_EMPTY_STR)
    email: str = field(metadata=_EMAIL)
    password: str = field(repr=False, metadata=SECRET)
    gpu_type: str | None = field(default=None, metadata=NON_EMPTY_STR)
    image: str = field(metadata=NON_EMPTY_STR)
    # GPUs per trial; by default the experiment's trialGpuNumber.
    trial_gpu_number: int | None = field(default=None, metadata=NON_NEGATIVE_INT)
    # The Python inside the image that has trialkeeper installed.
    python_path: str = field(default="python3", metadata=NON_EMPTY_STR)
    poll_interval: float = field(default=3.0, metadata=POSITIVE_DURATION)
    api_timeout: float = field(default=30.0, metadata=POSITIVE_DURATION)

    def gpus_per_job(self, experiment_gpus: int) -> int:
        slots = self.trials_per_environment if self.reuse_mode else 1
        return (self.trial_gpu_number if self.trial_gpu_number is not None else experiment_gpus) * slots
