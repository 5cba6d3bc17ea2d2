"""``trialkeeper tensorboard``: a TensorBoard log directory over the trials' output directories.

One run per trial, named by its id and parameters (as ``nnictl tensorboard`` names them), a
symbolic link to the directory the trial wrote in. Trials that ran where their output did not
come back to this machine (a cluster's shared storage, a remote host) are listed with where
their output is, instead of a link that would lead nowhere."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..read.model import ReadModel, TrialSnapshot
from ..store.reads import holds_experiment

log = logging.getLogger(__name__)

INSTALL = "pip install tensorboard"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")
NAME_LIMIT = 120  # characters of a run's name (file systems allow 255 bytes)


class TensorboardError(RuntimeError):
    pass


@dataclass
class LogdirPlan:
    logdir: Path
    runs: dict[str, Path] = field(default_factory=dict)  # run name -> the trial's output directory
    elsewhere: dict[str, str] = field(default_factory=dict)  # trial id -> where its output is
    notes: list[str] = field(default_factory=list)


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
        raise TensorboardError(f"no experiment in {experiment_dir}")
    with ReadModel.open(experiment_dir) as model:
        trials = [model.trial(t) for t in trial_ids] if trial_ids else list(model.trials())
        missing = [tid for tid, t in zip(trial_ids, trials) if t is None]
        if missing:
            raise TensorboardError(f"no trial {', '.join(missing)} in {experiment_dir}")
        envs = {e.id: e for e in model.environments()}
        config = model.stored_config()
    plan = LogdirPlan(logdir=(logdir or experiment_dir / "tensorboard").absolute())
    plan.logdir.mkdir(parents=True, exist_ok=True)
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
    for tid, where in sorted(plan.elsewhere.items()):
        plan.notes.append(f"trial {tid}: output not on this machine: {where}")
    return plan


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
