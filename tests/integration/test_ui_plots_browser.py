"""The comparison page, the trials table and the pages' details in a real browser (Debian's
chromium, headless, through chromium-driver), over a stored experiment whose search space
has a log-uniform, a choice, a uniform and a randint parameter, and whose metric depends
on the log-uniform one alone."""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from dashboard import get_json, stored_dashboard
from plotdata import two_objectives
from test_ui_browser import WAIT_S, browser, console_errors, series_points, text  # noqa: F401 - browser: a fixture
from trialkeeper.coordinator.store.store import MetricRow, Store

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium: pip install -e '.[dev]'")
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

SPACE = {
    "lr": {"_type": "loguniform", "_value": [1e-5, 1.0]},
    "opt": {"_type": "choice", "_value": ["sgd", "adam", "rmsprop"]},
    "noise": {"_type": "uniform", "_value": [0, 1]},
    "layers": {"_type": "randint", "_value": [1, 9]},
}
TRIALS = 300
DARK_TITLE = "#EEF1FA"  # ECharts' dark theme's title colour


def _experiment(exp: Path) -> None:
    """A finished experiment: the metric (minimized) is (log10 lr + 3)^2; every tenth trial was
    stopped early after three intermediate results; final results are dicts with a loss."""
    rng = random.Random(11)
    store = Store.in_dir(exp)
    store.create_experiment("plots1", "plots", {
        "searchSpace": SPACE, "maxTrialNumber": TRIALS,
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "minimize"}},
    })
    metrics = []
    with store.transaction():
        for seq in range(TRIALS):
            p = {"lr": math.exp(rng.uniform(math.log(1e-5), 0)), "opt": rng.choice(["sgd", "adam", "rmsprop"]),
                 "noise": rng.random(), "layers": rng.randint(1, 8)}
            value = (math.log10(p["lr"]) + 3) ** 2
            stopped = seq % 10 == 5
            store.insert_trial({
                "id": f"p{seq:04d}", "seq": seq, "status": "EARLY_STOPPED" if stopped else "SUCCEEDED",
                "parameters_json": json.dumps(p), "command": "c", "gpu_number": 0, "environment_id": "env-0",
                "submitted_at": 1_700_000_000.0 + seq, "started_at": 1_700_000_000.0 + seq,
                "ended_at": 1_700_000_030.0 + seq, "final_metric": None if stopped else value,
                "final_metric_json": None if stopped else json.dumps({"default": value, "loss": value / 2}),
            })
            metrics += [MetricRow(f"p{seq:04d}", i, "intermediate", value + 3 - i, json.dumps(value + 3 - i), 1.0)
                        for i in range(3)]
    store.add_metrics(metrics)
    store.insert_env("env-0", "local", "STOPPED")
    store.set_experiment_status("DONE", ended=True)
    store.close()


@contextmanager
def _served(root: Path) -> Iterator[Any]:
    exp = root / "exp"
    _experiment(exp)
    with stored_dashboard(exp) as served:
        yield served


def curve_ids(driver: Any) -> list[str]:
    """The trials whose curves the comparison draws."""
    return list(driver.execute_script(
        "return echarts.getInstanceByDom(document.getElementById('curves-chart')).getOption().series"
        ".filter(Boolean).map(s => s.id);"
    ))


def option(driver: Any, element_id: str, path: str) -> Any:
    """A value of the chart's option in ``element_id``: ``path`` is JavaScript after ``o``."""
    return driver.execute_script(
        "const c = echarts.getInstanceByDom(document.getElementById(arguments[0]));"
        f"const o = c && c.getOption(); try {{ return o ? o{path} : null; }} catch (e) {{ return null; }}", element_id,
    )


def settled(driver: Any) -> None:
    """Wait until the live stream's first change and the refresh it asked for are done (the
    page redraws its table's head then: an element found before would go stale)."""
    wait_until(lambda: "live" in text(driver, "#live") and driver.execute_script("return pending === false;"),
               timeout=WAIT_S, message="the live stream's first change handled")


def slice_of(driver: Any, name: str) -> str:
    return str(driver.execute_script(
        "const e = document.querySelector(`#slice-grid [data-parameter='${arguments[0]}']`);"
        "return e ? e.id : '';", name
    ))


