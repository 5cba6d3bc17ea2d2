"""The dashboard's server and JSON API against real experiments: `trialkeeper run --ui` with
real agents and trials, and `trialkeeper ui` over a stored one; the token, /metrics parsed by
prometheus-client."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from conftest import wait_until, write_script
from dashboard import (
    every_answer,
    first_event,
    gated_config,
    get_json,
    home_dashboard,
    http,
    live_experiment,
    many_trials,
    stored_dashboard,
    tk_bare,
)
from prometheus_client.parser import text_string_to_metric_families
from test_control import TRIAL as CHECKPOINTING_TRIAL

WAIT_S = 60.0


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "experiment")))] = s.value
    return out


@pytest.mark.slow
def test_a_running_experiment_through_the_api(tmp_path: Path) -> None:
    # Its trials save no checkpoint: at the stop they are canceled once pauseGracePeriod has passed.
    with live_experiment(tmp_path, trials=6, concurrency=2, pauseGracePeriod=2) as (served, gates):
        url, token = served.url, served.token
        assert url.startswith("http://127.0.0.1:")
        running = wait_until(
            lambda: (e := get_json(url + "/api/experiment"))["trials"].get("RUNNING") == 2 and e,
            timeout=WAIT_S, message="two trials running",
        )
        assert running["status"] == "RUNNING" and running["max_trials"] == 6 and running["name"] == "dashboard"
        assert first_event(url)["trials"].get("RUNNING") == 2

        page = get_json(url + "/api/trials?status=RUNNING&sort=sequence&order=desc")
        assert page["total"] == 2 and page["parameters"] == ["x"]
        victim, first = page["trials"][0], page["trials"][1]
        assert first["sequence_id"] == 0
        detail = wait_until(
            lambda: (
                (d := get_json(f"{url}/api/trials/{first['id']}"))["intermediate"] and len(d["intermediate"]) == 3 and d
            ),
            timeout=WAIT_S,
            message="the trial's intermediate results",
        )
        x = first["parameters"]["x"]
        assert [v for _, v in detail["intermediate"]] == pytest.approx([x / 3, 2 * x / 3, x])
        assert detail["trial"]["status"] == "RUNNING" and detail["history"][-1]["new"] == "RUNNING"

        # Actions need the token, in a header.
        status, _, body = http("POST", f"{url}/api/trials/{victim['id']}/cancel")
        assert status == 403 and b"token" in body
        assert http("POST", f"{url}/api/trials/{victim['id']}/cancel", token="wrong")[0] == 403
        status, _, body = http("POST", f"{url}/api/trials/{victim['id']}/cancel", token=token)
        assert status == 200, body
        wait_until(
            lambda: get_json(f"{url}/api/trials/{victim['id']}")["trial"]["status"] == "USER_CANCELED", timeout=WAIT_S
        )
        assert get_json(f"{url}/api/trials/{victim['id']}")["trial"]["reason"] == "canceled by the user (the dashboard)"
        assert http("POST", f"{url}/api/trials/{victim['id']}/cancel", token=token)[0] == 409  # it has ended
        assert http("POST", f"{url}/api/trials/nope/cancel", token=token)[0] == 404

        # Bad queries are refused by name.
        status, _, body = http("GET", url + "/api/trials?sort=bogus")
        assert status == 400 and b"sort: 'bogus' is not one of" in body
        assert http("GET", url + "/api/trials?offset=x")[0] == 400
        assert http("GET", url + "/api/trials/nope")[0] == 404

        gates.release(0)
        done = wait_until(
            lambda: (e := get_json(url + "/api/experiment"))["trials"].get("SUCCEEDED") == 1 and e,
            timeout=WAIT_S, message="the first trial finished",
        )
        assert done["best"]["id"] == first["id"] and done["best"]["final_metric"] == x

        # `trialkeeper ui` beside the running experiment serves the same, read from its store.
        with stored_dashboard(served.experiment_dir) as beside:
            wait_until(
                lambda: (
                    get_json(beside.url + "/api/experiment")["trials"] == get_json(url + "/api/experiment")["trials"]
                ),
                timeout=WAIT_S,
                message="the same counts from the store",
            )
            assert get_json(beside.url + "/api/experiment")["best"]["id"] == first["id"]
            # It acts through the experiment's control socket, as the commands do.
            assert get_json(beside.url + "/api/experiment")["actions"] is True
            status, _, body = http("POST", f"{beside.url}/api/trials/{victim['id']}/cancel", token=token)
            assert status == 409 and f"trial {victim['id']} is USER_CANCELED".encode() in body, body
            assert http("POST", f"{beside.url}/api/trials/{victim['id']}/cancel")[0] == 403
        output = get_json(f"{url}/api/trials/{first['id']}/log?stream=stdout")
        assert f"trial output for x = {x}" in output["text"] and output["following"] is False
        assert (
            get_json(f"{url}/api/trials/{first['id']}/log?stream=stdout&offset={output['next_offset']}")["text"] == ""
        )
        assert http("GET", f"{url}/api/trials/{first['id']}/log?stream=passwd")[0] == 400

        # Prometheus, parsed by its own parser.
        status, headers, text = http("GET", url + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        samples = _samples(text.decode())
        assert samples[("trialkeeper_trials", (("status", "SUCCEEDED"),))] == 1
        assert samples[("trialkeeper_trials", (("status", "USER_CANCELED"),))] == 1
        assert samples[("trialkeeper_metrics_stored_total", ())] >= 4  # the first trial: 3 intermediate, 1 final
        assert samples[("trialkeeper_scheduling_pass_seconds_count", ())] >= 1
        assert samples[("trialkeeper_scheduling_pass_seconds_sum", ())] > 0
        # The passes counted in buckets too: the +Inf one holds them all, each bound at most as many.
        bucket = [v for (n, labels), v in samples.items() if n == "trialkeeper_scheduling_pass_seconds_bucket"]
        assert len(bucket) == 13 and max(bucket) == samples[("trialkeeper_scheduling_pass_seconds_count", ())]
        assert sum(v for (n, _), v in samples.items() if n == "trialkeeper_environments") >= 1
        assert samples[("trialkeeper_agents_connected", ())] >= 1
        assert ("trialkeeper_queue_length", ()) in samples

        # No secret in any page or answer.
        answers = every_answer(url).values()
        assert all(token.encode() not in a for a in answers)
        assert all(b"coordinator_address" not in a for a in answers)
        headers = http("GET", url + "/")[1]
        assert (
            "script-src" not in headers["Content-Security-Policy"]
            and "default-src 'self'" in headers["Content-Security-Policy"]
        )
        assert headers["X-Frame-Options"] == "DENY"

        # The experiments home of its directory lists it running, and acts on it through its control socket.
        with home_dashboard(tmp_path) as home:
            [listed] = get_json(home.url + "/api/home")["experiments"]
            assert (listed["key"], listed["status"], listed["reason"]) == ("exp", "RUNNING", "")
            assert listed["max_trials"] == 6
            update = {"limits": {"maxTrialNumber": 7}}
            assert http("POST", home.url + "/x/exp/api/experiment/update", body=update)[0] == 403
            status, _, body = http("POST", home.url + "/x/exp/api/experiment/update", token=token, body=update)
            assert status == 200 and json.loads(body)["limits"]["maxTrialNumber"] == 7, body
            assert get_json(home.url + "/api/home")["experiments"][0]["max_trials"] == 7

        # Stop the experiment from the dashboard: refused without the token, then done.
        assert http("POST", url + "/api/experiment/stop")[0] == 403
        assert http("POST", url + "/api/experiment/stop", token=token)[0] == 200
        served.proc.wait(WAIT_S)
    assert served.proc.returncode == 1 and "stopped by the user" in "".join(served.lines), "".join(served.lines)


def test_pause_and_continue_a_trial_from_the_dashboard(tmp_path: Path) -> None:
    write_script(tmp_path, "steps.py", CHECKPOINTING_TRIAL)
    command = f"{sys.executable} steps.py"
    with live_experiment(tmp_path, trials=2, concurrency=2, trialCommand=command, pauseGracePeriod=30) as (served, _):
        url, token = served.url, served.token
        running = wait_until(
            lambda: (p := get_json(url + "/api/trials?status=RUNNING"))["total"] == 2
            and all(t["checkpoint_step"] for t in p["trials"]) and p["trials"],
            timeout=WAIT_S, message="two trials running, each with a checkpoint",
        )
        a, b = running[0]["id"], running[1]["id"]

        # Actions need the token, and apply only to the states they name.
        assert http("POST", f"{url}/api/trials/{a}/pause")[0] == 403
        status, _, body = http("POST", f"{url}/api/trials/{a}/continue", token=token)
        assert status == 409 and json.loads(body)["error"] == (
            f"trial {a} is RUNNING: continue applies to a trial that is PAUSED"
        )
        assert http("POST", f"{url}/api/trials/nope/pause", token=token)[0] == 404
        status, _, body = http("POST", f"{url}/api/trials/{a}/pause", token=token)
        assert status == 200 and json.loads(body) == {"ok": True, "done": [a]}
        detail = wait_until(
            lambda: (d := get_json(f"{url}/api/trials/{a}"))["trial"]["status"] != "RUNNING" and d,
            timeout=WAIT_S, message="the trial ended its run",
        )
        assert detail["trial"]["status"] == "PAUSED", detail["trial"]

        # Shown PAUSED, with its checkpoint, counted and filtered.
        step = detail["trial"]["checkpoint_step"]
        assert [(c["step"], c["size_bytes"]) for c in detail["checkpoints"]] == [(step, len(str(step)))]
        assert detail["checkpoints"][0]["where"] == str(served.experiment_dir.resolve() / "checkpoints" / a / str(step))
        assert detail["checkpoints"][0]["saved_at"] > 0 and detail["history"][-1]["new"] == "PAUSED"
        assert [t["id"] for t in get_json(url + "/api/trials?status=PAUSED")["trials"]] == [a]
        assert get_json(url + "/api/experiment")["trials"]["PAUSED"] == 1
        assert _samples(http("GET", url + "/metrics")[2].decode())[("trialkeeper_trials", (("status", "PAUSED"),))] == 1
        status, _, body = http("POST", f"{url}/api/trials/{a}/pause", token=token)
        assert status == 409 and json.loads(body)["error"] == (
            f"trial {a} is PAUSED: pause applies to a trial that is WAITING or RUNNING"
        )

        # Continued, it goes on from its checkpoint.
        assert http("POST", f"{url}/api/trials/{a}/continue", token=token)[0] == 200
        wait_until(
            lambda: f"continued from {step} holding {step}" in get_json(f"{url}/api/trials/{a}/log")["text"],
            timeout=WAIT_S, message="the trial continued from its checkpoint",
        )
        assert get_json(f"{url}/api/trials/{b}")["trial"]["status"] == "RUNNING"
        # A paused trial can be canceled too.
        assert http("POST", f"{url}/api/trials/{b}/pause", token=token)[0] == 200
        wait_until(lambda: get_json(f"{url}/api/trials/{b}")["trial"]["status"] == "PAUSED", timeout=WAIT_S)
        assert http("POST", f"{url}/api/trials/{b}/cancel", token=token)[0] == 200
        wait_until(lambda: get_json(f"{url}/api/trials/{b}")["trial"]["status"] == "USER_CANCELED", timeout=WAIT_S)


def test_a_stored_experiment_pages_sorts_and_filters(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    many_trials(exp, 3000)
    with stored_dashboard(exp) as served:
        url = served.url
        overview = get_json(url + "/api/experiment")
        assert overview["status"] == "DONE" and overview["trial_count"] == 3000
        assert len(overview["finished_over_time"]) <= 400 and overview["finished_over_time"][-1][1] == 3000

        page = get_json(url + "/api/trials?sort=param:lr&order=desc&limit=50&offset=10")
        lrs = [t["parameters"]["lr"] for t in page["trials"]]
        assert page["total"] == 3000 and len(lrs) == 50 and lrs == sorted(lrs, reverse=True)
        failed = get_json(url + "/api/trials?status=FAILED&q=rmsprop&limit=1000")
        assert failed["total"] > 0 and all(
            t["status"] == "FAILED" and t["parameters"]["opt"] == "rmsprop" for t in failed["trials"]
        )
        compare = get_json(url + "/api/compare")
        assert compare["sampled"] and 0 < len(compare["trials"]) <= 2000 and compare["curves"]
        envs = get_json(url + "/api/environments")
        assert envs["waiting_total"] == 0

        # In Prometheus's terms: the environments ended (env-0 had a GPU) leave no GPU series.
        samples = _samples(http("GET", url + "/metrics")[2].decode())
        assert not [k for k in samples if k[0].startswith("trialkeeper_gpu_")], samples
        assert samples[("trialkeeper_environments", (("status", "STOPPED"),))] == 7
        assert samples[("trialkeeper_trials", (("status", "SUCCEEDED"),))] == overview["trials"]["SUCCEEDED"]
        ended = {s: samples[("trialkeeper_trials_ended_total", (("status", s),))] for s in ("SUCCEEDED", "FAILED")}
        assert ended == {s: overview["trials"][s] for s in ended}
        # Every trial ran 1 to 100 s (see many_trials): all of them in the histogram, under 120 s.
        assert samples[("trialkeeper_trial_duration_seconds_count", ())] == 3000
        assert samples[("trialkeeper_trial_duration_seconds_bucket", (("le", "1"),))] == 0
        assert samples[("trialkeeper_trial_duration_seconds_bucket", (("le", "120"),))] == 3000
        assert 3000 < samples[("trialkeeper_trial_duration_seconds_sum", ())] < 300_000
        assert samples[("trialkeeper_best_final_metric", (("optimize_mode", "maximize"),))] == overview["best"][
            "final_metric"
        ]
        assert samples[("trialkeeper_experiment_status", (("status", "DONE"),))] == 1
        assert samples[("trialkeeper_experiment_status", (("status", "RUNNING"),))] == 0

        # Read from the store: no coordinator runs it, so nothing acts, and the answers say why.
        status, _, body = http("POST", url + "/api/experiment/stop", token=served.token)
        assert status == 409 and b"no coordinator runs this experiment" in body
        assert overview["actions"] is False
        assert overview["actions_why"].startswith("the experiment is DONE: no coordinator runs this experiment")


@pytest.mark.slow
def test_metrics_show_only_what_is_alive(tmp_path: Path) -> None:
    """Without reuse each trial gets an environment of its own, with two simulated GPUs: the
    GPU series are those of the environments still alive, and go when they end."""
    service = {"platform": "local", "reuseMode": False, "simulatedGpus": 2}
    with live_experiment(tmp_path, trials=4, concurrency=2, trainingService=service) as (served, gates):
        url = served.url

        def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            return _samples(http("GET", url + "/metrics")[2].decode())

        def gpu_envs(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
            return {dict(k[1])["environment"] for k in samples if k[0] == "trialkeeper_gpu_utilization_ratio"}

        def alive() -> set[str]:
            envs = get_json(url + "/api/environments")["environments"]
            return {e["id"] for e in envs if e["status"] not in ("STOPPED", "FAILED")}

        first = wait_until(
            lambda: len(found := gpu_envs(scrape())) == 2 and found, timeout=WAIT_S,
            message="two environments' GPUs sampled",
        )
        samples = scrape()
        gpus = [k for k in samples if k[0] == "trialkeeper_gpu_utilization_ratio"]
        assert len(gpus) == 4 and all(dict(k[1])["simulated"] == "true" for k in gpus), gpus
        assert all(0.0 <= samples[k] <= 1.0 for k in gpus)
        assert samples[("trialkeeper_experiment_status", (("status", "RUNNING"),))] == 1
        assert [k for k in samples if k[0] == "trialkeeper_build_info"]

        # The first two trials end, and their environments with them: their series go.
        gates.release(0)
        gates.release(1)
        wait_until(
            lambda: scrape().get(("trialkeeper_trials_ended_total", (("status", "SUCCEEDED"),))) == 2,
            timeout=WAIT_S, message="two trials ended",
        )
        later = wait_until(
            lambda: (s := scrape()) and gpu_envs(s) and not gpu_envs(s) & first and s, timeout=WAIT_S,
            message="the ended environments' GPU series gone, the new ones' there",
        )
        assert gpu_envs(later) <= alive() and len(gpu_envs(later)) <= 2
        assert later[("trialkeeper_environments", (("status", "STOPPED"),))] >= 2
        assert later[("trialkeeper_trial_duration_seconds_count", ())] == 2
        assert later[("trialkeeper_best_final_metric", (("optimize_mode", "maximize"),))] > 0
        assert "trialkeeper_gpu_utilization_percent" not in http("GET", url + "/metrics")[2].decode()


def test_beyond_loopback_every_read_needs_the_token(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    many_trials(exp, 10)
    token = (exp / ".token").read_text()
    with stored_dashboard(exp, address="0.0.0.0:0") as served:
        url = served.url.replace("0.0.0.0", "127.0.0.1")
        assert http("GET", url + "/")[0] == 200  # the page itself asks for the token
        for path in ("/api/experiment", "/api/trials", "/metrics", "/api/events"):
            assert http("GET", url + path)[0] == 401, path
        assert get_json(url + "/api/experiment", token=token)["trial_count"] == 10
        assert http("POST", url + "/api/login", body={"token": "wrong"})[0] == 403
        status, headers, _ = http("POST", url + "/api/login", body={"token": token})
        assert status == 200 and "HttpOnly" in headers["Set-Cookie"]
    # A separate token replaces the experiment's.
    with stored_dashboard(exp, address="0.0.0.0:0", env={"TRIALKEEPER_UI_TOKEN": "another-token"}) as served:
        url = served.url.replace("0.0.0.0", "127.0.0.1")
        assert http("GET", url + "/api/experiment", token=token)[0] == 401
        assert http("GET", url + "/api/experiment", token="another-token")[0] == 200


def test_run_refuses_a_bad_dashboard_address_before_it_starts(tmp_path: Path) -> None:
    proc = tk_bare("run", tmp_path / "missing.yml", "--ui", "127.0.0.1:99999")
    assert proc.returncode == 2 and "missing.yml" in proc.stderr  # the config is read first
    config = gated_config(tmp_path, trials=1, concurrency=1, gates=tmp_path / "gates")
    proc = tk_bare("run", config, "--experiment-dir", tmp_path / "exp", "--quiet", "--ui", "127.0.0.1:99999")
    assert proc.returncode == 2 and "--ui: port 99999 is not between 0 and 65535" in proc.stderr
    assert not (tmp_path / "exp").exists()  # nothing started

    # A port another program listens on: told before any agent or trial starts.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = tk_bare("run", config, "--experiment-dir", tmp_path / "exp", "--quiet", "--ui", f"127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr.strip() == f"trialkeeper: the dashboard cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert not (tmp_path / "exp").exists()


def test_ui_refuses_bad_input(tmp_path: Path) -> None:
    proc = tk_bare("ui", tmp_path)
    assert proc.returncode == 1 and f"no experiment {str(tmp_path)!r}: neither a directory holding one" in proc.stderr
    many_trials(tmp_path / "exp", 3)
    proc = tk_bare("ui", tmp_path / "exp", "--address", "127.0.0.1:http")
    assert proc.returncode == 1 and "is not HOST:PORT" in proc.stderr
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = tk_bare("ui", tmp_path / "exp", "--address", f"127.0.0.1:{port}")
    assert (
        proc.returncode == 1
        and proc.stderr.strip()
        == f"trialkeeper: the dashboard cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    (tmp_path / "exp" / ".token").unlink()
    proc = tk_bare("ui", tmp_path / "exp", "--address", "0.0.0.0:0")
    assert proc.returncode == 1 and "only with a token" in proc.stderr and "TRIALKEEPER_UI_TOKEN" in proc.stderr


def test_ui_and_view_serve_one_experiment_or_the_home_of_a_directory(tmp_path: Path) -> None:
    neither = tk_bare("ui")
    assert neither.returncode == 2
    assert neither.stderr.strip() == (
        "trialkeeper: give an experiment (its directory or id), or --dir DIR for the experiments home (not both)"
    )
    missing = tk_bare("ui", "--dir", tmp_path / "nope")
    assert missing.returncode == 1 and f"--dir: {tmp_path / 'nope'} is not a directory" in missing.stderr
    many_trials(tmp_path / "exp1", 10)
    one = tk_bare("ui", "--dir", tmp_path / "exp1")
    assert one.returncode == 1 and f"--dir: {tmp_path / 'exp1'} is an experiment's directory" in one.stderr
    with home_dashboard(tmp_path, command="view") as home:
        assert [e["key"] for e in get_json(home.url + "/api/home")["experiments"]] == ["exp1"]
        assert get_json(home.url + "/x/exp1/api/experiment")["trial_count"] == 10
        assert http("GET", home.url + "/x/nope/api/experiment")[0] == 404
