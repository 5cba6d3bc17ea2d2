"""The dashboard's pure parts: addresses, who may bind where, thinning series, and the JSON
answers built from a real store (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trialkeeper.coordinator.read.model import ReadModel, trial_snapshot
from trialkeeper.coordinator.read.pages import PageError
from trialkeeper.coordinator.store.store import MetricRow, Store
from trialkeeper.coordinator.ui import plots, views
from trialkeeper.coordinator.ui.server import DashboardError, check_bind, is_loopback, parse_address
from trialkeeper.coordinator.ui.tensorboard import run_name

RESULT_LINE = b"""[2026] NNISDK_MEb'{"type": "FINAL", "sequence": 0, "value": "0.5"}'\n"""


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:9000", ("127.0.0.1", 9000)),
    (":9000", ("127.0.0.1", 9000)),
    ("9000", ("127.0.0.1", 9000)),
    ("0.0.0.0", ("0.0.0.0", 8080)),
    ("[::1]:9000", ("::1", 9000)),
    ("localhost:0", ("localhost", 0)),
])
def test_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    ("text", "why"), [("host:http", "is not HOST:PORT"), ("host:70000", "not between 0 and 65535")]
)
def test_bad_addresses_are_named(text: str, why: str) -> None:
    with pytest.raises(DashboardError, match=why):
        parse_address(text)


def test_only_loopback_binds_without_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2") and not is_loopback("example.org")
    check_bind("127.0.0.1", "")
    check_bind("0.0.0.0", "a-token")
    with pytest.raises(DashboardError, match="only with a token"):
        check_bind("0.0.0.0", "")


def test_thin_keeps_the_ends_and_at_most_n() -> None:
    points = list(range(1000))
    thinned = views.thin(points, 10)
    assert len(thinned) == 10 and thinned[0] == 0 and thinned[-1] == 999 and thinned == sorted(thinned)
    assert views.thin(points[:5], 10) == points[:5]


def _store(exp: Path) -> None:
    store = Store.in_dir(exp)
    store.create_experiment(
        "e1",
        "views",
        {
            "maxTrialNumber": 10,
            "tuner": {"name": "random", "classArgs": {"optimize_mode": "minimize"}},
            "trainingService": {"platform": "remote", "machineList": [{"password": "[redacted]"}]},
        },
    )
    for seq, (status, metric) in enumerate(
        [("SUCCEEDED", 0.5), ("SUCCEEDED", 0.2), ("RUNNING", None), ("WAITING", None)]
    ):
        store.insert_trial(
            {
                "id": f"t{seq}",
                "seq": seq,
                "status": status,
                "parameters_json": json.dumps({"a": seq, "b": "x"}),
                "command": "c",
                "gpu_number": 0,
                "submitted_at": 100.0 + seq,
                "started_at": 100.0 + seq,
                "ended_at": 110.0 + seq if metric is not None else None,
                "final_metric": metric,
            }
        )
    store.set_waiting_reasons({"t3": "waiting: 1 trials are running (trialConcurrency)"})
    store.add_metrics([MetricRow("t2", i, "intermediate", float(i), str(float(i)), 1.0) for i in range(5)])
    store.close()
    (exp / "trials" / "t2").mkdir(parents=True)
    # NNI's result lines among the output, the last one still being written.
    (exp / "trials" / "t2" / "stdout.log").write_bytes(
        "héllo\n".encode() + RESULT_LINE + "héllo\n".encode() * 2 + RESULT_LINE[:20]
    )


def test_answers_from_a_store(tmp_path: Path) -> None:
    _store(tmp_path)
    with ReadModel.open(tmp_path) as model:
        exp = model.experiment()
        assert exp is not None and exp.started_at is not None
        o = views.overview(model, now=exp.started_at + 100.0)
        assert o["trials"] == {"RUNNING": 1, "SUCCEEDED": 2, "WAITING": 1} and o["best"]["id"] == "t1"
        assert o["max_trials"] == 10 and o["ended"] == 2 and o["eta_s"] == pytest.approx(100.0 / 2 * 8)
        assert o["elapsed_s"] == pytest.approx(100.0)
        assert [tuple(p) for p in o["finished_over_time"]] == [(110.0, 1), (111.0, 2)]
        assert [v for _, v in o["best_over_time"]] == [0.5, 0.2]
        assert "coordinator_address" not in o

        page = views.trials(model, {"sort": "param:a", "order": "desc", "limit": "2"})
        assert (
            [t["id"] for t in page["trials"]] == ["t3", "t2"]
            and page["total"] == 4
            and page["parameters"] == ["a", "b"]
        )
        with pytest.raises(ValueError, match="limit: 'many' is not a whole number"):
            views.trials(model, {"limit": "many"})
        with pytest.raises(PageError):
            views.trials(model, {"status": "BOGUS"})

        t2 = views.trial(model, "t2")
        assert t2["intermediate"] == [[i, float(i)] for i in range(5)] and "stdout" not in t2
        with pytest.raises(views.NotFound):
            views.trial(model, "nope")

        first = views.log(model, "t2", "stdout", 0)
        assert first["text"] == "héllo\n" * 3 and first["following"] is True
        assert first["next_offset"] == first["size"] - 20  # the unfinished result line is asked for again
        raw = views.log(model, "t2", "stdout", 0, nni_results=True)
        assert raw["text"].count("NNISDK_MEb") == 2 and raw["next_offset"] == raw["size"]
        assert views.log(model, "t2", "stdout", 10**9)["text"] == ""
        assert views.log(model, "t2", "stderr", 0)["text"] == ""  # none written yet
        with pytest.raises(ValueError, match="stream: '../x' is not stdout or stderr"):
            views.log(model, "t2", "../x", 0)

        envs = views.environments(model)
        assert envs["waiting_total"] == 1 and envs["waiting"][0]["reason"].startswith("waiting: ")
        compare = plots.compare(model, {})
        assert compare["optimize_mode"] == "minimize" and compare["sampled"] is False and len(compare["trials"]) == 4
        assert [c["id"] for c in compare["curves"]] == ["t2"]


def test_run_names_carry_id_and_parameters_safely() -> None:
    from trialkeeper.coordinator.read.model import trial_snapshot

    t = trial_snapshot(
        {
            "id": "ab12",
            "status": "SUCCEEDED",
            "parameters_json": json.dumps({"lr": 0.0123456, "opt": "a/b c", "n": [1, 2]}),
        }
    )
    assert run_name(t) == "ab12_lr=0.01235,n=_1,2_,opt=a_b_c"
    assert run_name(trial_snapshot({"id": "zz", "status": "WAITING", "parameters_json": "{}"})) == "zz"


def test_a_paused_trial_and_its_checkpoints(tmp_path: Path) -> None:
    from trialkeeper.coordinator.engine import checkpoints as ck

    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "paused", {})
    for seq, status in enumerate(["PAUSED", "RUNNING"]):
        store.insert_trial({
            "id": f"t{seq}", "seq": seq, "status": status, "parameters_json": "{}", "command": "c",
            "gpu_number": 0, "submitted_at": 100.0 + seq,
        })
    for step, location in ((4, ""), (8, "s3://b/p/e1/t0/8")):
        store.keep(ck.CheckpointRecorded(ck.Checkpoint(
            "t0", step, step, 1000 * step, "sha256:00", (ck.CheckpointFile("m", 1000 * step),), location, 200.0 + step,
        )))
    store.close()
    with ReadModel.open(tmp_path) as model:
        t0 = views.trial(model, "t0")
        assert t0["trial"]["status"] == "PAUSED" and t0["trial"]["checkpoint_step"] == 8
        assert [(c["step"], c["size_bytes"], c["saved_at"], c["where"]) for c in t0["checkpoints"]] == [
            (4, 4000, 204.0, str(tmp_path / "checkpoints" / "t0" / "4")), (8, 8000, 208.0, "s3://b/p/e1/t0/8"),
        ]
        assert views.trial(model, "t1")["checkpoints"] == []
        assert views.overview(model)["trials"] == {"PAUSED": 1, "RUNNING": 1}
        assert [t["id"] for t in views.trials(model, {"status": "PAUSED"})["trials"]] == ["t0"]
        assert views.change_marker(model)["trials"] == {"PAUSED": 1, "RUNNING": 1}


def test_a_log_answers_its_last_lines_and_the_chunk_before_an_offset(tmp_path: Path) -> None:
    _store(tmp_path)
    lines = [f"line {i:06d} é\n".encode() for i in range(100_000)]  # 1.5 MB: more than TAIL_BYTES
    whole = b"".join(lines[:50]) + RESULT_LINE + b"".join(lines[50:])
    (tmp_path / "trials" / "t0").mkdir(parents=True)
    (tmp_path / "trials" / "t0" / "stdout.log").write_bytes(whole)
    with ReadModel.open(tmp_path) as model:
        tail = views.log(model, "t0", "stdout", 0, tail=2000)
        assert tail["text"].splitlines() == [line.decode().rstrip("\n") for line in lines[-2000:]]
        assert tail["next_offset"] == tail["size"] == len(whole) and tail["following"] is False
        assert tail["exact"] is True and whole[tail["offset"]:].decode() == tail["text"]
        # Going back a chunk at a time, from a line's start each, meets the beginning with nothing
        # lost or doubled, and without the result line (stored as a metric).
        parts, before = [tail["text"]], tail["offset"]
        while before > 0:
            part = views.log(model, "t0", "stdout", 0, before=before)
            assert part["next_offset"] == before and part["offset"] < before
            assert part["offset"] == 0 or whole[part["offset"] - 1:part["offset"]] == b"\n"
            parts.insert(0, part["text"])
            before = part["offset"]
        assert "".join(parts) == b"".join(lines).decode()
        around = views.log(model, "t0", "stdout", 0, before=len(b"".join(lines[:51])) + len(RESULT_LINE))
        assert around["offset"] == 0 and around["exact"] is False  # the result line left out

        # Fewer lines than asked for: the whole of it; one line longer than TAIL_BYTES: its end.
        assert views.log(model, "t2", "stdout", 0, tail=2000)["text"] == "héllo\n" * 3
        (tmp_path / "trials" / "t0" / "stderr.log").write_bytes(b"x" * (views.TAIL_BYTES + 10))
        long = views.log(model, "t0", "stderr", 0, tail=10)
        assert long["offset"] == 10 and len(long["text"]) == views.TAIL_BYTES
        with pytest.raises(ValueError, match="not below 0"):
            views.log(model, "t0", "stdout", 0, before=-1)
        with pytest.raises(views.NotFound):
            views.log_path(model, "nope", "stdout")


def test_a_chunk_never_ends_inside_a_character(tmp_path: Path) -> None:
    _store(tmp_path)
    (tmp_path / "trials" / "t0").mkdir(parents=True)
    data = b"a" + "é".encode() * views.LOG_CHUNK  # a chunk boundary falls inside an é
    (tmp_path / "trials" / "t0" / "stdout.log").write_bytes(data)
    with ReadModel.open(tmp_path) as model:
        text, offset = "", 0
        while offset < len(data):
            part = views.log(model, "t0", "stdout", offset)
            text, offset = text + part["text"], part["next_offset"]
        assert text == data.decode() and "\ufffd" not in text


def test_the_environments_answer_reads_each_ones_latest_trials_and_counts_them_all(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "envs", {})
    store.insert_env("env-a", "local", "BUSY")
    store.insert_env("env-b", "local", "STOPPED")
    for seq in range(15):  # the first one on env-a still runs, behind 14 that ended
        store.insert_trial({"id": f"a{seq:02d}", "seq": seq, "status": "RUNNING" if seq == 0 else "SUCCEEDED",
                            "parameters_json": "{}", "command": "c", "gpu_number": 0, "submitted_at": float(seq),
                            "environment_id": "env-a"})
    for seq in (15, 16):
        store.insert_trial({"id": f"b{seq}", "seq": seq, "status": "SUCCEEDED", "parameters_json": "{}",
                            "command": "c", "gpu_number": 0, "submitted_at": float(seq), "environment_id": "env-b"})
    store.insert_trial({"id": "w", "seq": 17, "status": "WAITING", "parameters_json": "{}", "command": "c",
                        "gpu_number": 0, "submitted_at": 17.0})
    store.close()
    with ReadModel.open(tmp_path) as model:
        answer = {e["id"]: e for e in views.environments(model)["environments"]}
        whole = {e.id: e for e in model.environments()}
    a, b = answer["env-a"], answer["env-b"]
    assert a["trial_count"] == 15 and a["trials"] == [f"a{seq:02d}" for seq in range(5, 15)]
    assert a["running_trials"] == ["a00"], "a running trial is listed however many ended after it"
    assert b["trial_count"] == 2 and b["trials"] == ["b15", "b16"] and b["running_trials"] == []
    assert whole["env-a"].trials == tuple(f"a{seq:02d}" for seq in range(15))
    assert whole["env-a"].running_trials == ("a00",)


def test_a_multi_node_trials_ranks_reach_the_dashboard() -> None:
    row = {"id": "t", "seq": 0, "status": "RUNNING", "parameters_json": "{}", "environment_id": "e0",
           "gpu_indices_json": "[0]", "reason": "", "stderr_tail": "", "submitted_at": 1.0, "attempts": 1,
           "nodes": 2, "ranks_json": '[[0, "e0", [0], "running"], [1, "e1", [1], "ended (failed)"]]'}
    data = views.trial_json(trial_snapshot(row))
    assert data["nodes"] == 2
    assert data["ranks"] == [{"rank": 0, "environment_id": "e0", "gpu_indices": [0], "state": "running"},
                             {"rank": 1, "environment_id": "e1", "gpu_indices": [1], "state": "ended (failed)"}]
