"""The dashboard in a real browser: Debian's chromium, headless, driven by Selenium through
chromium-driver, against a real running experiment (real agents and trials) and a stored
experiment of 20,000 trials."""

from __future__ import annotations

import fcntl
import os
import pty
import shutil
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until, write_script
from dashboard import (
    gated_config,
    get_json,
    home_dashboard,
    http,
    live_experiment,
    many_trials,
    stored_dashboard,
)
from test_cli import _script
from test_control import TRIAL as CHECKPOINTING_TRIAL

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium: pip install -e '.[dev]'")
from selenium.webdriver.common.by import By

WAIT_S = 60.0
INSTALL = "apt-get install chromium chromium-driver"


def browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    why = f"chromium and chromium-driver are needed for the browser tests ({INSTALL})"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium, driver_path = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def visible(driver: Any, element_id: str) -> bool:
    return bool(driver.execute_script(
        "const e = document.getElementById(arguments[0]); return !!e && e.style.display !== 'none';", element_id,
    ))


def console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def text(driver: Any, css: str) -> str:
    """The text of the first element ``css`` selects ("" when none), read in one step: pages
    redraw their elements, and a reference held across steps would go stale."""
    return str(
        driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : '';", css)
    )


def series_points(driver: Any, element_id: str) -> int:
    """How many points the chart in ``element_id`` draws in its first series (0 before any)."""
    return int(driver.execute_script(
        "const c = echarts.getInstanceByDom(document.getElementById(arguments[0]));"
        "const s = c && c.getOption().series; return s && s.length ? s[0].data.length : 0;", element_id,
    ))


def painted(driver: Any, element_id: str) -> bool:
    """Whether the chart's canvas holds anything but background."""
    return bool(driver.execute_script(
        "const cv = document.querySelector('#' + arguments[0] + ' canvas'); if (!cv) return false;"
        "const d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;"
        "for (let i = 3; i < d.length; i += 4) if (d[i] !== 0) return true; return false;", element_id,
    ))


