"""The ``trialkeeper`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .store import Store, StoreError

_TERMINAL = ("SUCCEEDED", "FAILED", "USER_CANCELED", "EARLY_STOPPED", "SYS_CANCELED")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except StoreError as e:
        print(f"trialkeeper: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trialkeeper",
        description="Run the trials of hyperparameter-tuning experiments on local machines, SSH hosts and clusters.",
    )
    sub = p.add_subparsers(metavar="COMMAND")

    run = sub.add_parser("run", help="run an experiment from a YAML config", description="Run an experiment from a YAML config and show its progress.")
    run.add_argument("config", type=Path, help="experiment config (YAML)")
    run.add_argument("--experiment-dir", type=Path, help="directory for the store and logs (default: experimentWorkingDirectory/ID)")
    run.add_argument("--quiet", action="store_true", help="no live view; print the summary only")
    run.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.set_defaults(func=_cmd_run, resume_dir=None)

    resume = sub.add_parser(
        "resume", help="carry on an experiment whose coordinator died",
        description="Carry on an experiment after its coordinator crashed or was killed: rebuild its state from "
        "the store, listen on the same address so running agents reconnect, and go on to the end.",
    )
    resume.add_argument("resume_dir", type=Path, metavar="EXP_DIR")
    resume.add_argument(
        "--config", type=Path,
        help="the experiment's config, when the stored one (secrets redacted) is not enough; "
        "redacted trialEnv variables may come from the environment instead",
    )
    resume.add_argument("--quiet", action="store_true", help="no live view; print the summary only")
    resume.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    resume.set_defaults(func=_cmd_run, experiment_dir=None)

    clean = sub.add_parser(
        "clean", help="remove what a dead coordinator left running",
        description="Find the environments (agents, jobs, pods) an experiment still holds on its platform and "
        "remove them. Refused while a coordinator of the experiment is alive: its environments are its to stop.",
    )
    clean.add_argument("target", metavar="EXPERIMENT_ID_OR_DIR", help="an experiment directory, or an experiment id under the default working directory")
    clean.add_argument("--config", type=Path, help="the experiment's config, when the stored one (secrets redacted) is not enough")
    clean.set_defaults(func=_cmd_clean)

    agent = sub.add_parser("agent", help="run an agent (usually started for you)", description="Run trials for a coordinator. The first SIGTERM/SIGINT drains, a second one cancels running trials.")
    from trialkeeper.agent.main import add_arguments

    add_arguments(agent)
    agent.set_defaults(func=_cmd_agent)

    trials = sub.add_parser("trials", help="list an experiment's trials", description="List an experiment's trials.")
    trials.add_argument("experiment_dir", type=Path, metavar="EXP_DIR")
    trials.add_argument("--json", action="store_true", help="print a JSON list")
    trials.add_argument("--status", help="only trials with this status (e.g. FAILED)")
    trials.set_defaults(func=_cmd_trials)

    status = sub.add_parser("status", help="an experiment's state in a few lines", description="Show an experiment's status, counts and best trial.")
    status.add_argument("experiment_dir", type=Path, metavar="EXP_DIR")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_cmd_status)

    envs = sub.add_parser("envs", help="list an experiment's environments", description="List an experiment's environments and their GPUs.")
    envs.add_argument("experiment_dir", type=Path, metavar="EXP_DIR")
    envs.add_argument("--json", action="store_true")
    envs.set_defaults(func=_cmd_envs)

    trial = sub.add_parser("trial", help="one trial in detail", description="Show one trial: parameters, metrics, GPU usage, status history.")
    trial.add_argument("experiment_dir", type=Path, metavar="EXP_DIR")
    trial.add_argument("trial_id", metavar="TRIAL_ID")
    trial.add_argument("--json", action="store_true")
    trial.set_defaults(func=_cmd_trial)

    logs = sub.add_parser("logs", help="print a trial's output", description="Print a trial's stdout (and stderr with --stderr).")
    logs.add_argument("experiment_dir", type=Path, metavar="EXP_DIR")
    logs.add_argument("trial_id", metavar="TRIAL_ID")
    logs.add_argument("--stderr", action="store_true", help="print stderr instead of stdout")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new output until the trial ends")
    logs.set_defaults(func=_cmd_logs)
    return p


# ---- run -------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .core import CoordinatorError
    from .experiment import (
        ExperimentResult,
        Progress,
        optimize_mode_of,
        ranked,
        resume_experiment,
        run_experiment,
    )
    from .searchspace import SearchSpaceError
    from .states import TrialStatus
    from .tuners import TunerError

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config) if args.config is not None else None
        if config is None:
            if not (args.resume_dir / Store.FILENAME).is_file():
                print(f"trialkeeper: no experiment to resume in {args.resume_dir}", file=sys.stderr)
                return 1
            from .core import Coordinator

            config = Coordinator.resume(args.resume_dir).config
    except CoordinatorError as e:
        print(f"trialkeeper: cannot resume: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        # Plain prints: rich would wrap long messages at 80 columns when not on a terminal.
        if len(e.issues) == 1:
            print(f"trialkeeper: invalid config {args.config}: {e.issues[0]}", file=sys.stderr)
        else:
            print(f"trialkeeper: invalid config {args.config}:", file=sys.stderr)
            for issue in e.issues:
                print(f"  {issue}", file=sys.stderr)
        return 2
    console = _console()
    live_view = console.is_terminal and not args.quiet
    mode = optimize_mode_of(config)
    state: dict[str, Any] = {"printed": 0.0, "dir_shown": False}

    def on_progress(p: Progress) -> None:
        if not state["dir_shown"]:
            console.print(f"experiment [bold]{p.experiment_id}[/bold] in {p.experiment_dir}", highlight=False, soft_wrap=True)
            state["dir_shown"] = True
        if live is not None:
            live.update(_live_table(p))
        elif not args.quiet and time.monotonic() - state["printed"] >= 2.0:
            state["printed"] = time.monotonic()
            console.print(_progress_line(p), highlight=False, soft_wrap=True)

    async def go() -> ExperimentResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if args.resume_dir is not None:
            return await resume_experiment(args.resume_dir, config=config if args.config else None, on_progress=on_progress, stop=stop)
        return await run_experiment(config, experiment_dir=args.experiment_dir, on_progress=on_progress, stop=stop)

    live = Live(console=console, refresh_per_second=4, transient=False) if live_view else None
    try:
        if live is not None:
            with live:
                result = asyncio.run(go())
        else:
            result = asyncio.run(go())
    except (TunerError, SearchSpaceError, ValueError) as e:
        print(f"trialkeeper: {e}", file=sys.stderr)
        return 2
    except (CoordinatorError, OSError) as e:
        print(f"trialkeeper: cannot run the experiment: {e}", file=sys.stderr)
        return 1
    counts: dict[str, int] = {}
    for t in result.trials:
        counts[t.status.value] = counts.get(t.status.value, 0) + 1
    console.print(f"experiment {result.experiment_id}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), highlight=False, soft_wrap=True)
    top = ranked(result.trials, mode)[:10]
    if top:
        table = Table(title=f"best trials ({mode})")
        for col in ("trial", "final metric", "parameters"):
            table.add_column(col)
        for t in top:
            table.add_row(t.id, f"{t.final_metric:.6g}", json.dumps(t.parameters))
        console.print(table)
    if result.best is not None:
        console.print(f"best trial: {result.best.id} final metric {result.best.final_metric:.6g} parameters {json.dumps(result.best.parameters)}", highlight=False, soft_wrap=True)
    console.print(f"experiment directory: {result.experiment_dir}", highlight=False, soft_wrap=True)
    if not result.ok:
        print(f"trialkeeper: experiment did not complete: {result.reason}", file=sys.stderr)
        return 1
    failed = [t for t in result.trials if t.status is TrialStatus.FAILED]
    if failed:
        first = (failed[0].reason or "no reason given").splitlines()[0]
        print(f"trialkeeper: {len(failed)} of {len(result.trials)} trials failed (first: trial {failed[0].id}: {first})", file=sys.stderr)
        return 1
    return 0


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


def _console() -> Console:
    """A console for tables: the terminal's width, or 160 columns when piped (not 80)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _cmd_agent(args: argparse.Namespace) -> int:
    from trialkeeper.agent.main import run

    return run(args)


