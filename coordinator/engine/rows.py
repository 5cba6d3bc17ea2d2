"""The shapes of what the store keeps for every metric and GPU sample: plain values that the
decision core makes and the store writes as they are."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
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


class MetricRun(NamedTuple):
    """Results of one trial, of one kind, with consecutive indexes from ``first_index``: what
    an agent sends for a trial reporting in a tight loop, checked and stored as one."""

    trial_id: str
    kind: str
    first_index: int
    values: Sequence[float]
    # None where each value's JSON is the repr of its number; otherwise one per value, ""
    # where it is.
    value_jsons: Sequence[str] | None
    reported_at: Sequence[float]

    def json_of(self, k: int) -> str:
        """The JSON of value ``k`` as reported."""
        given = self.value_jsons[k] if self.value_jsons is not None else ""
        return given or repr(self.values[k])

    def rows(self) -> Iterator[MetricRow]:
        for k, (value, at) in enumerate(zip(self.values, self.reported_at)):
            yield MetricRow(self.trial_id, self.first_index + k, self.kind, value, self.json_of(k), at)

    @classmethod
    def of_rows(cls, rows: Iterable[MetricRow]) -> list[MetricRun]:
        """``rows`` as runs: one per stretch of one trial and kind with consecutive indexes."""
        runs: list[MetricRun] = []
        values: list[float] = []
        jsons: list[str] = []
        ats: list[float] = []
        for row in rows:
            last = runs[-1] if runs else None
            if last is None or (row.trial_id, row.kind, last.first_index + len(last.values)) != (
                last.trial_id,
                last.kind,
                row.index,
            ):
                values, jsons, ats = [], [], []
                runs.append(cls(row.trial_id, row.kind, row.index, values, jsons, ats))
            values.append(row.value)
            jsons.append("" if row.value_json == repr(row.value) else row.value_json)
            ats.append(row.reported_at)
        return [r if any(r.value_jsons or ()) else r._replace(value_jsons=None) for r in runs]


@dataclass(frozen=True)
class GpuSampleRow:
    at: float
    environment_id: str
    uuid: str
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int
    trial_ids: tuple[str, ...] = ()
