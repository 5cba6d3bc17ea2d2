"""The CLI's reading commands (`list`, `status`, `trials`, `trial`, `envs`): snapshots of the
read model rendered as tables, text or JSON. Nothing here reads the store itself."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..config.objectives import Objectives, number
from ..engine.states import TrialStatus
from ..read.failures import failure_summary
from ..read.model import (
    EnvSnapshot,
    ExperimentSnapshot,
    GpuSnapshot,
    ReadModel,
    TrialSnapshot,
    _unreadable_experiment,
    list_experiments,
    to_json,
)
from ..read.pages import MAX_PAGE, PageError, trial_page
from ..read.pareto import objectives_of, pareto_front
from ..read.results import result_keys
from ..store.index import experiment_path
from ..store.reads import StoreError
from ..ui.commands import EXP_HELP

# The experiment's checkpoint directory, in the experiment directory (checkpoints without
# an object storage URL are there: <trial>/<step>/).
CHECKPOINTS_DIR = "checkpoints"


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich would exit 1 by itself; the CLI's main ends every command alike (141).
        raise BrokenPipeError


def console() -> Console:
    """A console for tables: the terminal's width, or 160 columns when piped (not 80)."""
    c = _Console()
    return c if c.is_terminal else _Console(width=160)


def _print_json(value: Any) -> None:
    print(json.dumps(to_json(value), indent=2))


def _metric(value: float | None) -> str:
    return f"{value:.6g}" if value is not None else ""


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at is not None else ""


def _gib(n: int | None) -> str:
    return f"{(n or 0) / 2**30:.1f}"


def size_text(n: int | None) -> str:
    """Bytes as a person reads them: 512 B, 1.5 KiB, 2.0 GiB."""
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def checkpoint_where(location: str, experiment_dir: Path, trial_id: str, step: int) -> str:
    """Where a checkpoint's files are: its object storage URL, or its directory in the
    experiment's checkpoint directory."""
    return location or str(Path(experiment_dir) / CHECKPOINTS_DIR / trial_id / str(step))


def _status(t: TrialSnapshot) -> str:
    text = t.status.value if t.status is not None else "UNREADABLE"
    return text + (" (stopping)" if t.stopping else "")


def _not_placed(t: TrialSnapshot) -> str:
    """Where a trial placed nowhere now last was (a paused one's, a retried one's)."""
    return f"none now, last on {t.last_environment_id}" if t.last_environment_id else "not placed"


def _params(parameters: dict[str, Any] | None) -> str:
    return json.dumps(parameters) if parameters is not None else "(unreadable)"


def _why(t: TrialSnapshot) -> str:
    said = failure_summary(t) or t.reason or t.waiting_reason
    return "; ".join(filter(None, [said, *(f"unreadable {n}" for n in t.unreadable)]))


# ---- list ----------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    from ..config.experiment import _default_working_directory

    directory: Path = args.dir if args.dir is not None else _default_working_directory()
    experiments = list_experiments(directory) if args.dir is not None else _everywhere(directory)
    if args.json:
        _print_json(experiments)
        return 0
    if not experiments:
        elsewhere = "" if args.dir else " nor in the index of experiments"
        print(f"no experiments in {directory}{elsewhere}")
        return 0
    table = Table()
    everywhere = args.dir is None  # then where each one is matters
    columns = ("id", "name", "status", "trials", "best", "started")
    for col in (*columns, *(["directory"] if everywhere else [])):
        table.add_column(col, overflow="fold")
    for e in experiments:
        status = e.status + ("; unreadable: " + "; ".join(e.unreadable) if e.unreadable else "")
        best = (
            f"{e.best.final_metric:.6g} ({e.best.id})" if e.best is not None and e.best.final_metric is not None else ""
        )
        where = [e.directory] if everywhere else []
        shown = (e.id, e.name or "", status, str(e.trial_count), best, _when(e.started_at))
        table.add_row(*shown, *where)
    console().print(table)
    return 0


def _everywhere(directory: Path) -> list[ExperimentSnapshot]:
    """The experiments in ``directory`` and those the index of this machine's experiments
    holds (made with --experiment-dir anywhere), each once; gone ones leave the index."""
    from ..store import index

    found = {Path(e.directory).resolve(): e for e in list_experiments(directory)}
    with contextlib.suppress(OSError):  # an index that cannot be written still lists
        index.forget_gone()
    for entry in index.entries():
        where = entry.directory.resolve()
        if where not in found:
            found[where] = _experiment_at(entry.directory)
    return sorted(found.values(), key=lambda e: (e.started_at is None, e.started_at or 0.0, e.id))


