"""The real SDKs' request objects, built offline from what the services ask for.

The fakes of tests/fake_cloud_sdks.py stand at the adapter boundary; these tests cover
the other side of it: the adapters turn a spec into the SDK's own objects with every field
where the platform reads it, and the token only in the job's environment.

azureml-core cannot live beside this project's pins (it holds paramiko, packaging and
cryptography back), so its checks run in a separate interpreter: ``$TRIALKEEPER_AML_SDK_PYTHON``,
by default /opt/sdkvenv-aml/bin/python (a venv with ``pip install azureml-core``). They
skip, saying so, where it is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.services._cloud_jobs import JobView
from trialkeeper.coordinator.services.aml.config import AmlConfig
from trialkeeper.coordinator.services.aml.sdk import AmlRunSpec
from trialkeeper.coordinator.services.aml.service import AmlEnvironmentService
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.dlc import sdk as _dlc_sdk
from trialkeeper.coordinator.services.dlc.config import DlcConfig
from trialkeeper.coordinator.services.dlc.service import DlcEnvironmentService

REPO = Path(__file__).resolve().parents[2]
AML_PYTHON = os.environ.get("TRIALKEEPER_AML_SDK_PYTHON", "/opt/sdkvenv-aml/bin/python")
TOKEN = "tok-" + "5" * 32
REQUEST = EnvironmentRequest(
    env_id="env-3", experiment_id="exp42", coordinator_address="10.0.0.5:50051", token=TOKEN,
    agent_args=("--tls-fingerprint", "ab" * 32),
)


class _NoCalls:
    """An adapter that must not be called: these tests only build requests."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"adapter.{name} called")


def _aml_spec(tmp_path: Path) -> AmlRunSpec:
    section = {"platform": "aml", "subscriptionId": "sub", "resourceGroup": "rg", "workspaceName": "ws",
               "computeTarget": "gpu-cluster", "dockerImage": "myacr.azurecr.io/tk:1", "maxTrialNumberPerGpu": 2}
    config = parse_config({"trialCommand": "python3 t.py", "trialConcurrency": 1, "trainingService": section}, tmp_path)
    assert isinstance(config.training_service, AmlConfig)
    service = AmlEnvironmentService(config.training_service, tmp_path, _NoCalls())  # type: ignore[arg-type]
    assert service.gpu_policy("env-3") == (2, None)
    return service.job_spec(REQUEST)


# Runs in the azureml-core interpreter: the package is loaded from this checkout without
# its __init__ files (they import grpc and the rest of the coordinator).
_AML_PROGRAM = """
import json, sys, types
repo = sys.argv[1]
for name, path in [("trialkeeper", []), ("trialkeeper.coordinator", [repo + "/coordinator"]),
                   ("trialkeeper.coordinator.services", [repo + "/coordinator/services"]),
                   ("trialkeeper.coordinator.services.aml", [repo + "/coordinator/services/aml"])]:
    module = types.ModuleType(name)
    module.__path__ = path
    sys.modules[name] = module
from trialkeeper.coordinator.services.aml import sdk as _aml_sdk
from azureml.core.script_run_config import get_run_config_from_script_run
from azureml.core._serialization_utils import _serialize_to_dict

spec = _aml_sdk.AmlRunSpec(**json.loads(sys.stdin.read()))
src = _aml_sdk.script_run_config(spec)
wire = _serialize_to_dict(get_run_config_from_script_run(src))
print(json.dumps({"source_directory": src.source_directory, "command": src.command, "wire": wire}))
"""


