"""The collector's thresholds a coordinator's process runs with (coordinator/gcpolicy.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from trialkeeper.coordinator.gcpolicy import FLEET_OLDEST_THRESHOLD, tune_for_fleets


@pytest.fixture(autouse=True)
def _restore_thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def test_full_collections_wait_longer_and_the_young_generations_keep_their_thresholds() -> None:
    gc.set_threshold(700, 10, 10)
    assert tune_for_fleets() == (700, 10, FLEET_OLDEST_THRESHOLD)
    assert gc.get_threshold() == (700, 10, FLEET_OLDEST_THRESHOLD)
    assert tune_for_fleets() == (700, 10, FLEET_OLDEST_THRESHOLD)  # a second call changes nothing


def test_a_program_that_set_a_higher_threshold_keeps_it() -> None:
    gc.set_threshold(5000, 20, FLEET_OLDEST_THRESHOLD * 3)
    assert tune_for_fleets() == (5000, 20, FLEET_OLDEST_THRESHOLD * 3)


def test_a_program_that_turned_automatic_collection_off_is_left_so() -> None:
    gc.set_threshold(0, 10, 10)
    assert tune_for_fleets() == (0, 10, 10)
    assert gc.get_threshold() == (0, 10, 10)


def test_with_the_fleet_threshold_a_growing_heap_has_fewer_full_collections() -> None:
    # The behaviour the threshold is for, in CPython's own collector: a heap growing by
    # 400,000 long-lived objects (as a joining fleet's does) sees fewer full collections.
    def full_collections_while_growing() -> int:
        full = {"n": 0}

        def note(phase: str, info: dict[str, int]) -> None:
            if phase == "stop" and info["generation"] == 2:
                full["n"] += 1

        gc.collect()
        gc.callbacks.append(note)
        try:
            kept = [[i] for i in range(400_000)]
        finally:
            gc.callbacks.remove(note)
        del kept
        return full["n"]

    # CPython skips a full collection while the objects waiting for one are under a quarter
    # of those the last one kept, so in a process that already holds a big heap (the whole
    # test session's) the count depends on that heap. Frozen objects are left out of that
    # sum: measure against a heap that holds only what this test makes.
    gc.freeze()
    try:
        gc.set_threshold(700, 10, 10)
        default = full_collections_while_growing()
        tune_for_fleets()
        tuned = full_collections_while_growing()
    finally:
        gc.unfreeze()
    assert default >= 3
    assert tuned < default
