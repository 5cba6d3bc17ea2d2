"""A training loop that checkpoints: scikit-learn's SGDClassifier trained epoch by epoch with
partial_fit on the digits dataset, reporting validation accuracy after each epoch.

Each epoch ends with the model and the epoch number saved in TRIALKEEPER_CHECKPOINT_DIR and
trial.save_checkpoint(epoch). Continued (after its environment was lost, after a pause, or
when the experiment is resumed), the trial loads them and goes on from the next epoch: no
epoch is trained twice, and its curve has each epoch once.

EPOCH_SECONDS (environment) makes each epoch last at least that long, so that there is time
to pull the plug on it; EPOCH_LOG names a file each computed epoch is appended to.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

from sklearn.datasets import load_digits
from sklearn.linear_model import SGDClassifier
from sklearn.model_selection import train_test_split
from trialkeeper.agent import trial

params = trial.get_next_parameter()
epochs = int(params.get("epochs", 20))
checkpoints = Path(trial.get_checkpoint_dir())
state_file = checkpoints / "state.pkl"

X, y = load_digits(return_X_y=True)
X_train, X_val, y_train, y_val = train_test_split(X / 16.0, y, test_size=0.25, random_state=0)

if trial.checkpoint_step() is not None:
    with open(state_file, "rb") as f:
        model, done = pickle.load(f)
else:
    model = SGDClassifier(alpha=float(params.get("alpha", 1e-4)), learning_rate="constant",
                          eta0=float(params.get("eta0", 0.05)), random_state=0)
    done = 0
accuracy = float(model.score(X_val, y_val)) if done else 0.0

for epoch in range(done + 1, epochs + 1):
    started = time.monotonic()
    model.partial_fit(X_train, y_train, classes=list(range(10)))
    accuracy = float(model.score(X_val, y_val))
    pause = float(os.environ.get("EPOCH_SECONDS", "0")) - (time.monotonic() - started)
    if pause > 0:
        time.sleep(pause)
    if os.environ.get("EPOCH_LOG"):
        with open(os.environ["EPOCH_LOG"], "a") as log:
            log.write(f"{trial.get_trial_id()} {epoch}\n")
    trial.report_intermediate_result(accuracy)
    with open(state_file, "wb") as f:
        pickle.dump((model, epoch), f)
    trial.save_checkpoint(epoch)

trial.report_final_result(accuracy)