@pytest.mark.slow
def test_a_running_experiment_in_a_browser(tmp_path: Path, browser: Any) -> None:
    # Its trials save no checkpoint: at the stop they are canceled once pauseGracePeriod has passed.
    with live_experiment(tmp_path, trials=6, concurrency=2, pauseGracePeriod=2) as (served, gates):
        url, token = served.url, served.token
        browser.get(url + "/")
        wait_until(
            lambda: text(browser, "[data-count=RUNNING]") == "2", timeout=WAIT_S, message="2 running on the overview"
        )
        browser.execute_script("window.notReloaded = true;")
        assert text(browser, "#exp-title").startswith("Experiment ")

        # Counts change as a trial finishes, without a reload.
        gates.release(0)
        wait_until(lambda: text(browser, "[data-count=SUCCEEDED]") == "1", timeout=WAIT_S, message="1 succeeded, live")
        assert browser.execute_script("return window.notReloaded === true;")
        wait_until(lambda: series_points(browser, "best-chart") >= 1, timeout=WAIT_S, message="best metric drawn")
        assert "none yet" not in text(browser, "#best")

        # The finished trial's curve, parameters and output.
        first = get_json(url + "/api/trials?sort=sequence&limit=1")["trials"][0]
        browser.get(f"{url}/#/trial/{first['id']}")
        wait_until(lambda: series_points(browser, "curve-chart") == 3, timeout=WAIT_S, message="the curve drawn")
        wait_until(lambda: painted(browser, "curve-chart"), timeout=WAIT_S, message="the curve's canvas painted")
        wait_until(lambda: "trial output for x" in text(browser, "#stdout"), timeout=WAIT_S, message="stdout shown")
        assert "SUCCEEDED" in text(browser, "#trial-status")
        assert text(browser, "#params tr:first-child").split() == ["x", str(first["parameters"]["x"])]

        # Cancel a running trial: nothing happens without the token, it is canceled with it.
        running = get_json(url + "/api/trials?status=RUNNING&sort=sequence&limit=1")["trials"][0]
        browser.get(f"{url}/#/trial/{running['id']}")
        wait_until(lambda: "RUNNING" in text(browser, "#trial-status"), timeout=WAIT_S)
        assert console_errors(browser) == []  # (the log is read and emptied)
        browser.find_element(By.ID, "cancel").click()
        wait_until(lambda: "token" in text(browser, "#toast"), timeout=WAIT_S, message="asked for the token")
        assert get_json(f"{url}/api/trials/{running['id']}")["trial"]["status"] == "RUNNING"
        field = browser.find_element(By.ID, "token")
        field.send_keys("not-the-token\n")
        wait_until(lambda: "wrong token" in text(browser, "#toast"), timeout=WAIT_S, message="a wrong token refused")
        # The browser logs the refusal (403) itself; nothing else may be there.
        assert [e for e in console_errors(browser) if "/api/login" not in e or "403" not in e] == []
        field.send_keys(token + "\n")
        wait_until(lambda: "token accepted" in text(browser, "#toast"), timeout=WAIT_S)
        browser.find_element(By.ID, "cancel").click()
        assert browser.switch_to.alert.text.startswith(f"Cancel trial {running['id']}?")  # asked to confirm first
        browser.switch_to.alert.accept()
        wait_until(
            lambda: "USER_CANCELED" in text(browser, "#trial-status"), timeout=WAIT_S, message="canceled, shown live"
        )

        # Comparison and environments.
        browser.get(url + "/#/compare")
        wait_until(lambda: series_points(browser, "curves-chart") >= 2, timeout=WAIT_S, message="curves compared")
        wait_until(
            lambda: series_points(browser, "parallel-chart") >= 1, timeout=WAIT_S, message="parallel coordinates"
        )
        browser.get(url + "/#/environments")
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#envs tr[data-env]"), timeout=WAIT_S)
        assert "local" in text(browser, "#envs") and "connected" in text(browser, "#envs")
        wait_until(  # one page of environments holds them all
            lambda: text(browser, "#envs-shown") == "1\u2013{0} of {0}".format(
                len(browser.find_elements(By.CSS_SELECTOR, "#envs tr[data-env]"))
            ), timeout=WAIT_S, message="the page of environments says it shows them all",
        )
        assert browser.find_element(By.ID, "envs-prev").get_attribute("disabled")
        assert browser.find_element(By.ID, "envs-next").get_attribute("disabled")

        # An environment's trials, by the link on its row.
        # Read and clicked in one step each: the live table is redrawn under any reference held.
        env_id = browser.execute_script("return document.querySelector('#envs tr[data-env]').dataset.env;")
        on_env = get_json(f"{url}/api/trials?environment={env_id}&limit=1")["total"]
        browser.execute_script(
            "document.querySelector(arguments[0]).click();", f"#envs tr[data-env='{env_id}'] a[href*='environment=']"
        )
        wait_until(
            lambda: text(browser, "#trial-total") == f"{on_env} trials",
            timeout=WAIT_S,
            message="an environment's trials",
        )
        assert env_id in text(browser, "#env-filter")

        # A running trial's output is followed: what it prints next shows up without a reload.
        later = wait_until(
            lambda: (r := get_json(url + "/api/trials?status=RUNNING&sort=sequence&limit=1")["trials"]) and r[0],
            timeout=WAIT_S, message="another trial running",
        )
        browser.get(f"{url}/#/trial/{later['id']}")
        wait_until(
            lambda: "trial output for x" in text(browser, "#stdout"), timeout=WAIT_S, message="its output so far"
        )
        assert "let through" not in text(browser, "#stdout")
        browser.execute_script("window.notReloaded = true;")
        gates.release(later["sequence_id"])
        wait_until(
            lambda: "let through" in text(browser, "#stdout"), timeout=WAIT_S, message="its next output, followed"
        )
        wait_until(lambda: "SUCCEEDED" in text(browser, "#trial-status"), timeout=WAIT_S, message="its end, live")
        assert browser.execute_script("return window.notReloaded === true;")

        for page in ("/", "/#/trials", "/#/compare", "/#/environments"):
            browser.get(url + page)
            assert token not in browser.page_source
        assert console_errors(browser) == []
        # Offline: everything the pages loaded came from the dashboard itself (no CDN).
        loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
        assert f"{url}/static/vendor/echarts.min.js" in loaded and f"{url}/static/app.js" in loaded
        assert [u for u in loaded if not u.startswith(url + "/")] == []

        # Stop the experiment from the overview (the token is still in this tab).
        browser.get(url + "/")
        wait_until(
            lambda: browser.execute_script("return document.getElementById('stop').style.display === '';"),
            timeout=WAIT_S,
        )
        browser.find_element(By.ID, "stop").click()
        browser.switch_to.alert.accept()
        served.proc.wait(WAIT_S)
    assert served.proc.returncode == 1 and "stopped by the user" in "".join(served.lines), "".join(served.lines)


