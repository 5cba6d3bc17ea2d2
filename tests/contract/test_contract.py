"""The environment-service contract, run against every platform a harness brings up.

Each ``harness_<name>.py`` beside this file names the platforms it covers (``PLATFORMS``)
and a fixture ``<name>_training_service`` giving the ``trainingService`` section for one of
them (see README, "Writing a platform plug-in"). Every test below runs once per (harness,
platform) pair, through the public :class:`EnvironmentService` API only, against a real
gRPC endpoint on 127.0.0.1 that the agents dial and register with.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import psutil
import pytest
from conftest import async_wait_until, run_async
from trialkeeper.coordinator.config.experiment import parse_config
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.base import EnvironmentRequest, EnvironmentService
from trialkeeper.coordinator.transport.server import AgentLink, Servicer, create_server

HERE = Path(__file__).resolve().parent
HARNESS_ENV = "TRIALKEEPER_CONTRACT_HARNESSES"  # more harness files, os.pathsep-separated
# Generous for cluster platforms (a job queued, a pod scheduled); local agents take ~1 s.
# Every harness's real platform, each test a round trip: left out of the fast subset.
pytestmark = pytest.mark.slow

REGISTER_S = 60.0
GONE_S = 30.0
LIVE = ("starting", "running")


# ---- harness discovery -------------------------------------------------------------------


def _load(path: Path) -> ModuleType:
    name = path.stem.removeprefix("harness_")
    spec = importlib.util.spec_from_file_location(f"_contract_harness_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _is_fixture(value: object) -> bool:
    return type(value).__name__ == "FixtureFunctionDefinition" or hasattr(value, "_pytestfixturefunction")


def _discover() -> tuple[list[Any], dict[str, str]]:
    """(pytest params of (harness, platform), import errors by harness); copies the
    harnesses' fixtures into this module so that pytest collects them.

    tests/contract is no package and has no conftest: each ``harness_<name>.py`` is loaded
    by path, and its fixtures live on here."""
    params: list[Any] = []
    broken: dict[str, str] = {}
    # A plug-in's own harness, kept in its own repository, joins through the environment.
    extra = [Path(p).resolve() for p in os.environ.get(HARNESS_ENV, "").split(os.pathsep) if p]
    for path in [*sorted(HERE.glob("harness_*.py")), *extra]:
        name = path.stem.removeprefix("harness_")
        try:
            module = _load(path)
            platforms = tuple(module.PLATFORMS)
            getattr(module, f"{name}_training_service")
        except Exception as e:  # noqa: BLE001 - reported as that harness's failing test
            broken[name] = f"{path.name} cannot be loaded: {type(e).__name__}: {e}"
            params.append(pytest.param(name, "", id=f"{name}-broken"))
            continue
        for attr, value in vars(module).items():
            if _is_fixture(value) and attr not in globals():
                globals()[attr] = value
        marks = tuple(getattr(module, "MARKS", ()))  # e.g. pytest.mark.kube: run after the rest
        params += [pytest.param(name, p, id=p if p == name else f"{name}-{p}", marks=marks) for p in platforms]
    return params, broken


HARNESSES, BROKEN = _discover()


# ---- the coordinator end agents dial -------------------------------------------------------


@dataclass
class Endpoint:
    """A real gRPC coordinator server that accepts agents and remembers who registered."""

    token: str
    address: str = ""
    instances: dict[str, set[str]] = field(default_factory=dict)  # env id -> agent instance ids
    links: dict[str, AgentLink] = field(default_factory=dict)

    def agent_connected(self, registered: ev.AgentRegistered, link: AgentLink) -> ev.RefuseAgent | None:
        self.instances.setdefault(registered.env_id, set()).add(registered.instance_id)
        self.links[registered.env_id] = link
        link.send(ev.Welcome(experiment_id="", acked_seq=0, heartbeat_interval_s=1.0, cancel_trial_ids=()))
        return None

    def agent_event(self, event: ev.AgentReported | ev.HeartbeatReceived, link: AgentLink) -> None:
        if isinstance(event, ev.AgentReported) and event.seq:
            link.ack(event.seq)

    def agent_disconnected(self, env_id: str, link: AgentLink) -> None:
        if self.links.get(env_id) is link:
            del self.links[env_id]

    def agent_note(self, env_id: str, trial_id: str, text: str) -> None:
        raise AssertionError(f"a real agent sent a metric the coordinator refuses: {text}")

    def connected(self, env_id: str) -> bool:
        link = self.links.get(env_id)
        return link is not None and not link.closed

    def shut_down(self, env_id: str) -> None:
        """What the coordinator does before ``stop``: ask the agent to exit over its stream."""
        link = self.links.get(env_id)
        if link is not None:
            link.send(ev.Shutdown(drain=False, grace_s=1.0, reason="contract test"))


@contextlib.asynccontextmanager
async def endpoint() -> AsyncIterator[Endpoint]:
    ep = Endpoint(token=secrets.token_urlsafe(24))
    server: grpc.aio.Server
    server, port = await create_server("127.0.0.1:0", Servicer(ep, ep.token))
    ep.address = f"127.0.0.1:{port}"
    try:
        yield ep
    finally:
        await server.stop(0.5)


# ---- one experiment on one platform --------------------------------------------------------


@dataclass
class Case:
    """The experiment a test runs: its config, directory, id, and the services it made."""

    harness: str
    platform: str
    section: dict[str, Any]
    tmp_path: Path
    experiment_id: str = field(default_factory=lambda: "ct" + secrets.token_hex(4))
    services: list[EnvironmentService] = field(default_factory=list)
    started: dict[EnvironmentService, set[str]] = field(default_factory=dict)

    @property
    def experiment_dir(self) -> Path:
        return self.tmp_path / "experiments" / self.experiment_id

    def service(self) -> EnvironmentService:
        """A brand-new service for this experiment, as ``create_service`` builds it."""
        code = self.tmp_path / "code"
        code.mkdir(exist_ok=True)
        (code / "trial.py").write_text("print('contract')\n")
        config = parse_config(
            {
                "trialCommand": "python3 trial.py",
                "trialConcurrency": 2,
                "trialCodeDirectory": str(code),
                "experimentWorkingDirectory": str(self.tmp_path / "experiments"),
                "trainingService": self.section,
            },
            self.tmp_path,
        )
        self.experiment_dir.mkdir(parents=True, exist_ok=True)
        service = create_service(config, self.experiment_dir)
        self.services.append(service)
        return service

    def request(self, ep: Endpoint, env_id: str, *extra_args: str) -> EnvironmentRequest:
        return EnvironmentRequest(
            env_id=env_id, experiment_id=self.experiment_id, coordinator_address=ep.address, token=ep.token,
            agent_args=("--reconnect-window", "5", *extra_args),
        )

    async def start(self, service: EnvironmentService, request: EnvironmentRequest) -> str:
        self.started.setdefault(service, set()).add(request.env_id)
        result = await service.start(request)
        assert result.error is None, f"start of {request.env_id} failed: {result.error}"
        assert result.platform_id, "start returned no platform id"
        return result.platform_id

    async def cleanup(self, *, sweep: bool) -> None:
        """Stop what the test started, close every service, and (after a failure, when it
        may have been left) sweep what is left."""
        for service, env_ids in self.started.items():
            for env_id in env_ids:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(service.stop(env_id, 1.0), 60.0)
        for service in self.services:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(service.close(), 60.0)
        if not sweep:
            return
        last = self.service()
        try:
            await asyncio.wait_for(last.sweep(self.experiment_id), 60.0)
        finally:
            await last.close()


def _case(request: pytest.FixtureRequest, harness: str, platform: str, tmp_path: Path) -> Case:
    if harness in BROKEN:
        pytest.fail(BROKEN[harness])
    make_section: Callable[[str, Path], dict[str, Any]] = request.getfixturevalue(f"{harness}_training_service")
    section = make_section(platform, tmp_path)
    assert section.get("platform") == platform, f"harness {harness} gave a section for {section.get('platform')!r}"
    return Case(harness, platform, section, tmp_path)


def _contract(body: Callable[[Case, Endpoint], Any]) -> Callable[..., None]:
    """Turn ``async body(case, endpoint)`` into a test run once per (harness, platform)."""

    @pytest.mark.parametrize(("harness", "platform"), HARNESSES)
    def test(request: pytest.FixtureRequest, harness: str, platform: str, tmp_path: Path) -> None:
        case = _case(request, harness, platform, tmp_path)

        async def main() -> None:
            async with endpoint() as ep:
                passed = False
                try:
                    await body(case, ep)
                    passed = True
                finally:
                    await case.cleanup(sweep=not passed)

        run_async(main, timeout=110.0)

    test.__name__ = body.__name__
    test.__doc__ = body.__doc__
    return test


async def _state(service: EnvironmentService, env_id: str) -> str:
    seen = await service.poll([env_id])
    assert set(seen) == {env_id}, f"poll answered for {sorted(seen)}, asked for {env_id}"
    return seen[env_id].state


async def _wait_state(service: EnvironmentService, env_id: str, wanted: tuple[str, ...], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = await _state(service, env_id)
        if state in wanted:
            return state
        assert time.monotonic() < deadline, f"{env_id} is {state!r}, not {wanted}, after {timeout} s"
        await asyncio.sleep(0.1)


def _argv_holding(secret: str) -> list[int]:
    """Pids of this machine's processes with ``secret`` on their command line."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(secret in arg for arg in p.info["cmdline"] or ()):
                found.append(p.pid)
    return found


