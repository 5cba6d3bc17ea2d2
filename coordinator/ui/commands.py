"""The dashboard's commands: ``run --ui``, ``ui EXP`` and ``tensorboard EXP`` (an
experiment's directory or its id).

Only argparse, the standard library and the index of experiments are imported here: the
server's libraries (the ``ui`` extra) load when a command needs them, and their absence is
told plainly."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..store.index import experiment_path, no_experiment

UI_DEFAULT = "127.0.0.1:8080"
EXP_HELP = "the experiment's directory, or its id (`trialkeeper list` shows them)"
INSTALL_HINT = "the dashboard's libraries (aiohttp, prometheus-client) are missing: pip install trialkeeper"


def add_ui_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ui", nargs="?", const=UI_DEFAULT, default=None, metavar="HOST:PORT",
        help=f"serve the dashboard while it runs, and in a terminal after it ends until Ctrl-C (default {UI_DEFAULT}; "
        "beyond loopback every page needs the token)",
    )


def add_commands(sub: Any) -> None:
    ui = sub.add_parser(
        "ui", help="serve the dashboard of an experiment",
        description="Serve the dashboard of a running, finished or crashed experiment, read from its store; "
        "with --dir, the experiments home: every experiment in a directory, to open or compare.",
    )
    ui.add_argument("experiment_dir", type=experiment_path, metavar="EXP", nargs="?", help=EXP_HELP)
    add_home_option(ui)
    ui.add_argument(
        "--address", default=UI_DEFAULT, metavar="HOST:PORT", help=f"where to listen (default {UI_DEFAULT})"
    )
    ui.set_defaults(func=cmd_ui)

    tb = sub.add_parser(
        "tensorboard", help="start TensorBoard over the trials' output directories",
        description="Build a TensorBoard log directory with one run per trial (named by its id and parameters, "
        "linked to the trial's output directory) and start TensorBoard on it.",
    )
    tb.add_argument("experiment_dir", type=experiment_path, metavar="EXP", help=EXP_HELP)
    tb.add_argument("trial_ids", nargs="*", metavar="TRIAL_ID", help="these trials only (default: every trial)")
    tb.add_argument("--logdir", type=Path, help="where to build the log directory (default: EXP/tensorboard)")
    tb.add_argument("--port", type=int, default=6006, help="TensorBoard's port (default 6006)")
    tb.set_defaults(func=cmd_tensorboard)


def _err(message: str) -> None:
    print(f"trialkeeper: {message}", file=sys.stderr)


def dashboard_starter(
    args: argparse.Namespace, control: Any, say: Callable[[str], None]
) -> tuple[Callable[[Any], None] | None, Callable[[], None]]:
    """For ``run --ui``: a hook that starts the dashboard once the coordinator runs (after
    ``control``, the run's ControlHook, has opened its control server: the dashboard's actions
    are that server's requests, answered on the experiment's loop), and a function to call
    when the run has ended. That one stops the dashboard, or, with a terminal attached, makes
    it read-only and leaves it serving for :func:`linger_dashboard`. (None, no-op) without ``--ui``."""
    if getattr(args, "ui", None) is None:
        return None, lambda: None
    try:
        from .actions import on_loop
        from .server import Controls, DashboardThread, bind, parse_address
    except ImportError:
        raise SystemExit(f"trialkeeper: {INSTALL_HINT}") from None
    # Bound now, before the coordinator starts anything: a port already taken stops the run
    # here, with no agent launched and no trial started.
    sock = bind(*parse_address(args.ui))
    started: list[Any] = []

    def on_start(coordinator: Any) -> None:
        server = control.server
        controls = Controls(
            ask=on_loop(server, asyncio.get_running_loop()), scheduling=lambda: coordinator.scheduling_passes,
        ) if server is not None else None  # no control server: nothing can act, not even the dashboard
        thread = DashboardThread(coordinator.experiment_dir, sock, controls)
        url = thread.start()
        started.append(thread)
        say(f"dashboard: {url}")

    def end_dashboard() -> None:
        if started and started[0].alive and terminal_attached():
            started[0].read_only()
            args.lingering_dashboard = started[0]
            return
        for thread in started:
            thread.stop()
        sock.close()  # never served (the run ended before it started), or already closed with its server

    return on_start, end_dashboard


def terminal_attached() -> bool:
    """Whether this process runs in the foreground of a terminal, in and out: someone reads
    what it says and can press Ctrl-C (not a script that keeps its output, nor a background job)."""
    try:
        fd = sys.stdin.fileno()
        return os.isatty(fd) and sys.stdout.isatty() and os.tcgetpgrp(fd) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no stdin, or not a terminal of ours
        return False


def linger_dashboard(args: argparse.Namespace) -> None:
    """After ``run --ui`` in a terminal has printed its summary: serve the ended experiment's
    dashboard on, read-only, until Ctrl-C (or the terminal closes, or SIGTERM)."""
    thread = getattr(args, "lingering_dashboard", None)
    if thread is None:
        return
    print(
        f"the experiment has ended; its dashboard goes on serving it, read-only, at {thread.url} "
        "(press Ctrl-C to leave)", flush=True,
    )
    leave = threading.Event()
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {sig: signal.signal(sig, lambda *_: leave.set()) for sig in signals}
    try:
        while thread.alive and not leave.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        thread.stop()
    with contextlib.suppress(OSError):  # the terminal may be gone
        print("dashboard stopped", flush=True)


def add_home_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", type=Path, metavar="DIR", dest="home_dir",
        help="the experiments home: every experiment in DIR's subdirectories, with status, progress and best "
        "result, to open each or compare several",
    )


def cmd_ui(args: argparse.Namespace) -> int:
    from ..store.reads import holds_experiment

    try:
        from .home import build_home
        from .server import DashboardError, parse_address, serve_forever
    except ImportError:
        _err(INSTALL_HINT)
        return 1
    home = getattr(args, "home_dir", None)
    if (home is None) == (args.experiment_dir is None):
        _err("give an experiment (its directory or id), or --dir DIR for the experiments home (not both)")
        return 2
    if home is not None and not home.is_dir():
        _err(f"--dir: {home} is not a directory")
        return 1
    if home is not None and holds_experiment(home):
        _err(f"--dir: {home} is an experiment's directory, not one of experiments: `trialkeeper ui {home}` serves it")
        return 1
    if home is None and not holds_experiment(args.experiment_dir):
        _err(no_experiment(args.experiment_dir))
        return 1
    say = lambda url: print(f"dashboard: {url}", flush=True)
    try:
        host, port = parse_address(args.address)
        if home is not None:
            asyncio.run(serve_forever(home.resolve(), host, port, say, build=build_home))
        else:
            asyncio.run(serve_forever(args.experiment_dir, host, port, say))
    except DashboardError as e:
        _err(str(e))
        return 1
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from .tensorboard import TensorboardError, build_logdir, launch

    try:
        plan = build_logdir(args.experiment_dir, args.trial_ids, args.logdir)
    except TensorboardError as e:
        _err(str(e))
        return 1
    for line in plan.notes:
        print(line)
    return launch(plan, args.port)
