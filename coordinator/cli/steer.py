"""The commands that steer a running experiment through its control socket (``control.py``):
``pause``, ``continue``, ``cancel`` and ``stop``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..read.model import ReadModel
from ..store.reads import holds_experiment
from .control import ControlError, NoCoordinator, alive, request

# How long `stop` waits past the experiment's pauseGracePeriod for the run to end: its
# environments stop, its store closes.
STOP_MARGIN_S = 60.0
DEFAULT_PAUSE_GRACE_S = 120.0
POLL_S = 0.5


def _err(message: str) -> int:
    print(f"trialkeeper: {message}", file=sys.stderr)
    return 1


def resolve_experiment(target: str) -> Path | None:
    """The directory of an experiment named by its directory, or by its id: under the
    default working directory, or anywhere the index of this machine's experiments knows."""
    from ..config.experiment import _default_working_directory
    from ..store import index

    for candidate in (Path(target).expanduser(), _default_working_directory() / target):
        if holds_experiment(candidate):
            return candidate.resolve()
    known = [e for e in index.entries() if e.experiment_id == target]
    if known:
        return max(known, key=lambda e: e.recorded_at).directory.resolve()
    return None


def _experiment(args: argparse.Namespace) -> Path | None:
    found = resolve_experiment(args.experiment)
    if found is None:
        _err(
            f"no experiment {args.experiment!r}: neither a directory holding one nor a known experiment id "
            "(`trialkeeper list` shows them)"
        )
    return found


def _ask(args: argparse.Namespace, op: str) -> int:
    exp_dir = _experiment(args)
    if exp_dir is None:
        return 1
    try:
        answer = request(exp_dir, op, args.trial_ids, shown=args.experiment)
    except ControlError as e:
        return _err(str(e))
    done = answer.get("done") or []
    if done:
        print(f"{_DONE[op]}: {' '.join(done)}")
    if not answer.get("ok"):
        return _err(f"{answer.get('error') or 'refused'}{'' if done else '; nothing was done'}")
    if op == "pause":
        print(
            "a running trial pauses when it next saves a checkpoint; one that saves none within the "
            "experiment's pauseGracePeriod is stopped all the same. `trialkeeper continue` carries a paused one on."
        )
    return 0


_DONE = {
    "pause": "asked to pause",
    "continue": "continued (waiting for a place, then going on from the last checkpoint)",
    "cancel": "canceled",
}


def cmd_pause(args: argparse.Namespace) -> int:
    return _ask(args, "pause")


def cmd_continue(args: argparse.Namespace) -> int:
    return _ask(args, "continue")


def cmd_cancel(args: argparse.Namespace) -> int:
    return _ask(args, "cancel")


def _grace(model: ReadModel) -> float:
    value = (model.stored_config() or {}).get("pauseGracePeriod")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else DEFAULT_PAUSE_GRACE_S


def _tally(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no trials"


def cmd_stop(args: argparse.Namespace) -> int:
    exp_dir = _experiment(args)
    if exp_dir is None:
        return 1
    name = args.experiment
    try:
        answer = request(exp_dir, "stop", shown=name)
    except ControlError as e:
        return _err(str(e))
    if not answer.get("ok"):
        return _err(f"the coordinator of {name} refused to stop: {answer.get('error')}")
    with ReadModel.open(exp_dir) as model:
        timeout = args.timeout if args.timeout is not None else _grace(model) + STOP_MARGIN_S
        print(
            f"stopping {name}: trials that save checkpoints pause, the others are canceled "
            f"(waiting up to {timeout:g} s)",
            flush=True,
        )
        if args.no_wait:
            return 0
        started = time.monotonic()
        shown: dict[str, int] | None = None
        while alive(exp_dir):
            counts = model.trial_counts()
            if counts != shown:
                print(f"[{time.monotonic() - started:6.1f} s] {_tally(counts)}", flush=True)
                shown = counts
            if time.monotonic() - started >= timeout:
                return _err(
                    f"{name} has not stopped within {timeout:g} s; it goes on stopping "
                    f"(`trialkeeper status {name}` tells when it has)"
                )
            time.sleep(POLL_S)  # the store is polled: a reader has nothing to wait on
        exp = model.experiment()
        counts = model.trial_counts()
    if exp is None or exp.status != "STOPPED":
        status = exp.status if exp is not None else "gone"
        return _err(
            f"the coordinator of {name} ended, but the experiment is {status}, not STOPPED "
            f"({_tally(counts)}); `trialkeeper resume {name}` carries it on"
        )
    paused = counts.get("PAUSED", 0)
    carry_on = f"; `trialkeeper resume {name}` continues {'them' if paused > 1 else 'it'}" if paused else ""
    print(f"experiment {exp.id} STOPPED: {_tally(counts)}{carry_on}")
    return 0


def add_commands(sub: Any) -> None:
    """The steering commands' parsers, on the CLI's subparsers."""
    exp_help = "an experiment directory, or an experiment id (`trialkeeper list` shows them)"
    for name, func, what, more in (
        ("pause", cmd_pause, "pause running trials",
         ("Ask trials of a running experiment to pause: a running trial saves a checkpoint and ends, freeing "
          "its slot; a waiting one pauses at once. Applies to WAITING and RUNNING trials.")),
        ("continue", cmd_continue, "continue paused trials",
         ("Queue paused trials again: each goes on from its last checkpoint wherever there is room. "
          "Applies to PAUSED trials.")),
        ("cancel", cmd_cancel, "cancel trials",
         ("Cancel trials of a running experiment (USER_CANCELED): a running one gets SIGTERM, then SIGKILL. "
          "Applies to WAITING, RUNNING and PAUSED trials.")),
    ):
        p = sub.add_parser(name, help=what, description=more + " Nothing is done when a trial named is unknown "
                           "or in another state.")
        p.add_argument("experiment", metavar="EXP", help=exp_help)
        p.add_argument("trial_ids", nargs="+", metavar="TRIAL_ID")
        p.set_defaults(func=func)

    stop = sub.add_parser(
        "stop", help="stop a running experiment, pausing its trials",
        description="Stop a running experiment so that it can be resumed: its trials that save checkpoints "
        "pause (within pauseGracePeriod), the others are canceled, and it ends STOPPED. Waits until it has, "
        "printing the trials' states. `trialkeeper resume EXP` carries it on.",
    )
    stop.add_argument("experiment", metavar="EXP", help=exp_help)
    stop.add_argument(
        "--timeout", type=float, metavar="SECONDS",
        help=f"how long to wait (default: the experiment's pauseGracePeriod + {STOP_MARGIN_S:g} s)",
    )
    stop.add_argument("--no-wait", action="store_true", help="ask, and return at once")
    stop.set_defaults(func=cmd_stop)


__all__ = ["NoCoordinator", "add_commands", "resolve_experiment"]
