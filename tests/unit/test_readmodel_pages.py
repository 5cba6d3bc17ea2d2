"""The read model's paged queries, which a dashboard over 100,000 trials needs: filtered,
searched and sorted in the store, one page at a time."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from trialkeeper.coordinator.read import pages
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.read.pages import PageError
from trialkeeper.coordinator.store.store import GpuSampleRow, MetricRow, Store


def _store(exp_dir: Path, n: int = 50) -> None:
    store = Store.in_dir(exp_dir)
    store.create_experiment("exp1", "pages", {"tuner": {"name": "random", "classArgs": {"optimize_mode": "minimize"}}})
    with store.transaction():
        for seq in range(n):
            status = ("SUCCEEDED", "FAILED", "WAITING", "RUNNING")[seq % 4]
            ended = status in ("SUCCEEDED", "FAILED")
            store.insert_trial({
                "id": f"t{seq:03d}", "seq": seq, "status": status,
                "parameters_json": json.dumps({"lr": (seq * 7) % 13 / 10, "opt": "sgd" if seq % 3 else "adam_x"}),
                "command": "python t.py", "gpu_number": 0, "submitted_at": 1000.0 + seq,
                "started_at": 1000.0 + seq, "ended_at": 1000.0 + 2 * seq + 1 if ended else None,
                "ran_s": seq + 1.0 if ended else 0.0,
                "final_metric": float(100 - seq) if status == "SUCCEEDED" else None,
                "environment_id": "env-a" if seq < 10 else "env-b",
            })
    store.add_metrics([MetricRow("t000", i, "intermediate", i / 2, json.dumps(i / 2), 1.0 + i) for i in range(3)])
    store.add_gpu_samples([GpuSampleRow(5.0, "env-a", "GPU-0", 40.0, 2**30, 2**34, ("t003",))])
    store.close()


def test_a_page_is_filtered_searched_sorted_and_counted(tmp_path: Path) -> None:
    _store(tmp_path)
    with ReadModel.open(tmp_path) as model:
        page = pages.trial_page(model, limit=10)
        assert page.total == 50 and [t.id for t in page.trials] == [f"t{i:03d}" for i in range(10)]
        page = pages.trial_page(model, offset=45, limit=10)
        assert [t.id for t in page.trials] == [f"t{i:03d}" for i in range(45, 50)]

        succeeded = pages.trial_page(model, status="SUCCEEDED", sort="metric", descending=True, limit=1000)
        assert succeeded.total == 13
        metrics = [t.final_metric for t in succeeded.trials]
        assert metrics == sorted(metrics, reverse=True) and metrics[0] == 100.0

        # Trials without a metric come last, whichever the direction.
        ascending = pages.trial_page(model, sort="metric", limit=1000).trials
        assert [t.final_metric for t in ascending[:13]] == sorted(metrics)
        assert all(t.final_metric is None for t in ascending[13:])

        by_lr = pages.trial_page(model, sort="param:lr", limit=1000).trials
        lrs = [t.parameters["lr"] for t in by_lr if t.parameters]
        assert lrs == sorted(lrs) and len(lrs) == 50

        by_duration = pages.trial_page(model, sort="duration", descending=True, limit=3).trials
        assert [t.id for t in by_duration] == ["t049", "t048", "t045"]

        # The search is literal: "_" is no wildcard.
        adam = pages.trial_page(model, search="adam_x", limit=1000)
        assert adam.total == 17 and all(t.parameters and t.parameters["opt"] == "adam_x" for t in adam.trials)
        assert pages.trial_page(model, search="adam%", limit=1000).total == 0
        assert pages.trial_page(model, search="env-a", status="WAITING", limit=1000).total == 2
        on_a = pages.trial_page(model, environment="env-a", limit=1000)
        assert on_a.total == 10 and {t.environment_id for t in on_a.trials} == {"env-a"}
        assert pages.trial_page(model, environment="env-", limit=1000).total == 0  # exact, not a search


def test_bad_sort_keys_and_statuses_are_refused_by_name(tmp_path: Path) -> None:
    _store(tmp_path, n=3)
    with ReadModel.open(tmp_path) as model:
        with pytest.raises(PageError, match="sort: 'seq; DROP TABLE trials' is not one of"):
            pages.trial_page(model, sort="seq; DROP TABLE trials")
        with pytest.raises(PageError, match="status: 'DONE' is not one of"):
            pages.trial_page(model, status="DONE")
        # A parameter name is a value, never SQL.
        assert pages.trial_page(model, sort='param:x") --', limit=5).total == 3
        assert pages.trial_page(model).total == 3


def test_counts_best_outcomes_names_curves_and_gpu_series(tmp_path: Path) -> None:
    _store(tmp_path)
    with ReadModel.open(tmp_path) as model:
        assert model.trial_counts() == {"FAILED": 13, "RUNNING": 12, "SUCCEEDED": 13, "WAITING": 12}
        best = model.best("minimize")
        assert best is not None and best.id == "t048" and best.final_metric == 52.0
        best = model.best("maximize")
        assert best is not None and best.id == "t000"
        exp = model.experiment()
        assert exp is not None and exp.best is not None and exp.best.id == "t048"
        series = pages.ended_series(model, "minimize", points=1000)
        assert [p.ended for p in series] == list(range(1, 27))
        assert [p.at for p in series] == sorted(p.at for p in series)
        # The best so far: the first to end is t000 (metric 100), later ones are lower.
        assert series[0].best == 100.0 and series[-1].best == 52.0
        assert all(a.best >= b.best for a, b in itertools.pairwise(series))  # type: ignore[operator]
        thinned = pages.ended_series(model, "maximize", points=5)
        # Spread over the time trials ended in, each point exactly the full series' at its count.
        full = {p.ended: p for p in pages.ended_series(model, "maximize", points=1000)}
        assert 2 <= len(thinned) <= 5 and thinned[-1].ended == 26 and {p.best for p in thinned} == {100.0}
        assert all(p == full[p.ended] for p in thinned)
        assert pages.parameter_names(model) == ("lr", "opt")
        sample = pages.sample(model, 10)
        assert [t.sequence_id for t in sample] == list(range(0, 50, 5))
        assert len(pages.sample(model, 1000)) == 50
        assert pages.curves(model, ["t000", "t001"]) == {"t000": (0.0, 0.5, 1.0), "t001": ()}
        series = pages.gpu_series(model, environment_id="env-a")
        assert [(p.uuid, p.utilization_percent, p.trial_ids) for p in series] == [("GPU-0", 40.0, ("t003",))]
        assert pages.gpu_series(model, trial_id="t003") == series and pages.gpu_series(model, trial_id="t004") == ()
