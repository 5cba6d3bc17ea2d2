"""Checkpoints as the decision core sees them: what agents say of them, what the core asks
the shell to do with them, and the plain rules it decides by.

A checkpoint is the files a trial saved at a step, whole or absent. The core knows each by
its :class:`Checkpoint` record (never its bytes): where it is, how big, its digest, and how
many results the trial had reported when it saved. The files themselves are the shell's: it
writes uploaded chunks, finishes a checkpoint before the core hears of it, streams one down
to an agent, and removes the old ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

# Bytes of one file of a checkpoint in one message, up or down.
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class CheckpointFile:
    path: str  # relative, '/'-separated
    size: int
    mode: int = 0o644


@dataclass(frozen=True)
class Checkpoint:
    """One saved checkpoint of ``trial_id`` (the trial that saved it)."""

    trial_id: str
    step: int
    metric_index: int
    size_bytes: int
    digest: str
    files: tuple[CheckpointFile, ...]
    # "": in the experiment's checkpoint directory; else an object storage URL.
    location: str
    saved_at: float
    env_id: str = ""


# ---- what agents say -------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointChunkReported:
    trial_id: str
    step: int
    path: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class CheckpointSavedReported:
    trial_id: str
    step: int
    metric_index: int
    size_bytes: int
    digest: str
    files: tuple[CheckpointFile, ...]
    location: str
    saved_at: float
    # What the shell found wrong with its files before the core heard of it ("": whole).
    problem: str = ""


@dataclass(frozen=True)
class CheckpointFetchRequested:
    """An agent asks for the checkpoint of a trial it is to start (not numbered)."""

    env_id: str
    link: int
    trial_id: str
    step: int
    path: str
    offset: int


# ---- what the embedding API says -------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointDigested:
    """The shell read an uploaded checkpoint's files and found their digest."""

    trial_id: str
    step: int
    digest: str


@dataclass(frozen=True)
class PauseRequested:
    trial_id: str
    reason: str


@dataclass(frozen=True)
class ContinueRequested:
    trial_id: str
    # New parameters to continue with (a search's exploit); None: its own.
    parameters: Mapping[str, Any] | None = None
    # Continue from this other trial's newest checkpoint instead of its own (a population-based
    # search's exploit); "": its own.
    checkpoint_from: str = ""


@dataclass(frozen=True)
class SavesHeard:
    """The search has carried out what it decided on the saves published so far: the acks
    held for them (``Engine.save_hold_s``) go out."""


# ---- messages to agents ------------------------------------------------------------------------


@dataclass(frozen=True)
class PauseTrial:
    trial_id: str
    grace_s: float
    reason: str


@dataclass(frozen=True)
class CheckpointRefused:
    trial_id: str
    step: int
    reason: str


@dataclass(frozen=True)
class CheckpointData:
    """A piece of a checkpoint streamed down (the shell makes these from the files)."""

    trial_id: str
    step: int
    path: str
    offset: int
    data: bytes
    last: bool


# ---- instructions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteCheckpointChunk:
    """Write uploaded bytes into the trial's incoming checkpoint (before the commit)."""

    trial_id: str
    step: int
    path: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class SendCheckpoint:
    """Stream a checkpoint down to an agent, from file ``path`` (and ``offset``) on."""

    link: int
    trial_id: str  # the trial being started (named in every chunk)
    checkpoint: Checkpoint
    path: str
    offset: int


@dataclass(frozen=True)
class RemoveCheckpoint:
    """Delete a checkpoint's files (after the commit that records it removed)."""

    checkpoint: Checkpoint


# ---- facts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointRecorded:
    checkpoint: Checkpoint
    # Whether this save counts as progress since the trial's last loss.
    progressed: bool = True


@dataclass(frozen=True)
class CheckpointRemoved:
    trial_id: str
    step: int
    removed_at: float


@dataclass(frozen=True)
class MetricsSuperseded:
    """A trial continues from a checkpoint taken when it had ``from_index`` results: those
    it reported after (and lost) move to its history, and the continued run's replace them."""

    trial_id: str
    from_index: int
    at: float


@dataclass(frozen=True)
class TrialRetried:
    """Retries a trial has used up against maxTrialRetries, and whether it saved a
    checkpoint since its last loss."""

    trial_id: str
    retries: int
    progressed: bool


