"""The comparison's and the trials table's answers from a real store (no server): axes from
the search space, importance, the final metric's distribution, early-stopped trials, the
Pareto front, the latest intermediate result, dict result keys, and the table's export."""

from __future__ import annotations

import csv
import io
import json
import math
import random
from pathlib import Path

import pytest
from plotdata import two_objectives
from trialkeeper.coordinator.read import analysis
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.read.space import axes, label
from trialkeeper.coordinator.store.store import MetricRow, Store
from trialkeeper.coordinator.ui import export, plots, views

SPACE = {
    "lr": {"_type": "loguniform", "_value": [1e-5, 1.0]},
    "noise": {"_type": "uniform", "_value": [0, 1]},
    "opt": {"_type": "choice", "_value": ["sgd", "adam", "rmsprop"]},
    "layers": {"_type": "randint", "_value": [1, 9]},
    "width": {"_type": "qloguniform", "_value": [16, 1024, 16]},
}


def _experiment(exp: Path, n: int = 200, seed: int = 3) -> None:
    """``n`` trials whose metric depends on lr alone (noise, opt and layers do not matter); one
    early stopped, one running, both with intermediate results; dict final results."""
    rng = random.Random(seed)
    store = Store.in_dir(exp)
    store.create_experiment("ex1", "plots", {
        "searchSpace": SPACE, "tuner": {"name": "random", "classArgs": {"optimize_mode": "minimize"}},
    })
    with store.transaction():
        for seq in range(n):
            p = {"lr": math.exp(rng.uniform(math.log(1e-5), 0)), "noise": rng.random(),
                 "opt": rng.choice(["sgd", "adam", "rmsprop"]), "layers": rng.randint(1, 8),
                 "width": rng.choice([16, 64, 256, 1024])}
            status = "SUCCEEDED"
            metric: float | None = (math.log10(p["lr"]) + 3) ** 2
            if seq == 5:
                status, metric = "EARLY_STOPPED", None
            elif seq == 6:
                status, metric = "RUNNING", None
            store.insert_trial({
                "id": f"t{seq:03d}", "seq": seq, "status": status, "parameters_json": json.dumps(p),
                "command": "c", "gpu_number": 0, "submitted_at": 1000.0 + seq, "started_at": 1000.0 + seq,
                "ended_at": 1010.0 + seq if status != "RUNNING" else None, "final_metric": metric,
                "final_metric_json": json.dumps({"default": metric, "loss": seq / 10}) if metric is not None else None,
            })
    store.add_metrics([MetricRow("t005", i, "intermediate", 9.0 - i, json.dumps(9.0 - i), 1.0) for i in range(4)])
    store.add_metrics([MetricRow("t006", i, "intermediate", float(i), json.dumps({"default": float(i), "acc": i / 4}),
                                 1.0) for i in range(3)])
    store.close()


def test_each_parameter_gets_the_axis_its_search_space_says() -> None:
    seen = {"lr": [1e-4, 0.1], "noise": [0.5], "opt": ["adam", "old"], "layers": [1, 3], "width": [16, 64],
            "extra": ["a", 2], "count": [1, 2, 5]}
    found = {a.name: a for a in axes(SPACE, list(seen), seen)}
    assert found["lr"].kind == "log" and (found["lr"].low, found["lr"].high) == (1e-5, 1.0)
    assert found["width"].kind == "log" and found["width"].source == "qloguniform"
    assert found["noise"].kind == "value" and found["noise"].source == "uniform"
    # The choice's options in their order, then a value the space no longer offers.
    assert found["opt"].kind == "category" and found["opt"].categories == ("sgd", "adam", "rmsprop", "old")
    assert found["layers"].kind == "value" and found["layers"].integer
    # Not in the space: as the values say.
    assert found["extra"].kind == "category" and found["extra"].categories == ("2", "a")
    assert found["extra"].options == (2, "a") and found["opt"].options[-1] == "old"
    assert found["count"].kind == "value" and found["count"].source == "observed" and found["count"].integer
    assert label({"_name": "conv", "k": 3}) == "conv" and label(0.5) == "0.5" and label(True) == "true"
    # A log type whose values are not all positive cannot be drawn on a log axis.
    assert axes({"x": {"_type": "lognormal", "_value": [0, 1]}}, ["x"], {"x": [0.0, 1.0]})[0].kind == "value"


