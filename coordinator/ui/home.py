"""The experiments home: ``trialkeeper ui --dir DIR`` (and ``view --dir DIR``) lists every
experiment in DIR's subdirectories, with its status, progress, best result and start, and
compares two or more of them: their best-so-far curves and their parameters' distributions.

Each experiment opens at ``/x/NAME/`` (NAME: its directory's name in DIR), served by the
same dashboard app ``trialkeeper ui EXP`` serves (``server.build_app``), built when it is
first asked for, its routes under that prefix: its pages, its live stream and its actions
(through its control socket, with its own token) are those of a dashboard of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractResource, AbstractRoute

from ..control.client import alive
from ..read import pages
from ..read.kept import Kept
from ..read.model import ReadModel, to_json
from ..store.reads import FILENAME, StoreError, holds_experiment
from .server import PUBLIC, _State, build_app, read_token

PREFIX = "/x"
PING_S = 2.0  # how long a running experiment's coordinator has to answer the list's look
CRASHED = "no coordinator answers: it crashed or was killed (`trialkeeper resume` carries it on)"
COMPARED = 8  # experiments one comparison takes at most
SAMPLE = 500  # trials of each experiment whose parameters a comparison draws
CURVE_POINTS = 200


def experiment_dirs(directory: Path) -> list[Path]:
    """The subdirectories of ``directory`` that hold an experiment, by name."""
    try:
        return sorted(p for p in directory.iterdir() if p.is_dir() and holds_experiment(p))
    except OSError:
        return []


def _max_trials(config: Mapping[str, Any] | None) -> int | None:
    value = (config or {}).get("maxTrialNumber")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _row(path: Path) -> dict[str, Any]:
    """One experiment's line in the list (``error`` when its store cannot be read)."""
    row: dict[str, Any] = {"key": path.name}
    try:
        with ReadModel.open(path) as model:
            exp, config = model.experiment(), model.stored_config()
    except StoreError as e:
        return {**row, "error": str(e)}
    if exp is None:
        return {**row, "error": "the store holds no experiment"}
    best = exp.best
    return {
        **row, "id": exp.id, "name": exp.name, "status": exp.status, "reason": exp.reason,
        "started_at": exp.started_at, "ended_at": exp.ended_at, "optimize_mode": exp.optimize_mode,
        "trials": dict(exp.trials), "trial_count": exp.trial_count,
        "ended": sum(n for s, n in exp.trials.items() if s not in ("WAITING", "RUNNING", "PAUSED")),
        "max_trials": _max_trials(config),
        "best": {"id": best.id, "final_metric": to_json(best.final_metric)} if best is not None else None,
    }


def _written(path: Path) -> tuple[tuple[int, int], ...]:
    """When and how much the experiment's store (its database and write-ahead log) was last written."""
    found = []
    for name in (FILENAME, FILENAME + "-wal"):
        try:
            st = (path / name).stat()
        except OSError:
            continue
        found.append((st.st_mtime_ns, st.st_size))
    return tuple(found)


class Listing:
    """Every experiment in a directory, newest first. An experiment's store is read again only
    once it has been written since (a directory of hundreds of ended experiments costs a look
    at their files); a running one whose coordinator does not answer is said to have crashed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._seen: dict[str, tuple[tuple[tuple[int, int], ...], dict[str, Any]]] = {}

    def __call__(self) -> dict[str, Any]:
        rows, seen = [], {}
        for path in experiment_dirs(self.directory):
            written = _written(path)
            known = self._seen.get(path.name)
            row = known[1] if known is not None and known[0] == written else _row(path)
            seen[path.name] = (written, row)
            if row.get("status") == "RUNNING" and not row["reason"] and not alive(path, timeout=PING_S):
                row = {**row, "reason": CRASHED}
            rows.append(row)
        self._seen = seen
        rows.sort(key=lambda r: -(r.get("started_at") or 0.0))
        return {"directory": str(self.directory), "experiments": rows}


def listing(directory: Path) -> dict[str, Any]:
    """Every experiment in ``directory``, read now (see :class:`Listing`)."""
    return Listing(directory)()


def compare(directory: Path, keys: list[str]) -> dict[str, Any]:
    """For each experiment named: its best result as trials ended, and a sample of its trials'
    parameters and final metrics, with the search space's type of each parameter."""
    if not 2 <= len(keys) <= COMPARED:
        raise ValueError(f"keys: name 2 to {COMPARED} experiments (their directories' names), comma-separated")
    known = {p.name: p for p in experiment_dirs(directory)}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise LookupError(f"no experiment {', '.join(map(repr, unknown))} in {directory}")
    out = []
    for key in keys:
        with ReadModel.open(known[key]) as model:
            out.append(_compared.get(model, ("home", key), functools.partial(_comparable, model, key)))
    return {"experiments": out}


_compared: Kept[dict[str, Any]] = Kept()  # each experiment's part, kept until its trials change


