"""The ray platform against a real local Ray cluster on loopback (one for the whole module).

Agents run in detached actors that Ray places; trials are real processes on the node.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
from conftest import (
    QUICKSTART,
    async_wait_until,
    build_config,
    pid_gone,
    run_async,
    wait_until,
    write_script,
)
from interpreters import jax_python
from trialkeeper.coordinator.config.experiment import ConfigError, parse_config
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.services import create_service
from trialkeeper.coordinator.services.base import EnvironmentRequest
from trialkeeper.coordinator.services.ray.service import RayEnvironmentService, actor_name
from trialkeeper.coordinator.store.store import Store


def _harness() -> ModuleType:
    """The contract suite's Ray harness, under the name that suite loads it by, so that a
    run of both shares one cluster."""
    name = "_contract_harness_ray"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "contract" / "harness_ray.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


LocalRay = Any  # the harness's LocalRay: a running head node (.address, ...)
shared_local_ray = _harness().shared_local_ray

pytestmark = pytest.mark.slow

WAIT_S = 45.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRay]:
    with shared_local_ray() as c:
        import ray

        # This process looks at the cluster too (its named actors); the services share
        # the connection.
        if not ray.is_initialized():
            ray.init(address=c.address, log_to_driver=False, logging_level=logging.WARNING)
        yield c


def _section(cluster: LocalRay, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "platform": "ray",
        "address": cluster.address,
        "numCpus": 0.5,
        "nodeWorkingDirectory": str(tmp_path / "ray-nodes"),
        **extra,
    }


def _actors(experiment_id: str) -> list[str]:
    """The experiment's named actors still on the cluster (this process is connected)."""
    from ray.util import list_named_actors

    prefix = f"trialkeeper/{experiment_id}/"
    return sorted(a["name"] for a in list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def _cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
        check=False, capture_output=True, text=True, timeout=timeout,
    )


def _agents_under(root: Path) -> list[psutil.Process]:
    """Live agent processes (not their launchers) whose working directory is under root."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if argv[1:3] == ["-m", "trialkeeper.agent"] and str(root) in " ".join(argv) and not pid_gone(p.pid):
            found.append(p)
    return found


# ---- the quickstart, end to end ------------------------------------------------------


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_quickstart_runs_end_to_end_on_local_ray(cluster: LocalRay, tmp_path: Path, reuse: bool) -> None:
    code = tmp_path / "quickstart"
    shutil.copytree(QUICKSTART, code)
    trials = 8 if reuse else 4
    config = {
        "experimentName": "quickstart-ray",
        "searchSpaceFile": "search_space.json",
        "trialCommand": f"{sys.executable} train.py",
        "trialCodeDirectory": ".",
        "trialConcurrency": 2,
        "maxTrialNumber": trials,
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize", "seed": 7}},
        # A whole CPU each: without reuse, the third actor fits only once the first is gone.
        "trainingService": _section(cluster, tmp_path, reuseMode=reuse, environmentCount=2, numCpus=1),
    }
    (code / "config.yml").write_text(json.dumps(config))  # JSON is YAML

    run = _cli("run", str(code / "config.yml"), "--quiet")
    assert run.returncode == 0, run.stdout + run.stderr
    exp_dir = next(Path(line.split(": ", 1)[1]) for line in run.stdout.splitlines()
                   if line.startswith("experiment directory: "))

    listed = json.loads(_cli("trials", str(exp_dir), "--json").stdout)
    assert [t["status"] for t in listed] == ["SUCCEEDED"] * trials, listed
    envs = json.loads(_cli("envs", str(exp_dir), "--json").stdout)
    assert all(e["platform"] == "ray" and e["status"] == "STOPPED" for e in envs), envs
    assert all(e["platform_id"].startswith("trialkeeper/trialkeeper/") for e in envs), envs
    assert len(envs) == (2 if reuse else trials), envs
    # Trial logs came back over the stream: the nodes do not share our file system.
    assert "SUCCEEDED" in _cli("status", str(exp_dir)).stdout

    experiment_id = envs[0]["platform_id"].split("/")[2]
    wait_until(lambda: not _actors(experiment_id), WAIT_S, message="actors left on the cluster")
    assert not _agents_under(tmp_path)


# ---- losing an actor -------------------------------------------------------------------

HOLD_SCRIPT = """
import os, sys, time
from pathlib import Path

