"""The one module that talks to PAI-DLC through ``alibabacloud-pai-dlc20201203``.

The SDK is imported inside the functions below: importing this module (to read
``DlcJobSpec``) needs nothing installed. Each environment is one DLC job whose display
name starts with ``tk-<experiment id>-`` (how ``list_jobs`` asks the API for an
experiment's jobs) and whose envs name both ids (how it tells them apart exactly). The
experiment token travels in the job's envs, never in its command; the access key secret
goes only into the SDK client's config.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from trialkeeper.protos.wire import ENVIRONMENT_ENV, EXPERIMENT_ENV

from .._cloud_jobs import JobView
from ..base import env_id_in_name

PACKAGE = "alibabacloud-pai-dlc20201203"
PAGE_SIZE = 100
CONNECT_TIMEOUT_MS = 10_000
READ_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class DlcJobSpec:
    """One environment's job, in trialkeeper's terms; ``create_job_request`` makes it the SDK's."""

    display_name: str
    job_type: str
    role: str
    image: str
    pod_count: int
    ecs_spec: str
    user_command: str
    workspace_id: str | None
    nas_data_source_id: str
    nas_mount_path: str
    oss_data_source_id: str | None
    envs: dict[str, str] = field(repr=False)


def name_prefix(experiment_id: str) -> str:
    return "tk-" + _safe(experiment_id) + "-"


def display_name(experiment_id: str, env_id: str) -> str:
    return name_prefix(experiment_id) + _safe(env_id)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)


def sdk_missing() -> bool:
    """Whether the DLC SDK is absent (without importing it)."""
    try:
        return importlib.util.find_spec("alibabacloud_pai_dlc20201203") is None
    except (ImportError, ValueError):
        return True


def create_job_request(spec: DlcJobSpec) -> Any:
    """The CreateJobRequest that runs the agent: one job spec, the NAS (and OSS) mounted."""
    from alibabacloud_pai_dlc20201203 import models

    sources = [
        models.CreateJobRequestDataSources(data_source_id=spec.nas_data_source_id, mount_path=spec.nas_mount_path)
    ]
    if spec.oss_data_source_id:
        sources.append(models.CreateJobRequestDataSources(data_source_id=spec.oss_data_source_id))
    return models.CreateJobRequest(
        display_name=spec.display_name,
        job_type=spec.job_type,
        job_specs=[models.JobSpec(type=spec.role, image=spec.image, pod_count=spec.pod_count, ecs_spec=spec.ecs_spec)],
        user_command=spec.user_command,
        envs=dict(spec.envs),
        data_sources=sources,
        workspace_id=spec.workspace_id,
    )


def list_jobs_request(experiment_id: str, workspace_id: str | None, page: int) -> Any:
    from alibabacloud_pai_dlc20201203 import models

    return models.ListJobsRequest(
        display_name=name_prefix(experiment_id), workspace_id=workspace_id, page_number=page, page_size=PAGE_SIZE,
    )


def client_config(region: str, endpoint: str | None, access_key_id: str, access_key_secret: str) -> Any:
    """The client's config: the region's public endpoint unless one is given; a private
    endpoint may name its scheme (``http://10.0.0.8:8080``)."""
    from alibabacloud_tea_openapi.utils_models import Config

    protocol = None
    if endpoint and "://" in endpoint:
        protocol, _, endpoint = endpoint.partition("://")
    return Config(
        access_key_id=access_key_id, access_key_secret=access_key_secret, region_id=region,
        endpoint=endpoint or f"pai-dlc.{region}.aliyuncs.com", protocol=protocol,
        connect_timeout=CONNECT_TIMEOUT_MS, read_timeout=READ_TIMEOUT_MS,
    )


class DlcSdkAdapter:
    """Jobs, statuses and stops through the DLC SDK; blocking, called from threads."""

    def __init__(self, region: str, endpoint: str | None, workspace_id: str | None,
                 access_key_id: str, access_key_secret: str) -> None:
        self.region = region
        self.endpoint = endpoint
        self.workspace_id = workspace_id
        self._key = (access_key_id, access_key_secret)
        self._client: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the key
        return f"DlcSdkAdapter(region={self.region!r}, workspace_id={self.workspace_id!r})"

    def _api(self) -> Any:
        with self._lock:
            if self._client is None:
                from alibabacloud_pai_dlc20201203.client import Client

                self._client = Client(client_config(self.region, self.endpoint, *self._key))
            return self._client

    def connect(self) -> None:
        from alibabacloud_pai_dlc20201203 import models

        self._api().list_jobs(models.ListJobsRequest(workspace_id=self.workspace_id, page_size=1))

    def submit(self, spec: DlcJobSpec) -> str:
        return str(self._api().create_job(create_job_request(spec)).body.job_id)

    def get(self, job_id: str) -> JobView | None:
        from alibabacloud_pai_dlc20201203 import models

        try:
            body = self._api().get_job(job_id, models.GetJobRequest()).body
        except Exception as e:
            if getattr(e, "status_code", None) == 404 or "NotFound" in str(getattr(e, "code", "")):
                return None
            raise
        return _view(body)

    def cancel(self, job_id: str) -> None:
        self._api().stop_job(job_id)

    def list_jobs(self, experiment_id: str) -> list[JobView]:
        found: list[JobView] = []
        page = 1
        while True:
            body = self._api().list_jobs(list_jobs_request(experiment_id, self.workspace_id, page)).body
            jobs = body.jobs or []
            prefix = name_prefix(experiment_id)
            for j in jobs:
                env_id = env_id_in_name(j.display_name or "", prefix)
                if env_id is not None:
                    found.append(_view(j, listed_as=(experiment_id, env_id)))
            if len(jobs) < PAGE_SIZE:
                return found
            page += 1

    def close(self) -> None:
        self._client = None


def _view(job: Any, listed_as: tuple[str, str] = ("", "")) -> JobView:
    """A job as GetJob or ListJobs describes it. The ids come from its envs; a listing that
    leaves envs out falls back on the display name it was found by (``listed_as``)."""
    envs = job.envs or {}
    return JobView(
        job_id=str(job.job_id),
        status=str(job.status or ""),
        detail=str(job.reason_message or job.reason_code or ""),
        experiment_id=str(envs.get(EXPERIMENT_ENV) or listed_as[0]),
        env_id=str(envs.get(ENVIRONMENT_ENV) or listed_as[1]),
    )