def _comparable(model: ReadModel, key: str) -> dict[str, Any]:
    """An experiment as the comparison of experiments shows it."""
    exp = model.experiment()
    if exp is None:
        raise LookupError(f"no experiment in {model.experiment_dir}")
    space = (model.stored_config() or {}).get("searchSpace") or {}
    series = pages.ended_series(model, exp.optimize_mode, CURVE_POINTS)
    sample = pages.sample(model, SAMPLE)
    return {
        "key": key, "id": exp.id, "name": exp.name, "optimize_mode": exp.optimize_mode,
        "started_at": exp.started_at,
        "best_curve": [[p.ended, p.best, p.at] for p in series if p.best is not None],
        "space": {str(n): s.get("_type") for n, s in space.items() if isinstance(s, Mapping)},
        "trials": [{"parameters": t.parameters or {}, "final_metric": to_json(t.final_metric)} for t in sample],
    }


class _Experiments(AbstractResource):
    """``/x/NAME/...``: resolved by the dashboard app of experiment NAME (built when first asked for)."""

    def __init__(self, home: _Home) -> None:
        super().__init__()
        self._home = home

    @property
    def canonical(self) -> str:
        return PREFIX

    def url_for(self, *args: str, **kwargs: str) -> Any:
        raise RuntimeError("the experiments' pages have no URL to build")

    def get_info(self) -> dict[str, Any]:
        return {"prefix": PREFIX}

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("the experiments home is not a sub-application")

    def raw_match(self, path: str) -> bool:
        return False

    async def resolve(self, request: web.Request) -> tuple[Any, set[str]]:
        parts = request.rel_url.path.split("/")
        if len(parts) < 4 or parts[1] != PREFIX.strip("/"):
            return None, set()
        app = await self._home.experiment_app(parts[2])
        if app is None:
            return None, set()
        match_info = await app.router.resolve(request)
        match_info.add_app(app)
        exception = match_info.http_exception
        return match_info, set(exception.allowed_methods) if isinstance(exception, web.HTTPMethodNotAllowed) else set()

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[AbstractRoute]:
        return iter(())


class _Home:
    # The same rules as an experiment's dashboard: who may read, and the token's cookie.
    _presented = _State._presented
    _valid = _State._valid
    guard = _State.guard
    login = _State.login
    static = _State.static

    def __init__(self, directory: Path, token: str, open_reads: bool) -> None:
        self.directory = directory
        self.token = token
        self.open_reads = open_reads
        self.apps: dict[str, web.Application] = {}
        self.listing = Listing(directory)
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="home-reads")

    async def experiment_app(self, name: str) -> web.Application | None:
        app = self.apps.get(name)
        if app is not None:
            return app
        path = self.directory / name
        if name in ("", ".", "..") or "/" in name or not holds_experiment(path):
            return None
        app = build_app(path, token=read_token(path), open_reads=self.open_reads)
        router = app.router
        for resource in router.resources():  # as aiohttp mounts a sub-application under a prefix
            router.unindex_resource(resource)
            resource.add_prefix(f"{PREFIX}/{name}")
            router.index_resource(resource)
        app.freeze()
        self.apps[name] = app
        await app.startup()
        return app

    async def page(self, request: web.Request) -> web.Response:
        html = resources.files("trialkeeper.coordinator.ui").joinpath("static", "home.html").read_text("utf-8")
        return web.Response(text=html, content_type="text/html")

    async def _answer(self, fn: Callable[[], Any]) -> web.Response:
        try:
            data = await asyncio.get_running_loop().run_in_executor(self._reader, fn)
        except LookupError as e:
            return web.json_response({"error": str(e)}, status=404)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        except StoreError as e:
            return web.json_response({"error": str(e)}, status=503)
        return web.json_response(data)

    async def experiments(self, request: web.Request) -> web.Response:
        return await self._answer(self.listing)

    async def compared(self, request: web.Request) -> web.Response:
        keys = [k for k in request.query.get("keys", "").split(",") if k]
        return await self._answer(lambda: compare(self.directory, keys))

    async def close(self, app: web.Application) -> None:
        for sub in self.apps.values():
            await sub.cleanup()
        self._reader.shutdown(wait=False)


def build_home(directory: Path, *, token: str, open_reads: bool) -> web.Application:
    """The experiments home of ``directory``."""
    home = _Home(directory, token, open_reads)
    app = web.Application(middlewares=[home.guard])
    app.router.add_get("/", home.page, name=PUBLIC[0])
    app.router.add_get("/static/{path:.+}", home.static, name=PUBLIC[1])  # the package's files, as any dashboard
    app.router.add_post("/api/login", home.login, name=PUBLIC[2])
    app.router.add_get("/api/home", home.experiments)
    app.router.add_get("/api/home/compare", home.compared)
    app.router.register_resource(_Experiments(home))
    app.on_cleanup.append(home.close)
    return app