def _experiment_at(directory: Path) -> ExperimentSnapshot:
    try:
        with ReadModel.open(directory) as model:
            snapshot = model.experiment()
    except StoreError as e:
        return _unreadable_experiment(directory, str(e))
    return snapshot or _unreadable_experiment(directory, "the store holds no experiment")


# ---- one experiment ------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    with ReadModel.open(args.experiment_dir) as model:
        exp = model.experiment()
    if exp is None:
        print(f"trialkeeper: no experiment in {args.experiment_dir}", file=sys.stderr)
        return 1
    if args.json:
        _print_json(exp)
        return 0
    print(f"experiment {exp.id} ({exp.name or 'unnamed'}): {exp.status}{' - ' + exp.reason if exp.reason else ''}")
    print("trials: " + (", ".join(f"{n} {s}" for s, n in exp.trials.items()) or "none"))
    print(f"metrics stored: {exp.metrics}; environments: {exp.environments}")
    best = exp.best
    if best is not None and best.final_metric is not None:
        print(f"best trial: {best.id} final metric {best.final_metric:.6g} parameters {_params(best.parameters)}")
    for note in exp.unreadable:
        print(f"unreadable: {note}")
    return 0


def cmd_trials(args: argparse.Namespace) -> int:
    wanted = args.status.upper() if args.status else None
    if args.limit < 0 or args.offset < 0:
        print(
            "trialkeeper: --limit and --offset take a whole number of 0 or more (--limit 0: every trial)",
            file=sys.stderr,
        )
        return 2
    with ReadModel.open(args.experiment_dir) as model:
        objectives = objectives_of(model.stored_config())
        # The front is judged over every trial; with several objectives each row says whether it is on it.
        front = {t.id for t in pareto_front(model.trials(), objectives)} if args.pareto or objectives.several else set()
        try:
            if args.pareto:
                found = tuple(t for t in model.trials()
                              if t.id in front and (wanted is None or getattr(t.status, "value", None) == wanted))
                total, trials = len(found), found[args.offset:args.offset + args.limit or None]
            else:
                total, trials = _trials_shown(model, wanted, args.offset, args.limit)
        except PageError as e:
            print(f"trialkeeper: --{e}", file=sys.stderr)
            return 2
    if args.json or args.jsonl:
        shown = [{**to_json(t), "failure_summary": failure_summary(t),
                  **({"pareto": t.id in front} if objectives.several else {})} for t in trials]
        if args.jsonl:  # JSON Lines: one trial a line, for jq and line-by-line readers
            sys.stdout.writelines(json.dumps(t, separators=(",", ":")) + "\n" for t in shown)
        else:
            print(json.dumps(shown, indent=2))
        return 0
    table = Table()
    several = objectives.several
    for col in ("trial", "seq", "status", "env", "final metric", "duration", "parameters", "reason"):
        table.add_column(col, overflow="fold")
        if col == "final metric" and several:
            table.add_column("objectives", overflow="fold")
            table.add_column("pareto")
    for t in trials:
        ran = t.duration(time.time())  # every attempt's, the running one's so far
        dur = f"{ran:.1f} s" if ran is not None else ""
        shown_objectives = (_objectives(t, objectives), "front" if t.id in front else "") if several else ()
        table.add_row(
            t.id,
            str(t.sequence_id) if t.sequence_id is not None else "",
            _status(t),
            t.environment_id or (f"({t.last_environment_id})" if t.last_environment_id else ""),
            _metric(t.final_metric),
            *shown_objectives,
            dur,
            _params(t.parameters),
            _why(t),
        )
    console().print(table)
    shown_to = args.offset + len(trials)
    if shown_to < total:
        # On stderr, so that what is piped on stays the table.
        print(
            f"trials {args.offset + 1}-{shown_to} of {total}; --offset {shown_to} for the next ones, --limit 0 for all",
            file=sys.stderr,
        )
    return 0


def _objectives(t: TrialSnapshot, objectives: Objectives) -> str:
    """The final result's value of each objective, ``key=value``."""
    result = t.final_metric_value if t.final_metric_value is not None else t.final_metric
    values = [(k, number(result, k)) for k in objectives.keys]
    return " ".join(f"{k}={_metric(v)}" for k, v in values if v is not None)


def _trials_shown(
    model: ReadModel, status: str | None, offset: int, limit: int
) -> tuple[int, tuple[TrialSnapshot, ...]]:
    """How many trials have ``status`` (any when None), and those from ``offset`` on in
    submission order, ``limit`` of them (all when 0): paged in the store."""
    if status == "UNREADABLE":
        # A status this version cannot read is no value to page on: filter every trial.
        found = tuple(t for t in model.trials() if t.status is None)
        return len(found), found[offset:offset + limit] if limit else found[offset:]
    trials: list[TrialSnapshot] = []
    while True:
        size = MAX_PAGE if limit == 0 else min(MAX_PAGE, limit - len(trials))
        page = trial_page(model, status=status, offset=offset + len(trials), limit=size)
        trials += page.trials
        if len(page.trials) < size or (limit and len(trials) >= limit):
            return page.total, tuple(trials)