@pytest.mark.slow
def test_the_comparison_respects_the_search_space(tmp_path: Path, browser: Any) -> None:  # noqa: F811
    with _served(tmp_path) as served:
        url = served.url
        browser.get(url + "/#/compare")
        settled(browser)
        wait_until(
            lambda: slice_of(browser, "lr") and option(browser, slice_of(browser, "lr"), ".series[0].data.length"),
            timeout=WAIT_S, message="the parameter charts drawn",
        )
        lr, opt, layers = (slice_of(browser, n) for n in ("lr", "opt", "layers"))
        # A log-uniform parameter on a log axis, a choice on its options in order, a randint on integers.
        assert option(browser, lr, ".xAxis[0].type") == "log"
        assert option(browser, opt, ".xAxis[0].type") == "category"
        assert option(browser, opt, ".xAxis[0].data") == ["sgd", "adam", "rmsprop"]
        assert option(browser, layers, ".xAxis[0].type") == "value"
        assert option(browser, layers, ".xAxis[0].minInterval") == 1
        assert option(browser, "parallel-chart", ".parallelAxis.find(a => a.name === 'lr (log)').type") == "log"
        # Early-stopped trials are drawn, by their last intermediate result, marked.
        assert option(browser, lr, ".series[1].name") == "stopped early"
        assert option(browser, lr, ".series[1].data.length") == TRIALS // 10
        # The log toggle.
        browser.find_element(By.ID, "log-params").click()
        wait_until(lambda: option(browser, lr, ".xAxis[0].type") == "value", timeout=WAIT_S, message="linear lr")
        browser.find_element(By.ID, "log-params").click()
        wait_until(lambda: option(browser, lr, ".xAxis[0].type") == "log", timeout=WAIT_S)

        # Curves: titled with what they are, coloured by status with a legend, or by the metric.
        title = option(browser, "curves-chart", ".title[0].text")
        assert title == "Intermediate results of the 50 best and the 50 latest trials", title
        assert set(option(browser, "curves-chart", ".legend[0].data")) == {"SUCCEEDED", "EARLY_STOPPED"}
        assert option(browser, "curves-chart", ".xAxis[0].minInterval") == 1
        browser.find_element(By.CSS_SELECTOR, "#colour-by option[value=metric]").click()
        wait_until(lambda: text(browser, "#metric-scale").startswith("final metric:"), timeout=WAIT_S)
        assert option(browser, "curves-chart", ".legend[0].show") is False
        browser.find_element(By.CSS_SELECTOR, "#curve-status option[value=EARLY_STOPPED]").click()
        wait_until(lambda: "EARLY_STOPPED only" in option(browser, "curves-chart", ".title[0].text"), timeout=WAIT_S)
        statuses = curve_ids(browser)
        latest = get_json(url + "/api/trials?status=EARLY_STOPPED&sort=sequence&order=desc&limit=50")["trials"]
        assert statuses and set(statuses) <= {t["id"] for t in latest}

        # Importance ranks lr, the parameter that matters, first.
        wait_until(lambda: browser.execute_script(
            "return document.getElementById('importance-chart').dataset.ranked || '';"), timeout=WAIT_S)
        ranked = browser.execute_script("return document.getElementById('importance-chart').dataset.ranked;")
        assert ranked.split(",")[0] == "lr", ranked
        assert "PED-ANOVA" in option(browser, "importance-chart", ".title[0].text")
        # A contour of two parameters, and the final metric's distribution.
        assert series_points(browser, "contour-chart") > 5
        assert option(browser, "contour-chart", ".title[0].text").startswith("Mean metric by layers and lr")
        assert series_points(browser, "edf-chart") > 10
        assert option(browser, "edf-chart", ".yAxis[0].max") == 1
        assert browser.execute_script("return document.getElementById('pareto-chart').hidden;")
        assert console_errors(browser) == []