def _aml_objects(spec: AmlRunSpec) -> dict[str, Any]:
    if not Path(AML_PYTHON).is_file():
        pytest.skip(f"azureml-core needs its own venv ({AML_PYTHON} is missing: python3 -m venv /opt/sdkvenv-aml && "
                    "/opt/sdkvenv-aml/bin/pip install azureml-core, or set TRIALKEEPER_AML_SDK_PYTHON)")
    done = subprocess.run(
        [AML_PYTHON, "-W", "ignore", "-c", _AML_PROGRAM, str(REPO)], input=json.dumps(dataclasses.asdict(spec)),
        check=False, capture_output=True, text=True, timeout=50,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_aml_script_run_config_runs_the_agent_on_the_compute_target(tmp_path: Path) -> None:
    spec = _aml_spec(tmp_path)
    built = _aml_objects(spec)
    wire = built["wire"]
    assert built["source_directory"] == str(tmp_path)
    argv = ["python3", "-m", "trialkeeper.agent", "--coordinator", "10.0.0.5:50051", "--environment-id", "env-3",
            "--platform", "aml", "--workdir", "outputs/trialkeeper", "--tls-fingerprint", "ab" * 32]
    assert built["command"] == argv and wire["command"] == argv
    assert wire["script"] is None and wire["arguments"] == []
    assert wire["target"] == "gpu-cluster"
    env = wire["environment"]
    assert env["name"] == "trialkeeper-exp42"
    assert env["docker"]["baseImage"] == "myacr.azurecr.io/tk:1"
    assert env["python"]["userManagedDependencies"] is True
    # The token is a runtime variable of this run, not part of the Environment asset, nor the command.
    assert wire["environmentVariables"] == {
        "TRIALKEEPER_TOKEN": TOKEN, "TRIALKEEPER_EXPERIMENT_ID": "exp42", "TRIALKEEPER_ENVIRONMENT_ID": "env-3",
    }
    assert TOKEN not in json.dumps(env) and TOKEN not in json.dumps(wire["command"])


def test_aml_spec_names_and_tags_the_run_for_sweep(tmp_path: Path) -> None:
    spec = _aml_spec(tmp_path)
    assert spec.experiment_name == "trialkeeper-exp42" and spec.display_name == "exp42/env-3"
    assert spec.tags == {"trialkeeper.experiment": "exp42", "trialkeeper.environment": "env-3"}
    assert TOKEN not in repr(spec)


def test_aml_run_status_is_read_from_the_run() -> None:
    from trialkeeper.coordinator.services.aml.sdk import _view

    class Run:  # what azureml.core.Run answers, for the three calls _view makes
        id = "exp42_1700000000_abcd"

        def get_tags(self) -> dict[str, str]:
            return {"trialkeeper.experiment": "exp42", "trialkeeper.environment": "env-3"}

        def get_status(self) -> str:
            return "Failed"

        def get_details(self) -> dict[str, Any]:
            return {"error": {"error": {"code": "UserError", "message": "exit code 1"}}}

    assert _view(Run(), with_error=True) == JobView("exp42_1700000000_abcd", "Failed", "exit code 1", "exp42", "env-3")


def _dlc_service(tmp_path: Path, **extra: Any) -> DlcEnvironmentService:
    section = {"platform": "dlc", "image": "registry.cn-hangzhou.aliyuncs.com/tk/agent:1", "jobType": "PyTorchJob",
               "podCount": 1, "ecsSpec": "ecs.gn6i-c4g1.xlarge", "region": "cn-hangzhou", "workspaceId": "12345",
               "nasDataSourceId": "data-nas", "ossDataSourceId": "data-oss", "localStorageMountPoint": str(tmp_path),
               "containerStorageMountPoint": "/mnt/nas", "accessKeyId": "LTAIid", "accessKeySecret": "the-secret",
               **extra}
    config = parse_config({"trialCommand": "python3 t.py", "trialConcurrency": 1, "trainingService": section}, tmp_path)
    assert isinstance(config.training_service, DlcConfig)
    return DlcEnvironmentService(config.training_service, tmp_path / "exp", tmp_path, _NoCalls())  # type: ignore[arg-type]


def test_dlc_create_job_request_field_by_field(tmp_path: Path) -> None:
    pytest.importorskip(
        "alibabacloud_pai_dlc20201203", reason="the DLC SDK is not installed (pip install 'trialkeeper[dlc]')"
    )
    from alibabacloud_pai_dlc20201203 import models

    service = _dlc_service(tmp_path)
    request = _dlc_sdk.create_job_request(service.job_spec(REQUEST))
    assert isinstance(request, models.CreateJobRequest)
    assert request.display_name == "tk-exp42-env-3" and request.job_type == "PyTorchJob"
    assert request.workspace_id == "12345"
    (spec,) = request.job_specs
    assert isinstance(spec, models.JobSpec)
    assert (spec.type, spec.image, spec.pod_count, spec.ecs_spec) == (
        "Worker", "registry.cn-hangzhou.aliyuncs.com/tk/agent:1", 1, "ecs.gn6i-c4g1.xlarge")
    nas, oss = request.data_sources
    assert (nas.data_source_id, nas.mount_path) == ("data-nas", "/mnt/nas")
    assert (oss.data_source_id, oss.mount_path) == ("data-oss", None)
    root = f"/mnt/nas/trialkeeper/exp-{service._subdir.rsplit('-', 1)[1]}"
    assert service.working_directory() == f"{root}/code"
    assert shlex.split(request.user_command) == [
        "python3",
        "-m",
        "trialkeeper.agent",
        "--coordinator",
        "10.0.0.5:50051",
        "--environment-id",
        "env-3",
        "--platform",
        "dlc",
        "--workdir",
        f"{root}/envs/env-3",
        "--copy-working-directory",
        "--tls-fingerprint",
        "ab" * 32,
    ]
    assert request.envs == {
        "TRIALKEEPER_TOKEN": TOKEN,
        "TRIALKEEPER_EXPERIMENT_ID": "exp42",
        "TRIALKEEPER_ENVIRONMENT_ID": "env-3",
    }
    # What goes over the wire: the names the API reads, the token only under Envs.
    wire = _dense(request.to_map())
    assert (
        wire["DisplayName"] == "tk-exp42-env-3" and wire["JobType"] == "PyTorchJob" and wire["WorkspaceId"] == "12345"
    )
    assert wire["JobSpecs"] == [
        {
            "Type": "Worker",
            "Image": "registry.cn-hangzhou.aliyuncs.com/tk/agent:1",
            "PodCount": 1,
            "EcsSpec": "ecs.gn6i-c4g1.xlarge",
        }
    ]
    assert wire["DataSources"] == [{"DataSourceId": "data-nas", "MountPath": "/mnt/nas"}, {"DataSourceId": "data-oss"}]
    assert wire["Envs"]["TRIALKEEPER_TOKEN"] == TOKEN
    assert TOKEN not in json.dumps({k: v for k, v in wire.items() if k != "Envs"})
    assert "the-secret" not in json.dumps(wire)


def _dense(value: Any) -> Any:
    """The wire map without the empty lists the SDK writes for fields left unset."""
    if isinstance(value, dict):
        return {k: _dense(v) for k, v in value.items() if v != []}
    if isinstance(value, list):
        return [_dense(v) for v in value]
    return value


def test_dlc_list_get_and_client_config(tmp_path: Path) -> None:
    pytest.importorskip(
        "alibabacloud_pai_dlc20201203", reason="the DLC SDK is not installed (pip install 'trialkeeper[dlc]')"
    )
    from alibabacloud_pai_dlc20201203 import models

    listing = _dlc_sdk.list_jobs_request("exp42", "12345", 2)
    assert isinstance(listing, models.ListJobsRequest)
    assert _dense(listing.to_map()) == {
        "DisplayName": "tk-exp42-",
        "WorkspaceId": "12345",
        "PageNumber": 2,
        "PageSize": 100,
    }
    config = _dlc_sdk.client_config("cn-shanghai", None, "LTAIid", "the-secret")
    assert (config.region_id, config.endpoint, config.access_key_id, config.access_key_secret) == (
        "cn-shanghai", "pai-dlc.cn-shanghai.aliyuncs.com", "LTAIid", "the-secret")
    assert (config.connect_timeout, config.read_timeout) == (10_000, 30_000)
    assert _dlc_sdk.client_config("cn-shanghai", "pai-dlc-vpc.cn-shanghai.aliyuncs.com", "i", "s").endpoint == (
        "pai-dlc-vpc.cn-shanghai.aliyuncs.com")
    # GetJob's and ListJobs' answers, as the SDK parses them from the API's JSON.
    got = models.GetJobResponseBody().from_map(
        {
            "JobId": "dlc1abc",
            "Status": "Failed",
            "ReasonMessage": "OOMKilled",
            "DisplayName": "tk-exp42-env-3",
            "Envs": {
                "TRIALKEEPER_EXPERIMENT_ID": "exp42",
                "TRIALKEEPER_ENVIRONMENT_ID": "env-3",
                "TRIALKEEPER_TOKEN": TOKEN,
            },
        }
    )
    view = _dlc_sdk._view(got)
    assert view == JobView("dlc1abc", "Failed", "OOMKilled", "exp42", "env-3") and TOKEN not in repr(view)
    listed = models.ListJobsResponseBody().from_map({"Jobs": [
        {"JobId": "dlc2", "Status": "Running", "DisplayName": "tk-exp42-env-1",
         "Envs": {"TRIALKEEPER_EXPERIMENT_ID": "exp42", "TRIALKEEPER_ENVIRONMENT_ID": "env-1"}},
    ], "TotalCount": 1})
    assert [_dlc_sdk._view(j) for j in listed.jobs] == [JobView("dlc2", "Running", "", "exp42", "env-1")]


@dataclasses.dataclass
class _Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@contextlib.contextmanager
def _dlc_api() -> Iterator[tuple[str, list[_Seen]]]:
    """The DLC endpoints the adapter calls, on 127.0.0.1, answering as the API documents."""
    seen: list[_Seen] = []
    jobs: list[dict[str, Any]] = [{"JobId": "dlc-7", "Status": "Running", "DisplayName": "tk-exp42-env-3",
             "Envs": {"TRIALKEEPER_EXPERIMENT_ID": "exp42", "TRIALKEEPER_ENVIRONMENT_ID": "env-3"}},
            {"JobId": "dlc-8", "Status": "Running", "DisplayName": "tk-exp42x-env-1",  # another experiment
             "Envs": {"TRIALKEEPER_EXPERIMENT_ID": "exp42x", "TRIALKEEPER_ENVIRONMENT_ID": "env-1"}},
            {"JobId": "dlc-9", "Status": "Queuing", "DisplayName": "tk-exp42-env-4"}]  # listed without its envs

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _any(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            seen.append(_Seen(self.command, url.path, parse_qs(url.query), dict(self.headers),
                              self.rfile.read(length) if length else b""))
            code, answer = 200, dict[str, Any](RequestId="req-1")
            if (self.command, url.path) == ("POST", "/api/v1/jobs"):
                answer["JobId"] = "dlc-7"
            elif (self.command, url.path) == ("GET", "/api/v1/jobs"):
                answer.update(Jobs=jobs, TotalCount=len(jobs))
            elif (self.command, url.path) == ("GET", "/api/v1/jobs/dlc-7"):
                answer.update(jobs[0], Status="Failed", ReasonMessage="OOMKilled")
            elif (self.command, url.path) == ("POST", "/api/v1/jobs/dlc-7/stop"):
                pass
            else:
                code, answer = 404, {"Code": "JobNotFound", "Message": "job not found", "RequestId": "req-2"}
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _any

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_dlc_adapter_speaks_the_api_and_never_sends_the_secret(tmp_path: Path) -> None:
    pytest.importorskip(
        "alibabacloud_pai_dlc20201203", reason="the DLC SDK is not installed (pip install 'trialkeeper[dlc]')"
    )
    spec = _dlc_service(tmp_path).job_spec(REQUEST)
    with _dlc_api() as (endpoint, seen):
        adapter = _dlc_sdk.DlcSdkAdapter("cn-hangzhou", endpoint, "12345", "LTAIid", "the-secret")
        assert adapter.submit(spec) == "dlc-7"
        assert adapter.get("dlc-7") == JobView("dlc-7", "Failed", "OOMKilled", "exp42", "env-3")
        assert adapter.get("dlc-gone") is None
        adapter.cancel("dlc-7")
        assert adapter.list_jobs("exp42") == [JobView("dlc-7", "Running", "", "exp42", "env-3"),
                                              JobView("dlc-9", "Queuing", "", "exp42", "env-4")]
    calls = [(c.method, c.path) for c in seen]
    assert calls == [("POST", "/api/v1/jobs"), ("GET", "/api/v1/jobs/dlc-7"), ("GET", "/api/v1/jobs/dlc-gone"),
                     ("POST", "/api/v1/jobs/dlc-7/stop"), ("GET", "/api/v1/jobs")]
    body = json.loads(seen[0].body)
    assert (
        body["DisplayName"] == "tk-exp42-env-3" and body["JobType"] == "PyTorchJob" and body["WorkspaceId"] == "12345"
    )
    assert _dense(body["JobSpecs"]) == [{"Type": "Worker", "Image": "registry.cn-hangzhou.aliyuncs.com/tk/agent:1",
                                         "PodCount": 1, "EcsSpec": "ecs.gn6i-c4g1.xlarge"}]
    assert body["Envs"]["TRIALKEEPER_TOKEN"] == TOKEN and TOKEN not in body["UserCommand"]
    assert {k: v[0] for k, v in seen[-1].query.items()} == {"DisplayName": "tk-exp42-", "WorkspaceId": "12345",
                                                             "PageNumber": "1", "PageSize": "100"}
    # Requests are signed with the key: its id travels, its secret never does.
    for call in seen:
        assert call.headers["Authorization"].startswith("ACS3-HMAC-SHA256 Credential=LTAIid,")
        assert "the-secret" not in json.dumps(call.headers) + call.path + call.body.decode()


def test_the_adapters_import_no_sdk_until_used() -> None:
    program = (
        "import sys\n"
        "from trialkeeper.coordinator.services import aml, dlc, _aml_sdk, _dlc_sdk\n"
        "bad = [m for m in sys.modules if m.startswith(('azureml', 'alibabacloud'))]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