@dataclass(frozen=True)
class CheckpointDigestKnown:
    trial_id: str
    step: int
    digest: str


@dataclass(frozen=True)
class TrialParametersChanged:
    trial_id: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class TrialForked:
    """A trial continues from another trial's checkpoint (trial id, step) until it saves its own."""

    trial_id: str
    forked_from: tuple[str, int]


CHECKPOINT_FACTS = (
    CheckpointRecorded, CheckpointRemoved, MetricsSuperseded, TrialRetried, TrialParametersChanged,
    CheckpointDigestKnown, TrialForked,
)


# ---- rules -------------------------------------------------------------------------------------


def path_problem(path: str) -> str:
    """Why ``path`` cannot name a file of a checkpoint ("" when it can)."""
    if not path or len(path) > 4096:
        return "an empty or overlong path"
    if path.startswith("/") or "\\" in path or "\0" in path:
        return f"path {path!r} is not relative"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return f"path {path!r} is not a plain relative path"
    return ""


def saved_problem(report: CheckpointSavedReported, max_bytes: int) -> str:
    """Why a saved checkpoint cannot be recorded ("" when it can)."""
    if report.problem:
        return report.problem
    if max_bytes and report.size_bytes > max_bytes:
        return f"it is {report.size_bytes} bytes, more than maxCheckpointSize ({max_bytes} bytes)"
    if sum(f.size for f in report.files) != report.size_bytes:
        return "its files' sizes do not add up to its size"
    paths = [f.path for f in report.files]
    if len(set(paths)) != len(paths):
        return "it names a file twice"
    for p in paths:
        why = path_problem(p)
        if why:
            return why
    return ""


def take_chunk(t: Any, c: CheckpointChunkReported, max_bytes: int, out: list[Any]) -> None:
    """A piece of a trial's (``t``, a TrialState) upload: written, or its save marked refused."""
    if path_problem(c.path) or (max_bytes and c.offset + len(c.data) > max_bytes):
        t.refused_steps.add(c.step)  # its CheckpointSaved is refused with the reason
    else:
        out.append(WriteCheckpointChunk(t.id, c.step, c.path, c.offset, c.data))


def record(
    t: Any, s: CheckpointSavedReported, env_id: str, policy: Any, wall: float, held: Iterable[tuple[str, int]],
    out: list[Any],
) -> tuple[Checkpoint | None, str]:
    """Record a trial's (``t``, a TrialState) saved checkpoint, or say why not; the older ones
    beyond checkpointsPerTrial go. Appends the facts and instructions to ``out``."""
    why = saved_problem(s, policy.max_checkpoint_bytes)
    if not why and s.step in t.refused_steps:
        why = "a part of it was refused (an unsafe path, or more than maxCheckpointSize)"
    t.refused_steps.discard(s.step)
    if why:
        return None, why
    c = Checkpoint(
        t.id, s.step, s.metric_index, s.size_bytes, s.digest, s.files, s.location, s.saved_at or wall, env_id
    )
    t.checkpoints = [k for k in t.checkpoints if k.step != c.step] + [c]
    t.forked_from = None
    t.progressed = True
    t.refusals = {}
    out.append(CheckpointRecorded(c))
    for old in to_remove(t.checkpoints, policy.checkpoints_per_trial, held):
        t.checkpoints.remove(old)
        out.append(CheckpointRemoved(t.id, old.step, wall))
        out.append(RemoveCheckpoint(old))
    return c, ""


def refused_files(t: Any, s: CheckpointSavedReported, env_id: str, out: list[Any]) -> None:
    """A refused save's files, finished in the experiment's directory before it was refused,
    go (unless a save of the same step is recorded: ``t`` is its TrialState, or None)."""
    if s.location == "" and t is not None and all(c.step != s.step for c in t.checkpoints):
        out.append(RemoveCheckpoint(Checkpoint(s.trial_id, s.step, 0, s.size_bytes, "", (), "", 0.0, env_id)))


def held_by(trials: Iterable[Any], but: str) -> list[tuple[str, int]]:
    """The checkpoints (trial id, step) that live trials (TrialStates) other than ``but``
    continue from: they stay, whatever checkpointsPerTrial says."""
    return [(o.checkpoint.trial_id, o.checkpoint.step) for o in trials
            if o.id != but and o.checkpoint is not None and not o.status.terminal]


