"""Shared fixtures: configs, running async bodies, waiting with deadlines, leak checks."""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import sqlite3
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
from trialkeeper.coordinator.config.experiment import ExperimentConfig, parse_config
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.base import EnvironmentService
from trialkeeper.coordinator.store.store import Store, StoreError

T = TypeVar("T")
S = TypeVar("S", bound=EnvironmentService[Any])

# The generous ceiling for any single async test body; each waits on its own deadlines inside.
ASYNC_TEST_TIMEOUT_S = 90.0


# ---- configs --------------------------------------------------------------------------


def build_config(tmp_path: Path, **overrides: Any) -> ExperimentConfig:
    """A local-platform config whose trial code and experiments live in ``tmp_path``.

    ``trainingService`` and ``coordinator`` overrides are merged into the defaults;
    everything else replaces the top-level key.
    """
    data: dict[str, Any] = {
        "trialCommand": "python trial.py",
        "trialConcurrency": 2,
        "trainingService": {"platform": "local"},
        "trialCodeDirectory": str(tmp_path),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
    }
    for key, value in overrides.items():
        if key in ("trainingService", "coordinator") and isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    return parse_config(data, tmp_path)


@pytest.fixture
def make_config() -> Callable[..., ExperimentConfig]:
    """``make_config(tmp_path, **overrides)`` -> a parsed local-platform config."""
    return build_config


QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart"

def service_from_config(cls: type[S], config: ExperimentConfig, experiment_dir: Path) -> S:
    """The service of `config`'s platform, built as the coordinator builds it (through the
    platform registry and the service's `from_config`), checked to be a `cls`."""
    service = create_service(config, experiment_dir)
    assert isinstance(service, cls), f"{config.training_service.platform} gives a {type(service).__name__}"
    return service


def quickstart_code(tmp_path: Path, script: str | None = None) -> Path:
    """The quickstart's code in ``tmp_path/code`` (its config left out), with ``script`` as
    an extra ``trial.py`` when given."""
    code = tmp_path / "code"
    shutil.copytree(QUICKSTART, code, ignore=shutil.ignore_patterns("__pycache__", "config.yml"), dirs_exist_ok=True)
    if script:
        write_script(code, "trial.py", script)
    return code


def quickstart_data(tmp_path: Path, name: str, training_service: dict[str, Any]) -> dict[str, Any]:
    """The quickstart experiment, 4 trials 2 at a time, from ``tmp_path/code`` on
    ``training_service`` (a config as plain data, before parsing)."""
    return {
        "experimentName": name,
        "searchSpaceFile": "search_space.json",
        "trialCommand": "python3 train.py",
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "trialCodeDirectory": str(tmp_path / "code"),
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize", "seed": 7}},
        # Loose timers: a loaded machine must not make a slow agent look lost.
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 10, "trialLostTimeout": 30},
        "trainingService": training_service,
    }


# A trial that reports its parameter `x` as its final result; with `wait` set it first
# waits (60 s at most) until the file named by $GATE exists, so a test can act mid-trial.
GATED_TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
gate = pathlib.Path(os.environ["GATE"])
deadline = time.monotonic() + 60
while p.get("wait") and not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(float(p.get("x", 1)))
"""


def write_script(directory: Path, name: str, body: str) -> Path:
    """Write a trial script (dedented) into ``directory``; returns its path."""
    path = directory / name
    path.write_text(textwrap.dedent(body).lstrip(), encoding="utf-8")
    return path


@pytest.fixture
def script(tmp_path: Path) -> Callable[[str, str], Path]:
    """``script(name, body)`` writes a trial script into the trial code directory."""
    return lambda name, body: write_script(tmp_path, name, body)


# ---- async and waiting ----------------------------------------------------------------


def run_async(body: Callable[[], Awaitable[T]] | Awaitable[T], timeout: float = ASYNC_TEST_TIMEOUT_S) -> T:
    """Run an async test body on a fresh event loop, failing if it exceeds ``timeout``."""

    async def main() -> T:
        coro = body() if callable(body) else body
        return await asyncio.wait_for(coro, timeout)  # type: ignore[arg-type]

    return asyncio.run(main())


@pytest.fixture
def arun() -> Callable[..., Any]:
    return run_async


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, message: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(message or f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, message: str = ""
) -> Any:
    """:func:`wait_until` for use inside a running event loop (does not block the loop);
    ``predicate`` may be a coroutine function (a service's ``poll``, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(message or f"condition not met within {timeout} s: {predicate}")
        await asyncio.sleep(interval)


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    return wait_until


@pytest.fixture(name="async_wait_until")
def async_wait_until_fixture() -> Callable[..., Any]:
    return async_wait_until


def pid_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie waiting to be reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- leak check -----------------------------------------------------------------------


def _leftovers(tmp_path: Path) -> list[psutil.Process]:
    """Live processes this test started: our descendants, plus any trial or agent process
    that mentions the test's directory (trials run in their own sessions and can be
    orphaned away from our process tree)."""
    found: dict[int, psutil.Process] = {}
    me = psutil.Process()
    for p in me.children(recursive=True):
        found[p.pid] = p
    marker = str(tmp_path)
    uid = os.getuid()
    for p in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            if p.pid == me.pid or p.info["uids"] is None or p.info["uids"].real != uid:
                continue
            cmd = " ".join(p.info["cmdline"] or ())
            if marker in cmd:
                found.setdefault(p.pid, p)
                continue
            env = p.environ()
            if env.get("TRIALKEEPER_TRIAL_DIR", "").startswith(marker):
                found.setdefault(p.pid, p)
        except (psutil.Error, OSError):
            continue
    alive = []
    for p in found.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())}"
    except psutil.Error:
        return f"pid {p.pid}"