# ---- clean -------------------------------------------------------------------------------

PROBE_TIMEOUT_S = 5.0
SWEEP_TIMEOUT_S = 300.0


def _cmd_clean(args: argparse.Namespace) -> int:
    from .config import ConfigError, _default_working_directory, load_config, parse_config
    from .services import create_service

    exp_dir = _experiment_dir(args.target, _default_working_directory())
    if exp_dir is None:
        print(f"trialkeeper: no experiment {args.target!r}: neither a directory holding one nor a known experiment id", file=sys.stderr)
        return 1
    store = _open(exp_dir)
    try:
        exp = store.experiment()
        bound = store.meta("bound_address") or ""
    finally:
        store.close()
    if exp is None:
        print(f"trialkeeper: {exp_dir} holds no experiment", file=sys.stderr)
        return 1
    try:
        config = load_config(args.config) if args.config else parse_config(json.loads(exp["config_json"]), exp_dir)
    except ConfigError as e:
        print(f"trialkeeper: the experiment's config cannot be used ({e}); pass it with --config", file=sys.stderr)
        return 2
    alive = _coordinator_alive(bound, exp_dir) if bound else ""
    if alive:
        print(
            f"trialkeeper: refusing to clean experiment {exp['id']}: {alive}; stop it first (its environments "
            "are its to stop), or clean after it has exited",
            file=sys.stderr,
        )
        return 1

    async def sweep() -> list[str]:
        service = create_service(config, exp_dir)
        try:
            return await asyncio.wait_for(service.sweep(exp["id"], keep=()), SWEEP_TIMEOUT_S)
        finally:
            await service.close()

    try:
        removed = asyncio.run(sweep())
    except (ValueError, OSError, asyncio.TimeoutError) as e:
        print(f"trialkeeper: cannot clean experiment {exp['id']}: {e}", file=sys.stderr)
        return 1
    platform = config.training_service.platform
    if removed:
        print(f"experiment {exp['id']}: removed {len(removed)} environment(s) from {platform}: {', '.join(removed)}")
    else:
        print(f"experiment {exp['id']}: nothing left to remove on {platform}")
    return 0