async def _registered(ep: Endpoint, env_id: str) -> None:
    await async_wait_until(lambda: ep.connected(env_id), REGISTER_S, message=f"no agent of {env_id} registered")


async def _gone(ep: Endpoint, env_id: str) -> None:
    await async_wait_until(
        lambda: not ep.connected(env_id), GONE_S, message=f"the agent of {env_id} is still connected"
    )


async def _stop(service: EnvironmentService, ep: Endpoint, env_id: str) -> None:
    ep.shut_down(env_id)
    await asyncio.wait_for(service.stop(env_id, 2.0), 60.0)
    await _gone(ep, env_id)


# ---- the contract --------------------------------------------------------------------------


async def _lifecycle(case: Case, ep: Endpoint) -> None:
    """start -> the agent registers -> poll says running -> stop (twice) -> not running;
    unknown ids are polled as "unknown" and stopped as a no-op; nothing is left behind."""
    service = case.service()
    assert isinstance(service, EnvironmentService)
    assert service.platform
    await service.prepare()
    assert service.working_directory()
    assert isinstance(service.shares_filesystem, bool)

    platform_id = await case.start(service, case.request(ep, "env-1"))
    assert await _state(service, "env-1") in LIVE
    await _registered(ep, "env-1")
    await _wait_state(service, "env-1", ("running",), REGISTER_S)
    # Every platform under test runs its agents on this machine, where their argv is visible.
    assert not _argv_holding(ep.token), "the experiment token is on a command line"
    per_gpu, active = service.gpu_policy("env-1")
    assert per_gpu is None or per_gpu >= 1
    assert active is None or isinstance(active, bool)
    # Starting it again (a retried request) is the same environment.
    assert await case.start(service, case.request(ep, "env-1")) == platform_id

    assert await _state(service, "no-such-env") == "unknown"
    await asyncio.wait_for(service.stop("no-such-env", 1.0), 30.0)

    await _stop(service, ep, "env-1")
    await _wait_state(service, "env-1", ("exited", "failed", "unknown"), GONE_S)
    await asyncio.wait_for(service.stop("env-1", 1.0), 30.0)
    assert await _state(service, "env-1") not in LIVE
    assert ep.instances == {"env-1": ep.instances["env-1"]} and len(ep.instances["env-1"]) == 1

    fresh = case.service()
    assert await asyncio.wait_for(fresh.sweep(case.experiment_id), 60.0) == [], "the stopped environment is still there"


