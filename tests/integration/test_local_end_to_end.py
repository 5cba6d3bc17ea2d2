"""End to end on the local platform: a real Coordinator, real agent processes, real gRPC."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from conftest import async_wait_until, build_config, pid_gone, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus

WAIT_S = 30.0

METRICS_SCRIPT = """
from trialkeeper.agent import trial

params = trial.get_next_parameter()
x = params["x"]
for i in range(3):
    assert trial.report_intermediate_result(x * 10 + i)
assert trial.report_final_result({"default": x * 100.0, "x": x})
"""


def _agent_pids(c: Coordinator) -> dict[str, int]:
    assert c.store is not None
    return {e["id"]: json.loads(e["info_json"]).get("pid") for e in c.store.envs()}


def _expected_metrics(x: int) -> list[tuple[str, float]]:
    return [("intermediate", x * 10.0 + i) for i in range(3)] + [("final", x * 100.0)]


def test_reuse_two_environments_serve_eight_trials(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", METRICS_SCRIPT)
    config = build_config(tmp_path)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            heard: list[tuple[str, str, int, float]] = []
            c.on_metric(lambda e: heard.append((e.trial_id, e.kind, e.index, e.value)))
            handles = [await c.submit({"x": x}) for x in range(8)]
            infos = [await h.wait(WAIT_S) for h in handles]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 8, [(i.status, i.reason) for i in infos]

            envs = c.environments()
            env_ids = {e.id for e in envs}
            assert len(envs) == 2, env_ids
            assert {i.environment_id for i in infos} <= env_ids
            assert all(e.status in (EnvStatus.READY, EnvStatus.BUSY) for e in envs), [(e.id, e.status) for e in envs]

            pids_before = _agent_pids(c)
            assert set(pids_before) == env_ids and all(pids_before.values()), pids_before
            for pid in pids_before.values():
                assert psutil.pid_exists(pid) and not pid_gone(pid)

            for x, (h, info) in enumerate(zip(handles, infos)):
                assert info.final_metric == x * 100.0
                assert info.final_metric_value == {"default": x * 100.0, "x": x}
                rows = c.store.metrics(h.id)
                assert [r.index for r in rows] == [0, 1, 2, 3]
                assert [(r.kind, r.value) for r in rows] == _expected_metrics(x)
                assert json.loads(rows[-1].value_json) == {"default": x * 100.0, "x": x}
                assert [(k, v) for (tid, k, _, v) in heard if tid == h.id] == _expected_metrics(x)

            # A second wave goes to the same two agents: nothing restarted.
            more = [await c.submit({"x": x}) for x in range(8, 10)]
            for h in more:
                assert (await h.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            assert len(c.environments()) == 2
            assert _agent_pids(c) == pids_before
            stored = {t["id"]: t for t in c.store.trials()}
            assert all(stored[h.id]["environment_id"] in env_ids for h in handles + more)
        # After stop: every environment ended cleanly and its agent is gone.
        assert {e.status for e in c.environments()} == {EnvStatus.STOPPED}
        for pid in pids_before.values():
            assert pid_gone(pid), f"agent pid {pid} still runs"

    run_async(body)


def test_reuse_off_gives_each_trial_its_own_environment(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", METRICS_SCRIPT)
    config = build_config(tmp_path, trainingService={"reuseMode": False})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            handles = [await c.submit({"x": x}) for x in range(8)]
            infos = [await h.wait(WAIT_S) for h in handles]
            assert [i.status for i in infos] == [TrialStatus.SUCCEEDED] * 8, [(i.status, i.reason) for i in infos]
            env_of = [i.environment_id for i in infos]
            assert len(set(env_of)) == 8, env_of
            for h, x in zip(handles, range(8)):
                assert [(r.kind, r.value) for r in c.store.metrics(h.id)] == _expected_metrics(x)
            # Single-use environments are shut down once their trial ends.
            await async_wait_until(
                lambda: all(e.status is EnvStatus.STOPPED for e in c.environments()),
                WAIT_S,
                message="single-use environments were not all stopped after their trials ended",
            )
            assert len(c.environments()) == 8, [e.id for e in c.environments()]
            pids = list(_agent_pids(c).values())
            assert len(set(pids)) == 8, pids
            statuses = {e["status"] for e in c.store.envs()}
            assert statuses == {"STOPPED"}, statuses
        for pid in pids:
            assert pid_gone(pid), f"agent pid {pid} still runs"

    run_async(body)


def test_cancel_kills_the_trial_and_its_grandchild(tmp_path: Path) -> None:
    write_script(
        tmp_path,
        "trial.py",
        """
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        path = os.path.join(os.environ["TRIALKEEPER_TRIAL_DIR"], "grandchild.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.replace(path + ".tmp", path)
        time.sleep(300)
        """,
    )
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        exp = tmp_path / "exp"
        async with Coordinator(config, experiment_dir=exp) as c:
            h = await c.submit({})
            pid_file = exp / "trials" / h.id / "grandchild.pid"
            await async_wait_until(lambda: c.trial(h.id).status is TrialStatus.RUNNING and pid_file.exists(), WAIT_S)
            grandchild = int(pid_file.read_text())
            assert not pid_gone(grandchild)
            await c.cancel(h.id)
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.USER_CANCELED, (info.status, info.reason)
            assert "canceled by the user" in info.reason
            await async_wait_until(
                lambda: pid_gone(grandchild), 15.0, message=f"grandchild {grandchild} survived the cancel"
            )
            # The environment is free again and takes the next trial.
            write_script(tmp_path, "ok.py", "print('ok')\n")
            h2 = await c.submit({}, command="python ok.py")
            assert (await h2.wait(WAIT_S)).status is TrialStatus.SUCCEEDED

    run_async(body)


def test_nonzero_exit_fails_with_exit_code_and_stderr(tmp_path: Path) -> None:
    write_script(
        tmp_path,
        "fail.py",
        """
        import sys
        sys.stderr.write("boom\\n")
        sys.stderr.flush()
        sys.exit(3)
        """,
    )
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        exp = tmp_path / "exp"
        async with Coordinator(config, experiment_dir=exp) as c:
            info = await (await c.submit({}, command="python fail.py")).wait(WAIT_S)
            assert info.status is TrialStatus.FAILED
            assert info.exit_code == 3
            assert info.signal is None
            assert "exit code 3" in info.reason
            assert "boom" in info.stderr_tail
            log = exp / "trials" / info.id / "stderr.log"
            assert "boom" in log.read_text()
            row = next(t for t in c.store.trials() if t["id"] == info.id)
            assert row["status"] == "FAILED" and row["exit_code"] == 3 and "boom" in row["stderr_tail"]

    run_async(body)


def test_trial_killed_by_signal(tmp_path: Path) -> None:
    write_script(tmp_path, "die.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            info = await (await c.submit({}, command="python die.py")).wait(WAIT_S)
            assert info.status is TrialStatus.FAILED
            assert info.signal == 9
            assert info.exit_code is None
            assert "SIGKILL" in info.reason, info.reason

    run_async(body)


def test_invalid_metrics_are_refused_and_the_trial_goes_on(tmp_path: Path) -> None:
    write_script(
        tmp_path,
        "metrics.py",
        """
        import json, os, socket, sys
        from trialkeeper.agent import trial

        results = {
            "string": trial.report_intermediate_result("abc"),
            "no_default": trial.report_intermediate_result({"x": 1}),
        }
        # Bypass the SDK's own check: the agent must refuse it too.
        raw = json.dumps({"trial": os.environ["TRIALKEEPER_TRIAL_ID"], "kind": "intermediate", "value": "abc"})
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(raw.encode(), os.environ["TRIALKEEPER_SOCKET"])
        s.close()
        results["valid"] = trial.report_intermediate_result(0.5)
        print(json.dumps(results), flush=True)
        assert trial.report_final_result(0.75)
        """,
    )
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        exp = tmp_path / "exp"
        async with Coordinator(config, experiment_dir=exp) as c:
            info = await (await c.submit({}, command="python metrics.py")).wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, (info.reason, info.stderr_tail)
            assert info.final_metric == 0.75
            out = (exp / "trials" / info.id / "stdout.log").read_text()
            assert json.loads(out.strip().splitlines()[-1]) == {"string": False, "no_default": False, "valid": True}
            err = (exp / "trials" / info.id / "stderr.log").read_text()
            sdk_lines = [ln for ln in err.splitlines() if ln.startswith("trialkeeper: intermediate result refused")]
            assert len(sdk_lines) == 2, err
            assert "got str" in sdk_lines[0] and "'default'" in sdk_lines[1], sdk_lines
            agent_lines = [ln for ln in err.splitlines() if ln.startswith("[trialkeeper]") and "refused" in ln]
            assert len(agent_lines) == 1, err
            assert "intermediate result refused" in agent_lines[0]
            rows = c.store.metrics(info.id)
            assert [(r.index, r.kind, r.value) for r in rows] == [(0, "intermediate", 0.5), (1, "final", 0.75)]

    run_async(body)


def test_missing_command_fails_with_command_not_found(tmp_path: Path) -> None:
    config = build_config(tmp_path, trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            info = await (await c.submit({}, command="no-such-command-xyz")).wait(WAIT_S)
            assert info.status is TrialStatus.FAILED
            assert "command not found" in info.reason, info.reason
            assert "no-such-command-xyz" in info.reason

    run_async(body)


def test_max_trial_duration(tmp_path: Path) -> None:
    # Runs until it is ended (300 s at most): only the limit can end it within WAIT_S.
    write_script(tmp_path, "slow.py", "import time\ntime.sleep(300)\n")
    config = build_config(tmp_path, trialConcurrency=1, maxTrialDuration="1s")

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({}, command="python slow.py")
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED, (info.status, info.reason)
            assert "max duration" in info.reason, info.reason
            assert info.ended_at is not None and info.started_at is not None
            assert info.started_at <= info.ended_at

    run_async(body)


@pytest.mark.parametrize("reuse", [True, False])
def test_stop_with_a_running_trial_cancels_it(tmp_path: Path, reuse: bool) -> None:
    write_script(tmp_path, "slow.py", "import time\ntime.sleep(300)\n")
    config = build_config(tmp_path, trialConcurrency=1, trainingService={"reuseMode": reuse})

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h = await c.submit({}, command="python slow.py")
            await async_wait_until(lambda: c.trial(h.id).status is TrialStatus.RUNNING, WAIT_S)
        assert c.trial(h.id).status is TrialStatus.SYS_CANCELED
        assert all(e.status.terminal for e in c.environments())

    run_async(body)
