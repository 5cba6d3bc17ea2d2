"""``trialkeeper tensorboard``: a TensorBoard log directory over the trials' output directories.

One run per trial, named by its id and parameters (as ``nnictl tensorboard`` names them), a
symbolic link to the directory the trial wrote in. Trials that ran where their output did not
come back to this machine (a cluster's shared storage, a remote host) are listed with where
their output is, instead of a link that would lead nowhere.

Beside them, ``stored/<run>``: the results each trial reported, read from the store and
written as TensorBoard scalars (``intermediate``, ``final``, and ``intermediate/KEY`` and
``final/KEY`` for each key of dict results), so the board shows every trial's curve even
where no trial wrote an event file. A trial's file is written once its results are all in
(again only while it still reports)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..read.model import ReadModel, TrialSnapshot
from ..read.results import reported
from ..store.index import no_experiment
from ..store.reads import holds_experiment
from . import tfevents

log = logging.getLogger(__name__)

INSTALL = "pip install tensorboard"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")
NAME_LIMIT = 120  # characters of a run's name (file systems allow 255 bytes)
STORED = "stored"  # the runs of the stored results, under the log directory
WRITTEN = ".written.json"  # in STORED: how many results of each trial its file holds


class TensorboardError(RuntimeError):
    pass


@dataclass
class LogdirPlan:
    logdir: Path
    runs: dict[str, Path] = field(default_factory=dict)  # run name -> the trial's output directory
    elsewhere: dict[str, str] = field(default_factory=dict)  # trial id -> where its output is
    notes: list[str] = field(default_factory=list)
    with_events: list[str] = field(default_factory=list)  # trials whose output holds event files
    stored: dict[str, int] = field(default_factory=dict)  # run name -> results written as scalars


def run_name(t: TrialSnapshot) -> str:
    """``ID_name=value,...``: the trial's id, then its parameters, safe as a file name."""
    params = t.parameters or {}
    text = ",".join(f"{k}={_short(v)}" for k, v in sorted(params.items()))
    name = _UNSAFE.sub("_", f"{t.id}_{text}" if text else t.id).strip("_.") or t.id
    return name[:NAME_LIMIT]


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (str, int, bool)) or value is None:
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _remote_location(platform: str, hostname: str, config: dict[str, Any] | None, trial_id: str) -> str:
    """Where a trial that ran on another machine wrote its output, as best the store says."""
    for key in ("sharedStorage", "storage"):
        storage = (config or {}).get(key)
        if isinstance(storage, dict):
            where = storage.get("localMountPoint") or storage.get("remoteMountPoint")
            if where:
                return (f"on the shared storage ({key}), mounted at {where} on the machines, in the agent's working "
                        f"directory under trials/{trial_id}/output; mount it here and link that directory")
    host = f" on host {hostname}" if hostname else ""
    return (
        f"in the {platform} environment's working directory{host}, under trials/{trial_id}/output; copy it here "
        "(for example with rsync or scp, or kubectl cp for a pod) and run tensorboard --logdir over the copy"
    )


