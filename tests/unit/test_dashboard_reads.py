"""What keeps the dashboard's answers bounded over a large experiment: a page of environments
reads only its environments' trials and samples, from the store's indexes; the comparison is
kept until the trials change; the export is written from the stored rows, as the snapshots
read them, and sent as it is written."""

from __future__ import annotations

import csv
import io
import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import run_async
from trialkeeper.coordinator.read import pages
from trialkeeper.coordinator.read.kept import Kept
from trialkeeper.coordinator.read.model import ReadModel, to_json
from trialkeeper.coordinator.read.results import reported
from trialkeeper.coordinator.store.store import GpuSampleRow, MetricRow, Store
from trialkeeper.coordinator.ui import export, plots, views
from trialkeeper.coordinator.ui.server import build_app


def _trial(store: Store, seq: int, env: str | None, **extra: Any) -> None:
    store.insert_trial({"id": f"t{seq:04d}", "seq": seq, "status": "SUCCEEDED", "parameters_json": "{}", "command": "c",
                        "gpu_number": 0, "submitted_at": float(seq), "environment_id": env, **extra})


def test_a_page_of_environments_holds_its_own_trials_counts_and_gpus(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "envs", {})
    with store.transaction():
        for e in range(25):
            store.insert_env(f"env-{e:02d}", "local", "BUSY")
        for seq in range(250):  # env-k holds the trials k, k + 25, ...: 10 each
            _trial(store, seq, f"env-{seq % 25:02d}")
    for e in range(25):
        gpus = [{"index": 0, "uuid": f"G{e}", "name": "H100"}]
        store.update_env(f"env-{e:02d}", info_json=json.dumps({"gpus": gpus}))
    store.add_gpu_samples([GpuSampleRow(float(k), f"env-{e:02d}", f"G{e}", float(k + e), 2**30, 2**34, ())
                           for k in range(3) for e in range(25)])
    store.close()
    with ReadModel.open(tmp_path) as model:
        page = views.environments(model, {"offset": "10", "limit": "5"})
        assert page["total"] == 25 and page["offset"] == 10 and page["limit"] == 5
        assert [e["id"] for e in page["environments"]] == [f"env-{e}" for e in range(10, 15)]
        first = page["environments"][0]
        assert first["trial_count"] == 10
        assert first["trials"] == [f"t{seq:04d}" for seq in range(10, 250, 25)]  # every one of its 10
        assert first["gpus"][0]["utilization_percent"] == 12.0  # its GPU's latest sample: k = 2, e = 10
        assert views.environments(model)["limit"] == views.ENV_PAGE
        assert views.environments(model, {"offset": "100"})["environments"] == []
        with pytest.raises(ValueError, match="limit: 0 is not between 1 and 1000"):
            views.environments(model, {"limit": "0"})
        with pytest.raises(ValueError, match="offset: 'x' is not a whole number"):
            views.environments(model, {"offset": "x"})
        # The whole read model's environments are unchanged: every trial of each.
        whole = {e.id: e for e in model.environments()}
        assert len(whole) == 25 and len(whole["env-10"].trials) == 10
    # A store an earlier version made has no index by environment: the same page, read otherwise.
    db = sqlite3.connect(tmp_path / Store.FILENAME)
    db.execute("DROP INDEX trials_environment")
    db.commit()
    db.close()
    with ReadModel.open(tmp_path) as model:
        assert views.environments(model, {"offset": "10", "limit": "5"}) == page


def test_a_page_of_environments_is_read_from_the_indexes(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "plans", {})
    store.close()
    db = sqlite3.connect(tmp_path / Store.FILENAME)
    # The statements a page of environments runs, as SQLite plans them: each names its index.
    plans = {
        "SELECT id, environment_id, seq FROM trials WHERE environment_id IN ('a', 'b') ORDER BY environment_id, seq":
            "trials_environment",
        "SELECT environment_id, count(*) FROM trials WHERE environment_id IN ('a', 'b') GROUP BY environment_id":
            "trials_environment",
        "SELECT max(id) FROM gpu_samples WHERE environment_id IN ('a', 'b') GROUP BY environment_id, uuid":
            "gpu_samples_gpu",
    }
    for sql, index in plans.items():
        plan = " ".join(str(r[-1]) for r in db.execute("EXPLAIN QUERY PLAN " + sql))
        assert f"INDEX {index}" in plan, (sql, plan)
    db.close()


