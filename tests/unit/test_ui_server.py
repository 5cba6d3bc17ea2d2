"""The dashboard's server in this process: its socket is taken before it serves, a slow read
of the store never holds up the rest of the server, open reads answer only to this machine's
names, and every live stream shares one look at the store."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import async_wait_until, run_async
from trialkeeper.coordinator.store.store import Store
from trialkeeper.coordinator.ui.live import LiveChanges
from trialkeeper.coordinator.ui.server import STATE, Controls, DashboardError, bind, build_app

HELD_S = 20.0  # how long the slow read may wait to be let go (it is let go at once when all is well)


def test_a_taken_port_is_refused_by_bind_with_its_address() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(DashboardError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            bind("127.0.0.1", port)
    with pytest.raises(DashboardError, match="cannot listen on no-such-host.invalid:0"):
        bind("no-such-host.invalid", 0)
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_a_slow_read_does_not_hold_up_pages_or_other_answers(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "slow", {})
    store.close()
    app = build_app(tmp_path, token="t0ken", open_reads=True)
    state = app[STATE]
    reading, let_go = threading.Event(), threading.Event()

    def slow(model: object) -> bool:
        reading.set()
        return let_go.wait(HELD_S)  # False if the server's loop was held up waiting for it

    async def body() -> None:
        async with TestClient(TestServer(app)) as client:
            held = asyncio.ensure_future(state.read(slow))
            await async_wait_until(reading.is_set, message="the slow read started")
            page = await client.get("/")
            assert page.status == 200 and "trialkeeper" in await page.text()
            refused = await client.post("/api/experiment/stop")
            assert refused.status == 403  # an action's answer does not wait on reads either
            let_go.set()
            assert await held, "the server's loop waited on the read"
            answer = await client.get("/api/experiment")
            assert answer.status == 200 and (await answer.json())["name"] == "slow"

    run_async(body)


def test_open_reads_answer_only_to_a_loopback_host_name(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "hosts", {})
    store.close()

    async def body() -> None:
        async with TestClient(TestServer(build_app(tmp_path, token="t0ken", open_reads=True))) as client:
            for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "app.localhost", "localhost"):
                answer = await client.get("/api/experiment", headers={"Host": host})
                assert answer.status == 200, host
            # DNS rebinding: another site's name pointed at 127.0.0.1.
            for path in ("/api/experiment", "/metrics", "/"):
                refused = await client.get(path, headers={"Host": "attacker.example:8080"})
                assert refused.status == 403 and "not 'attacker.example:8080'" in (await refused.json())["error"], path
        # Beyond loopback the token is the rule, whatever name the page was reached by.
        async with TestClient(TestServer(build_app(tmp_path, token="t0ken", open_reads=False))) as client:
            answer = await client.get(
                "/api/experiment", headers={"Host": "dash.example", "Authorization": "Bearer t0ken"}
            )
            assert answer.status == 200

    run_async(body)


def test_every_live_stream_shares_one_look_at_the_store() -> None:
    async def body() -> None:
        state = {"n": 0}
        lookers: set[object] = set()

        async def look() -> dict[str, int]:
            lookers.add(asyncio.current_task())
            if state["n"] < 0:
                raise RuntimeError("the store went away")
            return dict(state)

        live = LiveChanges(look, interval_s=0.01)
        assert not live.polling
        async with live.follow() as first, live.follow() as second:
            assert await first(10) == {"n": 0} and await second(10) == {"n": 0}
            assert await first(0.05) is None  # nothing changed: nothing within the time given
            state["n"] = 1
            assert await first(10) == {"n": 1} and await second(10) == {"n": 1}
            state["n"] = -1
            failed = await first(10)
            assert failed is not None and "the store went away" in failed["error"]
            state["n"] = 2
            assert await first(10) == {"n": 2}  # and it goes on looking
            async with live.follow() as late:
                assert await late(10) == {"n": 2}  # a stream that joins gets the latest at once
        assert len(lookers) == 1  # one poller for all three streams
        await async_wait_until(lambda: not live.polling, message="no stream left: no more looking")
        await live.close()

    run_async(body)


def test_actions_need_the_token_and_a_coordinator_that_runs_the_experiment(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "actions", {})
    store.insert_trial({"id": "t0", "seq": 0, "status": "PAUSED", "parameters_json": "{}", "command": "c",
                        "gpu_number": 0, "submitted_at": 1.0})
    store.close()
    bearer = {"Authorization": "Bearer t0ken"}
    posts = [*(f"/api/trials/t0/{a}" for a in ("pause", "continue", "cancel", "rerun")),
             "/api/experiment/stop", "/api/experiment/update", "/api/experiment/submit", "/api/experiment/rerun"]

    async def body() -> None:
        async with TestClient(TestServer(build_app(tmp_path, token="t0ken", open_reads=True))) as client:
            about = await (await client.get("/api/experiment")).json()
            assert about["actions"] is False and about["actions_why"].startswith("no coordinator runs this experiment")
            for path in posts:
                refused = await client.post(path, json={"limits": {"trialConcurrency": 2}})
                assert refused.status == 403 and "token" in (await refused.json())["error"], path
                wrong = await client.post(path, headers={"Authorization": "Bearer nope"}, json={})
                assert wrong.status == 403, path
            # With the token: nothing runs the experiment, and the answer says so.
            stored = await client.post("/api/trials/t0/continue", headers=bearer)
            assert stored.status == 409 and "no coordinator runs this experiment" in (await stored.json())["error"]
            assert (await client.post("/api/trials/nope/cancel", headers=bearer)).status == 404
            bad = await client.post("/api/experiment/update", headers=bearer, json={"limits": 3})
            assert bad.status == 400 and (await bad.json())["error"].startswith("limits: an object of trialConcurrency")
        # The dashboard of run --ui hands each action to the run's control channel, as asked.
        asked: list[dict[str, object]] = []

        async def ask(request: dict[str, object]) -> dict[str, object]:
            asked.append(request)
            return {"ok": request["op"] != "submit", "error": "parameters: 'y' not in the search space"}

        app = build_app(tmp_path, token="t0ken", open_reads=True, controls=Controls(ask=ask))
        async with TestClient(TestServer(app)) as client:
            assert (await (await client.get("/api/experiment")).json())["actions"] is True
            assert (await client.post("/api/trials/t0/continue", headers=bearer)).status == 200
            update = {"limits": {"trialConcurrency": 3, "maxExperimentDuration": 60}}
            assert (await client.post("/api/experiment/update", headers=bearer, json=update)).status == 200
            assert (await client.post("/api/experiment/rerun", headers=bearer, json={"failed": True})).status == 200
            submit = await client.post("/api/experiment/submit", headers=bearer, json={"parameters": {"y": 1}})
            assert submit.status == 409 and (await submit.json())["error"] == "parameters: 'y' not in the search space"
        assert asked == [
            {"op": "continue", "trials": ["t0"], "from": "dashboard"}, {"op": "update", **update},
            {"op": "rerun", "failed": True}, {"op": "submit", "parameters": {"y": 1}},
        ]

    run_async(body)


def test_a_log_downloads_whole_and_only_with_the_token_where_reads_need_it(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "download", {})
    store.insert_trial({"id": "t0", "seq": 0, "status": "RUNNING", "parameters_json": "{}", "command": "c",
                        "gpu_number": 0, "submitted_at": 1.0})
    store.close()
    (tmp_path / "trials" / "t0").mkdir(parents=True)
    data = b"".join(f"line {i}\n".encode() for i in range(200_000))
    (tmp_path / "trials" / "t0" / "stdout.log").write_bytes(data)

    async def body() -> None:
        async with TestClient(TestServer(build_app(tmp_path, token="t0ken", open_reads=False))) as client:
            path = "/api/trials/t0/log/download?stream=stdout"
            assert (await client.get(path)).status == 401
            assert (await client.post("/api/login", json={"token": "t0ken"})).status == 200  # the page's cookie
            answer = await client.get(path)
            assert answer.status == 200 and await answer.read() == data
            assert answer.headers["Content-Disposition"] == 'attachment; filename="t0-stdout.log"'
            assert answer.headers["Content-Type"].startswith("text/plain")
            assert answer.headers["X-Content-Type-Options"] == "nosniff"
            none = await client.get("/api/trials/t0/log/download?stream=stderr")
            assert none.status == 404 and "no stderr" in (await none.json())["error"]
            assert (await client.get("/api/trials/nope/log/download")).status == 404
            bad = await client.get("/api/trials/t0/log/download?stream=../x")
            assert bad.status == 400 and "not stdout or stderr" in (await bad.json())["error"]

    run_async(body)


def test_after_its_run_a_dashboard_reads_on_and_acts_no_more(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "ended", {})
    store.insert_trial({"id": "t0", "seq": 0, "status": "RUNNING", "parameters_json": "{}", "command": "c",
                        "gpu_number": 0, "submitted_at": 1.0})
    store.close()
    stops: list[bool] = []

    async def body() -> None:
        async def ask(request: dict[str, object]) -> dict[str, object]:
            stops.append(True)
            return {"ok": True}

        controls = Controls(ask=ask)
        app = build_app(tmp_path, token="t0ken", open_reads=True, controls=controls)
        bearer = {"Authorization": "Bearer t0ken"}
        async with TestClient(TestServer(app)) as client:
            assert (await (await client.get("/api/experiment")).json())["actions"] is True
            assert (await (await client.get("/api/trials/t0")).json())["actions"] is True
            app[STATE].read_only()
            assert (await (await client.get("/api/experiment")).json())["actions"] is False
            assert (await (await client.get("/api/trials/t0")).json())["actions"] is False
            for path in ("/api/experiment/stop", "/api/trials/t0/cancel"):
                refused = await client.post(path, headers=bearer)
                assert refused.status == 409, path
                assert (await refused.json())["error"].startswith("the experiment has ended: this dashboard now only")
        assert stops == []

    run_async(body)
