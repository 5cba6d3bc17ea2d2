"""The search-quality objective: an MLPClassifier trained epoch by epoch (partial_fit) on
scikit-learn's digits, validation accuracy reported after every epoch.

As a trialkeeper trial: ``python digits_trial.py`` (parameters from the trial SDK). Ray
Tune imports ``train`` and reports through its own callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EPOCHS = 20

# NNI's search-space format; searchbench.py gives Ray Tune the same space.
SPACE: dict[str, Any] = {
    "hidden": {"_type": "quniform", "_value": [16, 256, 16]},
    "alpha": {"_type": "loguniform", "_value": [1e-6, 1e-1]},
    "lr": {"_type": "loguniform", "_value": [1e-5, 1e-1]},
    "batch_size": {"_type": "choice", "_value": [32, 64, 128, 256]},
    "activation": {"_type": "choice", "_value": ["relu", "tanh", "logistic"]},
}


def train(params: dict[str, Any], report: Callable[[int, float], None], epochs: int = EPOCHS) -> float:
    """Trains with ``params``; ``report(epoch, accuracy)`` after each epoch. Returns the last accuracy."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x / 16.0, y, test_size=0.3, random_state=0)
    model = MLPClassifier(
        hidden_layer_sizes=(int(params["hidden"]),), alpha=params["alpha"], learning_rate_init=params["lr"],
        batch_size=int(params["batch_size"]), activation=params["activation"], random_state=0,
    )
    accuracy = 0.0
    for epoch in range(epochs):
        model.partial_fit(x_train, y_train, classes=np.arange(10))
        accuracy = float(model.score(x_val, y_val))
        report(epoch, accuracy)
    return accuracy


def main() -> None:
    from trialkeeper.agent import trial

    params = trial.get_next_parameter()
    final = train(params, lambda _epoch, acc: trial.report_intermediate_result(acc))
    trial.report_final_result(final)


if __name__ == "__main__":
    main()
