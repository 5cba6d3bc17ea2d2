"""GpuProbe against a scripted fake NVML, plus the real pynvml on whatever machine runs this."""

from __future__ import annotations

import ctypes
import importlib
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from trialkeeper.agent.gpu import (
    DISABLED_REASON,
    GpuInfo,
    GpuProbe,
    GpuProcess,
    GpuSample,
    cuda_visible_devices,
)

GIB = 1024**3


class NVMLError(Exception):
    """Like pynvml's: carries the NVML return code in `.value`."""

    _names: ClassVar[dict[int, str]] = {
        3: "Not Supported",
        6: "Not Found",
        9: "Driver Not Loaded",
        12: "NVML Shared Library Not Found",
        15: "GPU is lost",
        999: "Unknown Error",
    }

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._names.get(self.value, f"NVML Error with code {self.value}")


@dataclass
class FakeDevice:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 80 * GIB
    memory_used: int = 0
    utilization: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    fail: dict[str, int] = field(default_factory=dict)  # NVML call name -> error code
    mig: list[FakeDevice | None] | None = None  # MIG slots (None = empty) when MIG is on


class FakeNvml:
    """The slice of pynvml that GpuProbe uses, scripted per device."""

    NVMLError = NVMLError

    def __init__(
        self,
        devices: list[FakeDevice],
        *,
        init_error: int | None = None,
        as_bytes: bool = False,
        cuda_version: int = 12040,
        driver_version: str = "550.54.15",
    ) -> None:
        self.devices = devices
        self.init_error = init_error
        self.as_bytes = as_bytes
        self.cuda = cuda_version
        self.driver = driver_version
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []

    def _call(self, name: str, dev: FakeDevice) -> None:
        self.calls.append(name)
        if self.init_calls <= self.shutdown_calls:
            raise NVMLError(1)  # Uninitialized
        if name in dev.fail:
            raise NVMLError(dev.fail[name])

    def _str(self, s: str) -> str | bytes:
        return s.encode() if self.as_bytes else s

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if not 0 <= index < len(self.devices):
            raise NVMLError(2)
        self._call("nvmlDeviceGetHandleByIndex", self.devices[index])
        return self.devices[index]

    def nvmlDeviceGetUUID(self, dev: FakeDevice) -> str | bytes:
        self._call("nvmlDeviceGetUUID", dev)
        return self._str(dev.uuid)

    def nvmlDeviceGetName(self, dev: FakeDevice) -> str | bytes:
        self._call("nvmlDeviceGetName", dev)
        return self._str(dev.name)

    def nvmlDeviceGetMemoryInfo(self, dev: FakeDevice) -> SimpleNamespace:
        self._call("nvmlDeviceGetMemoryInfo", dev)
        return SimpleNamespace(
            total=dev.memory_total, used=dev.memory_used, free=dev.memory_total - dev.memory_used
        )

    def nvmlDeviceGetUtilizationRates(self, dev: FakeDevice) -> SimpleNamespace:
        self._call("nvmlDeviceGetUtilizationRates", dev)
        return SimpleNamespace(gpu=dev.utilization, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, dev: FakeDevice) -> list[SimpleNamespace]:
        self._call("nvmlDeviceGetComputeRunningProcesses", dev)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in dev.processes]

    def nvmlDeviceGetMigMode(self, dev: FakeDevice) -> list[int]:
        self._call("nvmlDeviceGetMigMode", dev)
        if dev.mig is None:
            raise NVMLError(3)
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, dev: FakeDevice) -> int:
        return len(dev.mig or [])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, dev: FakeDevice, slot: int) -> FakeDevice:
        mig = (dev.mig or [])[slot]
        if mig is None:
            raise NVMLError(6)
        return mig

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self._str(self.driver)

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda


def two_gpus(**kwargs: Any) -> FakeNvml:
    return FakeNvml(
        [
            FakeDevice(
                "GPU-aaaa",
                memory_used=3 * GIB,
                utilization=87,
                processes=[(4242, 2 * GIB), (4343, None)],
            ),
            FakeDevice("GPU-bbbb", name="NVIDIA A100-SXM4-40GB", memory_total=40 * GIB),
        ],
        **kwargs,
    )


def test_inventory_lists_devices_by_uuid_with_versions() -> None:
    probe = GpuProbe(nvml=two_gpus())
    inv = probe.inventory()
    assert inv.gpus == (
        GpuInfo(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 80 * GIB),
        GpuInfo(1, "GPU-bbbb", "NVIDIA A100-SXM4-40GB", 40 * GIB),
    )
    assert (inv.driver_version, inv.cuda_version, inv.unavailable_reason) == (
        "550.54.15",
        "12.4",
        None,
    )