def test_importance_ranks_the_parameter_that_matters_first(tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason="the importance plot needs optuna: pip install -e '.[optuna]'")
    _experiment(tmp_path)
    with ReadModel.open(tmp_path) as model:
        answer = plots.importance(model)
        assert answer["error"] == "" and answer["trials"] == 198 and answer["of"] == 200
        ranked = [name for name, _ in answer["importances"]]
        assert ranked[0] == "lr", answer
        values = dict(answer["importances"])
        assert values["lr"] > 0.5 and all(values[p] < values["lr"] / 3 for p in ("noise", "opt", "layers"))
        assert sum(values.values()) == pytest.approx(1.0)
        assert plots.importance(model) is answer  # cached while the trials are as they were


def test_importance_says_why_there_is_none() -> None:
    pytest.importorskip("optuna", reason="the importance plot needs optuna: pip install -e '.[optuna]'")
    few = analysis.importance([({"x": 1.0}, 1.0)], axes({}, ["x"], {"x": [1.0]}), "maximize")
    assert few.importances == () and "too few" in few.error
    flat = analysis.importance([({"x": 1.0}, float(i)) for i in range(10)], axes({}, ["x"], {"x": [1.0]}), "maximize")
    assert "no parameter takes more than one value" in flat.error


def test_the_comparison_draws_stopped_trials_and_says_what_its_curves_are(tmp_path: Path) -> None:
    _experiment(tmp_path)
    with ReadModel.open(tmp_path) as model:
        c = plots.compare(model, {})
        assert {a["name"]: a["kind"] for a in c["axes"]} == {
            "layers": "value", "lr": "log", "noise": "value", "opt": "category", "width": "log"}
        assert c["curves_title"] == "Intermediate results of the 50 best and the 50 latest trials"
        stopped = next(t for t in c["trials"] if t["id"] == "t005")
        assert stopped["status"] == "EARLY_STOPPED" and stopped["stopped"] and stopped["value"] == 6.0
        running = next(t for t in c["trials"] if t["id"] == "t006")  # not ended: not drawn against the metric yet
        assert not running["stopped"] and running["value"] is None and running["final_metric"] is None
        done = next(t for t in c["trials"] if t["id"] == "t000")
        assert not done["stopped"] and done["value"] == done["final_metric"]
        # The distribution of the final metric: every trial with one, rising to 1.
        xs, ys = zip(*c["edf"])
        assert list(xs) == sorted(xs) and ys[-1] == 1.0 and list(ys) == sorted(ys)

        picked = plots.compare(model, {"ids": "t005,t006,t000"})
        assert picked["curves_title"] == "Intermediate results of the 3 selected trials"
        assert [cv["id"] for cv in picked["curves"]] == ["t005", "t006"]  # t000 reported none
        assert picked["curves"][0]["status"] == "EARLY_STOPPED" and picked["curves"][0]["values"] == [9, 8, 7, 6]
        with pytest.raises(ValueError, match="ids: no trial nope"):
            plots.compare(model, {"ids": "t000,nope"})


def test_the_final_metrics_distribution(tmp_path: Path) -> None:
    def ranks(values: list[float | None], points: int) -> tuple[int, list[tuple[float, int]]]:
        exp = tmp_path / f"e{len(values)}"
        store = Store.in_dir(exp)
        store.create_experiment("x", None, {})
        with store.transaction():
            for seq, v in enumerate(values):
                store.insert_trial({"id": f"t{seq}", "seq": seq, "status": "SUCCEEDED", "parameters_json": "{}",
                                    "command": "c", "gpu_number": 0, "submitted_at": 1.0, "final_metric": v})
        store.close()
        with ReadModel.open(exp) as model:
            return model.store.final_metric_ranks(points)

    assert analysis.edf([], 0) == [] and ranks([None], 10) == (0, [])
    n, ranked = ranks([3.0, 2.0, None, 1.0, 2.0], 10)
    assert n == 4 and analysis.edf(ranked, n) == [(1.0, 0.25), (2.0, 0.75), (3.0, 1.0)]
    n, ranked = ranks([float(i) for i in range(999, -1, -1)], 10)
    thinned = analysis.edf(ranked, n)
    assert n == 1000 and len(thinned) == 11 and thinned[0] == (0.0, 0.001) and thinned[-1] == (999.0, 1.0)
    assert [f for _, f in thinned] == [0.001, *(k / 10 for k in range(1, 11))]


