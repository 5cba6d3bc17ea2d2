"""The ``trialkeeper`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from trialkeeper.agent import nnicompat

from ..read.model import ReadModel
from ..store.index import no_experiment, record_or_warn
from ..store.reads import StoreError, holds_experiment
from ..ui.commands import add_commands as add_ui_commands
from ..ui.commands import add_ui_option, dashboard_starter, linger_dashboard
from .clean import cmd_clean
from .control import ControlHook
from .ended import ENDED_EXIT, add_exit_option, extended_config, failed_note, resume_refusal, stop_note
from .livelog import LiveLog
from .printconfig import check_search, print_config, say_invalid
from .replay import add_command as add_replay_command
from .steer import add_commands as add_steer_commands
from .views import EXP_HELP, add_commands, experiment_path, no_trial
from .views import console as _console

# The exit status of a command whose output pipe was closed (128 + SIGPIPE), as a shell
# reports for a program SIGPIPE ended.
BROKEN_PIPE_EXIT = 141


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at exit
        return code
    except BrokenPipeError:
        # Output piped into `head` ends quietly, as a SIGPIPE would end it: the rest of the
        # output (and the interpreter's flush at exit) goes nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT
    except StoreError as e:
        # An experiment named by an id that no index knows, or a path that is not there.
        target = getattr(args, "experiment_dir", None) or getattr(args, "resume_dir", None)
        missing = target is not None and not Path(target).exists()
        print(f"trialkeeper: {no_experiment(target) if missing else e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trialkeeper",
        description="Run the trials of hyperparameter-tuning experiments on local machines, SSH hosts and clusters.",
    )
    sub = p.add_subparsers(metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run an experiment from a YAML config",
        description="Run an experiment from a YAML config and show its progress.",
    )
    run.add_argument("config", type=Path, help="experiment config (YAML)")
    run.add_argument(
        "--experiment-dir", type=Path, help="directory for the store and logs (default: experimentWorkingDirectory/ID)"
    )
    run.add_argument("--quiet", action="store_true", help="no live view; print the summary only")
    run.add_argument(
        "--print-config", action="store_true",
        help="print the config in NNI's v2 format (an NNI v1 file converted), check it, and exit",
    )
    run.add_argument(
        "--log-level",
        default=None,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default: the config's logLevel, else WARNING",
    )
    add_ui_option(run)
    add_exit_option(run)
    run.add_argument(
        "--detach", action="store_true",
        help="run in the background (output to the experiment's log); print its directory and return once it runs",
    )
    run.add_argument("--detach-timeout", type=float, default=120.0, metavar="SECONDS", help=argparse.SUPPRESS)
    run.add_argument("--experiment-id", help=argparse.SUPPRESS)  # the id `--detach` chose for the run
    run.set_defaults(func=_cmd_run, resume_dir=None)

    resume = sub.add_parser(
        "resume", help="carry on an experiment that crashed or was stopped, or extend a finished one",
        description="Carry on an experiment after its coordinator crashed, was killed or was stopped: rebuild its "
        "state from the store, listen on the same address so running agents reconnect, continue its paused "
        "trials, and go on to the end. A finished experiment goes on only with a limit raised (--max-trials, "
        "--max-duration, or --config).",
    )
    resume.add_argument("resume_dir", type=experiment_path, metavar="EXP", help=EXP_HELP)
    resume.add_argument(
        "--config", type=Path,
        help="the experiment's config, when the stored one (secrets redacted) is not enough; "
        "redacted trialEnv variables may come from the environment instead",
    )
    resume.add_argument(
        "--max-trials", type=_positive_int, metavar="N",
        help="raise maxTrialNumber to N (it counts the trials already submitted): extends an experiment that "
        "has ended",
    )
    resume.add_argument(
        "--max-duration", type=_duration, metavar="DURATION",
        help="maxExperimentDuration for this run, counted from the resume (e.g. 30m, 2h): extends an "
        "experiment that has ended",
    )
    resume.add_argument("--quiet", action="store_true", help="no live view; print the summary only")
    resume.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    resume.add_argument(
        "--detach", action="store_true",
        help="carry on in the background (output to the experiment's log); return once it runs",
    )
    resume.add_argument("--detach-timeout", type=float, default=120.0, metavar="SECONDS", help=argparse.SUPPRESS)
    add_ui_option(resume)
    add_exit_option(resume)
    resume.set_defaults(func=_cmd_run, experiment_dir=None)

    clean = sub.add_parser(
        "clean", help="remove what a dead coordinator left running",
        description="Find the environments (agents, jobs, pods) an experiment still holds on its platform and "
        "remove them. Refused while a coordinator of the experiment is alive: its environments are its to stop.",
    )
    clean.add_argument(
        "target",
        metavar="EXP",
        help=EXP_HELP,
    )
    clean.add_argument(
        "--config", type=Path, help="the experiment's config, when the stored one (secrets redacted) is not enough"
    )
    clean.set_defaults(func=cmd_clean)

    agent = sub.add_parser(
        "agent",
        help="run an agent (usually started for you)",
        description=(
            "Run trials for a coordinator. The first SIGTERM/SIGINT drains, a second one cancels running trials."
        ),
    )
    from trialkeeper.agent.main import add_arguments

    add_arguments(agent)
    agent.set_defaults(func=_cmd_agent)

    add_commands(sub)
    add_steer_commands(sub)
    add_ui_commands(sub)
    add_replay_command(sub)

    logs = sub.add_parser(
        "logs", help="print a trial's output", description="Print a trial's stdout (and stderr with --stderr)."
    )
    logs.add_argument("experiment_dir", type=experiment_path, metavar="EXP", help=EXP_HELP)
    logs.add_argument("trial_id", metavar="TRIAL_ID")
    logs.add_argument("--stderr", action="store_true", help="print stderr instead of stdout")
    logs.add_argument("--rank", type=int, default=0, metavar="R", help="a multi-node trial's rank R (default 0)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new output until the trial ends")
    logs.add_argument(
        "--nni-results",
        action="store_true",
        help=(
            "also print the NNISDK_MEb lines NNI trials report results with "
            "(hidden by default: they are stored as metrics)"
        ),
    )
    logs.set_defaults(func=_cmd_logs)
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number above 0")
    return value


def _duration(text: str) -> float:
    from ..config.rules import parse_duration

    try:
        value = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration above 0")
    return value


# ---- run -------------------------------------------------------------------------------


# NNI's log levels (a config's logLevel) as Python's.
_NNI_LOG_LEVELS = {
    "fatal": "CRITICAL",
    "error": "ERROR",
    "warning": "WARNING",
    "info": "INFO",
    "debug": "DEBUG",
    "trace": "DEBUG",
}


def _cmd_run(args: argparse.Namespace) -> int:
    code = _run(args)
    linger_dashboard(args)  # run --ui in a terminal: its dashboard serves on, read-only, until Ctrl-C
    return code


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "print_config", False):  # reads the config only: nothing else is loaded
        return print_config(args.config)
    if getattr(args, "detach", False):
        from .steer import run_detached

        return run_detached(args)
    from ..config.experiment import ConfigError, load_config
    from ..core import CoordinatorError
    from ..experiment import (
        ExperimentResult,
        Progress,
        optimize_mode_of,
        ranked,
        resume_experiment,
        run_experiment,
    )
    from ..gcpolicy import tune_for_fleets
    from ..search.space import SearchSpaceError
    from ..search.tuners import TunerError

    logging.basicConfig(level=args.log_level or "WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "experiment_id", None):  # a detached run: its output is experiment.log already
        from .steer import said_once

        said_once()
    tune_for_fleets()  # this process is the coordinator's own: see gcpolicy
    extended = False  # resume --max-trials or --max-duration given
    try:
        notes: list[str] = []  # said once: an NNI v1 file was converted
        try:
            config = load_config(args.config, notes=notes) if args.config is not None else None
        finally:
            for note in notes:
                print(f"trialkeeper: {note}", file=sys.stderr)
        if config is not None and config.log_level and args.log_level is None:
            logging.getLogger().setLevel(_NNI_LOG_LEVELS[config.log_level])
        if config is None:
            if not holds_experiment(args.resume_dir):
                print(f"trialkeeper: {no_experiment(args.resume_dir)}", file=sys.stderr)
                return 1
            from ..core import Coordinator

            config = Coordinator.resume(args.resume_dir).config
        if args.resume_dir is not None:
            config, extended = extended_config(config, args)
    except CoordinatorError as e:
        print(f"trialkeeper: cannot resume: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        return say_invalid(args.config, e.issues)
    if args.resume_dir is not None and holds_experiment(args.resume_dir):
        refusal = resume_refusal(
            args.resume_dir, config, file_given=args.config is not None, limits_given=extended,
            duration_given=getattr(args, "max_duration", None) is not None,
        )
        if refusal:  # it has ended: no agent is started only to be told so
            print(f"trialkeeper: {refusal}", file=sys.stderr)
            return ENDED_EXIT
    console = _console()
    live_view = console.is_terminal and not args.quiet
    mode = optimize_mode_of(config)
    state: dict[str, Any] = {"printed": 0.0, "dir_shown": False}

    def on_progress(p: Progress) -> None:
        if not state["dir_shown"]:
            record_or_warn(p.experiment_id, Path(p.experiment_dir))  # for `list`, wherever it is
            console.print(
                f"experiment [bold]{p.experiment_id}[/bold] in {p.experiment_dir}", highlight=False, soft_wrap=True
            )
            state["dir_shown"] = True
            if live_log is not None:
                live_log.directory(Path(p.experiment_dir))
        if live is not None:
            live.update(_live_table(p))
        elif not args.quiet and time.monotonic() - state["printed"] >= 2.0:
            state["printed"] = time.monotonic()
            console.print(_progress_line(p), highlight=False, soft_wrap=True)

    async def go() -> ExperimentResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def say(line: str) -> None:
            console.print(line, highlight=False, soft_wrap=True)

        control = ControlHook(stop.set, say)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, control.signalled)
        start_dashboard, state["stop_dashboard"] = dashboard_starter(args, control, say)

        def on_start(coordinator: Any) -> None:
            control.on_start(coordinator)  # `trialkeeper pause`, `stop`, ... reach it from here on
            if start_dashboard is not None:
                start_dashboard(coordinator)

        try:
            if args.resume_dir is not None:
                return await resume_experiment(
                    args.resume_dir,
                    config=config if args.config or extended else None,
                    on_progress=on_progress,
                    stop=stop,
                    on_start=on_start,
                    steering=control.steering,
                )
            return await run_experiment(
                config, experiment_dir=args.experiment_dir, on_progress=on_progress, stop=stop, on_start=on_start,
                steering=control.steering, experiment_id=getattr(args, "experiment_id", None),
            )
        finally:
            await control.close()

    live = Live(console=console, refresh_per_second=4, transient=False) if live_view else None
    live_log = LiveLog().start() if live is not None else None  # log lines would tear the live view
    try:
        if live is not None:
            with live:
                result = asyncio.run(go())
        else:
            result = asyncio.run(go())
    except (TunerError, SearchSpaceError, ValueError) as e:
        # What the search refused, said as --print-config says it: every section at once.
        if args.config is None or not check_search(args.config, config):
            print(f"trialkeeper: {e}", file=sys.stderr)
        return 2
    except (CoordinatorError, OSError) as e:
        print(f"trialkeeper: cannot run the experiment: {e}", file=sys.stderr)
        return 1
    finally:
        state.get("stop_dashboard", lambda: None)()
        if live_log is not None and (said := live_log.stop()):
            print(f"trialkeeper: {said}", file=sys.stderr)
    counts: dict[str, int] = {}
    for t in result.trials:
        counts[t.status.value] = counts.get(t.status.value, 0) + 1
    console.print(
        f"experiment {result.experiment_id}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        highlight=False,
        soft_wrap=True,
    )
    top = ranked(result.trials, mode)[:10]
    if top:
        table = Table(title=f"best trials ({mode})")
        for col in ("trial", "final metric", "parameters"):
            table.add_column(col)
        for t in top:
            table.add_row(t.id, f"{t.final_metric:.6g}", json.dumps(t.parameters))
        console.print(table)
    if result.best is not None:
        console.print(
            f"best trial: {result.best.id} final metric {result.best.final_metric:.6g} "
            f"parameters {json.dumps(result.best.parameters)}",
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"experiment directory: {result.experiment_dir}", highlight=False, soft_wrap=True)
    if not result.ok:
        reason = result.reason
        if reason.startswith("stopped by the user"):
            reason += f"; {stop_note(result.trials, result.experiment_dir)}"
        print(f"trialkeeper: experiment did not complete: {reason}", file=sys.stderr)
        return 1
    failed = failed_note(result.trials, result.experiment_dir)
    if failed:  # an experiment with failed trials has run (as NNI's): 1 only when asked to fail
        print(f"trialkeeper: {failed}", file=sys.stderr)
    return 1 if failed and getattr(args, "fail_on_trial_failure", False) else 0


def _progress_line(p: Any) -> str:
    counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(p.counts.items()))
    best = f"; best {p.best.final_metric:.6g} ({p.best.id})" if p.best else ""
    eta = f"; eta {p.eta_s:.0f} s" if p.eta_s is not None else ""
    total = f"/{p.max_trials}" if p.max_trials else ""
    return f"[{p.elapsed_s:6.1f} s] {p.submitted}{total} trials: {counts or 'none yet'}{best}{eta}"


def _live_table(p: Any) -> Group:
    table = Table(title=_progress_line(p), title_justify="left")
    for col in ("trial", "status", "env", "final metric", "parameters"):
        table.add_column(col, overflow="fold")
    recent = [t for t in p.trials if not t.status.terminal][-10:] or p.trials[-5:]
    for t in recent:
        metric = f"{t.final_metric:.6g}" if t.final_metric is not None else ""
        table.add_row(t.id, t.status.value, t.environment_id or "", metric, json.dumps(t.parameters)[:80])
    if p.best is not None:
        table.caption = f"best: {p.best.id} = {p.best.final_metric:.6g}"
    envs = Table(box=None, show_header=False, pad_edge=False)
    for col in ("env", "status", "detail"):
        envs.add_column(col, overflow="fold")
    for env_id, status, detail in p.environments:
        envs.add_row(env_id, status, detail)
    return Group(table, envs)


def _cmd_agent(args: argparse.Namespace) -> int:
    from trialkeeper.agent.main import run

    return run(args)


# ---- reading an experiment ---------------------------------------------------------------


def _cmd_logs(args: argparse.Namespace) -> int:
    model = ReadModel.open(args.experiment_dir)
    found = model.trial(args.trial_id)
    if found is None:
        return no_trial(model, args)
    if not 0 <= args.rank < found.nodes:
        ranks = "rank 0 only" if found.nodes == 1 else f"ranks 0-{found.nodes - 1}"
        print(f"trialkeeper: --rank {args.rank}: trial {args.trial_id} has {ranks}", file=sys.stderr)
        return 2
    rank_dir = f"rank{args.rank}" if args.rank else ""
    path = args.experiment_dir / "trials" / args.trial_id / rank_dir / ("stderr.log" if args.stderr else "stdout.log")
    offset = 0
    pending = b""  # an unfinished result line, held back while following
    out = sys.stdout.buffer
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        offset += len(data)
        if not args.nni_results and not args.stderr:
            data, pending = nnicompat.without_results(pending + data, final=not args.follow)
        if data:
            out.write(data)
            out.flush()
        if not args.follow:
            return 0
        trial = model.trial(args.trial_id)
        if trial is not None and not trial.active:
            # One last read picks up what was written just before the end.
            args.follow = False
            continue
        time.sleep(0.5)  # polling a file the agent appends to; there is nothing to wait on


if __name__ == "__main__":
    sys.exit(main())
