"""The agent's GPU probe: which GPUs this agent may hand to trials, and how busy they are.

Built on NVML through nvidia-ml-py (import name ``pynvml``), which is imported only when a
probe first needs it, so that importing this module stays cheap on machines without GPUs.
When monitoring is off the inventory says why (not installed, no driver, init failed,
disabled) instead of raising, as dask's ``diagnostics/nvml.py`` does; ``inventory()`` and
``sample()`` never raise.

GPUs are identified by UUID everywhere. The physical NVML index is kept only to build
``CUDA_VISIBLE_DEVICES``; NVML numbers GPUs in PCI bus order, so a child that is given
indices also needs ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` for CUDA to mean the same GPUs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DISABLED_REASON",
    "GpuInfo",
    "GpuInventory",
    "GpuProbe",
    "GpuProcess",
    "GpuSample",
    "cuda_visible_devices",
]

log = logging.getLogger(__name__)

DISABLED_REASON = "disabled by --no-gpu"
SIMULATED_NAME = "Simulated GPU"
SIMULATED_MEMORY_BYTES = 16 * 1024**3

# NVML return codes and constants from nvml.h, compared by value so that a fake NVML only
# needs an NVMLError carrying `.value`.
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_MIG_ENABLED = 1


@dataclass(frozen=True)
class GpuInfo:
    """One GPU this agent reports; a MIG device is its own entry with its parent's index."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    simulated: bool = False
    mig: bool = False


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU; used memory is 0 where NVML cannot tell."""

    pid: int
    used_memory_bytes: int


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU."""

    uuid: str
    utilization_percent: float
    memory_used_bytes: int
    processes: tuple[GpuProcess, ...]


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs found; when there are none, `unavailable_reason` says why."""

    gpus: tuple[GpuInfo, ...]
    driver_version: str = ""
    cuda_version: str = ""
    unavailable_reason: str | None = None


@dataclass(frozen=True)
class _Device:
    info: GpuInfo
    handle: Any


class _Unusable(Exception):
    """A GPU that NVML lists but that can run nothing (MIG on, no MIG devices made)."""


def cuda_visible_devices(indices: Sequence[int], uuids: Sequence[str] = (), mig: Collection[str] = ()) -> str:
    """The CUDA_VISIBLE_DEVICES value for GPUs given by physical index (and, in the same
    order, by UUID): "0,2", or "" for none. When one of them is a MIG device (its UUID in
    ``mig``), whose index is its parent's, all are named by UUID, which CUDA takes too."""
    if uuids and len(uuids) == len(indices) and any(u in mig for u in uuids):
        return ",".join(uuids)
    return ",".join(str(int(i)) for i in indices)


