"""A trial's place on the agent's machine: its directory, the files the agent writes into it
(``parameter.json``, NNI's ``parameter.cfg``, notes in ``stderr.log``) and the environment
variables it runs with.

Layout of ``<workdir>/trials/<trial id>/``: ``parameter.json``, ``stdout.log``,
``stderr.log``, ``output/`` and, when the working directory is copied, ``code/``. Its
checkpoint directory lies elsewhere (see :mod:`.checkpoints`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import nnicompat, rendezvous
from . import trial as sdk

if TYPE_CHECKING:
    from .checkpoints import CheckpointRef

# Where a trial's copy of its working directory goes, under its trial directory.
TRIAL_CODE_DIR = "code"


@dataclass(frozen=True)
class TrialSpec:
    trial_id: str
    sequence_id: int
    experiment_id: str
    command: str
    parameters_json: str
    env: dict[str, str] = field(default_factory=dict)
    gpu_indices: tuple[int, ...] = ()
    # CUDA_VISIBLE_DEVICES for them (see gpu.cuda_visible_devices); "" for none.
    visible_devices: str = ""
    working_directory: str = ""
    max_duration_s: float = 0.0
    attempt: int = 0
    first_metric_index: int = 0
    # Continue from this checkpoint (None: a fresh start).
    checkpoint: CheckpointRef | None = None
    # A multi-node trial: this node's rank among ``nodes``, and rank 0's address and port.
    node_rank: int = 0
    nodes: int = 1
    master_addr: str = ""
    master_port: int = 0


def prepare(
    spec: TrialSpec,
    directory: Path,
    base_env: dict[str, str],
    socket_name: str,
    checkpoint_env: dict[str, str] | None = None,
) -> tuple[dict[str, str], str]:
    """Write the trial's parameter files into ``directory``; returns its environment and
    its working directory (the trial directory when the spec names none). ``checkpoint_env``
    names its checkpoint directory (see CheckpointKeeper.open_trial)."""
    (directory / "output").mkdir(parents=True, exist_ok=True)
    param_file = directory / "parameter.json"
    param_file.write_text(spec.parameters_json, encoding="utf-8")
    nnicompat.write_parameter_cfg(directory, spec.sequence_id, spec.parameters_json)
    env = dict(base_env)
    env.update(spec.env)
    cwd = spec.working_directory or str(directory)
    env.update(
        {
            sdk.ENV_TRIAL_ID: spec.trial_id,
            sdk.ENV_SEQUENCE_ID: str(spec.sequence_id),
            sdk.ENV_EXPERIMENT_ID: spec.experiment_id,
            sdk.ENV_PARAMETER_FILE: str(param_file),
            sdk.ENV_OUTPUT_DIR: str(directory / "output"),
            sdk.ENV_SOCKET: socket_name,
            "TRIALKEEPER_TRIAL_DIR": str(directory),
            "CUDA_VISIBLE_DEVICES": spec.visible_devices,
            # NVML numbers GPUs in PCI bus order; make CUDA agree with the indices given.
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
    )
    for name in (sdk.ENV_CHECKPOINT_DIR, sdk.ENV_CHECKPOINT_STEP):
        env.pop(name, None)  # never the agent's own, nor a stale one
    env.update(checkpoint_env or {})
    env.update(
        nnicompat.nni_environment(
            trial_id=spec.trial_id, sequence_id=spec.sequence_id, experiment_id=spec.experiment_id,
            sys_dir=directory, output_dir=directory / "output",
            checkpoint_dir=env.get(sdk.ENV_CHECKPOINT_DIR, ""),
        )
    )
    env.update(rendezvous.environment(
        node_rank=spec.node_rank, nodes=spec.nodes, master_addr=spec.master_addr, master_port=spec.master_port,
    ))
    env.pop(sdk.ENV_STANDALONE, None)
    # Trials find the agent's own Python first (and so the trial SDK), as NNI's
    # pythonPath does, even when the agent was started from an unactivated venv.
    with_agent_python(env)
    return env, cwd


def template_env(base_env: dict[str, str]) -> dict[str, str]:
    """The warm template's environment: the agent's as a trial sees it, PATH included."""
    env = dict(base_env)
    env.pop(sdk.ENV_STANDALONE, None)
    with_agent_python(env)
    return env


def with_agent_python(env: dict[str, str]) -> None:
    bindir = os.path.dirname(sys.executable)
    path = env.get("PATH", os.defpath)
    if bindir and bindir not in path.split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + path


def note(directory: Path, trial_id: str, message: str) -> None:
    """Write a line into the trial's own stderr log, where its author will look."""
    try:
        append_note(directory / "stderr.log", message)
    except OSError:
        print(f"[trialkeeper] trial {trial_id}: {message}", file=sys.stderr)


def append_note(path: Path, message: str) -> None:
    """Append ``[trialkeeper] message`` to a trial's log as a line of its own. The
    coordinator uses it too, for what it refused from an agent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        # A trial's own output may stop mid-line (a progress bar): start the note on a line
        # of its own.
        size = f.seek(0, os.SEEK_END)
        lead = b""
        if size:
            f.seek(size - 1)
            lead = b"" if f.read(1) == b"\n" else b"\n"
        f.write(lead + f"[trialkeeper] {message}\n".encode())


def tail(path: Path, limit: int) -> str:
    """The last ``limit`` bytes of a log as text, from the start of a line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    if size > limit:
        text = text.split("\n", 1)[-1]
    return text
