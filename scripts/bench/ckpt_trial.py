# The checkpoint benchmark's trial under trialkeeper (scripts/bench/ckptbench.py).
#
# mode "epochs": `epochs` epochs of `epoch_s` (sleep or CPU), noted in the events file; with
#   `ckpt`, its state (and a blob of `blob` bytes) saved after each epoch and read back
#   when continued; without, a continued run starts again from epoch 0.
# mode "save": for each size in `sizes`, `repeats` times: write a file of that size into
#   the checkpoint directory, time save_checkpoint, append {"bytes", "s"} to `out` (and
#   "error" when the save was refused: the next one goes on).
import json
import os
import pathlib
import time

from ckpt_chaos import note, work
from trialkeeper.agent import trial

p = trial.get_next_parameter()
ckpt = pathlib.Path(trial.get_checkpoint_dir())

if p["mode"] == "save":
    piece = os.urandom(1 << 20)
    step = 0
    with open(p["out"], "a") as out:
        for size in p["sizes"]:
            for _ in range(p["repeats"]):
                with open(ckpt / "blob.bin", "wb") as f:
                    for _ in range(size >> 20):
                        f.write(piece)
                    f.write(piece[: size & ((1 << 20) - 1)])
                os.sync()  # the write-back of these bytes is not the save's
                t = time.perf_counter()
                try:
                    trial.save_checkpoint(step)
                    row = {"bytes": size, "s": time.perf_counter() - t}
                except trial.CheckpointError as e:  # counted, and the next save goes on
                    row = {"bytes": size, "s": time.perf_counter() - t, "error": str(e)}
                out.write(json.dumps(row) + "\n")
                out.flush()
                step += 1
    trial.report_final_result(float(step))
else:
    key, events = p["key"], p["events"]
    start = 0
    if p["ckpt"] and trial.checkpoint_step() is not None:
        start = json.loads((ckpt / "state.json").read_text())["epoch"] + 1
    note(events, "run", key, start - 1)
    blob = b"\0" * p.get("blob", 0)
    for epoch in range(start, p["epochs"]):
        note(events, "start", key, epoch)
        work(p["epoch_s"], p["work"])
        note(events, "done", key, epoch)
        trial.report_intermediate_result(float(epoch))
        if p["ckpt"]:
            (ckpt / "state.json").write_text(json.dumps({"epoch": epoch}))
            if blob:
                (ckpt / "blob.bin").write_bytes(blob)
            trial.save_checkpoint(epoch)
    note(events, "end", key, p["epochs"])
    trial.report_final_result(float(p["epochs"]))