def test_the_pareto_front_of_several_objectives(tmp_path: Path) -> None:
    two_objectives(tmp_path)
    with ReadModel.open(tmp_path) as model:
        p = plots.compare(model, {})["pareto"]
        assert p["objectives"] == ["acc", "lat"] and p["maximize"] == [True, False] and p["trials"] == 5
        front = sorted(q[0] for q in p["points"] if q[3])
        assert front == ["a", "b", "d", "e"]  # c: b has more accuracy at less latency
        assert ["c", 0.7, 3.0, False] in p["points"]
    _experiment(tmp_path / "single", n=10)
    with ReadModel.open(tmp_path / "single") as model:
        assert plots.compare(model, {})["pareto"] is None  # one objective: no front to draw


def test_the_table_shows_the_latest_intermediate_and_every_result_key(tmp_path: Path) -> None:
    _experiment(tmp_path, n=10)
    with ReadModel.open(tmp_path) as model:
        page = views.trials(model, {"status": "RUNNING"})
        assert page["result_keys"] == ["default", "loss"]
        row = page["trials"][0]
        assert row["latest_intermediate"] == {"default": 2.0, "acc": 0.5} and row["latest_index"] == 2
        stopped = views.trials(model, {"status": "EARLY_STOPPED"})["trials"][0]
        assert stopped["latest_intermediate"] == 6.0
        by_loss = views.trials(model, {"sort": "result:loss", "order": "desc", "limit": "3"})
        assert [t["id"] for t in by_loss["trials"]] == ["t009", "t008", "t007"]


def test_the_table_exports_what_it_shows_as_csv_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _experiment(tmp_path, n=10)
    with ReadModel.open(tmp_path) as model:
        query = {"format": "csv", "sort": "metric", "order": "asc", "q": "adam",
                 "columns": "id,status,metric,latest,started,param:opt,result:loss"}
        body, kind, name = export.export(model, query)
        assert kind == "text/csv" and name == "ex1-trials.csv"
        rows = list(csv.reader(io.StringIO(body.decode())))
        assert rows[0] == ["id", "status", "metric", "latest", "started", "param:opt", "result:loss"]
        shown = views.trials(model, {"sort": "metric", "order": "asc", "q": "adam"})["trials"]
        assert [r[0] for r in rows[1:]] == [t["id"] for t in shown] and len(rows) > 2
        for r, t in zip(rows[1:], shown):
            assert r[1] == t["status"] and r[5] == "adam"
            assert r[2] == ("" if t["final_metric"] is None else repr(t["final_metric"]))
            seconds = 1000 + t["sequence_id"]  # started at
            assert r[4] == f"1970-01-01T00:{seconds // 60:02d}:{seconds % 60:02d}+00:00"
        body, kind, _ = export.export(model, {"format": "json", "ids": "t006,t005", "columns": "id,latest,metric"})
        assert kind == "application/json"
        assert json.loads(body) == [
            {"id": "t005", "latest": 6.0, "metric": None},
            {"id": "t006", "latest": {"default": 2.0, "acc": 0.5}, "metric": None},
        ]
        # Written in pieces of a few trials (their latest results looked up a piece at a time): the same file.
        one_by_one = export.export(model, {"format": "csv", "columns": "id,latest"})[0]
        monkeypatch.setattr(export, "CHUNK", 3)
        assert export.export(model, {"format": "csv", "columns": "id,latest"})[0] == one_by_one
        assert b"t005,6.0\n" in one_by_one and b'"{""acc"": 0.5, ""default"": 2.0}"' in one_by_one
        # In submission order, either way, read from the index on it.
        ascending = export.export(model, {"format": "csv", "columns": "id,sequence"})[0].splitlines()
        descending = export.export(model, {"format": "csv", "columns": "id,sequence", "order": "desc"})[0].splitlines()
        assert ascending[1:] == descending[:0:-1] and ascending[1] == b"t000,0" and len(ascending) == 11
        everything = json.loads(export.export(model, {"format": "json"})[0])
        assert len(everything) == 10 and list(everything[0]) == [*export.FIXED, "param:layers", "param:lr",
                                                                 "param:noise", "param:opt", "param:width"]
        with pytest.raises(ValueError, match="columns: 'secret' is not one of"):
            export.export(model, {"columns": "id,secret"})
        with pytest.raises(ValueError, match="format: 'xml' is not csv or json"):
            export.export(model, {"format": "xml"})


def test_event_files_are_tfrecords_with_crc32c() -> None:
    from trialkeeper.coordinator.ui import tfevents

    assert tfevents.crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    framed = tfevents.record(b"abc")
    assert framed[:8] == (3).to_bytes(8, "little") and framed[12:15] == b"abc" and len(framed) == 8 + 4 + 3 + 4


