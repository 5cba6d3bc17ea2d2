"""Trials' output streamed from agents, kept in the experiment's directory:
``trials/<trial>/<stream>.log``, each chunk written at its offset before the message that
carried it is acknowledged (a replay writes it again, never a hole)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# A trial's stdout or stderr streamed from an agent is kept up to this size.
MAX_TRIAL_LOG_BYTES = 1 << 30


class TrialLogs:
    def __init__(self, experiment_dir: Path) -> None:
        self.experiment_dir = experiment_dir
        self._refused: set[tuple[str, str]] = set()  # said once per trial and stream

    def write(self, trial_id: str, stream: str, offset: int, data: bytes) -> None:
        path = self.experiment_dir / "trials" / trial_id / f"{stream}.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            size = path.stat().st_size if path.exists() else 0
        except OSError as e:
            log.warning("could not write %s output of trial %s: %s", stream, trial_id, e)
            return
        # Chunks come in order (replays may repeat one): an offset past the end would leave a
        # hole, and a huge one would make a huge sparse file.
        if offset > size or offset + len(data) > MAX_TRIAL_LOG_BYTES:
            if (trial_id, stream) not in self._refused:
                self._refused.add((trial_id, stream))
                log.warning(
                    "refused %s output of trial %s at offset %d (file has %d bytes, limit %d)",
                    stream, trial_id, offset, size, MAX_TRIAL_LOG_BYTES,
                )
            return
        try:
            with open(path, "r+b" if path.exists() else "wb") as f:
                f.seek(offset)
                f.write(data)
        except OSError as e:  # that chunk is lost, loudly; the message and its batch go on
            log.warning("could not write %s output of trial %s at offset %d: %s", stream, trial_id, offset, e)