@pytest.mark.slow
def test_pause_and_continue_a_trial_in_a_browser(tmp_path: Path, browser: Any) -> None:
    write_script(tmp_path, "steps.py", CHECKPOINTING_TRIAL)
    command = f"{sys.executable} steps.py"
    with live_experiment(tmp_path, trials=2, concurrency=2, trialCommand=command, pauseGracePeriod=30) as (served, _):
        url, token = served.url, served.token
        running = wait_until(
            lambda: (p := get_json(url + "/api/trials?status=RUNNING&sort=sequence"))["total"] == 2
            and all(t["checkpoint_step"] for t in p["trials"]) and p["trials"],
            timeout=WAIT_S, message="two trials running, each with a checkpoint",
        )
        trial_id = running[0]["id"]
        browser.get(f"{url}/#/trial/{trial_id}")
        wait_until(lambda: "RUNNING" in text(browser, "#trial-status"), timeout=WAIT_S)
        assert visible(browser, "pause") and visible(browser, "cancel") and not visible(browser, "continue")
        browser.find_element(By.ID, "token").send_keys(token + "\n")
        wait_until(lambda: "token accepted" in text(browser, "#toast"), timeout=WAIT_S)

        browser.find_element(By.ID, "pause").click()
        wait_until(lambda: "RUNNING" not in text(browser, "#trial-status"), timeout=WAIT_S, message="its run ended")
        assert "PAUSED" in text(browser, "#trial-status")
        step = get_json(f"{url}/api/trials/{trial_id}")["trial"]["checkpoint_step"]
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, f"#checkpoints tr[data-step='{step}']"),
                   timeout=WAIT_S, message="its checkpoint listed")
        row = text(browser, f"#checkpoints tr[data-step='{step}']")
        assert row.startswith(f"{step}\t{len(str(step))} B\t") and row.endswith(f"checkpoints/{trial_id}/{step}"), row
        assert visible(browser, "continue") and visible(browser, "cancel") and not visible(browser, "pause")
        colour = browser.execute_script(
            "return getComputedStyle(document.querySelector('#trial-status .status')).color;"
        )
        assert colour == "rgb(123, 79, 201)", colour  # PAUSED's own colour

        # The trials table filters on it.
        browser.get(f"{url}/#/trials?status=PAUSED")
        wait_until(lambda: text(browser, "#trial-total") == "1 trial", timeout=WAIT_S, message="the paused one")
        assert trial_id in text(browser, "#vbody")
        options = browser.find_elements(By.CSS_SELECTOR, "#status-filter option")
        assert "PAUSED" in [o.get_attribute("value") for o in options]
        browser.get(url + "/")
        wait_until(lambda: text(browser, "[data-count=PAUSED]") == "1", timeout=WAIT_S, message="counted paused")

        browser.get(f"{url}/#/trial/{trial_id}")
        wait_until(lambda: visible(browser, "continue"), timeout=WAIT_S)
        browser.find_element(By.ID, "continue").click()
        wait_until(lambda: "RUNNING" in text(browser, "#trial-status"), timeout=WAIT_S, message="continued, shown live")
        wait_until(lambda: f"continued from {step}" in text(browser, "#stdout"), timeout=WAIT_S)
        assert console_errors(browser) == []


@pytest.mark.slow
def test_the_trials_table_sorts_and_filters_20000_trials(tmp_path: Path, browser: Any) -> None:
    exp = tmp_path / "exp"
    many_trials(exp, 20_000)
    with stored_dashboard(exp) as served:
        url = served.url
        browser.get(url + "/#/trials")
        wait_until(lambda: text(browser, "#trial-total") == "20000 trials", timeout=WAIT_S)
        # Virtualised: a screenful of rows in the page, not 20,000.
        assert 10 < len(browser.find_elements(By.CSS_SELECTOR, "#vbody .row")) < 100

        def shown(column: int) -> list[str]:
            """The first ten rows' cells of a column, top to bottom (read at once: rows are redrawn)."""
            return list(browser.execute_script(
                "return [...document.querySelectorAll('#vbody .row')]"
                ".sort((a, b) => parseFloat(a.style.top) - parseFloat(b.style.top)).slice(0, 10)"
                ".map(r => r.children[arguments[0]].textContent);", column,
            ))

        metric = browser.find_element(By.CSS_SELECTOR, "#vhead [data-sort=metric]")
        metric.click()
        metric = browser.find_element(By.CSS_SELECTOR, "#vhead [data-sort=metric]")
        metric.click()  # twice: best first
        best = get_json(url + "/api/trials?sort=metric&order=desc&limit=10")["trials"]
        wait_until(lambda: shown(2) == [t["id"] for t in best], timeout=WAIT_S, message="sorted by metric, descending")
        assert (
            browser.execute_script("return document.querySelector('#vhead [data-sort=metric]').className;")
            == "sorted desc"
        )

        browser.find_element(By.CSS_SELECTOR, "#vhead [data-sort='param:lr']").click()
        lowest = get_json(url + "/api/trials?sort=param:lr&limit=10")["trials"]
        wait_until(lambda: shown(2) == [t["id"] for t in lowest], timeout=WAIT_S, message="sorted by a parameter")

        browser.find_element(By.CSS_SELECTOR, "#status-filter option[value=FAILED]").click()
        failed = get_json(url + "/api/trials?status=FAILED&limit=1")["total"]
        wait_until(
            lambda: text(browser, "#trial-total") == f"{failed} trials", timeout=WAIT_S, message="filtered by status"
        )
        browser.find_element(By.ID, "search").send_keys("rmsprop")
        both = get_json(url + "/api/trials?status=FAILED&q=rmsprop&limit=1")["total"]
        assert 0 < both < failed
        wait_until(lambda: text(browser, "#trial-total") == f"{both} trials", timeout=WAIT_S, message="searched")
        wait_until(lambda: all(s == "FAILED" for s in shown(3)) and shown(3), timeout=WAIT_S)

        # Scrolled to the end, the last rows are fetched and drawn.
        browser.find_element(By.CSS_SELECTOR, "#status-filter option[value='']").click()
        browser.find_element(By.ID, "search").clear()
        browser.execute_script("document.getElementById('search').dispatchEvent(new Event('input'));")
        wait_until(lambda: text(browser, "#trial-total") == "20000 trials", timeout=WAIT_S)
        browser.find_element(By.CSS_SELECTOR, "#vhead [data-sort=sequence]").click()
        wait_until(lambda: shown(2)[:1] == ["tr00000"], timeout=WAIT_S, message="sorted by sequence")
        browser.execute_script("const b = document.getElementById('vtable'); b.scrollTop = b.scrollHeight;")
        wait_until(
            lambda: browser.find_elements(By.CSS_SELECTOR, "#vbody .row[data-id=tr19999]"),
            timeout=WAIT_S,
            message="last row drawn",
        )

        # GPU usage over a trial's life, and over an environment's.
        browser.get(url + "/#/trial/tr00000")
        wait_until(lambda: series_points(browser, "gpu-chart") == 6, timeout=WAIT_S, message="the trial's GPU drawn")
        assert painted(browser, "gpu-chart")
        browser.get(url + "/#/environments?env=env-0")
        wait_until(
            lambda: series_points(browser, "env-util") == 6 and series_points(browser, "env-mem") == 6, timeout=WAIT_S
        )
        assert "NVIDIA H100" in text(browser, "#envs") and "gpu-host" in text(browser, "#envs")
        assert console_errors(browser) == []