def test_the_last_result_is_read_from_either_table(tmp_path: Path) -> None:
    import sqlite3

    from trialkeeper.coordinator.store import metrics as metricstore

    _experiment(tmp_path, n=10)  # t005: four results in a run of metric_runs, indexes 0-3
    db = sqlite3.connect(tmp_path / "trialkeeper.db")
    with db:  # as a store written before runs keeps them: a row a result
        db.execute("INSERT INTO metrics VALUES ('t005', 4, 'intermediate', 1.5, '1.5', 2.0)")
        db.execute("INSERT INTO metrics VALUES ('t007', 0, 'intermediate', 7.0, '7.0', 2.0)")
        db.execute("INSERT INTO metrics VALUES ('t006', 0, 'intermediate', 9.0, '9.0', 2.0)")  # runs go further
    db.close()
    with ReadModel.open(tmp_path) as model:
        one = {t: model.store.last_metric(t, "intermediate") for t in ("t005", "t006", "t007", "t000")}
        every = model.store.last_metrics("intermediate")
        assert {t: (m.index, m.value) for t, m in every.items()} == {
            t: (m.index, m.value) for t, m in one.items() if m is not None
        } == {"t005": (4, 1.5), "t006": (2, 2.0), "t007": (0, 7.0)}
        assert one["t000"] is None and model.store.last_metric("t005", "final") is None
        # The export reads each trial's latest with its row, from either table as well.
        body = export.export(model, {"format": "json", "ids": "t007,t000,t005,t006", "columns": "id,latest"})[0]
        assert json.loads(body) == [
            {"id": "t000", "latest": None}, {"id": "t005", "latest": 1.5},
            {"id": "t006", "latest": {"default": 2.0, "acc": 0.5}}, {"id": "t007", "latest": 7.0},
        ]
        rows = model.store.trial_values_sorted(["id"], where="1=1", args=[], key="seq", key_args=[], descending=False,
                                               newest="final")
        assert {r[0]: metricstore.newest_of(r[1:-1]) for r in rows}["t005"] is None


def test_the_export_writes_each_time_as_datetime_writes_it() -> None:
    from datetime import datetime, timezone

    rng = random.Random(7)
    times: list[float | None] = [
        None, 0.0, 0.5, 1e-7, 5e-7, 1.5e-6, 0.9999995, 0.9999996, 59.9999996, 86399.9999999, 1e9, 1234567890.1234565,
        1_700_000_000.0, 253402300798.9999996, 253402300799.5, 253402300800.0, -0.5, -86400.25,
    ]
    times += [1_700_000_000 + k + rng.random() for k in range(2000)]  # a dozen a minute, and more
    times += [rng.uniform(0, 2.5e11) for _ in range(2000)] + [rng.randrange(2**40) / 1024 for _ in range(2000)]
    times += [rng.randrange(10**9) + k / 1e6 + 5e-7 for k in range(2000)]  # halfway between two microseconds
    rows = [(t,) for t in times]
    utc = timezone.utc

    def as_datetime_writes(t: float | None) -> str | None:
        try:
            return None if t is None else datetime.fromtimestamp(t, utc).isoformat()
        except (OverflowError, ValueError, OSError) as e:
            return type(e).__name__

    in_range = [r for r in rows if r[0] is None or r[0] < 253402300800.0]
    assert export._times(in_range, 0) == [as_datetime_writes(t) for (t,) in in_range]
    with pytest.raises((OverflowError, ValueError)):  # past year 9999: as datetime says
        export._times([(253402300800.0,)], 0)


def test_the_final_metrics_distribution_follows_the_store(tmp_path: Path) -> None:
    """A final metric written while its trial's status stays as it was (so the counts by
    status stay the same) is in the distribution at the next answer, as is a trial that ends."""
    _experiment(tmp_path)
    writer = Store.in_dir(tmp_path)
    try:
        with ReadModel.open(tmp_path) as model:
            before = plots.compare(model, {})["edf_trials"]
            assert plots.compare(model, {})["edf_trials"] == before
            with writer.transaction():
                writer.update_trial("t006", final_metric=1.5)
            assert plots.compare(model, {})["edf_trials"] == before + 1
            with writer.transaction():
                writer.update_trial("t005", status="SUCCEEDED", final_metric=2.5)
            assert plots.compare(model, {})["edf_trials"] == before + 2
    finally:
        writer.close()
