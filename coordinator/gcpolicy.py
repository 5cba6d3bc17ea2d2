"""The garbage collector's thresholds for a process that runs a coordinator.

A coordinator's heap grows with its fleet: each connected agent keeps its stream's gRPC and
asyncio objects and the core's record of it (about 130 objects the collector tracks). CPython
looks at the whole heap in a full collection, and with its default thresholds it may run one
every 70,000 objects kept (ten collections of the middle generation), whenever the objects
kept since the last one exceed a quarter of the heap. While 10,000 agents joined, that made
19 full collections over a heap growing to 1.3 million objects: 10.5 of the coordinator's
32 CPU seconds for the join (measured with ``gc.callbacks``), most of what it spent
beyond a bare gRPC server.

Letting the oldest generation wait for 100 middle collections (700,000 objects kept) instead
of 10 leaves a growing fleet one or two full collections. The young generations keep their
defaults, so short-lived cycles (asyncio's futures, exceptions) are freed as promptly as
before; only cycles that already survived two collections wait longer.

The thresholds are the whole process's: ``trialkeeper run`` sets them for its own process,
and a program embedding a :class:`~trialkeeper.coordinator.core.Coordinator` may call
:func:`tune_for_fleets` itself.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# Middle-generation collections between full ones (CPython's default is 10).
FLEET_OLDEST_THRESHOLD = 100


def tune_for_fleets() -> tuple[int, int, int]:
    """Raise the oldest generation's threshold to FLEET_OLDEST_THRESHOLD; a higher one set
    by the program already is kept, and the young generations are left as they are.
    Returns the thresholds now in force."""
    young, middle, oldest = gc.get_threshold()
    if young == 0:
        return young, middle, oldest  # the program turned automatic collection off: leave it so
    if oldest < FLEET_OLDEST_THRESHOLD:
        gc.set_threshold(young, middle, FLEET_OLDEST_THRESHOLD)
        log.debug("full collections after %d middle ones (was %d)", FLEET_OLDEST_THRESHOLD, oldest)
    return gc.get_threshold()
