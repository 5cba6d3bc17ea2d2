"""Dict results (NNI's ``{"default": 0.9, "loss": 0.2}``): every key stored is shown, in
`trialkeeper trial` (text and --json) and in the dashboard's trial view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.engine.rows import MetricRow
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.store.store import Store
from trialkeeper.coordinator.ui import views

FINAL = {"default": 0.93, "loss": 0.21, "note": "best so far"}


def _result(i: int) -> dict[str, float]:
    return {"default": 0.5 + i / 10, "loss": 1.0 - i / 10}


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    store = Store.in_dir(tmp_path / "exp")
    store.create_experiment("e1", "dicts", {"trialCommand": "python trial.py"})
    store.insert_trial({
        "id": "t0", "seq": 0, "status": "SUCCEEDED", "parameters_json": json.dumps({"x": 1}),
        "command": "python trial.py", "gpu_number": 0, "submitted_at": 100.0, "started_at": 100.0,
        "ended_at": 110.0, "final_metric": FINAL["default"], "final_metric_json": json.dumps(FINAL),
    })
    store.insert_trial({
        "id": "t1", "seq": 1, "status": "SUCCEEDED", "parameters_json": json.dumps({"x": 2}),
        "command": "python trial.py", "gpu_number": 0, "submitted_at": 100.0, "final_metric": 0.5,
        "final_metric_json": "0.5",
    })
    rows = [
        MetricRow("t0", i, "intermediate", _result(i)["default"], json.dumps(_result(i)), 101.0 + i)
        for i in range(3)
    ]
    rows.append(MetricRow("t1", 0, "intermediate", 0.25, "0.25", 101.0))
    store.add_metrics(rows)
    store.close()
    return tmp_path / "exp"


def test_trial_json_shows_every_key_of_dict_results(
    exp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["trial", str(exp), "t0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["final_result"] == FINAL
    assert data["intermediate_results"] == [_result(i) for i in range(3)]
    assert data["result_keys"] == ["default", "loss", "note"]
    assert data["intermediate"] == [0.5, 0.6, 0.7]  # the default numbers, as before


def test_trial_json_of_plain_numbers_is_unchanged_in_meaning(
    exp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["trial", str(exp), "t1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    shown = (data["final_result"], data["intermediate_results"], data["result_keys"])
    assert shown == (0.5, [0.25], [])


def test_trial_text_shows_the_keys(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trial", str(exp), "t0"]) == 0
    out = capsys.readouterr().out
    assert '"loss": 0.21' in out and '"note": "best so far"' in out
    assert '"loss": 0.8' in out  # the last intermediate result, whole


def test_the_dashboards_trial_view_has_every_key(exp: Path) -> None:
    with ReadModel.open(exp) as model:
        t0 = views.trial(model, "t0")
        t1 = views.trial(model, "t1")
    assert t0["final_result"] == FINAL and t0["result_keys"] == ["default", "loss", "note"]
    assert t0["intermediate_results"] == [[i, _result(i)] for i in range(3)]
    assert (t1["result_keys"], t1["intermediate_results"], t1["final_result"]) == ([], [], 0.5)


def test_the_dashboard_script_draws_each_key() -> None:
    script = (Path(views.__file__).parent / "static" / "app.js").read_text()
    assert "resultRows(d.final_result)" in script
    assert "series: resultCurves(d)" in script