def terminal_lines(controller: int) -> list[str]:
    """The lines a process writes to the terminal ``controller`` is the other end of, read by a
    thread into the list returned (it grows until the terminal's last user closes it)."""
    lines: list[str] = []

    def read() -> None:
        rest = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: no process holds the terminal any more
                chunk = b""
            if not chunk:
                break
            rest += chunk
            *done, rest = rest.split(b"\n")
            lines.extend(line.decode(errors="replace").rstrip("\r") for line in done)

    threading.Thread(target=read, daemon=True).start()
    return lines


def banner_shown(driver: Any) -> bool:
    return bool(driver.execute_script("return !document.getElementById('banner').hidden;"))


def shown_lines(driver: Any, stream: str = "stdout") -> list[str]:
    return list(driver.execute_script("return document.getElementById(arguments[0]).textContent.split('\\n');", stream))


# A trial that prints a numbered line every 10 ms until $GATES/all exists (90 s at most).
TICKER = """
import os, pathlib, time
from trialkeeper.agent import trial

trial.get_next_parameter()
done, deadline, n = pathlib.Path(os.environ["GATES"]) / "all", time.monotonic() + 90, 0
while not done.exists() and time.monotonic() < deadline:
    print("tick", n, flush=True)
    n += 1
    time.sleep(0.01)
trial.report_final_result(float(n))
"""


@pytest.mark.slow
def test_a_fresh_load_of_a_running_trials_page_shows_each_line_once(tmp_path: Path, browser: Any) -> None:
    write_script(tmp_path, "ticker.py", TICKER)
    command = f"{sys.executable} ticker.py"
    with live_experiment(tmp_path, trials=1, concurrency=1, trialCommand=command) as (served, _):
        url = served.url
        running = wait_until(
            lambda: (r := get_json(url + "/api/trials?status=RUNNING")["trials"]) and r[0],
            timeout=WAIT_S, message="a trial running",
        )
        for _ in range(4):  # the first refresh and the live stream's first change race on each load
            browser.get("about:blank")
            browser.get(f"{url}/#/trial/{running['id']}")
            wait_until(
                lambda: "live" in text(browser, "#live") and browser.execute_script("return pending === false;")
                and "tick" in text(browser, "#stdout"),
                timeout=WAIT_S, message="its output, the live stream's change, and the refresh it asked for, done",
            )
            lines = shown_lines(browser)[:-1]  # the last one may be still coming
            ticks = [int(line.removeprefix("tick ")) for line in lines]
            assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), lines