def _experiment_dir(target: str, working_directory: Path) -> Path | None:
    """The directory of an experiment named by its directory or by its id."""
    for candidate in (Path(target).expanduser(), working_directory / target):
        if (candidate / Store.FILENAME).is_file():
            return candidate.resolve()
    return None


def _coordinator_alive(bound_address: str, exp_dir: Path) -> str:
    """Why a coordinator of this experiment seems alive, or "" when none answers.

    The probe presents the experiment's token with a Register of a protocol no coordinator
    speaks: this experiment's coordinator refuses it as a version mismatch (so it is alive,
    and it joins no environment), another one as a wrong token. A listener that is no
    plain gRPC coordinator (one serving TLS) counts as alive: cleaning under a live
    coordinator would be worse than not cleaning."""
    import socket

    from .server import probe_coordinator

    host, _, port = bound_address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]"):
        host = "127.0.0.1"
    address = f"{host}:{port}"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except (OSError, ValueError):
        return ""
    try:
        token = (exp_dir / ".token").read_text().strip()
    except OSError:
        token = ""
    answer = probe_coordinator(address, token, PROBE_TIMEOUT_S)
    if answer == "other":
        return ""  # another experiment's coordinator took the port
    if answer == "ours":
        return f"its coordinator answers on {address}"
    return f"something listens on {address}, where its coordinator did"


# ---- reading an experiment ---------------------------------------------------------------


def _open(exp_dir: Path) -> Store:
    return Store.in_dir(exp_dir, readonly=True)


def _trial_rows(store: Store) -> list[dict[str, Any]]:
    out = []
    for r in store.trials():
        out.append(
            {
                "id": r["id"],
                "sequence_id": r["seq"],
                "status": r["status"],
                "parameters": json.loads(r["parameters_json"]),
                "final_metric": r["final_metric"],
                "final_metric_value": json.loads(r["final_metric_json"]) if r["final_metric_json"] else None,
                "environment_id": r["environment_id"],
                "gpu_indices": json.loads(r["gpu_indices_json"]),
                "exit_code": r["exit_code"],
                "signal": r["signal"],
                "reason": r["reason"],
                "attempts": r["attempts"],
                "submitted_at": r["submitted_at"],
                "started_at": r["started_at"],
                "ended_at": r["ended_at"],
            }
        )
    return out