@pytest.mark.slow
def test_the_trials_table_shows_what_matters_and_exports_it(tmp_path: Path, browser: Any) -> None:  # noqa: F811
    with _served(tmp_path) as served:
        url = served.url
        browser.get(url + "/#/trials?status=EARLY_STOPPED")
        wait_until(lambda: text(browser, "#trial-total") == f"{TRIALS // 10} trials", timeout=WAIT_S)
        settled(browser)
        headers = browser.execute_script(
            "return [...document.querySelectorAll('#vhead [data-sort]')].map(d => d.textContent);"
        )
        assert headers[:9] == ["#", "trial", "status", "metric", "latest intermediate", "duration", "started", "ended",
                               "environment"]
        assert "final loss" in headers and "lr" in headers
        row = text(browser, "#vbody .row[data-id=p0005]")
        assert "EARLY_STOPPED" in row and "@2" in row  # its latest intermediate result, the third

        # The headers sort from the keyboard.
        browser.execute_script("document.querySelector('#vhead [data-sort=sequence]').focus();")
        browser.switch_to.active_element.send_keys(Keys.ENTER)
        wait_until(lambda: browser.execute_script(
            "return document.querySelector('#vhead [data-sort=sequence]').getAttribute('aria-sort');") == "descending",
            timeout=WAIT_S, message="sorted by Enter")
        # The header keeps the focus (drawn again at once, and again as the rows come).
        assert browser.execute_script("return document.activeElement.dataset.sort;") == "sequence"
        wait_until(lambda: text(browser, "#vbody .row:first-child").startswith("295"), timeout=WAIT_S)
        assert browser.execute_script("return document.activeElement.dataset.sort;") == "sequence"

        # Columns chosen: a result key hidden, then the export has just what is shown.
        browser.find_element(By.CSS_SELECTOR, "#column-chooser summary").click()
        browser.find_element(By.CSS_SELECTOR, "#column-list input[data-column='result:loss']").click()
        browser.find_element(By.CSS_SELECTOR, "#column-list input[data-column='param:noise']").click()
        wait_until(lambda: "final loss" not in text(browser, "#vhead"), timeout=WAIT_S)
        href = browser.find_element(By.ID, "export-csv").get_attribute("href")
        body = browser.execute_async_script(
            "const done = arguments[1]; fetch(arguments[0]).then(r => r.text().then(t => done([r.status, t])));", href)
        assert body[0] == 200
        rows = list(csv.reader(io.StringIO(body[1])))
        assert rows[0] == ["sequence", "id", "status", "metric", "latest", "duration", "started", "ended",
                           "environment", "param:layers", "param:lr", "param:opt"]
        stopped = sorted((t for t in get_json(url + "/api/trials?status=EARLY_STOPPED&limit=1000")["trials"]),
                         key=lambda t: -t["sequence_id"])
        assert [r[1] for r in rows[1:]] == [t["id"] for t in stopped]  # the filter and the sort shown
        assert all(r[2] == "EARLY_STOPPED" and r[3] == "" and r[4] for r in rows[1:])
        first = stopped[0]
        assert float(rows[1][4]) == first["latest_intermediate"] and rows[1][11] == first["parameters"]["opt"]
        json_href = browser.find_element(By.ID, "export-json").get_attribute("href")
        exported = browser.execute_async_script(
            "const done = arguments[1]; fetch(arguments[0]).then(r => r.json().then(done));", json_href)
        assert [e["id"] for e in exported] == [r[1] for r in rows[1:]]

        # Pick two trials and compare them.
        for tid in ("p0015", "p0025"):
            browser.execute_script(
                "document.querySelector(`#vbody input[data-select='${arguments[0]}']`).click();", tid
            )
        wait_until(lambda: text(browser, "#compare-selected") == "Compare selected (2)", timeout=WAIT_S)
        # With trials ticked, the export is of those.
        assert text(browser, "#export-csv") == "Export CSV (2 selected)"
        picked = browser.execute_async_script(
            "const done = arguments[1]; fetch(arguments[0]).then(r => r.text().then(done));",
            browser.find_element(By.ID, "export-csv").get_attribute("href"))
        assert [r[1] for r in csv.reader(io.StringIO(picked))][1:] == ["p0025", "p0015"]  # sorted as shown
        browser.find_element(By.ID, "compare-selected").click()
        wait_until(
            lambda: option(browser, "curves-chart", ".title[0].text")
            == "Intermediate results of the 2 selected trials",
            timeout=WAIT_S, message="the selected trials compared",
        )
        assert sorted(curve_ids(browser)) == ["p0015", "p0025"]
        assert console_errors(browser) == []


