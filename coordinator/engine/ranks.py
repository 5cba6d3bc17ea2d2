"""The ranks of the multi-node trials that run: one process per environment of a gang.

The trials' book knows a multi-node trial as one trial placed on its rank 0's environment;
here are the others, and how the ranks' ends make the trial's one end:

- rank 0 is started first; its agent chooses the rendezvous address and port, and once it
  reports the start the other ranks are started with them (:meth:`Ranks.started`);
- every rank's end frees its own environment at once; the first rank to end other than by
  succeeding (failed, lost with its environment, timed out, canceled, paused) has the others
  stopped; when the last rank has ended the trial ends as a whole (:meth:`Ranks.ended`):
  succeeded when every rank exited 0, else as that first rank ended (so a lost rank has the
  whole trial retried, from rank 0's checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from . import events as ev
from .model import RankInfo

# The ends that let the other ranks go on.
_GOES_ON = (ev.Outcome.SUCCEEDED,)


@dataclass
class Rank:
    env_id: str
    gpu_uuids: tuple[str, ...] = ()
    gpu_indices: tuple[int, ...] = ()
    state: str = "placed"  # placed | started | running | ended
    end: ev.TrialEndReported | None = None


@dataclass
class Gang:
    trial_id: str
    ranks: list[Rank]
    master: tuple[str, int] | None = None  # rank 0's address and port, once it started
    first_stop: ev.TrialEndReported | None = None  # the first rank's end that stopped the others
    stopped_by: int = -1

    def rank_of(self, env_id: str) -> int | None:
        return next((i for i, r in enumerate(self.ranks) if r.env_id == env_id), None)


@dataclass(frozen=True)
class RankEnded:
    """What one rank's end means: the environments whose ranks to stop now, and (once the
    last rank ended) the trial's end as rank 0's environment reports it."""

    stop: tuple[str, ...] = ()
    trial_end: ev.TrialEndReported | None = None
    why: str = ""


@dataclass
class Ranks:
    gangs: dict[str, Gang] = field(default_factory=dict)

    def placed(self, trial_id: str, ranks: Iterable[tuple[str, tuple[str, ...], tuple[int, ...]]]) -> None:
        self.gangs[trial_id] = Gang(trial_id, [Rank(e, u, i) for e, u, i in ranks])

    def rank_of(self, trial_id: str, env_id: str) -> int | None:
        gang = self.gangs.get(trial_id)
        return gang.rank_of(env_id) if gang is not None else None

    def envs_of(self, trial_id: str) -> list[str]:
        """The environments of the ranks of ``trial_id`` that have not ended (rank order)."""
        gang = self.gangs.get(trial_id)
        return [r.env_id for r in gang.ranks if r.state != "ended"] if gang is not None else []

    def extra_holders(self) -> int:
        """Slots held beyond one per trial: a gang counts once against trialConcurrency."""
        return sum(sum(1 for r in g.ranks[1:] if r.state != "ended") for g in self.gangs.values())

    def keep(self, env_id: str, trial_ids: Iterable[str]) -> tuple[str, ...]:
        """Of the trials an agent is told to stop, those that are not a live rank there."""
        return tuple(t for t in trial_ids if self.rank_of(t, env_id) is None
                     or self.gangs[t].ranks[self.rank_of(t, env_id) or 0].state == "ended")

    def started(self, trial_id: str, env_id: str, address: str, port: int) -> list[tuple[str, int]]:
        """A rank reported its start: for rank 0, the (environment, rank) of the others to start
        now, with its address and port as their rendezvous."""
        gang = self.gangs.get(trial_id)
        rank = gang.rank_of(env_id) if gang is not None else None
        if gang is None or rank is None or gang.ranks[rank].state == "ended":
            return []
        gang.ranks[rank].state = "running"
        if rank != 0 or gang.master is not None:
            return []
        gang.master = (address, port)
        waiting = [(i, r) for i, r in enumerate(gang.ranks) if i and r.state == "placed"]
        for _, r in waiting:
            r.state = "started"
        return [(r.env_id, i) for i, r in waiting]

    def start_args(self, trial_id: str, rank: int) -> dict[str, object]:
        """What a StartTrial of this rank carries beyond the trial's own."""
        gang = self.gangs[trial_id]
        r = gang.ranks[rank]
        addr, port = gang.master or ("", 0)
        return {"node_rank": rank, "nodes": len(gang.ranks), "master_addr": addr, "master_port": port,
                    "gpu_uuids": r.gpu_uuids, "gpu_indices": r.gpu_indices}

    def ended(self, trial_id: str, env_id: str, end: ev.TrialEndReported) -> RankEnded | None:
        """A rank's end (an agent's report, or its environment lost). None when it is not a
        live rank of a running gang."""
        gang = self.gangs.get(trial_id)
        rank = gang.rank_of(env_id) if gang is not None else None
        if gang is None or rank is None or gang.ranks[rank].state == "ended":
            return None
        r = gang.ranks[rank]
        r.state, r.end = "ended", end
        stop: tuple[str, ...] = ()
        why = ""
        if gang.first_stop is None and end.outcome not in _GOES_ON:
            gang.first_stop, gang.stopped_by = end, rank
            stop = tuple(x.env_id for x in gang.ranks if x.state != "ended")
            why = f"rank {rank} ended ({end.outcome.value}{': ' + end.reason if end.reason else ''})"
        if any(x.state != "ended" for x in gang.ranks):
            return RankEnded(stop, None, why)
        first, by = gang.first_stop, gang.stopped_by
        if first is None:  # every rank exited 0: rank 0's end is the trial's
            return RankEnded(stop, gang.ranks[0].end, why)
        lost = [(i, x.end) for i, x in enumerate(gang.ranks) if x.end is not None and x.end.outcome is ev.Outcome.LOST]
        if first.outcome is ev.Outcome.FAILED and lost:
            # The others failed because a rank's environment went (a collective losing a peer
            # fails before the loss is declared): the trial was lost, not failed.
            by, first = lost[0]
        reason = first.reason if by == 0 else f"rank {by}: {first.reason or 'it ended'}"
        return RankEnded(stop, dataclasses.replace(first, reason=reason), why)

    def clear(self, trial_id: str) -> None:
        """The trial ended as a whole: its ranks are forgotten."""
        self.gangs.pop(trial_id, None)

    def infos(self, trial_id: str) -> tuple[RankInfo, ...]:
        """Each rank as the read side shows it."""
        gang = self.gangs.get(trial_id)
        if gang is None:
            return ()
        return tuple(
            RankInfo(i, r.env_id, r.gpu_indices, f"ended ({r.end.outcome.value})" if r.end is not None else r.state)
            for i, r in enumerate(gang.ranks)
        )
