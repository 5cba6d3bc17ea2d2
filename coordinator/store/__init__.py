"""The experiment's SQLite store: the source of truth for everything that happened.

``store`` writes it, ``metrics`` packs runs of results into rows.
"""

from __future__ import annotations

from ..engine.rows import GpuSampleRow, MetricRow, MetricRun
from .store import Store, StoreError

__all__ = ["GpuSampleRow", "MetricRow", "MetricRun", "Store", "StoreError"]
