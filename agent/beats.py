"""What a heartbeat carries: the GPU samples only when the coordinator would act on them.

The coordinator acts on which processes are on each GPU (a GPU held by an ended trial is
freed when its processes leave it; another user's process makes a GPU busy) and on the
memory in use (trials that ask for free GPU memory). Utilization it only keeps as a record,
every few seconds. So a heartbeat carries the samples when the processes changed, when
memory use moved by GPU_MEMORY_STEP or more, and at least every ``gpu_sample_interval_s``
the coordinator gave in its Welcome; otherwise it says ``gpus_unchanged``. A thousand idle
agents then send a thousand "alive" messages a second, which cost the coordinator next to
nothing to read.
"""

from __future__ import annotations

from collections.abc import Sequence

from trialkeeper.protos.v1 import coordinator_pb2 as pb

# Memory use that moved less than this since the samples last sent is "unchanged".
GPU_MEMORY_STEP = 64 << 20

# (uuid, memory used, ((pid, trial id, memory used), ...)) per GPU
_Shape = tuple[tuple[str, int, tuple[tuple[int, str, int], ...]], ...]


def _shape(samples: Sequence[pb.GpuSample]) -> _Shape:
    return tuple(
        (s.uuid, s.memory_used_bytes, tuple((p.pid, p.trial_id, p.used_memory_bytes) for p in s.processes))
        for s in samples
    )


def _moved(old: _Shape, new: _Shape) -> bool:
    """Whether ``new`` differs from ``old`` in what the coordinator acts on."""
    if len(old) != len(new):
        return True
    for (uuid, used, procs), (uuid2, used2, procs2) in zip(old, new):
        if uuid != uuid2 or abs(used - used2) >= GPU_MEMORY_STEP or len(procs) != len(procs2):
            return True
        for (pid, tid, mem), (pid2, tid2, mem2) in zip(procs, procs2):
            if pid != pid2 or tid != tid2 or abs(mem - mem2) >= GPU_MEMORY_STEP:
                return True
    return False


class GpuReport:
    """Per stream: decides whether the next heartbeat carries its GPU samples."""

    def __init__(self) -> None:
        self.interval_s = 0.0
        self._sent: _Shape | None = None
        self._sent_at = 0.0

    def new_stream(self, gpu_sample_interval_s: float) -> None:
        """A stream was welcomed: its first heartbeat carries the samples. An interval of 0
        (a coordinator that does not take ``gpus_unchanged``) means every one does."""
        self.interval_s = max(0.0, gpu_sample_interval_s)
        self._sent = None

    def outgoing(self, hb: pb.Heartbeat, now: float) -> pb.Heartbeat:
        """``hb`` as it goes out at monotonic time ``now``: as it is, or without its samples."""
        if not hb.gpus:
            return hb
        shape = _shape(hb.gpus)
        if (
            self.interval_s <= 0
            or self._sent is None
            or now - self._sent_at >= self.interval_s
            or _moved(self._sent, shape)
        ):
            self._sent, self._sent_at = shape, now
            return hb
        return pb.Heartbeat(memory_used_bytes=hb.memory_used_bytes, draining=hb.draining, gpus_unchanged=True)