from trialkeeper.agent import trial

params = trial.get_next_parameter()
Path(sys.argv[1], f"pid-{params['x']}").write_text(str(os.getpid()))
deadline = time.monotonic() + 300
while params["x"] == 0 and time.monotonic() < deadline:  # held until its environment dies (5 min at most)
    time.sleep(0.1)
trial.report_final_result(1.0)
"""


def test_killing_the_actor_mid_trial_loses_the_environment(cluster: LocalRay, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    write_script(tmp_path, "hold.py", HOLD_SCRIPT)
    config = build_config(
        tmp_path,
        trialCommand=f"{sys.executable} hold.py {marks}",
        trialConcurrency=1,
        trainingService=_section(cluster, tmp_path, environmentCount=1),
    )

    async def body() -> None:
        import ray

        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            held = await c.submit({"x": 0})
            pid_file = marks / "pid-0"
            await async_wait_until(pid_file.exists, WAIT_S, message="the trial never started")
            trial_pid = int(pid_file.read_text())
            [env] = c.environments()
            name = env.platform_id.split("/", 1)[1]
            ray.kill(ray.get_actor(name, namespace="trialkeeper"), no_restart=True)

            info = await held.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED, (info.status, info.reason)
            await async_wait_until(lambda: pid_gone(trial_pid), WAIT_S, message="the trial outlived its actor")
            lost = next(e for e in c.environments() if e.id == env.id)
            assert lost.status is EnvStatus.FAILED, (lost.status, lost.reason)
            # The experiment goes on in a fresh actor.
            after = await c.submit({"x": 1})
            assert (await after.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            assert after.id != held.id and len(c.environments()) == 2
        wait_until(lambda: not _actors(c.experiment_id), WAIT_S, message="actors left on the cluster")

    run_async(body, timeout=3 * WAIT_S)
    assert not _agents_under(tmp_path)


# ---- placementStrategy: every actor of the experiment in one placement group ------------------


def _groups(experiment_id: str, *, per_trial: bool = False) -> list[dict[str, Any]]:
    """The experiment's placement groups that Ray still keeps (this process is connected):
    its own, or (``per_trial``) those of its trials' groups of environments."""
    from ray.util import placement_group_table

    def ours(name: str) -> bool:
        own = f"trialkeeper/{experiment_id}"
        return name.startswith(f"{own}/") if per_trial else name == own

    return [g for g in placement_group_table().values() if ours(str(g.get("name"))) and g.get("state") != "REMOVED"]


def test_a_placement_strategy_puts_every_actor_in_the_experiments_placement_group(
    cluster: LocalRay, tmp_path: Path
) -> None:
    write_script(tmp_path, "trial.py", """
        from trialkeeper.agent import trial
        trial.report_final_result(trial.get_next_parameter()["x"])
    """)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=2,
        trainingService=_section(cluster, tmp_path, environmentCount=2, placementStrategy="PACK"),
    )

    async def body() -> None:
        import ray

        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            handles = [await c.submit({"x": float(i)}) for i in range(4)]
            for h in handles:
                info = await h.wait(WAIT_S)
                assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
            [group] = _groups(c.experiment_id)
            assert (group["strategy"], group["state"]) == ("PACK", "CREATED"), group
            assert group["bundles"] == {0: {"CPU": 0.5}, 1: {"CPU": 0.5}}, group["bundles"]
            assert len(c.environments()) == 2
            # Both actors (alive until the experiment ends) hold the group's CPUs, and nothing else does.
            in_group = f"CPU_group_{group['placement_group_id']}"
            assert ray.cluster_resources()[in_group] == 1.0
            wait_until(lambda: ray.available_resources().get(in_group, 0.0) == 0.0, WAIT_S,
                       message=f"the actors are not in the group: {ray.available_resources()}")
            experiment_id = c.experiment_id
        # The group goes with the experiment's actors.
        wait_until(lambda: not _groups(experiment_id), WAIT_S, message="the placement group outlived the experiment")

    run_async(body, timeout=4 * WAIT_S)


@pytest.mark.parametrize(("strategy", "per_trial"),
                         [("PACK", False), ("STRICT_SPREAD", False), ("STRICT_SPREAD", True)],
                         ids=["PACK", "STRICT_SPREAD", "STRICT_SPREAD-per-trial"])