async def _start_is_idempotent(case: Case, ep: Endpoint) -> None:
    """Two starts of one env id at once start one environment (one agent registers)."""
    service = case.service()
    await service.prepare()
    first, second = await asyncio.gather(
        case.start(service, case.request(ep, "env-1")), case.start(service, case.request(ep, "env-1"))
    )
    assert first == second
    await _registered(ep, "env-1")
    await _stop(service, ep, "env-1")
    # Whatever the platform still holds of this experiment would be a second environment.
    fresh = case.service()
    assert await asyncio.wait_for(fresh.sweep(case.experiment_id), 60.0) == []
    assert len(ep.instances["env-1"]) == 1, f"{len(ep.instances['env-1'])} agents registered for env-1"


async def _errors_are_data(case: Case, ep: Endpoint) -> None:
    """An agent that cannot run is reported, as data: a start error or a "failed" poll."""
    service = case.service()
    await service.prepare()
    request = case.request(ep, "env-bad", "--no-such-agent-option")
    case.started.setdefault(service, set()).add("env-bad")
    result = await service.start(request)
    if result.error is None:
        await _wait_state(service, "env-bad", ("failed",), REGISTER_S)
        detail = (await service.poll(["env-bad"]))["env-bad"].detail
        assert detail, "a failed environment must say why"
    else:
        assert result.error.strip()
    assert not ep.connected("env-bad")


async def _sweep_by_experiment_id(case: Case, ep: Endpoint) -> None:
    """A brand-new service finds the experiment's environments by its id alone and removes
    those not kept; other experiments' ids find nothing."""
    service = case.service()
    await service.prepare()
    await asyncio.gather(case.start(service, case.request(ep, "env-1")), case.start(service, case.request(ep, "env-2")))
    await _registered(ep, "env-1")
    await _registered(ep, "env-2")

    fresh = case.service()
    assert await asyncio.wait_for(fresh.sweep("ct" + secrets.token_hex(4)), 60.0) == []
    removed = await asyncio.wait_for(fresh.sweep(case.experiment_id, keep={"env-2"}), 60.0)
    assert sorted(removed) == ["env-1"]
    await _gone(ep, "env-1")
    await _wait_state(service, "env-1", ("exited", "failed", "unknown"), GONE_S)
    assert ep.connected("env-2"), "a kept environment was removed"
    # A platform may learn of the agent running a little after it registers.
    await _wait_state(service, "env-2", ("running",), REGISTER_S)

    again = case.service()
    assert await asyncio.wait_for(again.sweep(case.experiment_id, keep=()), 60.0) == ["env-2"]
    await _gone(ep, "env-2")


test_lifecycle = _contract(_lifecycle)
test_start_is_idempotent = _contract(_start_is_idempotent)
test_errors_are_data = _contract(_errors_are_data)
test_sweep_by_experiment_id = _contract(_sweep_by_experiment_id)
