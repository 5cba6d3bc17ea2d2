"""The shapes of what the store keeps for every metric and GPU sample: plain values that the
decision core makes and the store writes as they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class MetricRow(NamedTuple):
    """One stored metric; a tuple, made and stored for every metric a trial reports."""

    trial_id: str
    index: int  # type: ignore[assignment]  # shadows tuple.index, which nothing here uses
    kind: str
    value: float
    value_json: str
    reported_at: float


@dataclass(frozen=True)
class GpuSampleRow:
    at: float
    environment_id: str
    uuid: str
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int
    trial_ids: tuple[str, ...] = ()