@pytest.fixture(autouse=True, scope="session")
def experiment_index_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Experiments the tests run are recorded in an index of the session's own (see
    store/index.py), not in the user's ~/.trialkeeper."""
    os.environ.setdefault("TRIALKEEPER_HOME", str(tmp_path_factory.mktemp("trialkeeper-home")))


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Any:
    """Integration tests must leave no agent and no trial process behind."""
    if "integration" not in Path(str(request.node.fspath)).parts:
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    yield
    try:
        wait_until(lambda: not _leftovers(tmp_path), timeout=10.0)
    except AssertionError:
        left = _leftovers(tmp_path)
        description = "; ".join(_describe(p) for p in left)
        for p in left:  # do not let one test's leak fail the next ones
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=5.0)
        pytest.fail(f"processes left running after the test: {description}")


def stored_rows(exp: Path, table: str) -> list[dict[str, Any]]:
    """The "trials" or "envs" rows of an experiment's store as a running coordinator has
    written them so far; [] while the store or its schema does not exist yet."""
    if not (exp / Store.FILENAME).exists():
        return []
    try:
        store = Store.in_dir(exp, readonly=True)
    except StoreError:
        return []
    try:
        return store.trials() if table == "trials" else store.envs()
    except sqlite3.Error:
        return []  # the schema is still being created
    finally:
        store.close()


def stored_metrics(exp: Path, trial_id: str) -> list[dict[str, Any]]:
    """A trial's stored metrics as dicts with the columns of a row per metric (idx, kind,
    value, value_json, reported_at), read from a finished experiment's store."""
    store = Store.in_dir(exp, readonly=True)
    try:
        return [{**r._asdict(), "idx": r.index} for r in store.metrics(trial_id)]
    finally:
        store.close()


def counted_metrics(db: sqlite3.Connection) -> int:
    """The metrics in a store, counted in its tables (a row per metric, or per run of them)."""
    (n,) = db.execute(
        "SELECT (SELECT count(*) FROM metrics) + (SELECT coalesce(sum(n), 0) FROM metric_runs)"
    ).fetchone()
    return int(n)


def environment(c: Any, env_id: str) -> Any:
    """A fresh snapshot of one environment of a coordinator (snapshots never change: a test
    that waits on an environment reads it anew each time)."""
    return next(e for e in c.environments() if e.id == env_id)


# ---- a real Kubernetes control plane ---------------------------------------------------------


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the Kubernetes cluster run last: in CI its binaries may still be building in
    the background (.ci/run starts that first), and everything else can run meanwhile. The
    first of them starts the cluster (and may wait for that build): it gets the time for it."""
    def on_cluster(item: pytest.Item) -> bool:
        return "kube_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("kube") is not None

    items.sort(key=on_cluster)
    # So does the first to start an operator: CI builds the operators in the background too.
    starters = [next((item for item in items if on_cluster(item)), None)]
    starters += [next((item for item in items if name in getattr(item, "fixturenames", ())), None)
                 for name in ("kubeflow_operator", "adaptdl_scheduler")]
    if any(starters):
        from kube.cluster import BUILD_WAIT_S, START_TIMEOUT_S

        for first in {id(i): i for i in starters if i is not None}.values():
            first.add_marker(pytest.mark.timeout(BUILD_WAIT_S + START_TIMEOUT_S + 120))


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """etcd, kube-apiserver and kube-controller-manager on 127.0.0.1 with a stand-in kubelet as
    the one node (tests/kube); fails in CI and skips elsewhere when they cannot start."""
    from kube.cluster import session_cluster

    yield from session_cluster(tmp_path_factory)


@pytest.fixture(scope="session")
def kubeflow_operator(kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Kubeflow's training operator (TFJob, PyTorchJob) running against ``kube_cluster``, with
    its own CRDs and validating webhooks (tests/kube/operators.py)."""
    from kube.operators import session_training_operator

    yield from session_training_operator(kube_cluster, tmp_path_factory)


@pytest.fixture(scope="session")
def framework_controller(kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """FrameworkController against ``kube_cluster``, where a binary of it is given
    (tests/kube/operators.py says how); skipped without one."""
    from kube.operators import session_framework_controller

    yield from session_framework_controller(kube_cluster, tmp_path_factory)


@pytest.fixture(scope="session")
def adaptdl_scheduler(kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """AdaptDL's scheduler (its controller and allocator) against ``kube_cluster``."""
    from kube.operators import session_adaptdl_scheduler

    yield from session_adaptdl_scheduler(kube_cluster, tmp_path_factory)