def test_answers_are_kept_until_the_trials_change(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "kept", {})
    store.insert_env("env-0", "local", "BUSY")
    _trial(store, 0, "env-0")
    computed: list[int] = []
    kept: Kept[int] = Kept()

    def answer(model: ReadModel) -> int:
        return kept.get(model, "n", lambda: computed.append(1) or len(computed))

    with ReadModel.open(tmp_path) as model:
        assert answer(model) == answer(model) == 1
        # A GPU sample changes the store, not its trials: the answer holds.
        store.add_gpu_samples([GpuSampleRow(1.0, "env-0", "G", 5.0, 1, 2, ())])
        assert answer(model) == 1
        store.add_metrics([MetricRow("t0000", 0, "intermediate", 0.5, "0.5", 1.0)])  # a result
        assert answer(model) == 2
        _trial(store, 1, None)  # a trial submitted
        assert answer(model) == 3
        store.update_trial("t0001", status="RUNNING")  # a status
        assert answer(model) == 4 and answer(model) == 4
        with ReadModel.open(tmp_path) as other:  # another connection: the same trials, the same answer
            assert answer(other) == 4
    assert len(computed) == 4
    # The comparison itself: kept, and read again once a trial was added.
    with ReadModel.open(tmp_path) as model:
        before = plots.compare(model, {})
        assert plots.compare(model, {}) is before
        _trial(store, 2, "env-0", final_metric=0.9)
        after = plots.compare(model, {})
        assert after is not before and len(after["trials"]) == len(before["trials"]) + 1
    store.close()


def test_a_page_sorted_by_a_parameter_is_a_slice_of_an_order_kept_until_the_trials_change(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "sorted", {})
    for seq in range(60):
        _trial(store, seq, None, parameters_json=json.dumps({"lr": (seq * 37) % 60 / 10} if seq % 7 else {}),
               final_metric_json=json.dumps({"loss": -seq}))
    with ReadModel.open(tmp_path) as model:
        def ids(**asked: Any) -> list[str]:
            page = pages.trial_page(model, **asked)
            return [t.id for t in page.trials] + [f"total {page.total}"]

        by_lr = sorted((t for t in model.trials() if t.parameters), key=lambda t: (-t.parameters["lr"], -t.sequence_id))
        without = [t.id for t in sorted(model.trials(), key=lambda t: -t.sequence_id) if not t.parameters]
        expected = [t.id for t in by_lr] + without  # trials without the key last, either way
        assert ids(sort="param:lr", descending=True, limit=1000) == [*expected, "total 60"]
        assert ids(sort="param:lr", descending=True, offset=20, limit=7) == [*expected[20:27], "total 60"]
        assert ids(sort="result:loss", limit=3, search="t005") == ["t0059", "t0058", "t0057", "total 10"]
        _trial(store, 60, None, parameters_json=json.dumps({"lr": 99.0}))  # a new first
        assert ids(sort="param:lr", descending=True, limit=2) == ["t0060", expected[0], "total 61"]
    store.close()


def _odd_store(exp: Path) -> None:
    """Trials with every kind of value a column may hold, and values no snapshot can read."""
    store = Store.in_dir(exp)
    store.create_experiment("odd", "odd", {})
    store.insert_env("e1", "local", "BUSY")
    statuses = ["SUCCEEDED", "FAILED", "RUNNING", "WAITING", "EARLY_STOPPED"]
    for i in range(30):
        parameters = {"lr": i / 7, "flag": bool(i % 2), "name": f'n,{i}"q', "nested": {"a": [1, i]}, "big": 10**20}
        store.insert_trial({
            "id": f"t{i:03d}", "seq": i, "status": statuses[i % 5], "parameters_json": json.dumps(parameters),
            "command": "c", "gpu_number": 0, "environment_id": "e1" if i % 3 else None, "submitted_at": 1000.0 + i,
            "started_at": (1000 + i) if i % 4 else None, "ended_at": 1100.5 + i if i % 2 else None,
            "ran_s": 100.5 if i % 4 and i % 2 else 0.0,  # one attempt, from start to end
            "final_metric": [0.5, 1, None, math.inf, -2.25][i % 5],
            "final_metric_json": json.dumps({"default": i, "loss": -i}) if i % 6 == 0 else None,
        })
    store.add_metrics([
        MetricRow(f"t{i:03d}", k, "intermediate", k * 1.5, json.dumps({"default": k, "x": i}) if i % 4 == 0
                  else json.dumps(k * 1.5), 1.0)
        for i in range(0, 30, 2) for k in range(3)
    ])
    store.close()
    db = sqlite3.connect(exp / Store.FILENAME)
    for column, value, trial in [
        ("parameters_json", "not json", "t005"), ("parameters_json", "[1, 2]", "t006"), ("status", "WEIRD", "t007"),
        ("final_metric", "text", "t008"), ("seq", "x", "t009"), ("started_at", "x", "t010"), ("ended_at", 5, "t010"),
        ("environment_id", "", "t011"), ("final_metric_json", "{bad", "t012"), ("final_metric_json", "[1]", "t013"),
        ("parameters_json", '{"lr": NaN, "flag": null}', "t014"), ("final_metric", 7, "t015"),
    ]:
        db.execute(f"UPDATE trials SET {column} = ? WHERE id = ?", (value, trial))
    db.commit()
    db.close()