@pytest.mark.slow
def test_the_pages_details(tmp_path: Path, browser: Any) -> None:  # noqa: F811
    with _served(tmp_path) as served:
        url = served.url
        # No GPU: no empty GPU chart on a trial's page, nor on the environments page.
        browser.get(url + "/#/trial/p0001")
        wait_until(lambda: series_points(browser, "curve-chart") == 3, timeout=WAIT_S)
        assert browser.execute_script("return document.getElementById('gpu-chart').hidden;")
        assert option(browser, "curve-chart", ".xAxis[0].minInterval") == 1
        assert option(browser, "curve-chart", ".xAxis[0].name") == "report"
        browser.get(url + "/#/environments")
        wait_until(lambda: "env-0" in text(browser, "#envs"), timeout=WAIT_S)
        wait_until(lambda: browser.execute_script("return document.body.dataset.drawn === 'environments';"),
                   timeout=WAIT_S)
        assert browser.execute_script("return document.getElementById('gpu-section').hidden;")

        # The overview's time axes start at the experiment's start, and are named.
        browser.get(url + "/")
        wait_until(lambda: series_points(browser, "finished-chart") > 0, timeout=WAIT_S)
        started = get_json(url + "/api/experiment")["started_at"]
        assert option(browser, "finished-chart", ".xAxis[0].min") == started * 1000
        assert option(browser, "finished-chart", ".yAxis[0].name") == "trials ended"

        # An unknown trial: a page that says so.
        browser.get(url + "/#/trial/nope")
        wait_until(lambda: text(browser, "h1") == "No trial nope", timeout=WAIT_S, message="the unknown trial's page")
        assert "See its trials" in text(browser, "main")

        # Dark, where the system asks for it: the page and its charts, at once when the system changes.
        browser.get(url + "/#/compare")
        wait_until(lambda: series_points(browser, "edf-chart") > 0, timeout=WAIT_S)
        light = browser.execute_script("return getComputedStyle(document.body).backgroundColor;")
        assert light == "rgb(247, 248, 250)" and option(browser, "edf-chart", ".title[0].textStyle.color") != DARK_TITLE
        browser.execute_cdp_cmd(
            "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
        )
        wait_until(lambda: option(browser, "edf-chart", ".title[0].textStyle.color") == DARK_TITLE
                   and series_points(browser, "edf-chart") > 0, timeout=WAIT_S, message="the charts drawn dark")
        dark = browser.execute_script("return getComputedStyle(document.body).backgroundColor;")
        assert dark == "rgb(18, 21, 28)"
        # 404s of the unknown trial are the browser's own lines; nothing else.
        assert [e for e in console_errors(browser) if "/api/trials/nope" not in e] == []


@pytest.mark.slow
def test_the_pareto_front_of_two_objectives(tmp_path: Path, browser: Any) -> None:  # noqa: F811
    exp = tmp_path / "exp"
    two_objectives(exp)
    with stored_dashboard(exp) as served:
        browser.get(served.url + "/#/compare")
        wait_until(lambda: browser.execute_script("return document.getElementById('pareto-chart').dataset.front;"),
                   timeout=WAIT_S, message="the Pareto front drawn")
        front = browser.execute_script("return document.getElementById('pareto-chart').dataset.front;")
        assert front.split(",") == ["e", "b", "a", "d"]  # by accuracy; c is dominated by b
        assert option(browser, "pareto-chart", ".title[0].text").startswith("Pareto front of acc (max) and lat (min)")
        assert option(browser, "pareto-chart", ".series[0].data.length") == 1  # c, dominated
        assert console_errors(browser) == []


HOSTILE = '<img src=x class=injected onerror="window.pwned=1">'


@pytest.mark.slow
def test_hostile_names_and_values_stay_text(tmp_path: Path, browser: Any) -> None:  # noqa: F811
    exp = tmp_path / "exp"
    store = Store.in_dir(exp)
    store.create_experiment("hx", HOSTILE, {"searchSpace": {HOSTILE: {"_type": "choice", "_value": [HOSTILE, "b"]}}})
    for seq in range(8):
        store.insert_trial({
            "id": f"h{seq}", "seq": seq, "status": "SUCCEEDED" if seq % 4 else "EARLY_STOPPED",
            "parameters_json": json.dumps({HOSTILE: HOSTILE if seq % 2 else "b", "x": seq}), "command": "c",
            "gpu_number": 0, "submitted_at": 1.0, "started_at": 1.0, "ended_at": 2.0, "final_metric": float(seq),
            "final_metric_json": json.dumps({"default": float(seq), HOSTILE: HOSTILE}),
        })
        store.add_metrics([MetricRow(f"h{seq}", 0, "intermediate", 1.0, json.dumps({"default": 1.0, HOSTILE: 2}), 1.0)])
    store.set_experiment_status("DONE", ended=True)
    store.close()
    with stored_dashboard(exp) as served:
        for page, ready in (("/#/compare", "slice-grid"), ("/#/trials", "vbody")):
            browser.get(served.url + page)
            settled(browser)
            wait_until(lambda ready=ready: browser.execute_script(
                f"return document.getElementById('{ready}').children.length;"), timeout=WAIT_S)
            # The hostile text is shown as text (a header, a column chooser entry, a chart's name) ...
            assert HOSTILE in browser.execute_script("return document.getElementById('main').textContent;") or \
                HOSTILE in json.dumps(browser.execute_script(
                    "return [...document.querySelectorAll('[data-parameter]')].map(e => e.dataset.parameter);"))
            # ... never as an element.
            assert browser.execute_script("return document.querySelectorAll('.injected').length;") == 0
            assert browser.execute_script("return window.pwned === undefined;")
        assert console_errors(browser) == []  # an injected image would have asked for /x