def _gpu_line(g: GpuSnapshot) -> str:
    label = f"{g.index}: {g.name}"
    if g.mig:
        label += " (MIG)"
    if g.simulated:
        label += " (simulated)"
    if g.utilization_percent is not None:
        label += f" {g.utilization_percent:.0f}% {_gib(g.memory_used_bytes)}/{_gib(g.memory_total_bytes)} GiB"
    else:
        label += f" {_gib(g.memory_total_bytes)} GiB"
    if g.held_by:
        label += " held by " + ", ".join(g.held_by)
    return label


# The ended trials of an environment its row names, latest last (the count says how many in all).
ENV_TRIALS_NAMED = 5


def _env_trials(e: EnvSnapshot) -> str:
    """How many trials ran on an environment, those running now and the latest ended ones."""
    if not e.trials:
        return ""
    running = set(e.running_trials)
    ended = [t for t in e.trials if t not in running]
    parts = [t + (" (stopping)" if t in e.stopping_trials else " (running)") for t in e.running_trials]
    parts += ended[-ENV_TRIALS_NAMED:]
    more = len(ended) - min(len(ended), ENV_TRIALS_NAMED)
    return f"{len(e.trials)}: " + " ".join(parts) + (f" and {more} earlier" if more else "")


def cmd_envs(args: argparse.Namespace) -> int:
    with ReadModel.open(args.experiment_dir) as model:
        envs = model.environments()
    if args.json:
        _print_json(envs)
        return 0
    table = Table()
    for col in ("env", "platform", "status", "agent", "host", "job", "gpus", "trials", "reason"):
        table.add_column(col, overflow="fold")
    for e in envs:
        gpus = "\n".join(_gpu_line(g) for g in e.gpus) or (
            "no GPUs: " + e.gpu_unavailable_reason if e.gpu_unavailable_reason else "none"
        )
        reason = "; ".join(filter(None, [e.reason, *(f"unreadable {n}" for n in e.unreadable)]))
        table.add_row(
            e.id,
            e.platform,
            e.status.value if e.status else "UNREADABLE",
            "connected" if e.connected else "not connected",
            e.hostname,
            e.platform_id,
            gpus,
            _env_trials(e),
            reason,
        )
    console().print(table)
    return 0


def cmd_trial(args: argparse.Namespace) -> int:
    with ReadModel.open(args.experiment_dir) as model:
        detail = model.trial_detail(args.trial_id)
        if detail is None:
            return no_trial(model, args)
        checkpoints = model.checkpoints(args.trial_id)
    results, final = detail.intermediate_results, detail.trial.final_metric_value
    if args.json:
        data = _flat(detail)  # intermediate_results: every key of dict results, as reported
        data.update(final_result=to_json(final), result_keys=result_keys([*results, final]))
        data["checkpoints"] = [
            {**to_json(c), "where": checkpoint_where(c.location, args.experiment_dir, c.trial_id, c.step)}
            for c in checkpoints
        ]
        print(json.dumps(data, indent=2))
        return 0
    t = detail.trial
    print(f"trial {t.id} (#{t.sequence_id}): {_status(t)}{' - ' + _why(t) if _why(t) else ''}")
    print(f"parameters: {_params(t.parameters)}")
    where = t.environment_id or _not_placed(t)
    if t.gpu_indices:
        where += f", GPUs {','.join(str(i) for i in t.gpu_indices)}"
    print(f"environment: {where}; attempts: {t.attempts}")
    for r in t.ranks:  # a multi-node trial: every rank's environment, GPUs and state
        gpus = f", GPUs {','.join(str(i) for i in r.gpu_indices)}" if r.gpu_indices else ""
        print(f"  rank {r.rank}: {r.environment_id}{gpus}: {r.state}")
    if t.exit_code is not None or t.signal:
        print(f"exit code: {'none' if t.exit_code is None else t.exit_code}; signal: {t.signal or 'none'}")
    inter = detail.intermediate
    if inter:
        shown = ", ".join(f"{v:.6g}" for v in inter[:10]) + (f", ... ({len(inter)} in all)" if len(inter) > 10 else "")
        print(f"intermediate: {shown}")
    if any(isinstance(r, dict) for r in results):
        print(f"last intermediate result: {json.dumps(to_json(results[-1]))}")
    if t.final_metric is not None:
        shown = f" {json.dumps(to_json(final))}" if isinstance(final, dict) else ""
        print(f"final: {t.final_metric:.6g}{shown}")
    gpu = detail.gpu_usage
    if gpu.samples:
        print(
            f"GPU usage ({gpu.samples} samples): mean {gpu.mean_utilization_percent or 0:.0f}%, "
            f"max {gpu.max_utilization_percent or 0:.0f}%, peak memory {_gib(gpu.peak_memory_used_bytes)} GiB"
        )
    for ev in detail.history:
        at = time.strftime("%H:%M:%S", time.localtime(ev.at)) if ev.at is not None else "--:--:--"
        print(f"  {at} {ev.old or '-'} -> {ev.new}: {ev.reason}")
    if checkpoints:
        print(f"checkpoints ({len(checkpoints)}, newest last):")
        for c in checkpoints:
            where = checkpoint_where(c.location, args.experiment_dir, c.trial_id, c.step)
            print(f"  step {c.step}: {size_text(c.size_bytes)}, saved {_when(c.saved_at)}, in {where}")
    else:
        print("checkpoints: none")
    ended = t.status is None or t.status.terminal
    print("logs: " + _logs(detail.stdout, detail.stderr, ran=t.started_at is not None, ended=ended))
    return 0


