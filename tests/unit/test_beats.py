"""What an agent's heartbeat carries: GPU samples only when the coordinator would act on them."""

from __future__ import annotations

from trialkeeper.agent.beats import GPU_MEMORY_STEP, GpuReport
from trialkeeper.protos.v1 import coordinator_pb2 as pb


def beat(*gpus: pb.GpuSample, draining: bool = False) -> pb.Heartbeat:
    return pb.Heartbeat(memory_used_bytes=1 << 30, gpus=list(gpus), draining=draining)


def gpu(used: int = 1 << 30, util: float = 10.0, *procs: tuple[int, str, int]) -> pb.GpuSample:
    return pb.GpuSample(
        uuid="GPU-0", utilization_percent=util, memory_used_bytes=used,
        processes=[pb.GpuProcess(pid=p, trial_id=t, used_memory_bytes=m) for p, t, m in procs],
    )


def test_samples_go_first_on_a_stream_then_only_when_what_the_coordinator_acts_on_changed() -> None:
    report = GpuReport()
    report.new_stream(5.0)
    first = report.outgoing(beat(gpu()), now=0.0)
    assert len(first.gpus) == 1 and not first.gpus_unchanged
    # Utilization alone, and memory within the step, are not news.
    same = report.outgoing(beat(gpu((1 << 30) + GPU_MEMORY_STEP - 1, 97.0), draining=True), now=1.0)
    assert same.gpus_unchanged and not same.gpus and same.draining and same.memory_used_bytes == 1 << 30
    # A process coming, memory moving by a step, a process's memory moving by one: news.
    assert report.outgoing(beat(gpu(1 << 30, 10.0, (7, "t1", 0))), now=2.0).gpus
    assert report.outgoing(beat(gpu(1 << 30, 10.0, (7, "t1", 0))), now=2.5).gpus_unchanged
    assert report.outgoing(beat(gpu(1 << 30, 10.0, (7, "t1", GPU_MEMORY_STEP))), now=3.0).gpus
    assert report.outgoing(beat(gpu((1 << 30) + GPU_MEMORY_STEP, 10.0, (7, "t1", GPU_MEMORY_STEP))), now=3.5).gpus
    # The process going: news (the coordinator frees a GPU held by an ended trial on it).
    assert report.outgoing(beat(gpu((1 << 30) + GPU_MEMORY_STEP)), now=4.0).gpus
    # Nothing changed for the whole interval: sent anyway, for the record.
    assert report.outgoing(beat(gpu((1 << 30) + GPU_MEMORY_STEP)), now=8.9).gpus_unchanged
    assert report.outgoing(beat(gpu((1 << 30) + GPU_MEMORY_STEP)), now=9.0).gpus
    # A new stream starts with samples again, whatever the last one had.
    report.new_stream(5.0)
    assert report.outgoing(beat(gpu((1 << 30) + GPU_MEMORY_STEP)), now=9.5).gpus


def test_a_coordinator_that_does_not_offer_it_gets_every_sample_and_no_gpus_means_nothing_to_leave_out() -> None:
    report = GpuReport()
    report.new_stream(0.0)  # an older coordinator's Welcome has no gpu_sample_interval_s
    for t in range(3):
        assert report.outgoing(beat(gpu()), now=float(t)).gpus
    report.new_stream(5.0)
    empty = report.outgoing(beat(), now=0.0)
    assert not empty.gpus and not empty.gpus_unchanged
    assert not report.outgoing(beat(), now=1.0).gpus_unchanged
