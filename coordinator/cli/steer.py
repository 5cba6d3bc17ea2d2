"""The commands that steer a running experiment through its control socket (``control.py``):
``pause``, ``continue``, ``cancel``, ``stop``, ``update``, ``rerun`` and ``submit``; and
``view``, the dashboard of any experiment named by its directory or id."""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from .. import experimentlog
from ..read.model import ReadModel
from ..store.index import no_experiment, resolve_experiment
from ..store.reads import holds_experiment
from .control import LIMITS, ControlError, NoCoordinator, alive, request, valid_limit
from .ended import ENDED_EXIT, ended_note

# How long `stop` waits past the experiment's pauseGracePeriod for the run to end: its
# environments stop, its store closes.
STOP_MARGIN_S = 60.0
DEFAULT_PAUSE_GRACE_S = 120.0
POLL_S = 0.5


def _err(message: str, code: int = 1) -> int:
    print(f"trialkeeper: {message}", file=sys.stderr)
    return code


USAGE = 2  # the exit status of a wrong argument


# What there is nothing to do of, by request, once the experiment has ended.
_NOTHING = {
    "pause": "nothing to pause",
    "continue": "nothing to continue",
    "cancel": "nothing to cancel",
    "stop": "nothing to stop",
    "update": "its limits change as it is resumed",
    "rerun": "no trial can join it until it is resumed",
    "submit": "no trial can join it until it is resumed",
}


def _unreached(e: ControlError, exp_dir: Path, shown: str, op: str) -> int:
    """Why a request did not reach the coordinator. When none runs because the experiment has
    ended, that is said with how to extend it, and the status is the one ``resume`` exits with
    for an experiment that has ended: nothing was done."""
    ended = ended_note(exp_dir, shown, _NOTHING[op]) if isinstance(e, NoCoordinator) else ""
    return _err(ended, ENDED_EXIT) if ended else _err(str(e))


def _experiment(args: argparse.Namespace) -> Path | None:
    found = resolve_experiment(args.experiment)
    if found is None:
        _err(no_experiment(args.experiment))
    return found


def _ask(args: argparse.Namespace, op: str) -> int:
    exp_dir = _experiment(args)
    if exp_dir is None:
        return 1
    try:
        answer = request(exp_dir, op, args.trial_ids, shown=args.experiment)
    except ControlError as e:
        return _unreached(e, exp_dir, args.experiment, op)
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
        return _unreached(e, exp_dir, name, "stop")
    if not answer.get("ok"):
        return _err(f"the coordinator of {name} refused to stop: {answer.get('error')}")
    with ReadModel.open(exp_dir) as model:
        timeout = args.timeout if args.timeout is not None else _grace(model) + STOP_MARGIN_S
        waits = "" if args.no_wait else f" (waiting up to {timeout:g} s)"
        print(f"stopping {name}: trials that save checkpoints pause, the others are canceled{waits}", flush=True)
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


def _show_limits(limits: dict[str, Any], submitted: Any) -> str:
    concurrency, trials, duration = (limits.get(k) for k in LIMITS)
    return (
        f"trialConcurrency {concurrency}, maxTrialNumber {trials if trials is not None else 'none'} "
        f"({submitted} submitted), maxExperimentDuration {f'{duration:g} s' if duration is not None else 'none'}"
    )


def cmd_update(args: argparse.Namespace) -> int:
    limits = {
        name: value
        for name, value in zip(LIMITS, (args.concurrency, args.max_trials, args.max_duration), strict=True)
        if value is not None
    }
    if not limits:
        return _err("nothing to update: give --concurrency, --max-trials or --max-duration")
    exp_dir = _experiment(args)
    if exp_dir is None:
        return 1
    try:
        answer = request(exp_dir, "update", shown=args.experiment, fields={"limits": limits})
    except ControlError as e:
        return _unreached(e, exp_dir, args.experiment, "update")
    if not answer.get("ok"):
        return _err(str(answer.get("error") or "refused"))
    print(f"updated {args.experiment}: {_show_limits(answer.get('limits') or {}, answer.get('submitted'))}")
    return 0