def _logs(*paths: str, ran: bool, ended: bool) -> str:
    """The trial's log files that exist; with none, why."""
    found = [p for p in paths if Path(p).is_file()]
    if found:
        return ", ".join(found)
    if ran:
        return "none: it wrote no output" if ended else "none yet: it has written no output"
    return "none: it never ran" if ended else "none yet: it has not started"


def _flat(detail: Any) -> dict[str, Any]:
    """A trial's detail as one JSON object: the trial's fields, then what was read on demand."""
    data = to_json(detail)
    return {**data.pop("trial"), **data}


def no_trial(model: ReadModel, args: argparse.Namespace) -> int:
    known = [t.id for t in model.trials()][:20]
    print(
        f"trialkeeper: no trial {args.trial_id!r} in {args.experiment_dir}; trials: {' '.join(known) or 'none'}",
        file=sys.stderr,
    )
    return 1


def add_commands(sub: Any) -> None:
    """The reading commands' parsers, on the CLI's subparsers."""
    listing = sub.add_parser(
        "list", help="list this machine's experiments",
        description="List this machine's experiments: those under the default working directory "
        "and every one run elsewhere (--experiment-dir), from the index in "
        "~/.trialkeeper/experiments.json ($TRIALKEEPER_HOME): id, name, status, trials, best, "
        "started, directory.",
    )
    listing.add_argument(
        "--dir", type=Path,
        help="only the experiments under this working directory (default: all of them; the "
        "default working directory is ~/trialkeeper-experiments)",
    )
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    listing.set_defaults(func=cmd_list)

    trials = sub.add_parser("trials", help="list an experiment's trials", description="List an experiment's trials.")
    trials.add_argument("experiment_dir", type=experiment_path, metavar="EXP", help=EXP_HELP)
    output = trials.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print a JSON list")
    output.add_argument("--jsonl", action="store_true", help="print JSON Lines: one trial's JSON object a line")
    trials.add_argument(
        "--status", metavar="STATUS",
        help=f"only trials with this status: {', '.join(s.value for s in TrialStatus)} (or UNREADABLE)",
    )
    trials.add_argument("--limit", type=int, default=100, help="show this many trials at most (default 100; 0: all)")
    trials.add_argument("--offset", type=int, default=0, help="skip this many trials first (default 0)")
    trials.add_argument(
        "--pareto", action="store_true",
        help="only the trials on the Pareto front of the experiment's objectives (with one objective: its best)",
    )
    trials.set_defaults(func=cmd_trials)

    status = sub.add_parser(
        "status",
        help="an experiment's state in a few lines",
        description="Show an experiment's status, counts and best trial.",
    )
    status.add_argument("experiment_dir", type=experiment_path, metavar="EXP", help=EXP_HELP)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    envs = sub.add_parser(
        "envs",
        help="list an experiment's environments",
        description="List an experiment's environments and their GPUs.",
    )
    envs.add_argument("experiment_dir", type=experiment_path, metavar="EXP", help=EXP_HELP)
    envs.add_argument("--json", action="store_true")
    envs.set_defaults(func=cmd_envs)

    trial = sub.add_parser(
        "trial",
        help="one trial in detail",
        description="Show one trial: parameters, metrics, GPU usage, status history.",
    )
    trial.add_argument("experiment_dir", type=experiment_path, metavar="EXP", help=EXP_HELP)
    trial.add_argument("trial_id", metavar="TRIAL_ID")
    trial.add_argument("--json", action="store_true")
    trial.set_defaults(func=cmd_trial)