class GpuProbe:
    """Lists this agent's GPUs and samples their use through NVML.

    `nvml` replaces the `pynvml` module (tests pass a fake); `visible_indices` restricts
    the report to those physical indices; `simulated=N` reports N fake GPUs without
    touching NVML (tests and benchmarks only); `enabled=False` reports none. NVML is
    initialised on first use and kept until `close()`.
    """

    def __init__(
        self,
        *,
        nvml: object | None = None,
        visible_indices: Sequence[int] | None = None,
        simulated: int = 0,
        enabled: bool = True,
    ) -> None:
        if simulated < 0:
            raise ValueError(f"simulated must be >= 0, got {simulated}")
        self._nvml_override: Any = nvml
        self._visible = (
            None if visible_indices is None else tuple(sorted({int(i) for i in visible_indices}))
        )
        self._simulated = simulated
        self._enabled = enabled
        # The agent may sample from a monitor thread while another asks for the inventory.
        self._lock = threading.Lock()
        self._nvml: Any = None  # set while NVML is initialised
        self._devices: tuple[_Device, ...] = ()
        self._inventory: GpuInventory | None = None
        self._warned: set[str] = set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def inventory(self) -> GpuInventory:
        with self._lock:
            return self._ensure_inventory()

    def sample(self) -> list[GpuSample]:
        with self._lock:
            inventory = self._ensure_inventory()
            if self._simulated:
                return [GpuSample(g.uuid, 0.0, 0, ()) for g in inventory.gpus]
            samples = []
            for device in self._devices:
                try:
                    sample = self._sample_device(device)
                except Exception as e:  # noqa: BLE001 -- never raise into the agent's loop
                    self._warn_once(
                        f"sample:{device.info.uuid}",
                        "Skipping GPU %s in samples: %s",
                        device.info.uuid,
                        _err_text(e),
                    )
                    continue
                samples.append(sample)
            return samples

    def close(self) -> None:
        """Shut NVML down; a later call initialises it again."""
        with self._lock:
            self._shutdown()
            self._inventory = None

    def _ensure_inventory(self) -> GpuInventory:
        if self._inventory is None:
            try:
                inventory = self._discover()
            except Exception as e:  # a bug or an odd binding must not take the agent down
                log.warning("GPU probe failed unexpectedly", exc_info=True)
                self._shutdown()
                inventory = GpuInventory((), unavailable_reason=f"GPU probe failed: {_err_text(e)}")
            self._inventory = inventory
            _log_inventory(inventory)
        return self._inventory

    def _discover(self) -> GpuInventory:
        if not self._enabled:
            return GpuInventory((), unavailable_reason=DISABLED_REASON)
        if self._visible == ():
            return GpuInventory((), unavailable_reason="no GPU indices were given to this agent")
        if self._simulated:
            wanted, missing = self._select(self._simulated)
            gpus = tuple(
                GpuInfo(i, f"SIM-GPU-{i}", SIMULATED_NAME, SIMULATED_MEMORY_BYTES, simulated=True)
                for i in wanted
            )
            reason = None if gpus else _none_left(self._simulated, missing, [])
            return GpuInventory(gpus, unavailable_reason=reason)

        nvml = self._nvml_override
        if nvml is None:
            if not _pynvml_installed():
                return GpuInventory((), unavailable_reason="nvidia-ml-py is not installed")
            if not _nvml_library_loads():
                # What NVML init would say, without importing pynvml: a few MB an agent on a
                # machine without NVIDIA's driver keeps for nothing.
                return GpuInventory((), unavailable_reason=_library_not_found())
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError:
                return GpuInventory((), unavailable_reason="nvidia-ml-py is not installed")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            return GpuInventory((), unavailable_reason=_init_failure(e))
        self._nvml = nvml

        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            self._shutdown()
            return GpuInventory((), unavailable_reason=f"NVML device count failed: {_err_text(e)}")
        wanted, missing = self._select(count)
        devices: list[_Device] = []
        errors: list[str] = []
        for index in wanted:
            try:
                devices.extend(self._describe(nvml, index))
            except (nvml.NVMLError, _Unusable) as e:
                errors.append(f"GPU {index}: {_err_text(e)}")
                self._warn_once(f"describe:{index}", "Skipping GPU %d: %s", index, _err_text(e))
        driver = _optional_text(nvml, "nvmlSystemGetDriverVersion")
        cuda = _cuda_version(nvml)
        self._devices = tuple(devices)
        if not devices:
            self._shutdown()  # nothing to sample, so do not hold NVML open
            return GpuInventory((), driver, cuda, _none_left(count, missing, errors))
        return GpuInventory(tuple(d.info for d in devices), driver, cuda)

    def _select(self, count: int) -> tuple[list[int], list[int]]:
        if self._visible is None:
            return list(range(count)), []
        wanted = [i for i in self._visible if 0 <= i < count]
        missing = [i for i in self._visible if not 0 <= i < count]
        if missing:
            self._warn_once(
                "missing",
                "GPU indices %s do not exist (%d GPU(s) found); ignoring them",
                missing,
                count,
            )
        return wanted, missing

    def _describe(self, nvml: Any, index: int) -> list[_Device]:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        if _mig_enabled(nvml, handle):
            migs = []
            for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except nvml.NVMLError as e:
                    if _code(e) == _NOT_FOUND:  # an empty slot
                        continue
                    raise
                migs.append(_Device(_info(nvml, index, mig, mig=True), mig))
            if not migs:
                raise _Unusable("MIG mode is enabled but no MIG devices are configured")
            return migs
        return [_Device(_info(nvml, index, handle, mig=False), handle)]

    def _sample_device(self, device: _Device) -> GpuSample:
        nvml = self._nvml
        handle = device.handle
        memory_used = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        try:
            utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError as e:
            if _code(e) != _NOT_SUPPORTED:
                raise
            # MIG devices have no utilisation counter; 0 keeps the sample's memory and
            # processes, which still say whether the device is in use.
            utilization = 0.0
            if f"util:{device.info.uuid}" not in self._warned:
                self._warned.add(f"util:{device.info.uuid}")
                log.info("GPU %s reports no utilisation; sampling it as 0%%", device.info.uuid)
        return GpuSample(device.info.uuid, utilization, memory_used, self._processes(nvml, device))

    def _processes(self, nvml: Any, device: _Device) -> tuple[GpuProcess, ...]:
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(device.handle)
        except nvml.NVMLError as e:
            if _code(e) not in (_NOT_SUPPORTED, _NO_PERMISSION, _FUNCTION_NOT_FOUND):
                raise
            return ()
        except Exception as e:  # noqa: BLE001 -- pynvml's NVMLLibraryMismatchError is no NVMLError
            self._warn_once(
                f"procs:{device.info.uuid}",
                "No process list for GPU %s: %s",
                device.info.uuid,
                _err_text(e),
            )
            return ()
        return tuple(
            GpuProcess(int(p.pid), 0 if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in procs
        )

    def _shutdown(self) -> None:
        nvml, self._nvml, self._devices = self._nvml, None, ()
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception as e:  # noqa: BLE001 -- closing must not fail
                log.debug("nvmlShutdown failed: %s", _err_text(e))

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key in self._warned:
            log.debug(msg, *args)
        else:
            self._warned.add(key)
            log.warning(msg, *args)


def _info(nvml: Any, index: int, handle: Any, *, mig: bool) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        mig=mig,
    )


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    get_mode = getattr(nvml, "nvmlDeviceGetMigMode", None)
    if get_mode is None:
        return False
    try:
        current, _pending = get_mode(handle)
    except nvml.NVMLError:  # NOT_SUPPORTED on GPUs without MIG
        return False
    return bool(current == _MIG_ENABLED)


