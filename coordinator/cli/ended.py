"""What ``run`` and ``resume`` say about an experiment's end: a resume of an experiment that
already ended is refused with how to extend it, and a stop tells what a resume will run."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config.experiment import ExperimentConfig
from ..engine.model import TrialInfo
from ..engine.states import TrialStatus
from ..read.failures import failure_summary
from ..read.model import ReadModel
from ..store.reads import StoreReader

#: The exit status of a ``resume`` refused because the experiment has ended: nothing ran.
ENDED_EXIT = 3
# The stored status of an experiment that reached its end (tuner exhausted, a limit reached).
_ENDED = "DONE"


def add_exit_option(parser: argparse.ArgumentParser) -> None:
    """``--fail-on-trial-failure``, on ``run`` and ``resume``."""
    parser.add_argument(
        "--fail-on-trial-failure", action="store_true",
        help="exit 1 when any trial FAILED (default: 0 once the experiment has completed, failed trials or not)",
    )


def failed_note(trials: Sequence[TrialInfo], experiment_dir: Path) -> str:
    """What ``run`` says of the trials that FAILED, the first one's reason and the last line
    of its stderr with it; "" when none did."""
    failed = [t for t in trials if t.status is TrialStatus.FAILED]
    if not failed:
        return ""
    first = failure_summary(failed[0]) or "no reason given"
    return (
        f"{len(failed)} of {len(trials)} trials failed (first: trial {failed[0].id}: {first}); "
        f"`trialkeeper trials {experiment_dir} --status FAILED` lists them"
    )


def extended_config(config: ExperimentConfig, args: argparse.Namespace) -> tuple[ExperimentConfig, bool]:
    """``config`` with the limits ``resume --max-trials N`` and ``--max-duration D`` give, and
    whether either was given."""
    changes: dict[str, Any] = {}
    if getattr(args, "max_trials", None) is not None:
        changes["max_trial_number"] = args.max_trials
    if getattr(args, "max_duration", None) is not None:
        changes["max_experiment_duration"] = args.max_duration
    return (dataclasses.replace(config, **changes), True) if changes else (config, False)


def _read_end(experiment_dir: Path) -> tuple[dict[str, Any] | None, dict[str, int], dict[str, Any]]:
    """The experiment's row, its trials per status and its stored config."""
    store = StoreReader.in_dir(experiment_dir)
    try:
        return store.experiment(), store.trial_counts(), ReadModel(store).stored_config() or {}
    finally:
        store.close()


def _exhausted(exp: dict[str, Any], submitted: int, stored: dict[str, Any]) -> bool:
    """Ended with no reason said and below its trial limit: its search ran out, not a limit."""
    old_limit = stored.get("maxTrialNumber")
    return not exp.get("reason") and not (isinstance(old_limit, int) and submitted >= old_limit)


def _head(exp: dict[str, Any], counts: dict[str, int]) -> str:
    tally = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no trials"
    reason = str(exp.get("reason") or "")
    ended = f"{exp.get('status')}{f' ({reason})' if reason else ''}"
    return f"experiment {exp.get('id')} has ended: {ended}, {sum(counts.values())} trials ({tally})"


def _change_the_search(shown: Path | str) -> str:
    return (
        "To go on, change its search (searchSpace, tuner) in its config and run "
        f"`trialkeeper resume {shown} --config FILE`"
    )


def _raise_a_limit(shown: Path | str, submitted: int) -> str:
    return (
        "To go on, raise maxTrialNumber (which counts the trials already run) or "
        f"maxExperimentDuration: `trialkeeper resume {shown} --max-trials N` (N above {submitted}) "
        f"or `--max-duration D`, or in its config and run `trialkeeper resume {shown} --config FILE`"
    )


def ended_note(experiment_dir: Path, shown: str, nothing: str) -> str:
    """What a command that needs the experiment's coordinator says when none runs it because
    the experiment has ended (``nothing``: what there is then nothing to do), and how to
    extend it; "" when it has not ended (stopped, failed or crashed: ``resume`` carries it on)."""
    exp, counts, stored = _read_end(experiment_dir)
    if exp is None or exp.get("status") != _ENDED:
        return ""
    submitted = sum(counts.values())
    how = _change_the_search(shown) if _exhausted(exp, submitted, stored) else _raise_a_limit(shown, submitted)
    return f"{_head(exp, counts)}; no coordinator runs it: {nothing}. {how}"


