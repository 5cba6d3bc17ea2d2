"""Stores the dashboard's analysis tests read: an experiment of two objectives."""

from __future__ import annotations

import json
from pathlib import Path

from trialkeeper.coordinator.store.store import Store

# Trial id -> (accuracy, latency): c is dominated by b (more accurate, faster); the others are the front.
TWO_OBJECTIVES = {"a": (0.9, 5.0), "b": (0.8, 2.0), "c": (0.7, 3.0), "d": (0.95, 9.0), "e": (0.6, 1.0)}


def two_objectives(exp: Path) -> None:
    """A finished experiment that maximizes accuracy and minimizes latency (TWO_OBJECTIVES)."""
    store = Store.in_dir(exp)
    store.create_experiment("mo", "pareto", {
        "searchSpace": {"lr": {"_type": "loguniform", "_value": [1e-5, 1.0]}},
        "objectives": {"optimize": {"acc": "maximize", "lat": "minimize"}}, "tuner": {"name": "random"},
    })
    for seq, (tid, (acc, lat)) in enumerate(TWO_OBJECTIVES.items()):
        store.insert_trial({
            "id": tid, "seq": seq, "status": "SUCCEEDED", "parameters_json": json.dumps({"lr": 10.0 ** -seq}),
            "command": "c", "gpu_number": 0, "submitted_at": 1.0, "final_metric": acc,
            "final_metric_json": json.dumps({"default": acc, "acc": acc, "lat": lat}),
        })
    store.set_experiment_status("DONE", ended=True)
    store.close()
