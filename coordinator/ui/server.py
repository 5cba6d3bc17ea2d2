"""The dashboard's web server (aiohttp): pages, the JSON API, live updates by server-sent
events, the actions, and Prometheus's ``/metrics``.

It reads the experiment's store through a read model of its own, on a loop of its own: run
beside a live experiment (``trialkeeper run --ui``) it serves from a thread, so a heavy page
never holds up the coordinator; ``trialkeeper ui`` serves a stored experiment the same way.

Who may do what: bound to a loopback address, anyone on this machine may read; bound
elsewhere, every read needs the token too. Actions always need it, in an ``Authorization:
Bearer`` header (never a cookie, so another site cannot make a browser act). The token is
the experiment's own (its ``.token`` file) or one given with ``TRIALKEEPER_UI_TOKEN``; it
never appears in a page or an answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from ..read.model import ReadModel
from ..read.pages import PageError
from ..store.reads import StoreError
from . import export, plots, views
from .actions import Acting, Controls, add_routes
from .context import context
from .live import LiveChanges
from .metrics import metrics_text

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
UI_TOKEN_ENV = "TRIALKEEPER_UI_TOKEN"
COOKIE = "trialkeeper_ui"
LIVE_INTERVAL_S = 1.0  # how often the live stream looks for changes
KEEPALIVE_S = 15.0
START_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 2.0
PUBLIC = ("page", "static", "login")  # the routes that need no token: the page asks for it
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"
# Every answer's, unless it says otherwise: not cached, its type as said, and scripts only
# from the package (a value a trial reported can never run as code), and no framing (no other
# site can overlay the Cancel button).
SAFE_HEADERS = {
    "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
}


class DashboardError(ValueError):
    """The dashboard cannot serve as asked (a bad address, a port taken, no token)."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT``, ``PORT`` or ``HOST`` (the default port)."""
    host, sep, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not sep and text.isdigit():
        host, port = "", text
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise DashboardError(f"--ui: {text!r} is not HOST:PORT (a port is a number from 0 to 65535)") from None
    if not 0 <= number <= 65535:
        raise DashboardError(f"--ui: port {number} is not between 0 and 65535")
    return host, number


def is_loopback(host: str) -> bool:
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):  # names a browser keeps on this machine
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(experiment_dir: Path) -> str:
    """The token the dashboard asks for: ``TRIALKEEPER_UI_TOKEN``, else the experiment's own."""
    given = os.environ.get(UI_TOKEN_ENV, "").strip()
    if given:
        return given
    try:
        return (experiment_dir / ".token").read_text().strip()
    except OSError:
        return ""


def _static() -> Any:
    return resources.files("trialkeeper.coordinator.ui").joinpath("static")


def build_app(
    experiment_dir: Path, *, token: str, open_reads: bool, controls: Controls | None = None
) -> web.Application:
    """The dashboard of the experiment in ``experiment_dir``. ``open_reads``: pages and reads
    need no token (a loopback bind)."""
    state = _State(experiment_dir, token, open_reads, controls)
    app = web.Application(middlewares=[state.guard])
    app[STATE] = state
    app.router.add_get("/", state.index, name=PUBLIC[0])
    app.router.add_get("/static/{path:.+}", state.static, name=PUBLIC[1])
    app.router.add_post("/api/login", state.login, name=PUBLIC[2])
    app.router.add_get("/api/experiment", state.view(lambda m, r: views.overview(m), actions=True))
    app.router.add_get("/api/trials", state.view(lambda m, r: views.trials(m, r.query)))
    app.router.add_get("/api/trials/export", state.export)  # before /api/trials/{id}, which it would match
    app.router.add_get(
        "/api/trials/{id}", state.view(lambda m, r: views.trial(m, r.match_info["id"]), actions=True)
    )
    app.router.add_get("/api/trials/{id}/log", state.view(lambda m, r: views.log(
        m, r.match_info["id"], r.query.get("stream", "stdout"), views.int_arg(r.query, "offset", 0),
        r.query.get("nni_results") == "1", tail=views.int_arg(r.query, "tail", 0),
        before=views.int_arg(r.query, "before", -1) if "before" in r.query else None)))
    app.router.add_get("/api/trials/{id}/log/download", state.download)
    app.router.add_get("/api/compare", state.view(lambda m, r: plots.compare(m, r.query)))
    app.router.add_get("/api/importance", state.importance)
    app.router.add_get("/api/environments", state.view(lambda m, r: views.environments(m, r.query)))
    app.router.add_get(
        "/api/environments/{id}/gpus", state.view(lambda m, r: views.environment_gpus(m, r.match_info["id"]))
    )
    app.router.add_get("/api/context", state.view(lambda m, r: context(m), actions=True))
    app.router.add_get("/api/events", state.events)
    add_routes(app, state.acting, state.authorised, state.knows)
    app.router.add_get("/metrics", state.metrics)
    app.on_cleanup.append(state.close)
    return app


