"""The `trainingService` section for `platform: dlc`.

Field names are those NNI users know. Each environment is one PAI-DLC job running one
agent. The trial code reaches the job through a NAS file system: it is copied to
`localStorageMountPoint` (where the NAS is mounted on this machine) and the job sees it at
`containerStorageMountPoint` (where `nasDataSourceId` is mounted in the job).

The access key secret is a secret: write it in the config only if the file is private.
Better: name a file holding it (`accessKeySecretFile`), or leave both out and set
`ALIBABA_CLOUD_ACCESS_KEY_SECRET` in the environment. It is never logged, never put on a
command line, and stored redacted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ...config.platform import TrainingServiceConfig
from ...config.rules import (
    NON_EMPTY_STR,
    POSITIVE_DURATION,
    POSITIVE_INT,
    Issues,
    exists,
    is_dir,
    not_both,
    rule,
)

__all__ = ["ID_ENV", "SECRET_ENV", "DlcConfig"]

SECRET_ENV = "ALIBABA_CLOUD_ACCESS_KEY_SECRET"
ID_ENV = "ALIBABA_CLOUD_ACCESS_KEY_ID"


def _secret_text(value: object) -> object:
    # Never echo a secret in an error message, not even a mistyped one.
    if isinstance(value, str) or value is None:
        return value
    raise ValueError("expected a string (quote it in YAML); the value is not shown")


SECRET = rule("a string", coerce=_secret_text)
_ABSOLUTE = rule("an absolute path", lambda v: v.startswith("/") and "\n" not in v)


@dataclass(frozen=True, kw_only=True)
class DlcConfig(TrainingServiceConfig):
    """`platform: dlc`: every environment is a PAI-DLC job that runs one agent."""

    PLATFORM: ClassVar[str] = "dlc"
    type: str = field(default="Worker", metadata=NON_EMPTY_STR)  # the job spec's role
    image: str = field(metadata=NON_EMPTY_STR)
    job_type: str = field(default="TFJob", metadata=NON_EMPTY_STR)
    pod_count: int = field(default=1, metadata=POSITIVE_INT)
    ecs_spec: str = field(metadata=NON_EMPTY_STR)
    region: str = field(metadata=NON_EMPTY_STR)
    workspace_id: str | None = field(default=None, metadata=NON_EMPTY_STR)
    nas_data_source_id: str = field(metadata=NON_EMPTY_STR)
    oss_data_source_id: str | None = field(default=None, metadata=NON_EMPTY_STR)
    local_storage_mount_point: Path
    container_storage_mount_point: str = field(metadata=_ABSOLUTE)
    access_key_id: str | None = field(default=None, repr=False, metadata=SECRET)
    access_key_secret: str | None = field(default=None, repr=False, metadata=SECRET)
    access_key_secret_file: Path | None = None
    # The API endpoint; by default the region's public one.
    endpoint: str | None = field(default=None, metadata=NON_EMPTY_STR)
    # How often each job's status is asked of the platform.
    poll_interval: float = field(default=5.0, metadata=POSITIVE_DURATION)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues = not_both(given, names, "access_key_secret", "access_key_secret_file", at="access_key_secret")
        path = values.get("access_key_secret_file")
        if path is not None and not exists(path):
            issues.append(("access_key_secret_file", f"{path} does not exist"))
        local = values.get("local_storage_mount_point")
        if local is not None and not is_dir(local):
            issues.append(("local_storage_mount_point", f"{local} is not a directory (mount the NAS there first)"))
        return issues
