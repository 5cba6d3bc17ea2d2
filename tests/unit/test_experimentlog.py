"""An experiment's log file takes its own experiment's records, NNI's warnings included."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from trialkeeper.coordinator import experimentlog


def test_each_file_takes_the_records_of_its_own_experiment_and_nnis(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = experimentlog.open_log("a", tmp_path / "a")
    b = experimentlog.open_log("b", tmp_path / "b")
    try:
        scope = experimentlog.enter("a")
        logging.getLogger("trialkeeper.coordinator.search.search").warning("a's tuner raised")
        logging.getLogger("nni.tuner.tpe").warning("a's nni warning")
        logging.getLogger("nni.tuner.tpe").info("a's nni chatter")  # below the file's level
        experimentlog.leave(scope)
        scope = experimentlog.enter("b")
        logging.getLogger("trialkeeper.coordinator.search.search").error("b's tuner raised")
        experimentlog.leave(scope)
        # Outside any experiment's context, with two open: it belongs to neither for sure.
        thread = threading.Thread(target=lambda: logging.getLogger("trialkeeper").warning("unowned"))
        thread.start()
        thread.join(timeout=10)
    finally:
        experimentlog.close_log("a", a)
        experimentlog.close_log("b", b)
    text_a = (tmp_path / "a" / experimentlog.LOG_FILENAME).read_text()
    text_b = (tmp_path / "b" / experimentlog.LOG_FILENAME).read_text()
    assert "a's tuner raised" in text_a and "a's nni warning" in text_a
    assert "chatter" not in text_a and "b's" not in text_a and "unowned" not in text_a
    assert "b's tuner raised" in text_b and "a's" not in text_b and "unowned" not in text_b


def test_with_one_experiment_open_records_of_threads_without_its_context_are_its_own(tmp_path: Path) -> None:
    handler = experimentlog.open_log("solo", tmp_path)
    try:
        thread = threading.Thread(target=lambda: logging.getLogger("trialkeeper").warning("from a worker thread"))
        thread.start()
        thread.join(timeout=10)
    finally:
        experimentlog.close_log("solo", handler)
    assert "from a worker thread" in (tmp_path / experimentlog.LOG_FILENAME).read_text()