def cmd_rerun(args: argparse.Namespace) -> int:
    if bool(args.trial_ids) == bool(args.failed):
        return _err("name the trials to run again, or give --failed (not both)", USAGE)
    exp_dir = _experiment(args)
    if exp_dir is None:
        return 1
    fields = {"failed": True} if args.failed else None
    try:
        answer = request(exp_dir, "rerun", args.trial_ids, shown=args.experiment, fields=fields)
    except ControlError as e:
        return _unreached(e, exp_dir, args.experiment, "rerun")
    for old, new in answer.get("rerun") or []:
        print(f"trial {old} runs again as trial {new}")
    if not answer.get("ok"):
        return _err(str(answer.get("error") or "refused"))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        parameters = json.loads(args.params)
    except ValueError as e:
        return _err(f"--params: not JSON: {e}", USAGE)
    if not isinstance(parameters, dict):
        return _err(f"--params: a JSON object of parameter names to values is needed, got {args.params}", USAGE)
    exp_dir = _experiment(args)
    if exp_dir is None:
        return 1
    try:
        answer = request(exp_dir, "submit", shown=args.experiment, fields={"parameters": parameters})
    except ControlError as e:
        return _unreached(e, exp_dir, args.experiment, "submit")
    if not answer.get("ok"):
        return _err(str(answer.get("error") or "refused"))
    print(f"submitted trial {' '.join(answer.get('done') or [])}")
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from ..config.experiment import _default_working_directory
    from ..ui.commands import cmd_ui

    if args.experiment is None:  # the experiments home, of the default working directory unless --dir
        args.experiment_dir, args.home_dir = None, args.home_dir or _default_working_directory()
        return cmd_ui(args)
    exp_dir = _experiment(args)
    if exp_dir is None:
        return 1
    args.experiment_dir = exp_dir
    return cmd_ui(args)