def _big_log_experiment(exp: Path, lines: int) -> Path:
    """A stored experiment whose first trial is RUNNING with ``lines`` lines of stdout."""
    many_trials(exp, 3)
    from trialkeeper.coordinator.store.store import Store

    store = Store.in_dir(exp)
    store.update_trial("tr00000", status="RUNNING", ended_at=None)
    store.close()
    log = exp / "trials" / "tr00000" / "stdout.log"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as f:
        f.writelines(
            "".join(f"output line {i:09d}\n" for i in range(start, min(lines, start + 100_000))).encode()
            for start in range(0, lines, 100_000)
        )
    return log


@pytest.mark.slow
def test_a_big_output_shows_its_tail_earlier_parts_on_request_and_downloads_whole(
    tmp_path: Path, browser: Any
) -> None:
    exp = tmp_path / "exp"
    total = 1_500_000  # 33 MiB: kept whole, the page would hold 33 M characters
    log = _big_log_experiment(exp, total)
    with stored_dashboard(exp) as served:
        url = served.url
        browser.get(f"{url}/#/trial/tr00000")
        last = f"output line {total - 1:09d}"
        wait_until(lambda: last in text(browser, "#stdout"), timeout=WAIT_S, message="the end of the output")
        lines = [line for line in shown_lines(browser) if line]
        assert lines == [f"output line {i:09d}" for i in range(total - 2000, total)]
        assert visible(browser, "stdout-earlier") and "MiB before" in text(browser, "#stdout-earlier")

        # Earlier: the chunk before what is shown, joined on without a gap.
        browser.find_element(By.ID, "stdout-earlier").click()
        wait_until(lambda: len(shown_lines(browser)) > 3000, timeout=WAIT_S, message="an earlier chunk shown")
        lines = [line for line in shown_lines(browser) if line]
        first = int(lines[0].split()[-1])
        assert lines == [f"output line {i:09d}" for i in range(first, total)]

        # Followed: what the trial writes next is shown, and the window stays bounded (what was
        # asked for with "earlier" stays too; older lines go).
        shown_before = len(lines)
        with open(log, "a") as f:
            f.write("".join(f"output line {i:09d}\n" for i in range(total, total + 5000)))
        wait_until(lambda: f"output line {total + 4999:09d}" in text(browser, "#stdout"), timeout=WAIT_S,
                   message="new output followed")
        lines = [line for line in shown_lines(browser) if line]
        first = int(lines[0].split()[-1])
        assert lines == [f"output line {i:09d}" for i in range(first, total + 5000)]
        assert len(lines) == shown_before  # as many lines as before: the oldest dropped for the new
        assert browser.execute_script("return document.getElementById('main').textContent.length;") < 500_000

        # Far behind a trial that prints fast, the page goes to the end rather than read it all.
        more = total + 5000 + 300_000  # 6.6 MiB more at once
        with open(log, "a") as f:
            f.write("".join(f"output line {i:09d}\n" for i in range(total + 5000, more)))
        wait_until(lambda: f"output line {more - 1:09d}" in text(browser, "#stdout"), timeout=WAIT_S,
                   message="the end reached")
        lines = [line for line in shown_lines(browser) if line]
        assert lines == [f"output line {i:09d}" for i in range(more - 2000, more)]
        assert browser.execute_script("return performance.memory.usedJSHeapSize;") < 200 * 2**20

        # The whole file, by the link.
        href = browser.find_element(By.ID, "stdout-download").get_attribute("href")
        assert href == f"{url}/api/trials/tr00000/log/download?stream=stdout"
        disposition = browser.execute_async_script(
            "const done = arguments[1]; fetch(arguments[0]).then(r => r.blob().then(b => "
            "done([r.status, r.headers.get('content-disposition'), b.size])));", href,
        )
        assert disposition == [200, 'attachment; filename="tr00000-stdout.log"', log.stat().st_size]
        assert console_errors(browser) == []