@pytest.mark.parametrize(("raw", "text"), [(12040, "12.4"), (11080, "11.8"), (13000, "13.0")])
def test_cuda_version_formatting(raw: int, text: str) -> None:
    assert GpuProbe(nvml=two_gpus(cuda_version=raw)).inventory().cuda_version == text


def test_bytes_from_older_pynvml_are_decoded() -> None:
    inv = GpuProbe(nvml=two_gpus(as_bytes=True)).inventory()
    assert inv.gpus[0].uuid == "GPU-aaaa" and inv.gpus[1].name == "NVIDIA A100-SXM4-40GB"
    assert inv.driver_version == "550.54.15"


def test_sample_reports_utilisation_memory_and_processes() -> None:
    probe = GpuProbe(nvml=two_gpus())
    assert probe.sample() == [
        GpuSample("GPU-aaaa", 87.0, 3 * GIB, (GpuProcess(4242, 2 * GIB), GpuProcess(4343, 0))),
        GpuSample("GPU-bbbb", 0.0, 0, ()),
    ]


def test_nvml_initialised_once_and_shut_down_on_close() -> None:
    nvml = two_gpus()
    probe = GpuProbe(nvml=nvml)
    probe.inventory()
    for _ in range(3):
        assert len(probe.sample()) == 2
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 0)
    probe.close()
    probe.close()
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 1)
    assert len(probe.sample()) == 2  # usable again after close
    assert nvml.init_calls == 2


def test_visible_indices_restrict_to_physical_subset() -> None:
    nvml = FakeNvml([FakeDevice(f"GPU-{i}") for i in range(4)])
    probe = GpuProbe(nvml=nvml, visible_indices=[3, 1])
    inv = probe.inventory()
    assert [(g.index, g.uuid) for g in inv.gpus] == [(1, "GPU-1"), (3, "GPU-3")]
    assert [s.uuid for s in probe.sample()] == ["GPU-1", "GPU-3"]


