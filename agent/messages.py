"""The agent's messages as the wire has them: what it says of itself (Register), of its
machine (Heartbeat) and of a trial's end (TrialEnded), and a StartTrial read as the
TrialSpec the runner starts. Plain functions of their inputs: the session sends them."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

import psutil
from trialkeeper.protos import limits
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.wire import PROTOCOL_VERSION

from . import __version__
from .checkpoint_link import checkpoint_ref
from .gpu import GpuInventory, GpuSample, cuda_visible_devices
from .runner import TrialResult, TrialSpec

__all__ = ["heartbeat", "register", "trial_ended", "trial_spec"]

_OUTCOMES = {
    "succeeded": pb.TRIAL_OUTCOME_SUCCEEDED,
    "failed": pb.TRIAL_OUTCOME_FAILED,
    "canceled": pb.TRIAL_OUTCOME_CANCELED,
    "timed_out": pb.TRIAL_OUTCOME_TIMED_OUT,
    "lost": pb.TRIAL_OUTCOME_LOST,
    "paused": pb.TRIAL_OUTCOME_PAUSED,
}


def register(
    inv: GpuInventory, *, environment_id: str, instance_id: str, active_trial_ids: Sequence[str], last_seq: int,
    platform: str,
) -> pb.AgentMessage:
    vm = psutil.virtual_memory()
    return pb.AgentMessage(
        register=pb.Register(
            protocol_version=PROTOCOL_VERSION,
            environment_id=environment_id,
            agent_instance_id=instance_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            cpu_count=os.cpu_count() or 1,
            memory_total_bytes=vm.total,
            gpus=[
                pb.GpuInfo(index=g.index, uuid=g.uuid, name=g.name, memory_total_bytes=g.memory_total_bytes,
                           simulated=g.simulated, mig=g.mig)
                for g in inv.gpus[: limits.MAX_GPUS]
            ],
            gpu_unavailable_reason=limits.clip(inv.unavailable_reason or "", limits.MAX_REASON_CHARS),
            driver_version=inv.driver_version,
            cuda_version=inv.cuda_version,
            agent_version=__version__,
            active_trial_ids=list(active_trial_ids),
            last_seq=last_seq,
            platform=platform,
        )
    )


def heartbeat(gpu_samples: Sequence[GpuSample], owners: Mapping[int, str], draining: bool) -> pb.Heartbeat:
    """The machine now: ``gpu_samples`` (as many as Register gives), each process named by the
    trial ``owners`` says it belongs to."""
    samples = [
        pb.GpuSample(
            uuid=s.uuid,
            utilization_percent=s.utilization_percent,
            memory_used_bytes=s.memory_used_bytes,
            processes=[
                pb.GpuProcess(pid=p.pid, used_memory_bytes=p.used_memory_bytes, trial_id=owners.get(p.pid, ""))
                for p in s.processes[: limits.MAX_PROCESSES_PER_GPU]
            ],
        )
        for s in gpu_samples[: limits.MAX_GPUS]
    ]
    return pb.Heartbeat(memory_used_bytes=psutil.virtual_memory().used, gpus=samples, draining=draining)


def trial_ended(result: TrialResult, gpus_still_in_use: Sequence[str]) -> pb.AgentMessage:
    return pb.AgentMessage(trial_ended=pb.TrialEnded(
        trial_id=result.trial_id,
        outcome=_OUTCOMES[result.outcome],
        has_exit_code=result.exit_code is not None,
        exit_code=result.exit_code or 0,
        signal=result.signal,
        reason=limits.clip(result.reason, limits.MAX_REASON_CHARS),
        stderr_tail=result.stderr_tail,
        ended_at=result.ended_at,
        started=result.started,
        gpus_still_in_use=list(gpus_still_in_use),
    ))


def trial_spec(st: pb.StartTrial, mig_uuids: frozenset[str]) -> TrialSpec:
    """What the runner starts for a StartTrial; ``mig_uuids`` are this machine's MIG devices."""
    return TrialSpec(
        trial_id=st.trial_id,
        sequence_id=st.sequence_id,
        experiment_id=st.experiment_id,
        command=st.command,
        parameters_json=st.parameters_json or "{}",
        env=dict(st.env),
        gpu_indices=tuple(st.gpu_indices),
        visible_devices=cuda_visible_devices(st.gpu_indices, st.gpu_uuids, mig_uuids),
        working_directory=st.working_directory,
        max_duration_s=st.max_duration_s,
        attempt=st.attempt,
        first_metric_index=st.first_metric_index,
        checkpoint=checkpoint_ref(st.checkpoint) if st.HasField("checkpoint") else None,
        node_rank=st.node_rank, nodes=max(1, st.nodes), master_addr=st.master_addr, master_port=st.master_port,
    )