@pytest.mark.slow
def test_run_ui_shows_the_final_state_after_the_run_and_says_when_the_dashboard_stopped(
    tmp_path: Path, browser: Any
) -> None:
    gates = tmp_path / "gates"
    config = gated_config(tmp_path, trials=2, concurrency=2, gates=gates)
    exp = tmp_path / "exp"
    # In a terminal of its own (as a user runs it), where Ctrl-C reaches it.
    controller, terminal = pty.openpty()

    def take_the_terminal() -> None:  # one system call in the child, no lock taken: safe beside threads
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [_script(), "run", str(config), "--experiment-dir", str(exp), "--quiet", "--ui", "127.0.0.1:0"],
        stdin=terminal, stdout=terminal, stderr=terminal, cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"}, start_new_session=True,
        preexec_fn=take_the_terminal,  # noqa: PLW1509
    )
    os.close(terminal)
    lines = terminal_lines(controller)
    try:
        url = wait_until(lambda: next((line.removeprefix("dashboard: ").strip() for line in lines
                                       if line.startswith("dashboard: ")), None), timeout=WAIT_S,
                         message="the dashboard's address")
        browser.get(url)
        wait_until(lambda: text(browser, "[data-count=RUNNING]") == "2", timeout=WAIT_S, message="2 running")
        assert visible(browser, "stop") and "ETA" in text(browser, "#cards")

        (gates / "all").touch()
        wait_until(lambda: any("press Ctrl-C to leave" in line for line in lines), timeout=WAIT_S,
                   message="the run ended, and said its dashboard serves on")
        assert proc.poll() is None and any(line.startswith("best trial:") for line in lines)
        wait_until(lambda: "SUCCEEDED" not in text(browser, "#cards .status") and text(browser, "#cards .status"),
                   timeout=WAIT_S, message="the experiment's final status")
        wait_until(lambda: text(browser, "[data-count=SUCCEEDED]") == "2", timeout=WAIT_S)
        status = text(browser, "#cards .status")
        assert status == get_json(url.rstrip("/") + "/api/experiment")["status"] and status != "RUNNING"
        assert not visible(browser, "stop") and "ETA" not in text(browser, "#cards")
        # Other pages still answer, read-only.
        browser.get(url.rstrip("/") + "/#/trials")
        wait_until(lambda: text(browser, "#trial-total") == "2 trials", timeout=WAIT_S, message="the trials page")
        first = get_json(url.rstrip("/") + "/api/trials?limit=1")["trials"][0]
        browser.get(f"{url.rstrip('/')}/#/trial/{first['id']}")
        wait_until(lambda: "SUCCEEDED" in text(browser, "#trial-status"), timeout=WAIT_S)
        assert not visible(browser, "cancel") and not visible(browser, "pause")
        assert not banner_shown(browser)
        assert console_errors(browser) == []
        token = (exp / ".token").read_text().strip()
        status_code, _, body = http("POST", url.rstrip("/") + "/api/experiment/stop", token=token)
        assert status_code == 409 and b"the experiment has ended" in body

        os.write(controller, b"\x03")  # Ctrl-C
        assert proc.wait(WAIT_S) == 0, "\n".join(lines)
        wait_until(lambda: banner_shown(browser), timeout=WAIT_S, message="the page says the dashboard stopped")
        assert "dashboard has stopped" in text(browser, "#banner")
        assert "stopped" in text(browser, "#live")
    finally:
        (gates / "all").touch()
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT_S)
        os.close(controller)


def _set(driver: Any, element_id: str, value: str) -> None:
    driver.execute_script("document.getElementById(arguments[0]).value = arguments[1];", element_id, value)


def _log_in(driver: Any, token: str) -> None:
    driver.find_element(By.ID, "token").send_keys(token + "\n")
    wait_until(lambda: "token accepted" in text(driver, "#toast"), timeout=WAIT_S, message="the token accepted")


