from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MetricKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METRIC_KIND_UNSPECIFIED: _ClassVar[MetricKind]
    METRIC_KIND_INTERMEDIATE: _ClassVar[MetricKind]
    METRIC_KIND_FINAL: _ClassVar[MetricKind]

class LogStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOG_STREAM_UNSPECIFIED: _ClassVar[LogStream]
    LOG_STREAM_STDOUT: _ClassVar[LogStream]
    LOG_STREAM_STDERR: _ClassVar[LogStream]

class TrialOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRIAL_OUTCOME_UNSPECIFIED: _ClassVar[TrialOutcome]
    TRIAL_OUTCOME_SUCCEEDED: _ClassVar[TrialOutcome]
    TRIAL_OUTCOME_FAILED: _ClassVar[TrialOutcome]
    TRIAL_OUTCOME_CANCELED: _ClassVar[TrialOutcome]
    TRIAL_OUTCOME_TIMED_OUT: _ClassVar[TrialOutcome]
    TRIAL_OUTCOME_LOST: _ClassVar[TrialOutcome]
    TRIAL_OUTCOME_PAUSED: _ClassVar[TrialOutcome]
METRIC_KIND_UNSPECIFIED: MetricKind
METRIC_KIND_INTERMEDIATE: MetricKind
METRIC_KIND_FINAL: MetricKind
LOG_STREAM_UNSPECIFIED: LogStream
LOG_STREAM_STDOUT: LogStream
LOG_STREAM_STDERR: LogStream
TRIAL_OUTCOME_UNSPECIFIED: TrialOutcome
TRIAL_OUTCOME_SUCCEEDED: TrialOutcome
TRIAL_OUTCOME_FAILED: TrialOutcome
TRIAL_OUTCOME_CANCELED: TrialOutcome
TRIAL_OUTCOME_TIMED_OUT: TrialOutcome
TRIAL_OUTCOME_LOST: TrialOutcome
TRIAL_OUTCOME_PAUSED: TrialOutcome

class AgentMessage(_message.Message):
    __slots__ = ("seq", "register", "heartbeat", "trial_started", "metrics", "log", "trial_ended", "checkpoint_chunk", "checkpoint_saved", "fetch_checkpoint", "leaving")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TRIAL_STARTED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    TRIAL_ENDED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVED_FIELD_NUMBER: _ClassVar[int]
    FETCH_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    seq: int
    register: Register
    heartbeat: Heartbeat
    trial_started: TrialStarted
    metrics: MetricBatch
    log: LogChunk
    trial_ended: TrialEnded
    checkpoint_chunk: CheckpointChunk
    checkpoint_saved: CheckpointSaved
    fetch_checkpoint: FetchCheckpoint
    leaving: Leaving
    def __init__(self, seq: _Optional[int] = ..., register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., trial_started: _Optional[_Union[TrialStarted, _Mapping]] = ..., metrics: _Optional[_Union[MetricBatch, _Mapping]] = ..., log: _Optional[_Union[LogChunk, _Mapping]] = ..., trial_ended: _Optional[_Union[TrialEnded, _Mapping]] = ..., checkpoint_chunk: _Optional[_Union[CheckpointChunk, _Mapping]] = ..., checkpoint_saved: _Optional[_Union[CheckpointSaved, _Mapping]] = ..., fetch_checkpoint: _Optional[_Union[FetchCheckpoint, _Mapping]] = ..., leaving: _Optional[_Union[Leaving, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("protocol_version", "environment_id", "agent_instance_id", "hostname", "pid", "cpu_count", "memory_total_bytes", "gpus", "gpu_unavailable_reason", "driver_version", "cuda_version", "agent_version", "active_trial_ids", "last_seq", "platform")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRIAL_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    environment_id: str
    agent_instance_id: str
    hostname: str
    pid: int
    cpu_count: int
    memory_total_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    gpu_unavailable_reason: str
    driver_version: str
    cuda_version: str
    agent_version: str
    active_trial_ids: _containers.RepeatedScalarFieldContainer[str]
    last_seq: int
    platform: str
    def __init__(self, protocol_version: _Optional[int] = ..., environment_id: _Optional[str] = ..., agent_instance_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., cpu_count: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., gpu_unavailable_reason: _Optional[str] = ..., driver_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., agent_version: _Optional[str] = ..., active_trial_ids: _Optional[_Iterable[str]] = ..., last_seq: _Optional[int] = ..., platform: _Optional[str] = ...) -> None: ...

class Leaving(_message.Message):
    __slots__ = ("drained",)
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    def __init__(self, drained: _Optional[bool] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_bytes", "simulated", "mig")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    MIG_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    simulated: bool
    mig: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., simulated: _Optional[bool] = ..., mig: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("memory_used_bytes", "gpus", "draining", "gpus_unchanged")
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    GPUS_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    memory_used_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuSample]
    draining: bool
    gpus_unchanged: bool
    def __init__(self, memory_used_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuSample, _Mapping]]] = ..., draining: _Optional[bool] = ..., gpus_unchanged: _Optional[bool] = ...) -> None: ...

