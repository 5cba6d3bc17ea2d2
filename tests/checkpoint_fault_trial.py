"""The trial of the checkpoint fault tests (tests/integration/test_checkpoint_faults.py).

Trains for ``epochs`` epochs; each reports its epoch as a result, writes its checkpoint and
saves it as the checkpoint of that epoch. A checkpoint is three files of about 16 MiB whose
bytes follow from the file's name, the step and the run that wrote it, and a small file
named after the run (:func:`files`): a run that saves a step again after an interrupted save
writes other bytes, shorter files and another small file, so what the interrupted save left
cannot pass for its own. Each run appends to ``<out>/<trial>/runs`` its pid, the step it
continued from and the SHA-256 of each file it found in its checkpoint directory (which it
then empties: each save writes the whole state); the runs are numbered from 0 in that order.

At epoch ``hold_at`` of the first run that gets there, it stops where the test wants to
interrupt it and says so in a file of ``<out>/<trial>/``:

- ``hold: "mid-write"``: after the small file, the first big file and half of the second,
  in ``mid-write``; it then waits (for a file that never comes) to be killed;
- ``hold: "ready"``: with every file written and save_checkpoint not called yet, in
  ``ready``; it calls save_checkpoint once ``go`` exists, saying so in ``saving``.

After each save is answered it writes ``saved-<epoch>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import time

BIG = ("a.bin", "b.bin", "c.bin")
FILE_BYTES = 16 << 20
GATE_S = 120.0


def files(step: int, run: int) -> dict[str, bytes]:
    """The files of the checkpoint of ``step`` written by run ``run``, in manifest order."""
    size = FILE_BYTES - run * (1 << 20)
    out = {f"0-run-{run}.txt": f"{step}/{run}".encode()}
    for name in BIG:
        seed = hashlib.sha256(f"{name}@{step}/{run}".encode()).digest()
        out[name] = (seed * (size // len(seed) + 1))[:size]
    return out


def digests(step: int, run: int) -> dict[str, str]:
    """The SHA-256 of each file of :func:`files`, by relative path."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files(step, run).items()}


def found(directory: pathlib.Path) -> dict[str, str]:
    """The SHA-256 of each file under ``directory``, by relative path."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _write_step(directory: pathlib.Path, step: int, run: int, *, partial: bool = False) -> None:
    for i, (name, data) in enumerate(files(step, run).items()):
        if partial and i == 2:
            (directory / name).write_bytes(data[: len(data) // 2])
            return
        (directory / name).write_bytes(data)


def _note(out: pathlib.Path, name: str) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, out / name)


def _wait_for(path: pathlib.Path) -> None:
    deadline = time.monotonic() + GATE_S
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{path} did not appear within {GATE_S:g} s")
        time.sleep(0.02)


def main() -> None:
    from trialkeeper.agent import trial

    p = trial.get_next_parameter()
    out = pathlib.Path(p["out"]) / trial.get_trial_id()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = pathlib.Path(trial.get_checkpoint_dir())
    step = trial.checkpoint_step()
    runs = out / "runs"
    run = len(runs.read_text().splitlines()) if runs.exists() else 0
    with open(runs, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "step": step, "files": found(ckpt)}) + "\n")
    for path in ckpt.iterdir():  # loaded: each save writes the whole state anew
        path.unlink()
    epochs, hold, hold_at = int(p["epochs"]), str(p.get("hold", "")), int(p.get("hold_at", -1))
    for epoch in range(0 if step is None else step + 1, epochs):
        trial.report_intermediate_result(float(epoch))
        if hold and epoch == hold_at and not (out / "held").exists():
            _note(out, "held")
            if hold == "mid-write":
                _write_step(ckpt, epoch, run, partial=True)
                trial.flush()
                _note(out, "mid-write")
                _wait_for(out / "never")
                sys.exit("mid-write: not killed")
            _write_step(ckpt, epoch, run)
            trial.flush()
            _note(out, "ready")
            _wait_for(out / "go")
            _note(out, "saving")
        else:
            _write_step(ckpt, epoch, run)
        trial.save_checkpoint(epoch)
        _note(out, f"saved-{epoch}")
    trial.report_final_result(float(sum(range(epochs))))


if __name__ == "__main__":
    main()