@pytest.mark.slow
def test_the_context_page_steers_a_running_experiment_and_says_why_not_once_it_ended(
    tmp_path: Path, browser: Any
) -> None:
    with live_experiment(tmp_path, trials=3, concurrency=1, pauseGracePeriod=2) as (served, gates):
        url, token = served.url, served.token
        wait_until(lambda: get_json(url + "/api/experiment")["trials"].get("RUNNING") == 1, timeout=WAIT_S,
                   message="a trial running")
        browser.get(url + "/#/context")
        wait_until(lambda: "Context of experiment" in text(browser, "#ctx-title"), timeout=WAIT_S)
        assert text(browser, "#ctx-tuner") == "random"
        assert text(browser, "#ctx-space tr[data-param=x]").split("\t")[:2] == ["x", "choice"]
        assert '"GATES": ' in text(browser, "#ctx-config") and "local" in text(browser, "#ctx-platforms")
        assert Path(text(browser, "#ctx-directory")).resolve() == served.experiment_dir.resolve()
        assert visible(browser, "ctx-steer") and text(browser, "#ctx-why") == ""
        _log_in(browser, token)

        # New limits, live: a second trial starts at once.
        _set(browser, "limit-concurrency", "2")
        _set(browser, "limit-max-trials", "8")
        _set(browser, "limit-duration", "2h")
        browser.find_element(By.ID, "limits-save").click()
        wait_until(lambda: "limits updated: trialConcurrency 2, maxTrialNumber 8, maxExperimentDuration 7200"
                   in text(browser, "#toast"), timeout=WAIT_S, message="the limits updated")
        wait_until(lambda: get_json(url + "/api/experiment")["trials"].get("RUNNING") == 2, timeout=WAIT_S,
                   message="two trials running")
        wait_until(lambda: text(browser, "[data-card=Concurrency]") == "2", timeout=WAIT_S, message="shown")
        assert get_json(url + "/api/context")["limits"]["maxExperimentDuration"] == 7200

        # A trial of the user's own parameters (x is a choice: picked from its values).
        _set(browser, "param-x", "5")  # the sixth value, 6
        browser.find_element(By.ID, "submit-trial").click()
        said = wait_until(lambda: (t := text(browser, "#toast")).startswith("submitted trial ") and t, timeout=WAIT_S)
        mine = said.split()[-1]
        assert get_json(f"{url}/api/trials/{mine}")["trial"]["parameters"] == {"x": 6}

        # The trial page of a dashboard beside the run (trialkeeper ui) acts through the control socket.
        first = get_json(url + "/api/trials?sort=sequence&limit=1")["trials"][0]
        with stored_dashboard(served.experiment_dir) as beside:
            browser.get(f"{beside.url}/#/trial/{first['id']}")
            wait_until(lambda: visible(browser, "rerun") and visible(browser, "cancel"), timeout=WAIT_S,
                       message="its actions offered")
            _log_in(browser, token)  # another address, another tab's storage
            browser.find_element(By.ID, "rerun").click()
            wait_until(lambda: "rerun asked" in text(browser, "#toast"), timeout=WAIT_S, message="run again")
            again = wait_until(lambda: [t for t in get_json(url + "/api/trials?limit=100")["trials"]
                                        if t["parameters"] == first["parameters"] and t["id"] != first["id"]],
                               timeout=WAIT_S, message="a new trial of the same parameters")
            assert len(again) == 1
            # Cancel asks first: dismissed, nothing happens; accepted, the trial is canceled.
            browser.find_element(By.ID, "cancel").click()
            browser.switch_to.alert.dismiss()
            assert get_json(f"{url}/api/trials/{first['id']}")["trial"]["status"] == "RUNNING"
            browser.find_element(By.ID, "cancel").click()
            browser.switch_to.alert.accept()
            wait_until(lambda: "USER_CANCELED" in text(browser, "#trial-status"), timeout=WAIT_S,
                       message="canceled through the control socket")

            # The run stops: the page beside it hides its actions and says why, live.
            browser.get(f"{beside.url}/#/context")
            wait_until(lambda: visible(browser, "ctx-steer"), timeout=WAIT_S)
            assert console_errors(browser) == []
            assert http("POST", url + "/api/experiment/stop", token=token)[0] == 200
            gates.release_all()
            served.proc.wait(WAIT_S)
            wait_until(lambda: not visible(browser, "ctx-steer"), timeout=WAIT_S, message="its actions hidden")
            assert text(browser, "#ctx-why").startswith("the experiment is STOPPED: no coordinator runs this")
            browser.get(f"{beside.url}/#/")
            wait_until(lambda: "no coordinator runs" in text(browser, "#actions-why"), timeout=WAIT_S)
            assert not visible(browser, "stop")
            browser.get(f"{beside.url}/#/trial/{mine}")
            wait_until(lambda: "no coordinator runs" in text(browser, "#actions-why"), timeout=WAIT_S)
            assert not visible(browser, "rerun") and not visible(browser, "cancel")
            status, _, body = http("POST", f"{beside.url}/api/trials/{mine}/rerun", token=token)
            assert status == 409 and b"no coordinator runs this experiment" in body
            # (the stopped run's own dashboard, gone, is what the browser may have logged meanwhile)
            assert [e for e in console_errors(browser) if e.startswith(beside.url)] == []


def series_count(driver: Any, element_id: str) -> int:
    return int(driver.execute_script(
        "const c = echarts.getInstanceByDom(document.getElementById(arguments[0]));"
        "return c && c.getOption().series ? c.getOption().series.length : 0;", element_id,
    ))