def test_missing_visible_index_warns_but_others_report(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trialkeeper.agent.gpu")
    inv = GpuProbe(nvml=two_gpus(), visible_indices=[1, 7]).inventory()
    assert [g.uuid for g in inv.gpus] == ["GPU-bbbb"]
    assert inv.unavailable_reason is None
    assert "[7]" in caplog.text


def test_reason_when_no_visible_index_exists() -> None:
    nvml = two_gpus()
    inv = GpuProbe(nvml=nvml, visible_indices=[5, 6]).inventory()
    assert inv.gpus == ()
    assert inv.unavailable_reason is not None and "[5, 6]" in inv.unavailable_reason
    assert nvml.init_calls == nvml.shutdown_calls == 1  # not held open for nothing


def test_device_failing_mid_sample_is_skipped_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = two_gpus()
    probe = GpuProbe(nvml=nvml)
    assert len(probe.sample()) == 2
    nvml.devices[0].fail["nvmlDeviceGetMemoryInfo"] = 15  # GPU is lost
    caplog.set_level(logging.WARNING, logger="trialkeeper.agent.gpu")
    for _ in range(3):
        assert [s.uuid for s in probe.sample()] == ["GPU-bbbb"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "GPU-aaaa" in warnings[0].getMessage() and "GPU is lost" in warnings[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records)  # NVML errors: no tracebacks
    del nvml.devices[0].fail["nvmlDeviceGetMemoryInfo"]
    assert len(probe.sample()) == 2


def test_device_failing_at_inventory_is_left_out() -> None:
    nvml = two_gpus()
    nvml.devices[1].fail["nvmlDeviceGetUUID"] = 999
    probe = GpuProbe(nvml=nvml)
    assert [g.uuid for g in probe.inventory().gpus] == ["GPU-aaaa"]
    assert [s.uuid for s in probe.sample()] == ["GPU-aaaa"]


def test_all_devices_failing_gives_reason() -> None:
    nvml = two_gpus()
    for dev in nvml.devices:
        dev.fail["nvmlDeviceGetHandleByIndex"] = 999
    inv = GpuProbe(nvml=nvml).inventory()
    assert inv.gpus == ()
    assert inv.unavailable_reason == "no usable GPUs: GPU 0: Unknown Error; GPU 1: Unknown Error"


def test_unsupported_process_list_and_utilisation_degrade() -> None:
    nvml = two_gpus()
    nvml.devices[0].fail.update(
        {"nvmlDeviceGetComputeRunningProcesses": 3, "nvmlDeviceGetUtilizationRates": 3}
    )
    first = GpuProbe(nvml=nvml).sample()[0]
    assert first == GpuSample("GPU-aaaa", 0.0, 3 * GIB, ())


def test_mig_devices_are_listed_with_parent_index() -> None:
    mig = [
        FakeDevice(
            "MIG-1111",
            name="NVIDIA A100 MIG 3g.20gb",
            memory_total=20 * GIB,
            memory_used=GIB,
            processes=[(7, GIB)],
            fail={"nvmlDeviceGetUtilizationRates": 3},
        ),
        None,
        FakeDevice("MIG-2222", name="NVIDIA A100 MIG 3g.20gb", memory_total=20 * GIB),
    ]
    nvml = FakeNvml([FakeDevice("GPU-plain"), FakeDevice("GPU-parent", mig=mig)])
    probe = GpuProbe(nvml=nvml)
    assert probe.inventory().gpus == (
        GpuInfo(0, "GPU-plain", "NVIDIA H100 80GB HBM3", 80 * GIB),
        GpuInfo(1, "MIG-1111", "NVIDIA A100 MIG 3g.20gb", 20 * GIB, mig=True),
        GpuInfo(1, "MIG-2222", "NVIDIA A100 MIG 3g.20gb", 20 * GIB, mig=True),
    )
    assert probe.sample()[1] == GpuSample("MIG-1111", 0.0, GIB, (GpuProcess(7, GIB),))


def test_mig_enabled_without_instances_is_unusable() -> None:
    nvml = FakeNvml([FakeDevice("GPU-parent", mig=[None, None])])
    inv = GpuProbe(nvml=nvml).inventory()
    assert inv.gpus == ()
    assert inv.unavailable_reason is not None and "MIG" in inv.unavailable_reason


def test_no_devices_gives_reason() -> None:
    inv = GpuProbe(nvml=FakeNvml([])).inventory()
    assert (inv.gpus, inv.unavailable_reason) == ((), "no NVIDIA GPUs found")


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (12, "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"),
        (9, "NVIDIA driver is not loaded (NVML init: Driver Not Loaded)"),
        (999, "NVML init failed: Unknown Error"),
    ],
)
def test_init_failure_reason(code: int, reason: str) -> None:
    nvml = two_gpus(init_error=code)
    probe = GpuProbe(nvml=nvml)
    inv = probe.inventory()
    assert (inv.gpus, inv.unavailable_reason) == ((), reason)
    assert probe.sample() == []
    probe.close()
    assert nvml.shutdown_calls == 0  # never initialised, so never shut down


def test_library_missing_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    probe = GpuProbe()
    assert probe.inventory().unavailable_reason == "nvidia-ml-py is not installed"
    assert probe.sample() == []


def test_disabled_touches_no_nvml() -> None:
    nvml = two_gpus()
    probe = GpuProbe(nvml=nvml, enabled=False)
    inv = probe.inventory()
    assert (inv.gpus, inv.unavailable_reason) == ((), DISABLED_REASON)
    assert probe.sample() == []
    assert nvml.init_calls == 0


def test_unexpected_error_becomes_reason() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise RuntimeError("binding bug")

    nvml = Broken([])
    inv = GpuProbe(nvml=nvml).inventory()
    assert inv.unavailable_reason == "GPU probe failed: binding bug"
    assert nvml.init_calls == nvml.shutdown_calls == 1


def test_simulated_gpus() -> None:
    nvml = two_gpus()
    probe = GpuProbe(nvml=nvml, simulated=3)
    inv = probe.inventory()
    assert [g.uuid for g in inv.gpus] == ["SIM-GPU-0", "SIM-GPU-1", "SIM-GPU-2"]
    assert all(g.simulated and g.name == "Simulated GPU" for g in inv.gpus)
    assert all(g.memory_total_bytes == 16 * GIB for g in inv.gpus)
    assert inv.unavailable_reason is None
    assert probe.sample() == [GpuSample(f"SIM-GPU-{i}", 0.0, 0, ()) for i in range(3)]
    assert nvml.calls == [] and nvml.init_calls == 0
    sub = GpuProbe(simulated=3, visible_indices=[2]).inventory()
    assert [g.uuid for g in sub.gpus] == ["SIM-GPU-2"]