class _State:
    def __init__(self, experiment_dir: Path, token: str, open_reads: bool, controls: Controls | None) -> None:
        self.experiment_dir = experiment_dir
        self.token = token
        self.open_reads = open_reads
        self.acting = Acting(experiment_dir, controls)
        self._model: ReadModel | None = None
        # Reads run on one thread of their own: a slow one (a parameter sort over 100,000
        # trials) never holds up the server's loop, so pages, live streams and actions keep
        # answering; one thread, because a SQLite connection stays on the thread that opened it.
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dashboard-reads")
        self.live = LiveChanges(self._change_marker, LIVE_INTERVAL_S)

    def _model_here(self) -> ReadModel:
        if self._model is None:  # opened on first use, on the reading thread
            self._model = ReadModel.open(self.experiment_dir)
        return self._model

    async def read(self, fn: Callable[[ReadModel], T]) -> T:
        """``fn`` of the read model, run on the reading thread."""
        return await asyncio.get_running_loop().run_in_executor(self._reader, lambda: fn(self._model_here()))

    async def _change_marker(self) -> dict[str, Any]:
        try:
            marker = await self.read(views.change_marker)
        except StoreError as e:
            return {"error": str(e)}
        # A page redraws its actions when they come or go.
        return {**marker, **await self.acting.about(marker.get("status"))}

    def read_only(self) -> None:
        """The run this dashboard served has ended: it goes on serving the store, and acts no more."""
        self.acting.read_only()

    async def close(self, app: web.Application) -> None:
        await self.live.close()
        def close_model() -> None:
            if self._model is not None:
                self._model.close()

        await asyncio.get_running_loop().run_in_executor(self._reader, close_model)
        self._reader.shutdown(wait=False)

    # -- who may

    def _presented(self, request: web.Request, *, cookie: bool) -> str:
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return header.removeprefix("Bearer ").strip()
        return request.cookies.get(COOKIE, "") if cookie else ""

    def _valid(self, presented: str) -> bool:
        return bool(self.token) and hmac.compare_digest(presented.encode(), self.token.encode())

    @web.middleware
    async def guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        public = request.match_info.route.name in PUBLIC  # (also under the prefix of the experiments home)
        if self.open_reads and not is_loopback(_host_name(request.host)):
            # Open reads are for this machine: a page of another site that has its name point
            # at 127.0.0.1 (DNS rebinding) still sends its own name, and is refused.
            return _error(403, f"this dashboard answers only to a loopback address or localhost, not {request.host!r}")
        if not (self.open_reads or public or self._valid(self._presented(request, cookie=True))):
            return _error(
                401,
                "this dashboard needs the experiment's token (log in on the page, or send Authorization: Bearer TOKEN)",
            )
        response = await handler(request)
        if not response.prepared:  # (a streamed answer has sent them already)
            for name, value in SAFE_HEADERS.items():
                response.headers.setdefault(name, value)
        return response

    async def login(self, request: web.Request) -> web.Response:
        """Trade the token for a cookie, so the page's live stream (which sends no headers) may read."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        presented = body.get("token", "") if isinstance(body, dict) else ""
        if not isinstance(presented, str) or not self._valid(presented):
            return _error(403, "wrong token")
        response = web.json_response({"ok": True})
        response.set_cookie(COOKIE, presented, httponly=True, samesite="Strict", path="/")
        return response

    # -- pages

    async def index(self, request: web.Request) -> web.Response:
        html = _static().joinpath("index.html").read_text(encoding="utf-8")
        return web.Response(text=html, content_type="text/html")

    async def static(self, request: web.Request) -> web.Response:
        parts = request.match_info["path"].split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise web.HTTPNotFound()
        node = _static()
        for p in parts:
            node = node.joinpath(p)
        if not node.is_file():
            raise web.HTTPNotFound()
        kinds = {".js": "application/javascript", ".css": "text/css", ".html": "text/html"}
        kind = kinds.get(Path(parts[-1]).suffix, "text/plain")
        return web.Response(body=node.read_bytes(), content_type=kind, headers={"Cache-Control": "max-age=3600"})

    # -- the JSON API

    def view(
        self, view: Callable[[ReadModel, web.Request], Any], *, actions: bool = False
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        """``view``'s answer; with ``actions``, whether the page may offer the actions (see actions.py)."""

        async def handler(request: web.Request) -> web.Response:
            try:
                data = await self.read(lambda m: view(m, request))
                if actions:
                    data.update(await self.acting.about(data.get("status")))
                return web.json_response(data, dumps=_dumps)
            except views.NotFound as e:
                return _error(404, str(e))
            except (PageError, ValueError) as e:
                return _error(400, str(e))
            except StoreError as e:
                return _error(503, str(e))

        return handler

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``change`` whenever the experiment's counts, metrics or best trial
        change (the page then fetches what it shows), and a comment now and then to keep
        proxies from closing the stream."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await response.prepare(request)
        try:
            async with self.live.follow() as next_change:
                while True:
                    marker = await next_change(KEEPALIVE_S)
                    if marker is None:
                        await response.write(b": keepalive\n\n")
                    else:
                        await response.write(f"event: change\ndata: {_dumps(marker)}\n\n".encode())
        except ConnectionResetError:
            pass  # the page went away
        return response

    async def download(self, request: web.Request) -> web.StreamResponse:
        """A trial's whole stdout or stderr as a file (a page shows only its end)."""
        trial_id, stream = request.match_info["id"], request.query.get("stream", "stdout")
        try:
            path = await self.read(lambda m: views.log_path(m, trial_id, stream))
        except views.NotFound as e:
            return _error(404, str(e))
        except ValueError as e:
            return _error(400, str(e))
        except StoreError as e:
            return _error(503, str(e))
        if not path.is_file():
            return _error(404, f"trial {trial_id} has written no {stream}")
        name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{trial_id}-{stream}.log")
        return web.FileResponse(path, headers={
            "Content-Disposition": f'attachment; filename="{name}"', "Content-Type": "text/plain; charset=utf-8",
        })

    async def importance(self, request: web.Request) -> web.Response:
        """Parameter importance: its trials read on the reading thread, computed (a while, the
        first time) on another, so the other pages go on answering meanwhile."""
        try:
            found = await self.read(plots.importance_input)
            if isinstance(found, plots.Pending):
                found = await asyncio.get_running_loop().run_in_executor(None, plots.importance_of, found)
        except StoreError as e:
            return _error(503, str(e))
        return web.json_response(found, dumps=_dumps)

    async def export(self, request: web.Request) -> web.StreamResponse:
        """The trials table as a CSV or JSON file, read on a thread and a connection of its own
        (a hundred thousand trials take seconds, and hold up no other page meanwhile), and sent
        as it is written: the first rows leave before the last are read."""
        query = dict(request.query)
        loop = asyncio.get_running_loop()
        try:
            model = await loop.run_in_executor(None, ReadModel.open, self.experiment_dir)
        except StoreError as e:
            return _error(503, str(e))
        try:
            try:
                asked = await loop.run_in_executor(None, export.plan, model, query)
            except (PageError, ValueError) as e:
                return _error(400, str(e))
            except StoreError as e:
                return _error(503, str(e))
            name = re.sub(r"[^A-Za-z0-9._-]", "_", asked.name)
            response = web.StreamResponse(headers={
                **SAFE_HEADERS, "Content-Type": f"{asked.content_type}; charset=utf-8",
                "Content-Disposition": f'attachment; filename="{name}"',
            })
            pieces = export.pieces(model, asked)
            await response.prepare(request)
            try:
                while (piece := await loop.run_in_executor(None, next, pieces, None)) is not None:
                    await response.write(piece.encode())
            except StoreError as e:  # too late for an error status: the download breaks off, and the log says why
                log.error("the export of %s ended early: %s", self.experiment_dir, e)
                raise
            await response.write_eof()
            return response
        finally:
            await loop.run_in_executor(None, model.close)

    # -- actions

    def authorised(self, request: web.Request) -> web.Response | None:
        """None when ``request`` may act: it carries the token in its Authorization header."""
        if not self.token:
            return _error(403, "no token is set for this dashboard, so it takes no actions")
        if not self._valid(self._presented(request, cookie=False)):
            return _error(403, "actions need the experiment's token in an Authorization: Bearer header")
        return None

    async def knows(self, trial_id: str) -> bool:
        return await self.read(lambda m: m.trial(trial_id)) is not None

    # -- Prometheus

    async def metrics(self, request: web.Request) -> web.Response:
        controls = self.acting.controls
        scheduling = controls.scheduling if controls is not None else None
        try:
            passes = scheduling() if scheduling else None
            body, kind = await self.read(lambda m: metrics_text(m, passes))
        except StoreError as e:
            return _error(503, str(e))
        return web.Response(body=body, headers={"Content-Type": kind})


