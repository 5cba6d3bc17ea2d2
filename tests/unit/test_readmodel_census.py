"""/metrics over a store where ten thousand environments have ended: their GPUs leave no
series, they are counted per status, and the live ones' GPUs are there, ratios labelled."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from trialkeeper.coordinator.engine.rows import GpuSampleRow
from trialkeeper.coordinator.read.census import environment_census, trial_durations
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.store.store import Store
from trialkeeper.coordinator.ui.metrics import metrics_text

ENDED = 10_000


def _store(directory: Path) -> None:
    store = Store.in_dir(directory)
    store.create_experiment("exp1", "census", {"tuner": {"name": "random", "classArgs": {"optimize_mode": "minimize"}}})
    gpus = json.dumps({"gpus": [
        {"index": i, "uuid": f"GPU-{i}", "name": "H100", "memory_total_bytes": 80 * 2**30, "simulated": True}
        for i in range(6)
    ]})
    with store.transaction():
        for e in range(ENDED):
            store.insert_env(f"old-{e}", "local", "STOPPED" if e % 10 else "FAILED")
            store.update_env(f"old-{e}", info_json=gpus)
        for e in ("live-1", "live-2"):
            store.insert_env(e, "local", "BUSY")
            store.update_env(e, info_json=gpus)
    store.add_gpu_samples([
        GpuSampleRow(1.0, env, f"GPU-{i}", 40.0, 2**30, 80 * 2**30, ())
        for env in ("old-1", "old-2", "live-1", "live-2") for i in range(6)
    ])
    with store.transaction():
        for seq, (status, took) in enumerate([("SUCCEEDED", 3.0), ("FAILED", 70.0), ("RUNNING", None)]):
            store.insert_trial({
                "id": f"t{seq}", "seq": seq, "status": status, "parameters_json": "{}", "command": "x",
                "gpu_number": 0, "environment_id": "live-1", "submitted_at": 10.0, "started_at": 10.0,
                "ended_at": 10.0 + took if took is not None else None, "ran_s": took or 0.0,
                "final_metric": 0.25 if status == "SUCCEEDED" else None,
            })
    store.close()


def test_ended_environments_leave_no_series(tmp_path: Path) -> None:
    _store(tmp_path)
    with ReadModel.open(tmp_path) as model:
        census = environment_census(model)
        assert dict(census.counts) == {"STOPPED": ENDED * 9 // 10, "FAILED": ENDED // 10, "BUSY": 2}
        assert [e.id for e in census.alive] == ["live-1", "live-2"]
        assert census.alive[0].running_trials == ("t2",)
        durations = trial_durations(model, (1.0, 5.0, 60.0, 120.0))
        assert (durations.under, durations.count, durations.total_s) == ((0, 1, 1, 2), 2, 73.0)
        text = metrics_text(model, (3, 0.03, 0.01))[0].decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
    gpu = [k for k in samples if k[0].startswith("trialkeeper_gpu_")]
    assert len(gpu) == 2 * 6 * 3  # two live environments, six GPUs, three series each
    assert {dict(k[1])["environment"] for k in gpu} == {"live-1", "live-2"}
    ratios = [v for k, v in samples.items() if k[0] == "trialkeeper_gpu_utilization_ratio"]
    assert ratios == [0.4] * 12 and all(dict(k[1])["simulated"] == "true" for k in gpu)
    assert len(samples) < 150, len(samples)  # bounded by what is alive, not by the 60,000 GPUs ended
    label = (("experiment", "exp1"), ("status", "STOPPED"))
    assert samples[("trialkeeper_environments", label)] == ENDED * 9 // 10
    assert samples[("trialkeeper_best_final_metric", (("experiment", "exp1"), ("optimize_mode", "minimize")))] == 0.25
    assert samples[("trialkeeper_trials_ended_total", (("experiment", "exp1"), ("status", "FAILED")))] == 1
    assert samples[("trialkeeper_scheduling_pass_seconds_count", (("experiment", "exp1"),))] == 3
    # One label name for a status throughout.
    names = {k for key in samples for k, _ in key[1]}
    assert "state" not in names and "status" in names