def test_cuda_visible_devices() -> None:
    assert cuda_visible_devices([0, 2]) == "0,2"
    assert cuda_visible_devices([]) == ""
    assert cuda_visible_devices([0, 2], ["GPU-a", "GPU-c"], mig={"MIG-x"}) == "0,2"
    # Two MIG devices of GPU 1 share its index: only their UUIDs tell them apart.
    assert cuda_visible_devices([1], ["MIG-2222"], mig={"MIG-1111", "MIG-2222"}) == "MIG-2222"
    assert cuda_visible_devices([0, 1], ["GPU-plain", "MIG-1111"], mig={"MIG-1111"}) == "GPU-plain,MIG-1111"
    # From a coordinator that sends no UUIDs: indices, as before.
    assert cuda_visible_devices([1], [], mig={"MIG-1111"}) == "1"


def test_a_trial_given_a_mig_device_sees_it_by_uuid(tmp_path: Path) -> None:
    from trialkeeper.agent.session import AgentOptions, AgentSession
    from trialkeeper.protos.v1 import coordinator_pb2 as pb

    mig = [FakeDevice("MIG-1111", memory_total=20 * GIB), FakeDevice("MIG-2222", memory_total=20 * GIB)]
    probe = GpuProbe(nvml=FakeNvml([FakeDevice("GPU-plain"), FakeDevice("GPU-parent", mig=mig)]))
    session = AgentSession(AgentOptions("127.0.0.1:1", "env-1", "t", tmp_path, probe=probe))
    started: list[Any] = []
    session.runner.start = started.append  # type: ignore[method-assign]
    session._on_start(pb.StartTrial(trial_id="a", gpu_indices=[1], gpu_uuids=["MIG-2222"], attempt=1))
    session._on_start(pb.StartTrial(trial_id="b", gpu_indices=[0], gpu_uuids=["GPU-plain"], attempt=1))
    assert [s.visible_devices for s in started] == ["MIG-2222", "0"]
    probe.close()


def test_import_does_not_load_pynvml() -> None:
    code = "import sys, trialkeeper.agent.gpu; assert 'pynvml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_real_pynvml_never_raises() -> None:
    """On any machine: GPUs, or a reason why there are none."""
    probe = GpuProbe()
    try:
        inv = probe.inventory()
        samples = probe.sample()
    finally:
        probe.close()
    assert inv.gpus or inv.unavailable_reason
    assert {s.uuid for s in samples} <= {g.uuid for g in inv.gpus}


@pytest.mark.skipif(
    _nvml_loadable(), reason="checks the answer without a GPU driver, and this machine has one; runs where none loads"
)
def test_real_pynvml_without_driver_names_why() -> None:
    with GpuProbe() as probe:
        inv = probe.inventory()
        assert probe.sample() == []
    assert inv.gpus == ()
    assert inv.unavailable_reason is not None
    assert "driver" in inv.unavailable_reason or "nvidia-ml-py" in inv.unavailable_reason


@pytest.mark.gpu
@pytest.mark.skipif(
    not _nvml_loadable(), reason="needs an NVIDIA GPU and its driver (libnvidia-ml loads); runs on a machine with one"
)
def test_real_pynvml_with_driver_reports_gpus() -> None:
    with GpuProbe() as probe:
        inv = probe.inventory()
        samples = probe.sample()
    assert inv.gpus, inv.unavailable_reason
    assert inv.driver_version and inv.cuda_version
    assert all(g.uuid.startswith(("GPU-", "MIG-")) and g.memory_total_bytes > 0 for g in inv.gpus)
    assert [s.uuid for s in samples] == [g.uuid for g in inv.gpus]
    assert all(0.0 <= s.utilization_percent <= 100.0 for s in samples)


def test_no_nvml_library_means_no_pynvml_import(monkeypatch: pytest.MonkeyPatch) -> None:
    # pynvml costs an idle agent a few MB: without NVIDIA's library it is not imported.
    from trialkeeper.agent import gpu

    monkeypatch.setattr(gpu, "_nvml_library_loads", lambda: False)
    imported: list[str] = []
    real = importlib.import_module
    monkeypatch.setattr(gpu.importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    probe = GpuProbe()
    assert probe.inventory().unavailable_reason == "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"
    assert probe.sample() == []
    assert "pynvml" not in imported


def test_a_pynvml_without_a_spec_in_sys_modules_does_not_make_inventory_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from trialkeeper.agent import gpu

    stub = types.ModuleType("pynvml")
    stub.__spec__ = None
    monkeypatch.setitem(sys.modules, "pynvml", stub)  # find_spec raises ValueError for such a module
    monkeypatch.setattr(gpu, "_nvml_library_loads", lambda: False)
    assert (
        GpuProbe().inventory().unavailable_reason == "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"
    )