@pytest.mark.slow
def test_the_experiments_home_lists_opens_and_compares_experiments(tmp_path: Path, browser: Any) -> None:
    many_trials(tmp_path / "first", 300, seed=1)
    many_trials(tmp_path / "second", 200, seed=2)
    (tmp_path / "not-an-experiment").mkdir()
    with home_dashboard(tmp_path) as home:
        url = home.url
        listed = get_json(url + "/api/home")["experiments"]
        assert [e["key"] for e in listed] == ["second", "first"]  # newest first
        assert listed[1]["ended"] == 300 and listed[1]["max_trials"] == 300 and listed[1]["best"]["final_metric"]
        assert http("GET", url + "/api/home/compare?keys=first")[0] == 400
        assert http("GET", url + "/api/home/compare?keys=first,nope")[0] == 404

        browser.get(url + "/")
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#experiments tr[data-key]")) == 2,
                   timeout=WAIT_S, message="both experiments listed")
        row = text(browser, "#experiments tr[data-key=first]")
        assert "DONE" in row and "300 / 300" in row and "maximize" in row, row
        browser.find_element(By.ID, "home-search").send_keys("seco")
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#experiments tr[data-key]")) == 1,
                   timeout=WAIT_S, message="the search leaves one")
        assert browser.find_elements(By.CSS_SELECTOR, "#experiments tr[data-key=second]")
        browser.find_element(By.ID, "home-search").clear()
        browser.execute_script("const s = document.getElementById('home-search'); s.value = '';"
                               "s.dispatchEvent(new Event('input'));")
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#experiments tr[data-key]")) == 2,
                   timeout=WAIT_S, message="both again")
        best = get_json(url + "/x/first/api/experiment")["best"]
        assert text(browser, "#experiments tr[data-key=first] [data-col=best]").startswith(str(best["final_metric"]))

        # Two picked, compared: a best-so-far curve and a distribution of each.
        assert not browser.find_element(By.ID, "compare-picked").is_enabled()
        for key in ("first", "second"):
            browser.execute_script("document.querySelector(arguments[0]).click();", f"[data-pick={key}]")
        browser.find_element(By.ID, "compare-picked").click()
        wait_until(lambda: series_count(browser, "best-curves") == 2 and series_points(browser, "best-curves") > 10,
                   timeout=WAIT_S, message="two best-so-far curves")
        assert series_count(browser, "distribution") == 2
        by_trials = browser.execute_script(
            "return echarts.getInstanceByDom(document.getElementById('best-curves')).getOption().series[0].data;")
        browser.execute_script("const s = document.getElementById('curve-x'); s.value = 'time';"
                               "s.dispatchEvent(new Event('change'));")
        by_time = browser.execute_script(
            "return echarts.getInstanceByDom(document.getElementById('best-curves')).getOption().series[0].data;")
        assert [v for _, v in by_time] == [v for _, v in by_trials] and by_time != by_trials
        assert all(x >= 0 for x, _ in by_time)
        browser.execute_script("const s = document.getElementById('dist-param'); s.value = 'opt';"
                               "s.dispatchEvent(new Event('change'));")
        categories = browser.execute_script(
            "return echarts.getInstanceByDom(document.getElementById('distribution')).getOption().xAxis[0].data;")
        assert sorted(categories) == ["adam", "rmsprop", "sgd"]
        shares = browser.execute_script(
            "return echarts.getInstanceByDom(document.getElementById('distribution')).getOption().series"
            ".map(s => s.data.reduce((a, b) => a + b, 0));")
        assert shares == [pytest.approx(1.0), pytest.approx(1.0)]

        # Each opens as a dashboard of its own, under /x/NAME/, with a way back.
        browser.execute_script("document.querySelector('#experiments tr[data-key=first] a').click();")
        wait_until(lambda: text(browser, "#exp-title").startswith("Experiment bigexp"), timeout=WAIT_S)
        assert browser.current_url.startswith(url + "/x/first/")
        assert visible(browser, "home-link")
        wait_until(lambda: text(browser, "[data-count=SUCCEEDED]") == str(
            get_json(url + "/x/first/api/experiment")["trials"]["SUCCEEDED"]), timeout=WAIT_S)
        browser.get(url + "/x/first/#/trial/tr00001")
        wait_until(lambda: "tr00001" in text(browser, "#trial-id"), timeout=WAIT_S)
        href = browser.find_element(By.ID, "stdout-download").get_attribute("href")
        assert href.startswith(url + "/x/first/api/trials/tr00001/log/download"), href
        browser.get(url + "/x/second/#/context")
        wait_until(lambda: "no coordinator runs this experiment" in text(browser, "#ctx-why"), timeout=WAIT_S)
        assert not visible(browser, "ctx-steer")
        stored_token = (tmp_path / "second" / ".token").read_text()
        status, _, body = http("POST", url + "/x/second/api/experiment/stop", token=stored_token)
        assert status == 409 and b"no coordinator runs this experiment" in body
        assert http("POST", url + "/x/second/api/experiment/stop")[0] == 403
        assert console_errors(browser) == []


@pytest.mark.slow
def test_the_experiments_home_beyond_loopback_asks_for_the_token_once(tmp_path: Path, browser: Any) -> None:
    many_trials(tmp_path / "only", 50)
    with home_dashboard(tmp_path, address="0.0.0.0:0", env={"TRIALKEEPER_UI_TOKEN": "home-token"}) as home:
        url = home.url.replace("0.0.0.0", "127.0.0.1")
        browser.get(url + "/")
        wait_until(lambda: "token" in text(browser, "#toast"), timeout=WAIT_S, message="the token asked for")
        assert not browser.find_elements(By.CSS_SELECTOR, "#experiments tr[data-key]")
        browser.find_element(By.ID, "token").send_keys("home-token\n")
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#experiments tr[data-key=only]"), timeout=WAIT_S,
                   message="listed once the token is in")
        browser.execute_script("document.querySelector('#experiments tr[data-key=only] a').click();")
        wait_until(lambda: text(browser, "[data-count=SUCCEEDED]") != "", timeout=WAIT_S,
                   message="the experiment's page reads with the same session")
        assert "home-token" not in browser.page_source