def test_a_two_node_trial_runs_a_real_collective_across_two_actors_of_one_placement_group(
    cluster: LocalRay, tmp_path: Path, strategy: str, per_trial: bool
) -> None:
    """Every actor of the experiment in its placement group; or (``placementGroupPerTrial``)
    the trial's actors, started for it, in a placement group of its own, given back after."""
    python = jax_python()
    shutil.copy(Path(__file__).resolve().parents[2] / "examples" / "multinode" / "collective.py", tmp_path)
    extra = {"placementGroupPerTrial": True} if per_trial else {}
    config = build_config(
        tmp_path, trialCommand=f"{python} collective.py", trialConcurrency=1, trialNodes=2,
        trainingService=_section(cluster, tmp_path, environmentCount=2, placementStrategy=strategy, **extra),
    )

    async def body() -> None:
        import ray

        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({"x": 2.0})
            info = await h.wait(4 * WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason, info.stderr_tail)
            assert info.final_metric == 2.0 * (1 + 2)  # the all-gather joined both ranks
            [group] = _groups(c.experiment_id, per_trial=per_trial)
            assert (group["strategy"], group["state"], len(group["bundles"])) == (strategy, "CREATED", 2), group
            if per_trial:  # named after the first of the trial's group of environments, and no other
                assert group["name"] in {f"trialkeeper/{c.experiment_id}/{r.environment_id}" for r in info.ranks}
                assert not _groups(c.experiment_id)
            # PACK: both on the one node there is; STRICT_SPREAD: each rank on a node of its own.
            nodes = set(group["bundles_to_node_id"].values())
            assert len(nodes) == (2 if strategy == "STRICT_SPREAD" else 1), group
            assert nodes <= {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            # Each rank ran in its own actor: rank 1's output is kept apart, by its own agent.
            rank1 = tmp_path / "exp" / "trials" / h.id / "rank1" / "stdout.log"
            assert "rank 1 of 2 up" in rank1.read_text()
            experiment_id = c.experiment_id
        # The trial's group goes with its actors.
        wait_until(lambda: not _groups(experiment_id, per_trial=True), WAIT_S, message="a trial's group outlived it")

    # For STRICT_SPREAD a second node joins the one-node cluster for the test.
    with _harness().second_node(cluster) if strategy == "STRICT_SPREAD" else contextlib.nullcontext():
        run_async(body, timeout=6 * WAIT_S)


def test_strict_spread_waits_for_a_node_per_actor_and_says_so(cluster: LocalRay, tmp_path: Path) -> None:
    # The local cluster has one node: two actors each on a node of its own can never be placed.
    config = build_config(
        tmp_path, trainingService=_section(cluster, tmp_path, environmentCount=2, placementStrategy="STRICT_SPREAD"),
    )
    experiment_id = f"spread{tmp_path.name[-6:]}"

    async def body() -> None:
        service = create_service(config, tmp_path / "exp")
        await service.prepare()
        for env_id in ("env-1", "env-2"):
            result = await service.start(EnvironmentRequest(env_id, experiment_id, "127.0.0.1:9", "t0ken"))
            assert result.error is None, result.error
        seen = await service.poll(["env-1", "env-2"])
        for env_id in ("env-1", "env-2"):
            assert seen[env_id].state == "starting", seen[env_id]
            assert f"placement group trialkeeper/{experiment_id} (STRICT_SPREAD: 2 bundles of 0.5 CPU, each on a " \
                   "node of its own; the cluster has 1 now)" in seen[env_id].detail, seen[env_id]
        [group] = _groups(experiment_id)
        assert (group["strategy"], group["state"]) == ("STRICT_SPREAD", "PENDING"), group
        await service.stop("env-1", 0.0)
        await service.stop("env-2", 0.0)
        await service.close()
        assert not _groups(experiment_id) and not _actors(experiment_id)

    run_async(body, timeout=3 * WAIT_S)


def test_a_trials_placement_group_is_given_back_once_its_actors_are_gone(cluster: LocalRay, tmp_path: Path) -> None:
    """placementGroupPerTrial: a group of two environments is a placement group of two bundles,
    named after its first, each actor in a bundle of its own; it goes once both actors have
    stopped, before the service closes."""
    config = build_config(tmp_path, trainingService=_section(
        cluster, tmp_path, environmentCount=2, placementStrategy="PACK", placementGroupPerTrial=True))
    experiment_id = f"gang{tmp_path.name[-6:]}"

    async def body() -> None:
        import ray

        service = create_service(config, tmp_path / "exp")
        assert service.groups_environments
        await service.prepare()
        requests = [EnvironmentRequest(e, experiment_id, "127.0.0.1:9", "t0ken") for e in ("env-1", "env-2")]
        results = await service.start_group("env-1", requests)
        assert [r.error for r in results] == [None, None], results
        # Reserved once the actors that earlier tests stopped have given their CPUs back.
        [group] = await async_wait_until(
            lambda: [g for g in _groups(experiment_id, per_trial=True) if g["state"] == "CREATED"], WAIT_S)
        assert (group["name"], group["strategy"], len(group["bundles"])) == (
            f"trialkeeper/{experiment_id}/env-1", "PACK", 2), group
        assert not _groups(experiment_id)  # no group of the whole experiment
        # Each actor holds the CPU of a bundle of its own.
        for index in (0, 1):
            held = f"CPU_group_{index}_{group['placement_group_id']}"
            # Ray's view of the cluster's resources shows a new group's bundles a moment after it is made.
            await async_wait_until(lambda held=held: ray.cluster_resources().get(held) == 0.5, WAIT_S,
                                   message=f"bundle {held} of 0.5 CPU not shown: {ray.cluster_resources()}")
            await async_wait_until(lambda held=held: ray.available_resources().get(held, 0.0) == 0.0, WAIT_S,
                                   message=f"bundle {held} not taken: {ray.available_resources()}")
        await service.stop("env-1", 0.0)
        assert _groups(experiment_id, per_trial=True)  # env-2's actor still in it
        await service.stop("env-2", 0.0)
        await async_wait_until(lambda: not _groups(experiment_id, per_trial=True), WAIT_S,
                               message="the group outlived its actors")
        await service.close()

    run_async(body, timeout=3 * WAIT_S)


def test_a_trials_placement_group_goes_when_a_member_could_not_be_started(cluster: LocalRay, tmp_path: Path) -> None:
    """placementGroupPerTrial: a member whose actor cannot be made (its name is taken) holds
    no bundle, so the group is given back once the other member's actor is gone."""
    config = build_config(tmp_path, trainingService=_section(
        cluster, tmp_path, environmentCount=2, placementStrategy="PACK", placementGroupPerTrial=True))
    experiment_id = f"gangfail{tmp_path.name[-6:]}"

    async def body() -> None:
        import ray

        service = create_service(config, tmp_path / "exp")
        await service.prepare()
        assert isinstance(service, RayEnvironmentService)
        await service._connect()
        name = actor_name(experiment_id, "env-2")

        @ray.remote(num_cpus=0)
        class Squatter:
            def ping(self) -> int:
                return 1

        squatter = Squatter.options(name=name, namespace=service.config.namespace).remote()
        assert ray.get(squatter.ping.remote(), timeout=WAIT_S) == 1
        try:
            requests = [EnvironmentRequest(e, experiment_id, "127.0.0.1:9", "t0ken") for e in ("env-1", "env-2")]
            results = await service.start_group("env-1", requests)
            assert results[0].error is None and results[1].error and "env-2" in results[1].error, results
            assert _groups(experiment_id, per_trial=True)
            await service.stop("env-1", 0.0)
            await async_wait_until(lambda: not _groups(experiment_id, per_trial=True), WAIT_S,
                                   message="the group outlived its only actor")
        finally:
            ray.kill(squatter)
            await service.close()

    run_async(body, timeout=3 * WAIT_S)


def test_a_left_over_placement_group_is_swept_with_its_actors(cluster: LocalRay, tmp_path: Path) -> None:
    config = build_config(tmp_path, trainingService=_section(cluster, tmp_path, placementStrategy="SPREAD"))
    experiment_id = f"pgorphan{tmp_path.name[-6:]}"

    async def body() -> None:
        crashed = create_service(config, tmp_path / "exp")
        await crashed.prepare()
        assert (await crashed.start(EnvironmentRequest("env-1", experiment_id, "127.0.0.1:9", "t0ken"))).error is None
        await async_wait_until(lambda: len(_groups(experiment_id)) == 1, WAIT_S, message="no placement group")
        # Its coordinator is gone without a word; a fresh service that keeps nothing sweeps both.
        fresh = create_service(config, tmp_path / "exp")
        assert await fresh.sweep(experiment_id) == ["env-1"]
        assert not _groups(experiment_id) and not _actors(experiment_id)
        await fresh.close()

    run_async(body, timeout=3 * WAIT_S)


# ---- what a crashed coordinator leaves behind -------------------------------------------


def test_fresh_service_sweeps_orphans_and_adopts_the_rest(cluster: LocalRay, tmp_path: Path) -> None:
    config = build_config(tmp_path, trainingService=_section(cluster, tmp_path))
    experiment_id = f"orphans{tmp_path.name[-6:]}"

    async def body() -> None:
        crashed = create_service(config, tmp_path / "exp")
        await crashed.prepare()
        started = {}
        for env_id in ("env-1", "env-2"):
            # Nobody listens at port 9: the agents keep dialling, like agents whose
            # coordinator died.
            request = EnvironmentRequest(env_id, experiment_id, "127.0.0.1:9", "secret-token")
            result = await crashed.start(request)
            assert result.error is None, result.error
            started[env_id] = result.platform_id
        await async_wait_until(lambda: len(_agents_under(tmp_path)) == 2, WAIT_S, message="agents did not start")
        agents = {p.pid: " ".join(p.cmdline()) for p in _agents_under(tmp_path)}
        assert not any("secret-token" in cmd for cmd in agents.values())

        # The coordinator is gone without stopping anything; a new one comes up.
        fresh = create_service(config, tmp_path / "exp")
        assert await fresh.sweep(experiment_id, keep={"env-2"}) == ["env-1"]
        assert _actors(experiment_id) == [f"trialkeeper/{experiment_id}/env-2"]
        fresh.adopt("env-2", started["env-2"])
        seen = await fresh.poll(["env-1", "env-2"])
        assert seen["env-1"].state == "unknown"
        assert seen["env-2"].state in ("starting", "running"), seen["env-2"]
        await async_wait_until(
            lambda: len(_agents_under(tmp_path)) == 1, WAIT_S, message="the swept agent still runs"
        )
        await fresh.stop("env-2", 0.0)
        await fresh.stop("env-2", 0.0)  # idempotent
        assert (await fresh.poll(["env-2"]))["env-2"].state == "exited"
        assert await fresh.sweep(experiment_id) == []
        await async_wait_until(lambda: not _agents_under(tmp_path), WAIT_S, message="agents outlived the sweep")
        await fresh.close()
        await crashed.close()

    run_async(body, timeout=3 * WAIT_S)
    assert not _actors(experiment_id)


def test_an_actor_whose_coordinator_never_returns_frees_its_resources(cluster: LocalRay, tmp_path: Path) -> None:
    config = build_config(tmp_path, trainingService=_section(cluster, tmp_path))
    experiment_id = f"gone{tmp_path.name[-6:]}"

    async def body() -> None:
        service = create_service(config, tmp_path / "exp")
        assert isinstance(service, RayEnvironmentService)
        service.linger_s = 0.5
        # Its agent gives up on the missing coordinator after 1 s, and no one polls or
        # stops the environment: the actor must still go.
        request = EnvironmentRequest("env-1", experiment_id, "127.0.0.1:9", "t", agent_args=("--reconnect-window", "1"))
        assert (await service.start(request)).error is None
        await async_wait_until(lambda: _actors(experiment_id), WAIT_S, message="the actor never appeared")
        await async_wait_until(lambda: not _actors(experiment_id), WAIT_S, message="the actor outlived its agent")
        await service.close()

    run_async(body, timeout=3 * WAIT_S)
    assert not _agents_under(tmp_path)


# ---- a coordinator killed -9, then resumed -------------------------------------------

GATED_SCRIPT = """
import os, sys, time
from pathlib import Path

from trialkeeper.agent import trial

params = trial.get_next_parameter()
marks = Path(sys.argv[1])
(marks / f"running-{params['x']}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not (marks / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
trial.report_final_result(float(params["x"]))
"""


def test_resume_after_kill_9_adopts_its_actors_and_sweeps_orphans(cluster: LocalRay, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    write_script(tmp_path, "gated.py", GATED_SCRIPT)
    config = {
        "trialCommand": f"{sys.executable} gated.py {marks}",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3, 4]}},
        "tuner": {"name": "grid"},
        "trainingService": _section(cluster, tmp_path, environmentCount=2),
        "coordinator": {"heartbeatInterval": 0.2, "agentLostTimeout": 2, "trialLostTimeout": 30},
    }
    (tmp_path / "config.yml").write_text(json.dumps(config))
    exp = tmp_path / "exp"
    cli = [sys.executable, "-m", "trialkeeper.coordinator.cli"]
    first = subprocess.Popen([*cli, "run", str(tmp_path / "config.yml"), "--experiment-dir", str(exp), "--quiet"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    resumed = None
    orphans = None
    try:
        wait_until(lambda: len(list(marks.glob("running-*"))) == 2 or first.poll() is not None, WAIT_S,
                   message="two trials never ran")
        assert first.poll() is None, first.communicate()[0].decode(errors="replace")
        store = Store.in_dir(exp, readonly=True)
        experiment = store.experiment()
        store.close()
        assert experiment is not None
        experiment_id = str(experiment["id"])
        # An environment the store never recorded: started just before the crash.
        orphans = create_service(build_config(tmp_path, trainingService=_section(cluster, tmp_path)), tmp_path / "o")
        started = run_async(orphans.start(EnvironmentRequest("env-99", experiment_id, "127.0.0.1:9", "t")))
        assert started.error is None, started.error
        assert len(_actors(experiment_id)) == 3

        first.kill()
        first.wait(timeout=30)
        resumed = subprocess.Popen(
            [*cli, "resume", str(exp), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        wait_until(lambda: len(_actors(experiment_id)) == 2 or resumed.poll() is not None, WAIT_S,
                   message="resume did not sweep the orphan")
        (marks / "go").write_text("")
        out, _ = resumed.communicate(timeout=2 * WAIT_S)
        assert resumed.returncode == 0, out.decode(errors="replace")

        store = Store.in_dir(exp, readonly=True)
        trials, envs = store.trials(), store.envs()
        store.close()
        assert sorted(t["status"] for t in trials) == ["SUCCEEDED"] * 4, [
            (t["id"], t["status"], t["reason"]) for t in trials
        ]
        # The two actors started before the crash carried on: no replacement was needed.
        assert sorted(e["id"] for e in envs) == ["env-1", "env-2"], [(e["id"], e["status"], e["reason"]) for e in envs]
        assert all(t["attempts"] == 1 for t in trials), trials
        wait_until(lambda: not _actors(experiment_id), WAIT_S, message="actors left on the cluster")
    finally:
        for proc in (first, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        if orphans is not None:
            run_async(orphans.close())
    assert not _agents_under(tmp_path)


# ---- GPUs ------------------------------------------------------------------------------


def test_each_actor_offers_its_agent_the_gpus_ray_assigned(cluster: LocalRay, tmp_path: Path) -> None:
    config = build_config(tmp_path, trainingService=_section(cluster, tmp_path, numGpus=1))
    experiment_id = f"gpus{tmp_path.name[-6:]}"

    async def body() -> None:
        service = create_service(config, tmp_path / "exp")
        try:
            for env_id in ("env-1", "env-2", "env-3"):
                result = await service.start(EnvironmentRequest(env_id, experiment_id, "127.0.0.1:9", "t"))
                assert result.error is None, result.error

            async def states() -> dict[str, Any]:
                return await service.poll(["env-1", "env-2", "env-3"])

            seen: dict[str, Any] = {}

            async def two_running() -> bool:
                seen.update(await states())
                return sum(o.state == "running" for o in seen.values()) == 2

            await async_wait_until(two_running, WAIT_S, message="two of three actors never ran")
            # The node has 2 GPUs: one actor waits for a GPU; the others hold one each.
            [waiting] = [i for i, o in seen.items() if o.state == "starting"]
            assert seen[waiting].detail == "waiting for Ray to place the actor (0.5 CPU, 1 GPU)"
            running = sorted(i for i, o in seen.items() if o.state == "running")
            argv = {" ".join(p.cmdline()) for p in _agents_under(tmp_path)}
            assert len(argv) == 2, argv
            assert {a.split("--gpu-indices ")[1].split()[0] for a in argv} == {"0", "1"}, argv
            await service.stop(running[0], 0.0)

            async def placed() -> bool:
                return (await states())[waiting].state == "running"

            await async_wait_until(placed, WAIT_S, message="the waiting actor never got the freed GPU")
        finally:
            await service.close()

    run_async(body, timeout=3 * WAIT_S)
    assert not _actors(experiment_id)
    assert not _agents_under(tmp_path)


# ---- config --------------------------------------------------------------------------


def _ray_config(tmp_path: Path, **section: Any) -> Any:
    data = {
        "trialCommand": "python trial.py",
        "trialConcurrency": 2,
        "trainingService": {"platform": "ray", **section},
    }
    return parse_config(data, tmp_path)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _ray_config(
            tmp_path, address="ray://head:0", numCpus=-1, numGpuz=1, resources={"GPU": 1},
            memory="lots", environmentCount=0, rayTimeout="soon",
        )
    text = str(caught.value)
    for expected in (
        "trainingService.address: expected 'auto', 'ray://HOST:PORT'",
        "trainingService.numCpus: expected a non-negative number",
        "trainingService.numGpuz: unknown key; did you mean 'numGpus'?",
        "trainingService.resources: give GPU through numCpus, numGpus and memory instead",
        "trainingService.memory: ",
        "trainingService.environmentCount: expected a positive integer",
        "trainingService.rayTimeout: ",
    ):
        assert expected in text, text
    with pytest.raises(ConfigError, match=r"trainingService\.address: required key is missing"):
        _ray_config(tmp_path)


def test_a_placement_strategy_is_one_of_rays_and_needs_a_resource(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"placementStrategy: expected one of PACK, SPREAD, STRICT_PACK, STRICT_"):
        _ray_config(tmp_path, address="auto", placementStrategy="NEAR")
    with pytest.raises(ConfigError, match=r"placementStrategy: a placement group's bundles need a resource: set num"):
        _ray_config(tmp_path, address="auto", numCpus=0, placementStrategy="PACK")
    with pytest.raises(ConfigError, match=r"placementGroupPerTrial: needs placementStrategy, the strategy of each"):
        _ray_config(tmp_path, address="auto", placementGroupPerTrial=True)
    with pytest.raises(ConfigError, match=r"placementGroupPerTrial: needs reuseMode: true"):
        _ray_config(tmp_path, address="auto", placementStrategy="PACK", placementGroupPerTrial=True, reuseMode=False)
    spread = _ray_config(tmp_path, address="auto", placementStrategy="STRICT_SPREAD").training_service
    assert spread.placement_strategy == "STRICT_SPREAD"
    assert _ray_config(tmp_path, address="auto").training_service.placement_strategy is None


def test_config_defaults_and_environment_counts(tmp_path: Path) -> None:
    cfg = _ray_config(tmp_path, address="10.0.0.5:6379", numGpus=1, trialsPerEnvironment=2).training_service
    assert (cfg.namespace, cfg.num_cpus, cfg.num_gpus, cfg.reuse_mode) == ("trialkeeper", 1.0, 1.0, True)
    assert cfg.effective_environment_count(5) == 3 and cfg.trial_slots_per_environment(5) == 2
    assert _ray_config(tmp_path, address="auto", reuseMode=False).training_service.effective_environment_count(4) == 4
    assert _ray_config(tmp_path, address="ray://head.example:10001").training_service.address == "ray://head.example:10001"


def test_missing_extra_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from trialkeeper.coordinator.services.ray import service as ray_service

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ray_service.RaySetupError, match=r"^platform ray needs ray: pip install 'trialkeeper\[ray\]'$"):
        create_service(_ray_config(tmp_path, address="auto"), tmp_path / "exp")


def test_gpu_options_follow_what_ray_assigned() -> None:
    from trialkeeper.coordinator.services.ray.node import _gpu_args

    assert _gpu_args(0, []) == ["--no-gpu"]
    assert _gpu_args(2, ["1", "3"]) == ["--gpu-indices", "1,3"]
    with pytest.raises(RuntimeError, match="not NVML indices"):
        _gpu_args(1, ["GPU-5f1c"])