PARAMETERS = ("lr", "flag", "name", "nested", "big", "none")
COLUMNS = ["sequence", "id", "status", "metric", "latest", "duration", "started", "ended", "environment", "param:lr",
           "param:flag", "param:name", "param:nested", "param:big", "param:none", "result:default", "result:loss"]


def _as_snapshots_say(model: ReadModel) -> list[dict[str, Any]]:
    """Each trial's columns as its snapshot reads them: what the export must write."""
    def time(at: float | None) -> str | None:
        from datetime import datetime, timezone
        return datetime.fromtimestamp(at, timezone.utc).isoformat() if at is not None else None

    rows = []
    for t in sorted(model.trials(), key=lambda t: (t.sequence_id is None, t.sequence_id or 0)):
        last = model.store.last_metric(t.id, "intermediate")
        result = t.final_metric_value if isinstance(t.final_metric_value, dict) else {}
        metric = t.final_metric
        rows.append({
            "sequence": t.sequence_id, "id": t.id, "status": t.status.value if t.status else None,
            "metric": metric if metric is None or math.isfinite(metric) else str(metric),
            "latest": to_json(reported(last.value, last.value_json)) if last else None,
            "duration": t.ended_at - t.started_at if t.started_at is not None and t.ended_at is not None else None,
            "started": time(t.started_at), "ended": time(t.ended_at), "environment": t.environment_id,
            **{f"param:{k}": to_json((t.parameters or {}).get(k)) for k in PARAMETERS},
            "result:default": to_json(result.get("default")) if result else None,
            "result:loss": to_json(result.get("loss")) if result else None,
        })
    return rows


@pytest.mark.parametrize("chunk", [1, 7, 2000])
def test_the_export_writes_what_the_snapshots_read_from_the_same_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    _odd_store(tmp_path)
    monkeypatch.setattr(export, "CHUNK", chunk)  # a piece a trial, several pieces, or one
    with ReadModel.open(tmp_path) as model:
        expected = _as_snapshots_say(model)
        assert any(model.trial(f"t{i:03d}").unreadable for i in (5, 6, 7, 8, 9, 10, 12))  # the odd rows are odd
        body, kind, name = export.export(model, {"format": "json", "columns": ",".join(COLUMNS)})
        assert (kind, name) == ("application/json", "odd-trials.json")
        written = json.loads(body)
        as_read = {r["id"]: r for r in expected}
        assert [r["id"] for r in written] == [r["id"] for r in expected]
        for row in written:
            assert row == json.loads(json.dumps(as_read[row["id"]])), row["id"]
        body, kind, _ = export.export(model, {"format": "csv", "columns": ",".join(COLUMNS)})
        cells = list(csv.reader(io.StringIO(body.decode())))
        assert cells[0] == COLUMNS and len(cells) == 31
        odd = {r[1]: dict(zip(COLUMNS, r)) for r in cells[1:]}
        assert odd["t005"]["param:lr"] == "" and odd["t007"]["status"] == "" and odd["t008"]["metric"] == ""
        assert odd["t003"]["metric"] == "inf" and odd["t015"]["metric"] == "7.0" and odd["t001"]["param:flag"] == "True"
        assert odd["t000"]["latest"] == '{"default": 2, "x": 0}' and odd["t000"]["param:nested"] == '{"a": [1, 0]}'
        assert odd["t002"]["latest"] == "3.0" and odd["t000"]["result:loss"] == "0" and odd["t013"]["result:loss"] == ""
        none = {"q": "matches no trial", "columns": "id,latest"}
        assert export.export(model, {**none, "format": "json"})[0] == b"[\n]\n"
        assert export.export(model, {**none, "format": "csv"})[0] == b"id,latest\n"


def test_the_export_is_sent_as_it_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _odd_store(tmp_path)
    monkeypatch.setattr(export, "CHUNK", 4)
    with ReadModel.open(tmp_path) as whole:
        expected = export.export(whole, {"format": "csv", "sort": "metric", "order": "desc"})[0]
    app = build_app(tmp_path, token="t0ken", open_reads=True)

    async def body() -> None:
        async with TestClient(TestServer(app)) as client:
            r = await client.get("/api/trials/export?format=csv&sort=metric&order=desc")
            assert r.status == 200 and r.headers["Content-Type"] == "text/csv; charset=utf-8"
            assert r.headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in r.headers
            assert r.headers["Content-Disposition"] == 'attachment; filename="odd-trials.csv"'
            assert r.headers["X-Content-Type-Options"] == "nosniff" and r.headers["Cache-Control"] == "no-store"
            assert await r.read() == expected
            bad = await client.get("/api/trials/export?format=csv&columns=id,secret")
            assert bad.status == 400 and "columns: 'secret' is not one of" in (await bad.json())["error"]
            bad = await client.get("/api/trials/export?sort=nothing")
            assert bad.status == 400 and "sort: 'nothing' is not one of" in (await bad.json())["error"]

    run_async(body())