def _cmd_trials(args: argparse.Namespace) -> int:
    store = _open(args.experiment_dir)
    rows = _trial_rows(store)
    if args.status:
        rows = [r for r in rows if r["status"] == args.status.upper()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table()
    for col in ("trial", "seq", "status", "env", "final metric", "duration", "parameters", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        dur = f"{r['ended_at'] - r['started_at']:.1f} s" if r["started_at"] and r["ended_at"] else ""
        metric = f"{r['final_metric']:.6g}" if r["final_metric"] is not None else ""
        status = r["status"] + (" (stopping)" if r["status"] not in _TERMINAL and r["reason"].startswith("stopping:") else "")
        table.add_row(r["id"], str(r["sequence_id"]), status, r["environment_id"] or "", metric, dur, json.dumps(r["parameters"]), r["reason"])
    _console().print(table)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    store = _open(args.experiment_dir)
    exp = store.experiment()
    if exp is None:
        print(f"trialkeeper: no experiment in {args.experiment_dir}", file=sys.stderr)
        return 1
    rows = _trial_rows(store)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    config = json.loads(exp["config_json"])
    mode = (config.get("tuner") or {}).get("classArgs", {}).get("optimize_mode", "maximize")
    scored = [r for r in rows if r["final_metric"] is not None]
    best = (max if mode != "minimize" else min)(scored, key=lambda r: r["final_metric"]) if scored else None
    info = {
        "id": exp["id"],
        "name": exp["name"],
        "status": exp["status"],
        "reason": exp["reason"],
        "coordinator": exp["coordinator_address"],
        "trials": counts,
        "metrics": store.metric_count(),
        "best": {"id": best["id"], "final_metric": best["final_metric"], "parameters": best["parameters"]} if best else None,
        "environments": len(store.envs()),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"experiment {info['id']} ({info['name'] or 'unnamed'}): {info['status']}{' - ' + info['reason'] if info['reason'] else ''}")
    print("trials: " + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"))
    print(f"metrics stored: {info['metrics']}; environments: {info['environments']}")
    if best:
        print(f"best trial: {best['id']} final metric {best['final_metric']:.6g} parameters {json.dumps(best['parameters'])}")
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _env_gpus(store: Store, env_id: str, info: dict[str, Any], trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each GPU of an environment with its newest sample and the trials holding it."""
    latest = store.latest_gpu_samples(env_id)
    holding: dict[int, list[str]] = {}
    for t in trials:
        if t["environment_id"] == env_id and t["status"] not in _TERMINAL:
            for i in t["gpu_indices"]:
                holding.setdefault(i, []).append(t["id"])
    gpus = []
    for g in info.get("gpus", []):
        sample = latest.get(g["uuid"])
        gpus.append({
            **g,
            "utilization_percent": sample.utilization if sample else None,
            "memory_used_bytes": sample.memory_used_bytes if sample else None,
            "sampled_at": sample.at if sample else None,
            "held_by": holding.get(g["index"], []),
        })
    return gpus


def _gpu_line(g: dict[str, Any]) -> str:
    label = f"{g['index']}: {g['name']}"
    if g.get("mig"):
        label += " (MIG)"
    if g.get("simulated"):
        label += " (simulated)"
    if g["utilization_percent"] is not None:
        label += f" {g['utilization_percent']:.0f}% {_gib(g['memory_used_bytes'])}/{_gib(g['memory_total_bytes'])} GiB"
    else:
        label += f" {_gib(g['memory_total_bytes'])} GiB"
    if g["held_by"]:
        label += " held by " + ", ".join(g["held_by"])
    return label


def _cmd_envs(args: argparse.Namespace) -> int:
    store = _open(args.experiment_dir)
    envs = store.envs()
    trials = _trial_rows(store)
    rows = []
    for e in envs:
        info = json.loads(e["info_json"] or "{}")
        holding = [t["id"] for t in trials if t["environment_id"] == e["id"] and t["status"] not in _TERMINAL]
        rows.append({
            "id": e["id"], "platform": e["platform"], "status": e["status"], "reason": e["reason"],
            "platform_id": e["platform_id"], "hostname": e["hostname"],
            "gpus": _env_gpus(store, e["id"], info, trials),
            "gpu_unavailable_reason": info.get("gpu_unavailable_reason", ""), "running_trials": holding,
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table()
    for col in ("env", "platform", "status", "host", "job", "gpus", "trials", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        gpus = "\n".join(_gpu_line(g) for g in r["gpus"]) or ("no GPUs: " + r["gpu_unavailable_reason"] if r["gpu_unavailable_reason"] else "none")
        table.add_row(r["id"], r["platform"], r["status"], r["hostname"], r["platform_id"], gpus, " ".join(r["running_trials"]), r["reason"])
    _console().print(table)
    return 0


def _cmd_trial(args: argparse.Namespace) -> int:
    store = _open(args.experiment_dir)
    row = next((r for r in _trial_rows(store) if r["id"] == args.trial_id), None)
    if row is None:
        return _no_trial(store, args)
    metrics = store.metrics(args.trial_id)
    samples = store.gpu_samples(trial_id=args.trial_id)
    gpu: dict[str, Any] = {"samples": len(samples)}
    if samples:
        gpu.update(
            mean_utilization_percent=sum(s.utilization for s in samples) / len(samples),
            max_utilization_percent=max(s.utilization for s in samples),
            peak_memory_used_bytes=max(s.memory_used_bytes for s in samples),
            gpus=sorted({s.uuid for s in samples}),
        )
    trial_dir = args.experiment_dir / "trials" / args.trial_id
    detail = {
        **row,
        "intermediate": [m.value for m in metrics if m.kind == "intermediate"],
        "gpu_usage": gpu,
        "history": [
            {"at": ev["at"], "from": ev["old"], "to": ev["new"], "reason": ev["reason"]} for ev in store.events(args.trial_id)
        ],
        "stdout": str(trial_dir / "stdout.log"),
        "stderr": str(trial_dir / "stderr.log"),
    }
    if args.json:
        print(json.dumps(detail, indent=2))
        return 0
    print(f"trial {row['id']} (#{row['sequence_id']}): {row['status']}{' - ' + row['reason'] if row['reason'] else ''}")
    print(f"parameters: {json.dumps(row['parameters'])}")
    where = row["environment_id"] or "not placed"
    if row["gpu_indices"]:
        where += f", GPUs {','.join(str(i) for i in row['gpu_indices'])}"
    print(f"environment: {where}; attempts: {row['attempts']}")
    if row["exit_code"] is not None or row["signal"]:
        print(f"exit code: {row['exit_code']}; signal: {row['signal'] or 'none'}")
    inter = detail["intermediate"]
    if inter:
        shown = ", ".join(f"{v:.6g}" for v in inter[:10]) + (f", ... ({len(inter)} in all)" if len(inter) > 10 else "")
        print(f"intermediate: {shown}")
    if row["final_metric"] is not None:
        print(f"final: {row['final_metric']:.6g}")
    if samples:
        print(
            f"GPU usage ({gpu['samples']} samples): mean {gpu['mean_utilization_percent']:.0f}%, "
            f"max {gpu['max_utilization_percent']:.0f}%, peak memory {_gib(gpu['peak_memory_used_bytes'])} GiB"
        )
    for ev in detail["history"]:
        print(f"  {time.strftime('%H:%M:%S', time.localtime(ev['at']))} {ev['from'] or '-'} -> {ev['to']}: {ev['reason']}")
    print(f"logs: {detail['stdout']}, {detail['stderr']}")
    return 0


def _no_trial(store: Store, args: argparse.Namespace) -> int:
    known = [r["id"] for r in store.trials()][:20]
    print(f"trialkeeper: no trial {args.trial_id!r} in {args.experiment_dir}; trials: {' '.join(known) or 'none'}", file=sys.stderr)
    return 1


def _cmd_logs(args: argparse.Namespace) -> int:
    store = _open(args.experiment_dir)
    if store.trial(args.trial_id) is None:
        known = [r["id"] for r in store.trials()][:20]
        print(f"trialkeeper: no trial {args.trial_id!r} in {args.experiment_dir}; trials: {' '.join(known) or 'none'}", file=sys.stderr)
        return 1
    path = args.experiment_dir / "trials" / args.trial_id / ("stderr.log" if args.stderr else "stdout.log")
    offset = 0
    out = sys.stdout.buffer
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        if data:
            out.write(data)
            out.flush()
            offset += len(data)
        if not args.follow:
            return 0
        row = store.trial(args.trial_id)
        if row is not None and row["status"] in _TERMINAL:
            # One last read picks up what was written just before the end.
            args.follow = False
            continue
        time.sleep(0.5)  # polling a file the agent appends to; there is nothing to wait on


if __name__ == "__main__":
    sys.exit(main())