def build_logdir(experiment_dir: Path, trial_ids: list[str], logdir: Path | None = None) -> LogdirPlan:
    """Make (or refresh) the log directory; returns what it holds and what it could not."""
    if not holds_experiment(experiment_dir):
        raise TensorboardError(no_experiment(experiment_dir))
    with ReadModel.open(experiment_dir) as model:
        trials = [model.trial(t) for t in trial_ids] if trial_ids else list(model.trials())
        missing = [tid for tid, t in zip(trial_ids, trials) if t is None]
        if missing:
            raise TensorboardError(f"no trial {', '.join(missing)} in {experiment_dir}")
        envs = {e.id: e for e in model.environments()}
        config = model.stored_config()
        plan = LogdirPlan(logdir=(logdir or experiment_dir / "tensorboard").absolute())
        plan.logdir.mkdir(parents=True, exist_ok=True)
        write_stored(model, [t for t in trials if t is not None], plan)
    for t in trials:
        assert t is not None
        env = envs.get(t.environment_id or "")
        output = (experiment_dir / "trials" / t.id / "output").absolute()
        # The local platform's agents work in the experiment directory itself; other
        # platforms' trials wrote where they ran, and only their logs came back.
        if env is not None and env.platform != "local" and not output.is_dir():
            plan.elsewhere[t.id] = _remote_location(env.platform, env.hostname, config, t.id)
            continue
        if not output.is_dir():
            plan.notes.append(f"trial {t.id}: no output directory yet ({output})")
            continue
        if wrote_events(output):
            plan.with_events.append(t.id)
        name = run_name(t)
        link = plan.logdir / name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and Path(os.readlink(link)) == output:
                plan.runs[name] = output
                continue
            if link.is_symlink():
                link.unlink()
            else:
                raise TensorboardError(f"{link} exists and is not a link this command made; pass another --logdir")
        link.symlink_to(output, target_is_directory=True)
        plan.runs[name] = output
    plan.notes.append(f"log directory {plan.logdir}: {len(plan.runs)} run(s)")
    if not plan.with_events:
        plan.notes.append(
            "no trial wrote TensorBoard event files (events.out.tfevents.*) in its output directory "
            "(TRIALKEEPER_OUTPUT_DIR): the board shows the results the trials reported, under stored/"
        )
    written = sum(plan.stored.values())
    plan.notes.append(f"{STORED}/: the results of {len(plan.stored)} trial(s) as scalars ({written} value(s))")
    for tid, where in sorted(plan.elsewhere.items()):
        plan.notes.append(f"trial {tid}: output not on this machine: {where}")
    return plan


def wrote_events(output: Path) -> bool:
    """Whether a trial's output directory holds a TensorBoard event file, at any depth."""
    return any("tfevents" in name for _, _, files in os.walk(output) for name in files)


def scalars(model: ReadModel, trial_id: str) -> list[tuple[str, float, int, float]]:
    """A trial's stored results as scalars: (tag, value, step, wall time) each; a dict result
    gives one per numeric key (``default`` under the bare kind)."""
    out = []
    for m in model.read("metrics", lambda: model.store.metrics(trial_id)):
        result = reported(m.value, m.value_json)
        items = result.items() if isinstance(result, dict) else [("default", result)]
        for key, value in items:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                tag = m.kind if key == "default" else f"{m.kind}/{key}"
                out.append((tag, float(value), m.index, m.reported_at))
    return out


def write_stored(model: ReadModel, trials: list[TrialSnapshot], plan: LogdirPlan) -> None:
    """Each trial's results as an event file of its own run under ``stored/``: written when
    the store holds results the file does not (so an ended trial's, once), the old file gone."""
    root = plan.logdir / STORED
    root.mkdir(exist_ok=True)
    index = root / WRITTEN
    try:
        done = json.loads(index.read_text())
        done = done if isinstance(done, dict) else {}
    except (OSError, ValueError):
        done = {}
    for t in trials:
        name = run_name(t)
        count = model.read("metrics", lambda t=t: model.store.next_metric_index(t.id))
        if count == 0:
            continue
        plan.stored[name] = count
        run = root / name
        if done.get(name) == count and run.is_dir():
            continue
        old = list(run.glob("events.out.tfevents.*.trialkeeper")) if run.is_dir() else []
        new = tfevents.write_scalars(run, scalars(model, t.id))
        for path in old:
            if path != new:
                path.unlink(missing_ok=True)
        done[name] = count
    index.write_text(json.dumps(done))


def launch(plan: LogdirPlan, port: int) -> int:
    """Become TensorBoard on the log directory (so Ctrl-C or a signal stops TensorBoard
    itself, never leaving it behind); or say how to get it and return 1."""
    exe = shutil.which("tensorboard")
    if exe is None:
        print(f"tensorboard is not installed: {INSTALL}, then run: tensorboard --logdir {plan.logdir} --port {port}")
        return 1
    argv = [exe, "--logdir", str(plan.logdir), "--port", str(port)]
    print(f"starting: {' '.join(argv)}", flush=True)
    sys.stderr.flush()
    os.execv(exe, argv)
    return 0  # not reached: execv replaces this process