STATE = web.AppKey("state", _State)  # the app's own state, for whoever holds the app


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8080`` -> ``::1``."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, default=str)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


# ---- serving ---------------------------------------------------------------------------


def check_bind(host: str, token: str) -> None:
    if not is_loopback(host) and not token:
        raise DashboardError(
            f"the dashboard binds {host}, beyond this machine, only with a token: the experiment's .token file "
            f"is missing, so set {UI_TOKEN_ENV}"
        )


def bind(host: str, port: int) -> socket.socket:
    """The dashboard's listening socket, bound now: a port already taken is told before anything
    else starts (``run --ui`` binds it before the coordinator launches a single agent)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise DashboardError(f"the dashboard cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does: a restart reuses the port at once
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise DashboardError(f"the dashboard cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


async def serve(app: web.Application, sock: socket.socket) -> tuple[web.AppRunner, str]:
    """Start serving ``app`` on ``sock`` (from :func:`bind`); returns its runner and the URL it answers on."""
    # Open live streams never end by themselves: shutting down waits for them only briefly.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    host, port = sock.getsockname()[:2]
    await web.SockSite(runner, sock).start()
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{port}/"


class DashboardThread:
    """The dashboard served from a thread of its own, beside a running experiment, on a
    socket :func:`bind` made (the thread owns it from here on, and closes it)."""

    def __init__(self, experiment_dir: Path, sock: socket.socket, controls: Controls | None = None) -> None:
        host = sock.getsockname()[0]
        self.token = read_token(experiment_dir)
        check_bind(host, self.token)
        self._args = (experiment_dir, host, sock, controls)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._state: _State | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="dashboard", daemon=True)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise DashboardError(f"the dashboard did not start within {START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise self._error
        return self.url

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        experiment_dir, host, sock, controls = self._args
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        app = build_app(experiment_dir, token=self.token, open_reads=is_loopback(host), controls=controls)
        self._state = app[STATE]
        runner, self.url = await serve(app, sock)
        self._ready.set()
        try:
            await self._stopped.wait()
        finally:
            await runner.cleanup()

    def read_only(self) -> None:
        """The experiment's run has ended: serve its store on, taking no actions."""
        if self._state is not None:
            self._state.read_only()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopped is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(timeout)


async def serve_forever(
    experiment_dir: Path, host: str, port: int, on_url: Callable[[str], None],
    build: Callable[..., web.Application] = build_app,
) -> None:
    """``trialkeeper ui``: serve a stored experiment (or with ``build``, another app of a
    directory: the experiments home) until cancelled."""
    token = read_token(experiment_dir)
    check_bind(host, token)
    app = build(experiment_dir, token=token, open_reads=is_loopback(host))
    runner, url = await serve(app, bind(host, port))
    on_url(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
