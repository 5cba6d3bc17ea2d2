"""The experiments home's answers over real stores: the list (newest first, a store that
cannot be read said so, a running experiment whose coordinator is gone said so), and a
comparison's best-so-far curves and samples, with its arguments checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import run_async
from trialkeeper.coordinator.store.store import Store
from trialkeeper.coordinator.ui.home import CRASHED, Listing, build_home, compare, listing

SPACE = {"lr": {"_type": "loguniform", "_value": [1e-4, 1.0]}, "opt": {"_type": "choice", "_value": ["a", "b"]}}


def _experiment(directory: Path, exp_id: str, metrics: list[float | None], *, done: bool = True) -> None:
    store = Store.in_dir(directory)
    store.create_experiment(exp_id, f"name-{exp_id}", {
        "maxTrialNumber": 10, "searchSpace": SPACE,
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "minimize"}},
    })
    for seq, metric in enumerate(metrics):
        store.insert_trial({
            "id": f"{exp_id}-{seq}", "seq": seq, "status": "SUCCEEDED" if metric is not None else "RUNNING",
            "parameters_json": json.dumps({"lr": 10 ** -(seq % 4), "opt": "ab"[seq % 2]}), "command": "c",
            "gpu_number": 0, "submitted_at": 1.0 + seq, "started_at": 1.0 + seq,
            "ended_at": 2.0 + seq if metric is not None else None, "final_metric": metric,
        })
    if done:
        store.set_experiment_status("DONE", ended=True)
    store.close()


def test_the_list_says_status_progress_best_and_what_cannot_be_read(tmp_path: Path) -> None:
    _experiment(tmp_path / "old", "old", [0.5, 0.2, 0.9])
    _experiment(tmp_path / "gone", "gone", [0.4, None], done=False)  # RUNNING in its store, no coordinator
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "trialkeeper.db").write_bytes(b"not a database at all" * 100)
    (tmp_path / "plain").mkdir()
    rows = {r["key"]: r for r in listing(tmp_path)["experiments"]}
    assert set(rows) == {"old", "gone", "broken"}
    old = rows["old"]
    assert (old["status"], old["ended"], old["trial_count"], old["max_trials"]) == ("DONE", 3, 3, 10)
    assert old["best"] == {"id": "old-1", "final_metric": 0.2}  # minimized
    assert rows["gone"]["status"] == "RUNNING" and rows["gone"]["reason"] == CRASHED
    assert (rows["gone"]["ended"], rows["gone"]["trial_count"]) == (1, 2)
    assert rows["broken"]["error"]


def test_a_comparison_gives_each_experiments_best_so_far_and_parameters(tmp_path: Path) -> None:
    _experiment(tmp_path / "a", "a", [0.5, 0.7, 0.2, 0.3])
    _experiment(tmp_path / "b", "b", [0.9, 0.1])
    got = compare(tmp_path, ["a", "b"])["experiments"]
    assert [e["key"] for e in got] == ["a", "b"]
    assert [(n, best) for n, best, _ in got[0]["best_curve"]] == [(1, 0.5), (2, 0.5), (3, 0.2), (4, 0.2)]
    assert [(n, best) for n, best, _ in got[1]["best_curve"]] == [(1, 0.9), (2, 0.1)]
    assert got[0]["space"] == {"lr": "loguniform", "opt": "choice"}
    assert [t["parameters"]["opt"] for t in got[0]["trials"]] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="keys: name 2 to 8 experiments"):
        compare(tmp_path, ["a"])
    with pytest.raises(LookupError, match="no experiment 'zz'"):
        compare(tmp_path, ["a", "zz"])

    async def body() -> None:
        async with TestClient(TestServer(build_home(tmp_path, token="", open_reads=True))) as client:
            assert (await client.get("/api/home/compare?keys=a")).status == 400
            assert (await client.get("/api/home/compare?keys=a,zz")).status == 404
            assert (await client.get("/x/..%2F..%2Fetc/api/experiment")).status == 404
            assert (await (await client.get("/x/b/api/experiment")).json())["trial_count"] == 2

    run_async(body)


def test_beyond_loopback_the_home_and_its_experiments_need_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _experiment(tmp_path / "a", "a", [0.5])
    monkeypatch.setenv("TRIALKEEPER_UI_TOKEN", "h0me-token")  # what a home served beyond loopback takes

    async def body() -> None:
        async with TestClient(TestServer(build_home(tmp_path, token="h0me-token", open_reads=False))) as client:
            assert (await client.get("/")).status == 200  # the pages and their scripts: they ask for it
            assert (await client.get("/static/home.js")).status == 200
            assert (await client.get("/x/a/")).status == 200
            for path in ("/api/home", "/api/home/compare?keys=a,a", "/x/a/api/experiment"):
                assert (await client.get(path)).status == 401, path
            assert (await client.post("/x/a/api/login", json={"token": "wrong"})).status == 403
            assert (await client.post("/x/a/api/login", json={"token": "h0me-token"})).status == 200
            assert (await client.get("/api/home")).status == 200
            assert (await (await client.get("/x/a/api/experiment")).json())["trial_count"] == 1

    run_async(body)


def test_the_list_reads_a_store_again_only_once_it_was_written(tmp_path: Path) -> None:
    _experiment(tmp_path / "a", "a", [0.5])
    _experiment(tmp_path / "b", "b", [0.5])
    lister = Listing(tmp_path)
    assert [r["trial_count"] for r in lister()["experiments"]] == [1, 1]
    unchanged = {r["key"]: r for r in lister()["experiments"]}
    store = Store.in_dir(tmp_path / "a")
    store.insert_trial({"id": "a-9", "seq": 9, "status": "SUCCEEDED", "parameters_json": "{}", "command": "c",
                        "gpu_number": 0, "submitted_at": 9.0, "final_metric": 0.1})
    store.close()
    again = {r["key"]: r for r in lister()["experiments"]}
    assert again["a"]["trial_count"] == 2 and again["a"]["best"] == {"id": "a-9", "final_metric": 0.1}
    assert again["b"] is unchanged["b"], "an experiment whose store was not written is not read again"
    (tmp_path / "a" / "trialkeeper.db").unlink()
    assert [r["key"] for r in lister()["experiments"]] == ["b"]