def _limit(field: str, name: str, valid: str, parse: Any) -> Any:
    def check(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not valid_limit(field, value):
            raise argparse.ArgumentTypeError(f"{text!r} is not valid for {name}: {valid} is needed")
        return value

    return check


def _add_control_commands(sub: Any, exp_help: str) -> None:
    update = sub.add_parser(
        "update", help="change a running experiment's concurrency, trial limit or duration",
        description="Change the limits of a running experiment at once: trialConcurrency (more trials are "
        "placed now; with fewer, running trials finish and no new one starts until there is room), "
        "maxTrialNumber and maxExperimentDuration (counted from when the coordinator started). A resume keeps "
        "the new limits.",
    )
    update.add_argument("experiment", metavar="EXP", help=exp_help)
    for flag, name, parse in (
        ("--concurrency", "trialConcurrency", int), ("--max-trials", "maxTrialNumber", int),
        ("--max-duration", "maxExperimentDuration", _seconds),
    ):
        field, valid = LIMITS[name]
        update.add_argument(
            flag, metavar="N" if parse is int else "DURATION", type=_limit(field, name, valid, parse),
            help=f"the new {name}: {valid}" + (" (90s, 30m, 2h)" if parse is _seconds else ""),
        )
    update.set_defaults(func=cmd_update)

    rerun = sub.add_parser(
        "rerun", help="run trials again with the same parameters",
        description="Submit a new trial with the parameters of each trial named (or of every FAILED trial with "
        "--failed) to the running experiment. The tuner hears its result as it hears a customized trial's.",
    )
    rerun.add_argument("experiment", metavar="EXP", help=exp_help)
    rerun.add_argument("trial_ids", nargs="*", metavar="TRIAL_ID")
    rerun.add_argument("--failed", action="store_true", help="every trial that is FAILED")
    rerun.set_defaults(func=cmd_rerun)

    submit = sub.add_parser(
        "submit", help="run a trial of your own parameters",
        description="Submit a trial of the parameters given to the running experiment (NNI's customized trial): "
        "it counts towards maxTrialNumber, and the tuner hears its result. The names must be the search space's.",
    )
    submit.add_argument("experiment", metavar="EXP", help=exp_help)
    submit.add_argument("--params", required=True, metavar="JSON", help='e.g. \'{"lr": 0.01, "batch": 64}\'')
    submit.set_defaults(func=cmd_submit)

    from ..ui.commands import UI_DEFAULT, add_home_option

    view = sub.add_parser(
        "view", help="serve the dashboard of any experiment, by directory or id",
        description="Serve the dashboard of an experiment, running or not, read from its store (as "
        "`trialkeeper ui`, also by experiment id); without EXP, the experiments home of the default working "
        "directory (or of --dir DIR).",
    )
    view.add_argument("experiment", metavar="EXP", help=exp_help, nargs="?")
    add_home_option(view)
    view.add_argument(
        "--address", default=UI_DEFAULT, metavar="HOST:PORT", help=f"where to listen (default {UI_DEFAULT})"
    )
    view.set_defaults(func=cmd_view)


def _seconds(text: str) -> float:
    from ..config.rules import parse_duration

    return parse_duration(text)


def run_detached(args: argparse.Namespace) -> int:
    """``run --detach`` and ``resume --detach``: the run goes on in a process of its own (its
    output to the experiment's log); return once its coordinator answers on its control socket."""
    if getattr(args, "resume_dir", None) is not None:
        return _resume_detached(args)
    from ..config.experiment import ConfigError, load_config
    from .printconfig import check_search, say_invalid

    try:
        config = load_config(args.config)
    except ConfigError as e:
        return say_invalid(args.config, e.issues)
    if check_search(args.config, config):  # what the run would refuse at start, before its directory is made
        return USAGE
    experiment_id = "".join(secrets.choice("abcdefghijkmnpqrstuvwxyz23456789") for _ in range(8))
    exp_dir = Path(args.experiment_dir or Path(config.experiment_working_directory) / experiment_id).resolve()
    if holds_experiment(exp_dir):
        return _err(f"{exp_dir} already holds an experiment; choose another directory")
    exp_dir.mkdir(parents=True, exist_ok=True)
    command = [
        "run", str(Path(args.config).resolve()), "--experiment-dir", str(exp_dir), "--experiment-id", experiment_id,
    ]
    return _detached(args, command, exp_dir, experiment_id)


def _resume_detached(args: argparse.Namespace) -> int:
    """``resume --detach``: the resumed run in a process of its own, as ``run --detach``."""
    exp_dir = Path(args.resume_dir).resolve()
    if not holds_experiment(exp_dir):
        return _err(no_experiment(args.resume_dir))
    with ReadModel.open(exp_dir) as model:
        exp = model.experiment()
    experiment_id = exp.id if exp is not None else exp_dir.name
    if alive(exp_dir):
        return _err(f"experiment {experiment_id} is running already: its coordinator answers on its control socket")
    command = ["resume", str(exp_dir)]
    if args.config is not None:
        command += ["--config", str(Path(args.config).resolve())]
    if args.max_trials is not None:
        command += ["--max-trials", str(args.max_trials)]
    if args.max_duration is not None:
        command += ["--max-duration", f"{args.max_duration}s"]
    return _detached(args, command, exp_dir, experiment_id)


def _detached(args: argparse.Namespace, command: list[str], exp_dir: Path, experiment_id: str) -> int:
    """Start ``trialkeeper COMMAND`` in a session of its own, its output to the experiment's log,
    and wait until it answers on the control socket (or ends, or the wait times out)."""
    import os
    import subprocess

    from ..experimentlog import LOG_FILENAME
    from ..store.index import record_or_warn

    command = [sys.executable, "-m", "trialkeeper.coordinator.cli", *command, "--quiet"]
    if args.ui is not None:
        command += ["--ui", args.ui]
    if args.log_level is not None:
        command += ["--log-level", args.log_level]
    log_path = exp_dir / LOG_FILENAME
    said_before = log_path.stat().st_size if log_path.exists() else 0  # a resume's log has the runs before
    with open(log_path, "ab") as out:
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def said() -> list[str]:
        with open(log_path, "rb") as f:
            f.seek(said_before)
            return f.read().decode(errors="replace").splitlines()

    deadline = time.monotonic() + args.detach_timeout
    while True:
        try:
            address = str(request(exp_dir, "ping", timeout=5.0, shown=experiment_id).get("address") or "")
            break
        except ControlError:
            pass
        code = child.poll()
        if code is not None:
            print("\n".join(said()[-15:]), file=sys.stderr)
            _err(f"the run ended at once (exit code {code}); its output is in {log_path}")
            return code or 1
        if time.monotonic() >= deadline:
            return _err(
                f"the run (pid {child.pid}) has not answered on its control socket within {args.detach_timeout:g} s; "
                f"it may still be starting: its output is in {log_path}"
            )
        time.sleep(POLL_S / 2)  # the child is polled: there is nothing to wait on here
    record_or_warn(experiment_id, exp_dir)  # the commands that follow find it by id at once
    print(f"experiment {experiment_id} runs in the background (pid {child.pid})")
    print(f"experiment directory: {exp_dir}")
    if address:
        print(f"coordinator: {address} (agents started by hand dial it: "
              f"trialkeeper agent --coordinator {address} --environment-id ID)")
    if args.ui is not None:
        dashboard = [line for line in said() if line.startswith("dashboard: ")]
        print(dashboard[-1] if dashboard else f"dashboard: http://{args.ui}/")
    print(f"output: {log_path}; `trialkeeper stop {experiment_id}` stops it, `trialkeeper view {experiment_id}` "
          "shows it")
    return 0


class _InTheLogFile(logging.Filter):
    """Drops what the experiment's own log handler writes to experiment.log anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        mine = record.name.split(".", 1)[0] in ("trialkeeper", "nni")
        return not (mine and record.levelno >= logging.WARNING and experimentlog.current_experiment.get())


def said_once() -> None:
    """For a detached run, whose output goes to experiment.log: the warnings and errors the
    experiment's log handler writes there are not written again by the stderr handler."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_InTheLogFile())


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
    _add_control_commands(sub, exp_help)


__all__ = ["NoCoordinator", "add_commands"]