def whence(trial_id: str, c: Checkpoint | None) -> str:
    """Where a trial continues from, said: its own step, another trial's (an exploit, a fork)."""
    if c is None:
        return "from the start"
    return f"from step {c.step}" if c.trial_id == trial_id else f"from trial {c.trial_id}'s checkpoint at step {c.step}"


def fork(t: Any, source: Checkpoint, held: Iterable[tuple[str, int]], wall: float, out: list[Any]) -> None:
    """The paused trial ``t`` (a TrialState) is to continue from ``source``, another trial's
    checkpoint (a population-based search's exploit: the better trial's state copied into the
    worse one), as a trial forked from it does: its own checkpoints go (their files stay while
    another live trial continues from them), and its results from the checkpoint's on are
    superseded by the continued run's when it is placed."""
    keep = set(held)
    for c in t.checkpoints:
        out.append(CheckpointRemoved(t.id, c.step, wall))
        if (c.trial_id, c.step) not in keep:
            out.append(RemoveCheckpoint(c))
    t.checkpoints, t.forked_from = [], source
    out.append(TrialForked(t.id, (source.trial_id, source.step)))


def digested(trials: Iterable[Any], d: CheckpointDigested, out: list[Any]) -> None:
    """An uploaded checkpoint's digest, now known: in every trial (TrialState) that holds it."""
    found = False
    for t in trials:
        for i, c in enumerate(t.checkpoints):
            if (c.trial_id, c.step) == (d.trial_id, d.step) and not c.digest:
                t.checkpoints[i], found = replace(c, digest=d.digest), True
        fork = t.forked_from
        if fork is not None and (fork.trial_id, fork.step) == (d.trial_id, d.step) and not fork.digest:
            t.forked_from = replace(fork, digest=d.digest)
    if found:
        out.append(CheckpointDigestKnown(d.trial_id, d.step, d.digest))


def after_end(trials: Iterable[Any], rule: str, wall: float, out: list[Any]) -> None:
    """An experiment finished (not stopped to be resumed): the checkpoints of its trials
    (TrialStates) that ``rule`` (checkpointsAfterEnd) does not keep go. ``succeeded``: those of
    succeeded trials stay; ``all``: every one; ``none``: none."""
    if rule == "all":
        return
    for t in trials:
        if rule == "succeeded" and t.status.value == "SUCCEEDED":
            continue
        for c in t.checkpoints:
            out.append(CheckpointRemoved(t.id, c.step, wall))
            out.append(RemoveCheckpoint(c))
        t.checkpoints = []


def to_remove(kept: Sequence[Checkpoint], keep: int, referenced: Iterable[tuple[str, int]]) -> list[Checkpoint]:
    """Of a trial's checkpoints (oldest first), those beyond the newest ``keep`` that no other
    trial still counts on (``referenced``: (trial, step) pairs)."""
    held = set(referenced)
    old = kept[:-keep] if keep > 0 else list(kept)
    return [c for c in old if (c.trial_id, c.step) not in held]


def from_row(r: Mapping[str, Any]) -> Checkpoint:
    """A checkpoint as the store keeps it."""
    try:
        files = json.loads(r["files_json"])
    except (TypeError, ValueError, RecursionError):
        files = []
    files = files if isinstance(files, list) else []
    return Checkpoint(
        trial_id=r["trial_id"], step=int(r["step"]), metric_index=int(r["metric_index"]),
        size_bytes=int(r["size_bytes"]), digest=r["digest"] or "",
        files=tuple(
            CheckpointFile(str(f[0]), int(f[1]), int(f[2])) for f in files if isinstance(f, list) and len(f) == 3
        ),
        location=r["location"] or "", saved_at=float(r["saved_at"] or 0.0), env_id=r["env_id"] or "",
    )


def fetch_answer(saved: Checkpoint | None, f: CheckpointFetchRequested) -> SendCheckpoint | CheckpointRefused:
    """The answer to an agent asking for the checkpoint a trial continues from (``saved``):
    its files, or a refusal (to send on its link) when the trial does not continue from that one."""
    if saved is None or saved.step != f.step:
        why = f"trial {f.trial_id} does not continue from a checkpoint at step {f.step} on {f.env_id}"
        return CheckpointRefused(f.trial_id, f.step, why)
    return SendCheckpoint(f.link, f.trial_id, saved, f.path, f.offset)
