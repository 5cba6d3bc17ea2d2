"""The dashboard's actions: cancel, pause, continue and run again a trial, submit a trial of
the user's own parameters, change the limits, stop the experiment.

Each is a request of the experiment's control channel (``control/client.py``), answered by the
coordinator that runs it as ``trialkeeper cancel``, ``update``, ``submit`` ... are: the
dashboard of ``run --ui`` hands it to the control server on the experiment's own loop; one
that ``trialkeeper view`` or ``ui`` serves beside a running experiment sends it over the
control socket. An experiment that no coordinator runs takes none, and its pages say why.
Every action needs the token in an ``Authorization: Bearer`` header."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from ..control.client import ControlError, NoCoordinator, request

log = logging.getLogger(__name__)

Ask = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]  # a control request -> its answer
ACTION_TIMEOUT_S = 30.0
REACHABLE_FOR_S = 3.0  # how long a look at whether a coordinator answers holds
# The actions on one trial: the control channel's requests of the same names (which states
# each applies to, the coordinator checks and says).
TRIAL_ACTIONS = ("cancel", "pause", "continue", "rerun")
ENDED = "the experiment has ended: this dashboard now only reads its store"
NOT_RUNNING = (
    "no coordinator runs this experiment (it has ended, stopped or crashed; `trialkeeper resume` carries it on): "
    "this dashboard only reads its store"
)


class Answers(Protocol):
    """What answers control requests in the run's own process (its control server)."""

    async def answer(self, line: bytes) -> dict[str, Any]: ...


@dataclass
class Controls:
    """What the dashboard of ``run --ui`` has of the experiment running in its process: the
    control channel's requests answered on the experiment's loop, and the scheduler's figures."""

    ask: Ask
    scheduling: Callable[[], tuple[int, float, float]] | None = None  # passes, total s, last s


def on_loop(server: Answers, loop: asyncio.AbstractEventLoop) -> Ask:
    """Requests answered by ``server`` (the run's control server) on the experiment's ``loop``."""

    async def ask(body: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps(body).encode()
        future: concurrent.futures.Future[dict[str, Any]] = asyncio.run_coroutine_threadsafe(server.answer(line), loop)
        return await asyncio.wait_for(asyncio.wrap_future(future), ACTION_TIMEOUT_S)

    return ask


def over_socket(experiment_dir: Path) -> Ask:
    """Requests sent over the experiment's control socket (a thread waits for the answer)."""

    async def ask(body: dict[str, Any]) -> dict[str, Any]:
        fields = {k: v for k, v in body.items() if k not in ("op", "trials")}
        try:
            return await asyncio.to_thread(
                request, experiment_dir, body["op"], body.get("trials", ()), fields=fields, timeout=ACTION_TIMEOUT_S,
            )
        except NoCoordinator:
            return {"ok": False, "error": NOT_RUNNING, "gone": True}
        except ControlError as e:
            return {"ok": False, "error": str(e)}

    return ask


class Acting:
    """Whether the dashboard can act on its experiment, and the requests when it can."""

    def __init__(self, experiment_dir: Path, controls: Controls | None) -> None:
        self.controls = controls
        self.ended = False  # the run this dashboard served has ended
        self._socket = over_socket(experiment_dir)
        self._looked: tuple[float, bool] = (-REACHABLE_FOR_S, False)

    def read_only(self) -> None:
        self.ended, self.controls = True, None

    async def why_not(self) -> str:
        """Why no action can be taken now ("" when they can)."""
        if self.controls is not None:
            return ""
        if self.ended:
            return ENDED
        at, reachable = self._looked
        if time.monotonic() - at >= REACHABLE_FOR_S:
            answer = await self._socket({"op": "ping"})
            reachable = bool(answer.get("ok"))
            self._looked = (time.monotonic(), reachable)
        return "" if reachable else NOT_RUNNING

    async def about(self, status: Any = None) -> dict[str, Any]:
        """What a page needs to show or hide its actions: ``actions`` and, without, ``actions_why``
        (which names the experiment's ``status`` when it is one it ended with)."""
        why = await self.why_not()
        if why == NOT_RUNNING and isinstance(status, str) and status and status != "RUNNING":
            why = f"the experiment is {status}: {why}"
        return {"actions": not why, "actions_why": why}

    async def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.controls is not None:
            return await self.controls.ask(body)
        answer = await self._socket(body)
        if answer.get("gone"):
            self._looked = (time.monotonic(), False)
        return answer


def add_routes(app: web.Application, acting: Acting, authorised: Callable[[web.Request], web.Response | None],
               knows: Callable[[str], Awaitable[bool]]) -> None:
    """The action routes. ``authorised`` refuses a request without the token (None: it may);
    ``knows`` says whether the store holds a trial."""

    async def act(request: web.Request, body: dict[str, Any], what: str) -> web.Response:
        refused = authorised(request)
        if refused is not None:
            return refused
        why = await acting.why_not()
        if why:
            return web.json_response({"error": why}, status=409)
        try:
            answer = await acting.ask(body)
        except (asyncio.TimeoutError, TimeoutError):
            return web.json_response({"error": f"the coordinator did not answer within {ACTION_TIMEOUT_S:g} s"},
                                     status=504)
        if not answer.get("ok"):
            return web.json_response({**answer, "error": answer.get("error") or "refused"}, status=409)
        log.info("%s asked from the dashboard", what)
        return web.json_response(answer)

    def trial_action(op: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            trial_id = request.match_info["id"]
            if authorised(request) is None and not await knows(trial_id):
                return web.json_response({"error": f"no trial {trial_id!r}"}, status=404)
            body = {"op": op, "trials": [trial_id], "from": "dashboard"}  # the trial's history says who asked
            return await act(request, body, f"trial {trial_id}: {op}")

        return handler

    async def body_of(request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": "the request's body is one JSON object"}, status=400)
        return body

    def with_body(op: str, field: str, kind: type, valid: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            refused = authorised(request)
            if refused is not None:
                return refused
            body = await body_of(request)
            if isinstance(body, web.Response):
                return body
            if op == "rerun" and body.get("failed") is True:
                return await act(request, {"op": "rerun", "failed": True}, "rerun of the failed trials")
            value = body.get(field)
            if not isinstance(value, kind) or not value:
                return web.json_response({"error": f"{field}: {valid} is needed"}, status=400)
            return await act(request, {"op": op, field: value}, op)

        return handler

    for op in TRIAL_ACTIONS:
        app.router.add_post(f"/api/trials/{{id}}/{op}", trial_action(op))
    app.router.add_post("/api/experiment/update", with_body(
        "update", "limits", dict, "an object of trialConcurrency, maxTrialNumber or maxExperimentDuration (seconds)"))
    app.router.add_post("/api/experiment/submit", with_body(
        "submit", "parameters", dict, "an object of the search space's parameter names to values"))
    app.router.add_post("/api/experiment/rerun", with_body(
        "rerun", "trials", list, "a list of trial ids (or failed: true)"))

    async def stop(request: web.Request) -> web.Response:
        return await act(request, {"op": "stop"}, "experiment stop")

    app.router.add_post("/api/experiment/stop", stop)