def resume_refusal(
    experiment_dir: Path, config: ExperimentConfig, *, file_given: bool, limits_given: bool = False,
    duration_given: bool = False,
) -> str:
    """Why ``resume`` must start nothing for this experiment, or "".

    One that crashed, was stopped or failed is carried on. One that reached its end is
    carried on only with limits (``resume --config``, ``--max-trials``, ``--max-duration``)
    that raise one it reached: otherwise it would start agents only to find there is nothing
    to do. A duration given on the command line counts from the resume: it always raises.
    One whose search had nothing more to propose is carried on only with a config (which
    may change the search): more trials or time alone would find nothing to run either."""
    exp, counts, stored = _read_end(experiment_dir)
    if exp is None or exp.get("status") != _ENDED:
        return ""
    submitted = sum(counts.values())
    limit = config.max_trial_number
    room = limit is None or submitted < limit
    old_limit = stored.get("maxTrialNumber")
    exhausted = _exhausted(exp, submitted, stored)
    if file_given and room and (exhausted or duration_given or _raises_a_limit(config, stored)):
        return ""
    if limits_given and room and not exhausted and (duration_given or _raises_a_limit(config, stored)):
        return ""
    head = _head(exp, counts)
    if exhausted and not file_given:
        below = f"below its maxTrialNumber ({old_limit})" if isinstance(old_limit, int) else "with no maxTrialNumber"
        return (
            f"{head}; nothing to resume: its search had nothing more to propose (it ended {below}), so more "
            f"trials or time would start agents with nothing to run. {_change_the_search(experiment_dir)}"
        )
    if file_given or limits_given:
        how = (
            "the limits given raise neither maxTrialNumber nor maxExperimentDuration above what the experiment reached"
            if room
            else f"its maxTrialNumber ({limit}) counts the {submitted} trials already submitted"
        )
        advice = f"nothing to resume: {how}"
    else:
        advice = "nothing to resume"
    return f"{head}; {advice}. {_raise_a_limit(experiment_dir, submitted)}"


def _raises_a_limit(config: ExperimentConfig, stored: dict[str, Any]) -> bool:
    def raised(new: float | None, old: object) -> bool:
        if new is None:
            return old is not None  # no limit any more
        return isinstance(old, (int, float)) and not isinstance(old, bool) and new > old

    return raised(config.max_trial_number, stored.get("maxTrialNumber")) or raised(
        config.max_experiment_duration, stored.get("maxExperimentDuration")
    )


def stop_note(trials: Sequence[TrialInfo], experiment_dir: Path) -> str:
    """What a stop did to the trials, and what ``resume`` will and will not run: added to
    the reason ``run`` prints when it was stopped (SIGINT, SIGTERM, ``trialkeeper stop``).
    A stop pauses the trials it can; one that saved no checkpoint when asked is canceled."""
    paused = [t for t in trials if t.status is TrialStatus.PAUSED]
    canceled = [
        t for t in trials
        if t.status is TrialStatus.SYS_CANCELED
        and (t.reason.startswith("the experiment stopped") or "no checkpoint to continue from" in t.reason)
    ]
    resume = f"`trialkeeper resume {experiment_dir}`"
    if not canceled and not paused:
        return f"{resume} goes on with the trials not started yet"
    if not paused:
        return (
            f"{_canceled(canceled)}; {resume} does not run {_them(canceled)} again: it goes on with the trials "
            "not submitted yet"
        )
    several = len(paused) > 1
    what = f"{len(paused)} trial{'s' if several else ''} paused"
    if not canceled:
        return f"{what}; {resume} continues {_them(paused)} first, then goes on with the trials not submitted yet"
    return (
        f"{what}, {_canceled(canceled)}; {resume} continues the paused {'ones' if several else 'one'} first and "
        f"does not run the canceled {'ones' if len(canceled) > 1 else 'one'} again"
    )


def _them(trials: Sequence[TrialInfo]) -> str:
    return "them" if len(trials) > 1 else "it"


def _canceled(canceled: Sequence[TrialInfo]) -> str:
    running = sum(1 for t in canceled if t.started_at is not None)
    waiting = len(canceled) - running
    parts = (f"{running} running" if running else "", f"{waiting} waiting" if waiting else "")
    which = " and ".join(part for part in parts if part)
    return f"{which} trial{'s' if len(canceled) > 1 else ''} canceled as SYS_CANCELED"