def _pynvml_installed() -> bool:
    try:
        return importlib.util.find_spec("pynvml") is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return "pynvml" in sys.modules and sys.modules["pynvml"] is not None


def _nvml_library_loads() -> bool:
    """Whether NVIDIA's NVML library can be loaded (as pynvml loads it on Linux); True
    elsewhere, where pynvml's own search decides."""
    if not sys.platform.startswith("linux"):
        return True
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _library_not_found() -> str:
    library = "nvml.dll" if sys.platform == "win32" else "libnvidia-ml.so.1"
    return f"NVIDIA driver not found ({library} could not be loaded)"


def _init_failure(e: BaseException) -> str:
    code = _code(e)
    if code == _LIBRARY_NOT_FOUND:
        return _library_not_found()
    if code == _DRIVER_NOT_LOADED:
        return "NVIDIA driver is not loaded (NVML init: Driver Not Loaded)"
    return f"NVML init failed: {_err_text(e)}"


def _none_left(count: int, missing: list[int], errors: list[str]) -> str:
    parts = []
    if count == 0:
        parts.append("no NVIDIA GPUs found")
    if missing:
        parts.append(f"GPU indices {missing} do not exist ({count} GPU(s) found)")
    if errors:
        parts.append("no usable GPUs: " + "; ".join(errors))
    return "; ".join(parts) or "no GPUs to report"


def _cuda_version(nvml: Any) -> str:
    for name in ("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2"):
        fn = getattr(nvml, name, None)
        if fn is None:
            continue
        try:
            version = int(fn())
        except nvml.NVMLError:
            continue
        if version > 0:  # 12040 -> "12.4"
            return f"{version // 1000}.{version % 1000 // 10}"
    return ""


def _optional_text(nvml: Any, name: str) -> str:
    try:
        return _text(getattr(nvml, name)())
    except nvml.NVMLError:
        return ""


def _log_inventory(inventory: GpuInventory) -> None:
    if not inventory.gpus:
        log.info("GPU monitoring off: %s", inventory.unavailable_reason)
    elif inventory.gpus[0].simulated:
        log.info("GPU probe: %d SIMULATED GPU(s), not real hardware", len(inventory.gpus))
    else:
        log.info(
            "GPU probe: %d GPU(s) %s, driver %s, CUDA %s",
            len(inventory.gpus),
            ", ".join(f"{g.index}:{g.uuid}" for g in inventory.gpus),
            inventory.driver_version or "?",
            inventory.cuda_version or "?",
        )


def _code(e: BaseException) -> int | None:
    value = getattr(e, "value", None)
    return value if isinstance(value, int) else None


def _text(value: object) -> str:
    if isinstance(value, bytes):  # pynvml before 11.5 returns bytes
        return value.decode("utf-8", "replace")
    return str(value)


def _err_text(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 -- pynvml's __str__ may call into the library
        text = ""
    return text or type(e).__name__
