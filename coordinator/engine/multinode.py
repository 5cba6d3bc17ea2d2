"""Multi-node trials between the book and the fleet: what the engine does for a gang.

The book knows a multi-node trial as one trial placed on its rank 0's environment; the
fleet holds a slot (and the trial's GPUs) for it on every rank's environment. This room
carries the gang's events between the two: the gang pass and its reservation
(:mod:`.gangs`), the ranks' starts (rank 0 first, the others with its rendezvous), their
ends (:mod:`.ranks`), their logs (``trials/<id>/rank<r>/``), and cancels to every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from . import events as ev
from . import starts
from .book import CANCEL_GRACE_S, TrialBook
from .environments import Lost
from .fleet import Fleet
from .gangs import place_gangs, take_rank, waiting_gangs
from .model import TrialState
from .policy import Policy
from .ranks import Ranks
from .scheduler import EnvCapacity, Placement
from .supply import held


class GangRoom:
    def __init__(self) -> None:
        self.ranks = Ranks()
        # The environments held for the first gang that cannot start yet (see gangs.py).
        self.reserved: tuple[str, ...] = ()
        self._closed: dict[str, bool] = {}  # reserved views closed for one pass: their state before
        self._out: list[ev.Instruction] = []

    def take(self) -> list[ev.Instruction]:
        """The facts of the calls since the last take (each gang's ranks as they changed)."""
        out, self._out = self._out, []
        return out

    def _tell(self, book: TrialBook, trial_id: str) -> None:
        t = book.trials[trial_id]
        t.ranks = self.ranks.infos(trial_id)
        self._out.append(ev.TrialRanks(trial_id, t.ranks))

    # ---- the scheduling pass -------------------------------------------------------------------

    def place(self, book: TrialBook, fleet: Fleet, policy: Policy, views: Mapping[str, EnvCapacity],
              *, wall: float) -> dict[str, str]:
        """Place the gangs that can start, reserve for the first that cannot, and close the
        reserved environments to the one-node pass that follows (:meth:`reopen` after it).
        Returns why each gang waits, or where it starts."""
        gangs = waiting_gangs(book.queue)
        before = self.reserved
        told: dict[str, str] = {}
        # Groups started for a waiting gang are its own (supply.py): closed to everything else.
        holds = {e: t for e, t in held(fleet.live_envs(), book.queue).items() if book.queue.demand(t).nodes > 1
                 } if gangs and any(p.groups_environments for p in policy.platforms) else {}
        if gangs:
            running = fleet.running() - self.ranks.extra_holders()
            decision = place_gangs(
                gangs, views, budget=policy.trial_concurrency - running, policy=policy.placement,
                across_platforms=policy.gang_across_platforms, reserved_before=before, held=holds,
            )
            for g in decision.placements:
                self._placed(book, fleet, g.trial_id, g.ranks)
                told[g.trial_id] = f"starting on {', '.join(p.env_id for p in g.ranks)}"
            told.update(decision.waiting)
            self.reserved = closing = decision.reserved
            if decision.reserved:
                told.update(self._backfill(book, fleet, policy, views, decision.reserved_for, wall))
        else:
            self.reserved = closing = ()
        # What the one-node pass may use changed where a reservation came or went.
        book.queue.changed_envs |= set(before).symmetric_difference(self.reserved)
        for env_id in (*closing, *(e for e in holds if e not in closing)):
            view = views.get(env_id)
            if view is not None:
                self._closed[env_id] = view.accepting
                view.accepting = False
        return told

    def _backfill(self, book: TrialBook, fleet: Fleet, policy: Policy, views: Mapping[str, EnvCapacity],
                  gang: str, wall: float) -> dict[str, str]:
        """One-node trials bound to end before the gang could start take the free room of its
        reserved environments (in queue order). The gang could start once the last trial on
        its reserved environments is bound to end: unknown while one of them has no limit."""
        reserved = [views[e] for e in self.reserved if e in views and views[e].accepting]
        ends = []
        for view in reserved:
            for trial_id in view.holders:
                t = book.trials.get(trial_id)
                limit = starts.time_limit(t, policy) if t is not None else 0.0
                if t is None or not limit:
                    return {}
                ends.append((t.started_at or wall) + limit)
        if not ends or not any(v.free_slots() > 0 for v in reserved):
            return {}
        start_by, told = max(ends), {}
        room = policy.trial_concurrency - (fleet.running() - self.ranks.extra_holders())
        queue = book.queue
        ones = sorted(queue.head_of(t) for s in list(queue.shapes()) if s.nodes == 1 for t in queue.members(s))
        for _, demand in ones:
            t = book.trials[demand.trial_id]
            limit = starts.time_limit(t, policy)
            if room <= 0:
                break
            if not limit or wall + limit > start_by:
                continue
            env = next((v for v in reserved if v.free_slots() > 0 and demand.rank(v.platform) is not None
                        and len(v.usable_gpus(demand.gpu_memory_bytes)) >= demand.gpus), None)
            if env is None:
                continue
            gpus = take_rank(env, demand, policy.placement)
            book.placed(t.id, env.env_id, tuple(g.uuid for g in gpus), tuple(g.index for g in gpus))
            queue.remove(t.id)
            fleet.occupied(env.env_id, t.id)
            fleet.send(env.env_id, book.start_message(t.id, fleet.section(env.env_id).working_directory))
            told[t.id] = f"starting on {env.env_id}: it ends before gang {gang} could start (backfill)"
            room -= 1
        return told

    def reopen(self, views: Mapping[str, EnvCapacity]) -> None:
        for env_id, accepting in self._closed.items():
            if env_id in views:
                views[env_id].accepting = accepting
        self._closed = {}

    def _placed(self, book: TrialBook, fleet: Fleet, trial_id: str, ranks: tuple[Placement, ...]) -> None:
        r0 = ranks[0]
        book.placed(trial_id, r0.env_id, r0.gpu_uuids, r0.gpu_indices)
        book.queue.remove(trial_id)
        self.ranks.placed(trial_id, [(p.env_id, p.gpu_uuids, p.gpu_indices) for p in ranks])
        for p in ranks:
            fleet.occupied(p.env_id, trial_id)
        self._start(book, fleet, trial_id, r0.env_id, 0)
        self._tell(book, trial_id)

    def _start(self, book: TrialBook, fleet: Fleet, trial_id: str, env_id: str, rank: int) -> None:
        message = book.start_message(trial_id, fleet.section(env_id).working_directory)
        fleet.send(env_id, dataclasses.replace(message, **self.ranks.start_args(trial_id, rank)))  # type: ignore[arg-type]

    # ---- what the ranks' agents report ---------------------------------------------------------

    def reported(self, book: TrialBook, fleet: Fleet, env_id: str, report: ev.Report) -> bool:
        """A gang's rank reported: True when handled here (a start, an end, another rank's
        log); False for what the book takes as for any trial (rank 0's results, checkpoints)."""
        trial_id = getattr(report, "trial_id", "")
        rank = self.ranks.rank_of(trial_id, env_id)
        if rank is None:
            return False
        if isinstance(report, ev.TrialStartReported):
            if rank == 0:
                book.started(env_id, report)
            for other, r in self.ranks.started(trial_id, env_id, report.address, report.port):
                self._start(book, fleet, trial_id, other, r)
            self._tell(book, trial_id)
            return True
        if isinstance(report, ev.TrialEndReported):
            self._ended(book, fleet, env_id, report, gone=report.outcome is ev.Outcome.LOST)
            return True
        if isinstance(report, ev.LogReported) and rank:
            t = book.trials[trial_id]
            if not fleet.writes_own_logs(env_id) and t.env_id is not None:
                book.log(t.env_id, dataclasses.replace(report, stream=f"rank{rank}/{report.stream}"))
            return True
        return False

    def rejoined(self, book: TrialBook, fleet: Fleet, env_id: str, resend: Iterable[str],
                 active: Iterable[str]) -> list[str]:
        """An agent registered again, running ``active``: a rank it was sent but does not know
        (its StartTrial lost with the stream) is sent again while its gang goes on, and taken
        as ended once the gang is being stopped. Returns the other trials of ``resend``."""
        running = set(active)
        for trial_id, gang in list(self.ranks.gangs.items()):
            rank = gang.rank_of(env_id)
            if rank is None or trial_id in running:
                continue
            if gang.ranks[rank].state not in ("started", "running") and (rank or gang.ranks[0].state != "placed"):
                continue  # (rank 0 is sent its start as it is placed, the others once rank 0 ran)
            if gang.first_stop is None:
                self._start(book, fleet, trial_id, env_id, rank)
            else:
                gone = ev.TrialEndReported(trial_id, ev.Outcome.CANCELED, None, None, "not started", "", 0.0)
                self._ended(book, fleet, env_id, gone, gone=True)
        return [t for t in resend if t not in self.ranks.gangs]

    def lost(self, book: TrialBook, fleet: Fleet, gone: Lost) -> tuple[str, ...]:
        """An environment is lost: its gangs' ranks end with it. Returns its other trials."""
        rest = []
        for trial_id in gone.trial_ids:
            if self.ranks.rank_of(trial_id, gone.env_id) is None:
                rest.append(trial_id)
                continue
            end = ev.TrialEndReported(trial_id, ev.Outcome.LOST, None, None, gone.reason, "", book.wall - gone.silent_s)
            self._ended(book, fleet, gone.env_id, end, gone=True, released=True)
        return tuple(rest)

    def _ended(self, book: TrialBook, fleet: Fleet, env_id: str, end: ev.TrialEndReported, *,
               gone: bool, released: bool = False) -> None:
        trial_id = end.trial_id
        t = book.trials[trial_id]
        rank0_env = t.env_id
        result = self.ranks.ended(trial_id, env_id, end)
        if result is None:
            return
        if not released:
            fleet.release(env_id, trial_id, processes_gone=gone, still_in_use=end.gpus_still_in_use)
            if not gone:
                fleet.trial_done(env_id)
        book.slot_freed()
        self._tell(book, trial_id)
        for other in result.stop:
            fleet.send(other, ev.CancelTrial(trial_id, CANCEL_GRACE_S, f"stopped with its gang: {result.why}"))
        if result.trial_end is not None and rank0_env is not None:
            self.ranks.clear(trial_id)
            platform = fleet.envs[rank0_env].platform if rank0_env in fleet.envs else ""
            book.ended(rank0_env, result.trial_end, platform=platform)

    def restored(self, book: TrialBook, fleet: Fleet) -> None:
        """After a crash: a multi-node trial that was placed cannot have its ranks joined
        again; it is lost with the coordinator (retried whole within maxTrialRetries)."""
        for t in sorted(book.trials.values(), key=lambda t: t.seq):
            if t.nodes > 1 and t.env_id is not None and not t.status.terminal:
                if t.env_id in fleet.envs:
                    fleet.release(t.env_id, t.id, processes_gone=True)
                book.lose([t.id], "the coordinator restarted under it", platform=fleet.envs[t.env_id].platform
                          if t.env_id in fleet.envs else "")

    def rank_trial(self, book: TrialBook, env_id: str, trial_id: str) -> TrialState | None:
        """The trial of a live rank other than 0 on ``env_id``: it continues from the trial's
        checkpoint too, and fetches it there."""
        return book.trials.get(trial_id) if self.ranks.rank_of(trial_id, env_id) else None

    def not_saved(self, trial_id: str, env_id: str) -> str:
        """Why a save of another rank than 0 is refused ("" for any other save)."""
        rank = self.ranks.rank_of(trial_id, env_id)
        return f"this is rank {rank} of a multi-node trial: its checkpoints are rank 0's" if rank else ""

    # ---- cancel, pause, stop -------------------------------------------------------------------

    def cancel_others(self, fleet: Fleet, trial_id: str, reason: str, *, pausing: bool = False) -> None:
        """Rank 0 was told to stop: the other ranks are stopped too (told to pause, rank 0
        saves first; the others are stopped as it ends, see ranks.py)."""
        if pausing:
            return
        for env_id in self.ranks.envs_of(trial_id):
            if self.ranks.rank_of(trial_id, env_id):
                fleet.send(env_id, ev.CancelTrial(trial_id, CANCEL_GRACE_S, reason))
