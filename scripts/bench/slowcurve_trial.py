# A trial of the multi-fidelity benchmark (mfbench.py): follows slowcurves.py's curve for its
# parameters, sleeping `epoch_s` per epoch, saving a checkpoint after each; continued (after a
# pause, or with new parameters from a population-based exploit), it goes on from the epoch
# its checkpoint holds, along the curve of the parameters it now has. With TRACE, it appends
# a line per epoch there: the clock, the score it reported and what that configuration is
# worth at that epoch without the noise (mfbench's regret). With SAVES "none" it saves no
# checkpoints: for a search that never pauses a trial, as Ray Tune's OptunaSearch + ASHA trial.
#
#     python slowcurve_trial.py SEED EPOCH_S [FAMILY [TRACE [SAVES]]]
import json
import os
import pathlib
import sys
import time

from slowcurves import EPOCHS, FAMILIES, curve
from trialkeeper.agent import trial

seed, epoch_s = int(sys.argv[1]), float(sys.argv[2])
family = sys.argv[3] if len(sys.argv) > 3 else FAMILIES[0]
trace = sys.argv[4] if len(sys.argv) > 4 else None
saves = (sys.argv[5] if len(sys.argv) > 5 else "each") != "none"
p = trial.get_next_parameter()
ckpt = pathlib.Path(trial.get_checkpoint_dir())
start = 0
if trial.checkpoint_step() is not None:
    start = json.loads((ckpt / "state.json").read_text())["epoch"]
values, worth = curve(p, seed, family), curve(p, seed, family, noise=False)
for epoch in range(start, EPOCHS):
    time.sleep(epoch_s)
    trial.report_intermediate_result(values[epoch])
    if trace:  # one short line in one write: trials running side by side never interleave
        line = json.dumps({"t": time.time(), "score": values[epoch], "worth": worth[epoch]}) + "\n"
        fd = os.open(trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    if saves:
        (ckpt / "state.json").write_text(json.dumps({"epoch": epoch + 1}))
        trial.save_checkpoint(epoch + 1)
trial.report_final_result(values[-1])