class GpuSample(_message.Message):
    __slots__ = ("uuid", "utilization_percent", "memory_used_bytes", "processes")
    UUID_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    utilization_percent: float
    memory_used_bytes: int
    processes: _containers.RepeatedCompositeFieldContainer[GpuProcess]
    def __init__(self, uuid: _Optional[str] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[GpuProcess, _Mapping]]] = ...) -> None: ...

class GpuProcess(_message.Message):
    __slots__ = ("pid", "used_memory_bytes", "trial_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_memory_bytes: int
    trial_id: str
    def __init__(self, pid: _Optional[int] = ..., used_memory_bytes: _Optional[int] = ..., trial_id: _Optional[str] = ...) -> None: ...

class TrialStarted(_message.Message):
    __slots__ = ("trial_id", "pid", "started_at", "rendezvous_address", "rendezvous_port")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    pid: int
    started_at: float
    rendezvous_address: str
    rendezvous_port: int
    def __init__(self, trial_id: _Optional[str] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ..., rendezvous_address: _Optional[str] = ..., rendezvous_port: _Optional[int] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("trial_id", "kind", "index", "value", "value_json", "reported_at")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    kind: MetricKind
    index: int
    value: float
    value_json: str
    reported_at: float
    def __init__(self, trial_id: _Optional[str] = ..., kind: _Optional[_Union[MetricKind, str]] = ..., index: _Optional[int] = ..., value: _Optional[float] = ..., value_json: _Optional[str] = ..., reported_at: _Optional[float] = ...) -> None: ...

class MetricRun(_message.Message):
    __slots__ = ("trial_id", "kind", "first_index", "values", "value_json", "reported_at")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    kind: MetricKind
    first_index: int
    values: _containers.RepeatedScalarFieldContainer[float]
    value_json: _containers.RepeatedScalarFieldContainer[str]
    reported_at: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, trial_id: _Optional[str] = ..., kind: _Optional[_Union[MetricKind, str]] = ..., first_index: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ..., value_json: _Optional[_Iterable[str]] = ..., reported_at: _Optional[_Iterable[float]] = ...) -> None: ...

class MetricBatch(_message.Message):
    __slots__ = ("metrics", "runs")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedCompositeFieldContainer[Metric]
    runs: _containers.RepeatedCompositeFieldContainer[MetricRun]
    def __init__(self, metrics: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ..., runs: _Optional[_Iterable[_Union[MetricRun, _Mapping]]] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("trial_id", "stream", "offset", "data")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    stream: LogStream
    offset: int
    data: bytes
    def __init__(self, trial_id: _Optional[str] = ..., stream: _Optional[_Union[LogStream, str]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TrialEnded(_message.Message):
    __slots__ = ("trial_id", "outcome", "has_exit_code", "exit_code", "signal", "reason", "stderr_tail", "ended_at", "started", "gpus_still_in_use")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    GPUS_STILL_IN_USE_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    outcome: TrialOutcome
    has_exit_code: bool
    exit_code: int
    signal: int
    reason: str
    stderr_tail: str
    ended_at: float
    started: bool
    gpus_still_in_use: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trial_id: _Optional[str] = ..., outcome: _Optional[_Union[TrialOutcome, str]] = ..., has_exit_code: _Optional[bool] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., reason: _Optional[str] = ..., stderr_tail: _Optional[str] = ..., ended_at: _Optional[float] = ..., started: _Optional[bool] = ..., gpus_still_in_use: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointFile(_message.Message):
    __slots__ = ("path", "size", "mode")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    mode: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("trial_id", "step", "path", "offset", "data", "last")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    step: int
    path: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, trial_id: _Optional[str] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class CheckpointSaved(_message.Message):
    __slots__ = ("trial_id", "step", "metric_index", "size_bytes", "digest", "files", "location", "saved_at")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRIC_INDEX_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    SAVED_AT_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    step: int
    metric_index: int
    size_bytes: int
    digest: str
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    location: str
    saved_at: float
    def __init__(self, trial_id: _Optional[str] = ..., step: _Optional[int] = ..., metric_index: _Optional[int] = ..., size_bytes: _Optional[int] = ..., digest: _Optional[str] = ..., files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ..., location: _Optional[str] = ..., saved_at: _Optional[float] = ...) -> None: ...

class FetchCheckpoint(_message.Message):
    __slots__ = ("trial_id", "step", "path", "offset")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    step: int
    path: str
    offset: int
    def __init__(self, trial_id: _Optional[str] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("step", "metric_index", "location", "digest", "size_bytes", "files", "trial_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRIC_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    metric_index: int
    location: str
    digest: str
    size_bytes: int
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    trial_id: str
    def __init__(self, step: _Optional[int] = ..., metric_index: _Optional[int] = ..., location: _Optional[str] = ..., digest: _Optional[str] = ..., size_bytes: _Optional[int] = ..., files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ..., trial_id: _Optional[str] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("welcome", "start_trial", "cancel_trial", "shutdown", "ack", "settings", "pause_trial", "checkpoint_chunk", "checkpoint_refused")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    START_TRIAL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_TRIAL_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_TRIAL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_REFUSED_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    start_trial: StartTrial
    cancel_trial: CancelTrial
    shutdown: Shutdown
    ack: Ack
    settings: Settings
    pause_trial: PauseTrial
    checkpoint_chunk: CheckpointChunk
    checkpoint_refused: CheckpointRefused
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., start_trial: _Optional[_Union[StartTrial, _Mapping]] = ..., cancel_trial: _Optional[_Union[CancelTrial, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., settings: _Optional[_Union[Settings, _Mapping]] = ..., pause_trial: _Optional[_Union[PauseTrial, _Mapping]] = ..., checkpoint_chunk: _Optional[_Union[CheckpointChunk, _Mapping]] = ..., checkpoint_refused: _Optional[_Union[CheckpointRefused, _Mapping]] = ...) -> None: ...

class PauseTrial(_message.Message):
    __slots__ = ("trial_id", "grace_s", "reason")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    grace_s: float
    reason: str
    def __init__(self, trial_id: _Optional[str] = ..., grace_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckpointRefused(_message.Message):
    __slots__ = ("trial_id", "step", "reason")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    step: int
    reason: str
    def __init__(self, trial_id: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Settings(_message.Message):
    __slots__ = ("heartbeat_interval_s", "gpu_sample_interval_s")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    GPU_SAMPLE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    gpu_sample_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., gpu_sample_interval_s: _Optional[float] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("experiment_id", "acked_seq", "heartbeat_interval_s", "protocol_version", "cancel_trial_ids", "gpu_sample_interval_s", "checkpoint_dir", "checkpoint_storage", "max_checkpoint_bytes", "checkpoint_refusals", "checkpoint_data_port")
    EXPERIMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANCEL_TRIAL_IDS_FIELD_NUMBER: _ClassVar[int]
    GPU_SAMPLE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STORAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    experiment_id: str
    acked_seq: int
    heartbeat_interval_s: float
    protocol_version: int
    cancel_trial_ids: _containers.RepeatedScalarFieldContainer[str]
    gpu_sample_interval_s: float
    checkpoint_dir: str
    checkpoint_storage: str
    max_checkpoint_bytes: int
    checkpoint_refusals: _containers.RepeatedCompositeFieldContainer[CheckpointRefused]
    checkpoint_data_port: int
    def __init__(self, experiment_id: _Optional[str] = ..., acked_seq: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., protocol_version: _Optional[int] = ..., cancel_trial_ids: _Optional[_Iterable[str]] = ..., gpu_sample_interval_s: _Optional[float] = ..., checkpoint_dir: _Optional[str] = ..., checkpoint_storage: _Optional[str] = ..., max_checkpoint_bytes: _Optional[int] = ..., checkpoint_refusals: _Optional[_Iterable[_Union[CheckpointRefused, _Mapping]]] = ..., checkpoint_data_port: _Optional[int] = ...) -> None: ...

class StartTrial(_message.Message):
    __slots__ = ("trial_id", "sequence_id", "command", "parameters_json", "env", "gpu_indices", "working_directory", "max_duration_s", "experiment_id", "attempt", "first_metric_index", "gpu_uuids", "checkpoint", "node_rank", "nodes", "master_addr", "master_port")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    MAX_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FIRST_METRIC_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    sequence_id: int
    command: str
    parameters_json: str
    env: _containers.ScalarMap[str, str]
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    working_directory: str
    max_duration_s: float
    experiment_id: str
    attempt: int
    first_metric_index: int
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    checkpoint: CheckpointRef
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    def __init__(self, trial_id: _Optional[str] = ..., sequence_id: _Optional[int] = ..., command: _Optional[str] = ..., parameters_json: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., working_directory: _Optional[str] = ..., max_duration_s: _Optional[float] = ..., experiment_id: _Optional[str] = ..., attempt: _Optional[int] = ..., first_metric_index: _Optional[int] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., checkpoint: _Optional[_Union[CheckpointRef, _Mapping]] = ..., node_rank: _Optional[int] = ..., nodes: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ...) -> None: ...

class CancelTrial(_message.Message):
    __slots__ = ("trial_id", "grace_s", "reason")
    TRIAL_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    trial_id: str
    grace_s: float
    reason: str
    def __init__(self, trial_id: _Optional[str] = ..., grace_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("drain", "grace_s", "reason")
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    grace_s: float
    reason: str
    def __init__(self, drain: _Optional[bool] = ..., grace_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...
