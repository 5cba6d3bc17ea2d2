"""Warm trial starts (trialPreload): the same probe trial run cold and forked from the
template must observe the same process, and end the same way. Real coordinator, real
agent process, real template, real trials."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import async_wait_until, build_config, pid_gone, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus

WAIT_S = 60.0
PRELOAD = ["json", "decimal"]

PROBE = r'''
import json, os, signal, sys
own_globals = sorted(globals())
loader = type(__loader__).__name__
seen_modules = "decimal" in sys.modules   # before the probe imports anything of its own
p = json.load(open(os.environ["TRIALKEEPER_PARAMETER_FILE"]))
mode = p["mode"]

def disposition(h):
    if h is signal.SIG_DFL: return "default"
    if h is signal.SIG_IGN: return "ignore"
    return getattr(h, "__name__", repr(h))

ppid = os.getppid()
try:
    parent = open(f"/proc/{ppid}/cmdline", "rb").read().split(b"\0")
except OSError:
    parent = []
seen = {
    "argv": sys.argv, "orig_argv": sys.orig_argv, "executable": sys.executable,
    "name": __name__, "file": __file__, "globals": own_globals, "loader": loader, "path": sys.path, "cwd": os.getcwd(),
    "env": dict(os.environ), "pid": os.getpid(),
    "own_group": os.getpgid(0) == os.getpid(), "own_session": os.getsid(0) == os.getpid(),
    "stdin": os.readlink("/proc/self/fd/0"), "stdout": os.readlink("/proc/self/fd/1"),
    "stderr": os.readlink("/proc/self/fd/2"),
    "signals": {s.name: disposition(signal.getsignal(s)) for s in signal.valid_signals()
                if s not in (signal.SIGKILL, signal.SIGSTOP) and isinstance(s, signal.Signals)},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "warm": any(b"warm.py" in a for a in parent), "preloaded_seen": seen_modules,
}
import decimal
if mode == "leak-set":
    decimal.left_by_trial_one = True
seen["leak"] = hasattr(decimal, "left_by_trial_one")
with open(p["out"], "w") as f:
    json.dump(seen, f)
print("probe stdout line")
print("probe stderr line", file=sys.stderr)
sys.stdout.flush()
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("probe raised")
if mode == "signal":
    os.kill(os.getpid(), signal.SIGUSR1)
if mode == "gate":
    import pathlib, time
    deadline = time.monotonic() + 60
    while not pathlib.Path(p["gate"]).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
if mode == "block":
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(p["out"] + ".child", "w") as f:
        f.write(str(child.pid))
    signal.pause()
'''

MODES = ["ok", "exit3", "raise", "signal"]


def _normalized(seen: dict[str, Any]) -> dict[str, Any]:
    """What a trial observes, with what differs from trial to trial by design (its id, its
    directories, its pid) replaced by names."""
    env = seen["env"]
    # The trial's checkpoint directory is one of its own (its name made at random) under the experiment's.
    subs = [(env["TRIALKEEPER_CHECKPOINT_DIR"], "<checkpoint dir>"),
            (env["TRIALKEEPER_TRIAL_DIR"], "<trial dir>"), (env["TRIALKEEPER_TRIAL_ID"], "<trial id>"),
            (env["TRIALKEEPER_EXPERIMENT_ID"], "<experiment>"), ("/cold/exp/", "/<exp>/"), ("/warm/exp/", "/<exp>/")]

    def norm(value: Any) -> Any:
        if isinstance(value, str):
            for old, new in subs:
                value = value.replace(old, new)
            return value
        if isinstance(value, list):
            return [norm(v) for v in value]
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        return value

    out = norm({k: v for k, v in seen.items() if k not in ("pid", "warm", "preloaded_seen")})
    return out


async def _run_modes(
    tmp_path: Path, name: str, preload: list[str], command: str = "python trial.py", modes: list[str] | None = None
) -> dict[str, Any]:
    config = build_config(tmp_path, trialPreload=preload, trialConcurrency=1, trialCommand=command,
                          experimentWorkingDirectory=str(tmp_path / name))
    results: dict[str, Any] = {}
    out_dir = tmp_path / f"{name}-seen"
    out_dir.mkdir()
    async with Coordinator(config, experiment_dir=tmp_path / name / "exp") as c:
        for mode in modes or [*MODES, "leak-set", "leak-check"]:
            out = out_dir / f"{mode}.json"
            info = await (await c.submit({"mode": mode, "out": str(out)})).wait(WAIT_S)
            seen = json.loads(out.read_text())
            trial_dir = Path(seen["env"]["TRIALKEEPER_TRIAL_DIR"])
            results[mode] = {
                "seen": seen, "status": info.status, "exit_code": info.exit_code, "signal": info.signal,
                "stdout": (trial_dir / "stdout.log").read_text(), "stderr": (trial_dir / "stderr.log").read_text(),
            }
        if modes is not None:
            return results
        # Cancel ends the trial and what it started.
        out = out_dir / "block.json"
        h = await c.submit({"mode": "block", "out": str(out)})
        await async_wait_until(lambda: Path(str(out) + ".child").exists(), WAIT_S)
        child = int(Path(str(out) + ".child").read_text())
        await h.cancel()
        info = await h.wait(WAIT_S)
        seen = json.loads(out.read_text())
        results["block"] = {"status": info.status, "trial_gone": pid_gone(seen["pid"]),
                            "child_gone": pid_gone(child), "warm": seen["warm"]}
    return results


@pytest.mark.slow
def test_a_warm_trial_observes_what_a_cold_one_does(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", PROBE)

    async def body() -> tuple[dict[str, Any], dict[str, Any]]:
        return await _run_modes(tmp_path, "cold", []), await _run_modes(tmp_path, "warm", PRELOAD)

    cold, warm = run_async(body, timeout=240.0)
    for mode in [*MODES, "leak-set", "leak-check"]:
        c, w = cold[mode], warm[mode]
        assert not c["seen"]["warm"] and not c["seen"]["preloaded_seen"], mode
        # Forked from the template, which had imported the preload list.
        assert w["seen"]["warm"] and w["seen"]["preloaded_seen"], mode
        assert w["seen"]["pid"] != c["seen"]["pid"]
        assert _normalized(w["seen"]) == _normalized(c["seen"]), mode
        for key in ("status", "exit_code", "signal", "stdout", "stderr"):
            wv, cv = w[key], c[key]
            assert wv == cv, (mode, key, wv, cv)
    seen = warm["ok"]["seen"]
    assert seen["name"] == "__main__" and seen["own_group"] and seen["own_session"]
    assert (
        seen["stdin"] == os.devnull and seen["stdout"].endswith("stdout.log") and seen["stderr"].endswith("stderr.log")
    )
    assert seen["path"][0] == str(tmp_path)
    assert warm["ok"]["stdout"] == "probe stdout line\n"
    assert warm["exit3"]["exit_code"] == 3 and warm["exit3"]["status"] is TrialStatus.FAILED
    assert "ValueError: probe raised" in warm["raise"]["stderr"] and warm["raise"]["exit_code"] == 1
    assert "warm.py" not in warm["raise"]["stderr"]  # the traceback is the trial's own
    assert warm["signal"]["signal"] == signal.SIGUSR1
    # Nothing a trial does to a module reaches the next trial forked from the same template.
    assert warm["leak-set"]["seen"]["leak"] and not warm["leak-check"]["seen"]["leak"]
    for side in (cold, warm):
        assert side["block"]["status"] is TrialStatus.USER_CANCELED
        assert side["block"]["trial_gone"] and side["block"]["child_gone"]
    assert warm["block"]["warm"]


@pytest.mark.slow
def test_a_warm_module_trial_observes_what_a_cold_one_does(tmp_path: Path) -> None:
    write_script(tmp_path, "probe_module.py", PROBE)
    modes = ["ok", "raise"]

    async def body() -> tuple[dict[str, Any], dict[str, Any]]:
        command = "python -m probe_module"
        return (await _run_modes(tmp_path, "cold", [], command, modes),
                await _run_modes(tmp_path, "warm", PRELOAD, command, modes))

    cold, warm = run_async(body, timeout=120.0)
    for mode in modes:
        assert warm[mode]["seen"]["warm"] and not cold[mode]["seen"]["warm"]
        assert _normalized(warm[mode]["seen"]) == _normalized(cold[mode]["seen"]), mode
        for key in ("status", "exit_code", "stdout"):
            assert warm[mode][key] == cold[mode][key], (mode, key)
    assert warm["ok"]["seen"]["name"] == "__main__" and warm["ok"]["seen"]["path"][0] == str(tmp_path)
    assert warm["ok"]["seen"]["argv"][0] == str(tmp_path / "probe_module.py")


def _template(agent_pid: int) -> psutil.Process:
    found = [p for p in psutil.Process(agent_pid).children() if any("warm.py" in a for a in p.cmdline())]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_template_rebuilt_after_kill_and_non_python_runs_cold(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", PROBE)

    async def body() -> None:
        for command, warm in ((f"{sys.executable} trial.py", True), ("/bin/sh -c 'exec python trial.py'", False)):
            config = build_config(tmp_path, trialPreload=PRELOAD, trialCommand=command, trialConcurrency=1,
                                  experimentWorkingDirectory=str(tmp_path / f"exp-{warm}"))
            async with Coordinator(config, experiment_dir=tmp_path / f"exp-{warm}" / "exp") as c:

                async def probe(round_: int, warm: bool = warm) -> bool:
                    out = tmp_path / f"seen-{warm}-{round_}.json"
                    info = await (await c.submit({"mode": "ok", "out": str(out)})).wait(WAIT_S)
                    assert info.status is TrialStatus.SUCCEEDED, info.reason
                    return bool(json.loads(out.read_text())["warm"])

                assert await probe(0) is warm
                if not warm:
                    continue
                assert c.store is not None
                agent = json.loads(c.store.envs()[0]["info_json"])["pid"]
                first = _template(agent)
                first.kill()
                first.wait(10.0)
                # A trial started while the agent learns of the loss starts cold; the one
                # after it is forked from a new template.
                await probe(1)
                assert await probe(2)
                second = _template(agent)
                assert second.pid != first.pid
                # A trial running when its template dies is the agent's to wait for now.
                out, gate = tmp_path / "gated.json", tmp_path / "gate"
                h = await c.submit({"mode": "gate", "out": str(out), "gate": str(gate)})
                await async_wait_until(out.exists, WAIT_S)
                assert json.loads(out.read_text())["warm"]
                second.kill()
                second.wait(10.0)
                gate.touch()
                info = await h.wait(WAIT_S)
                assert (info.status, info.exit_code) == (TrialStatus.FAILED, 3), info.reason

    run_async(body, timeout=180.0)


@pytest.mark.slow
def test_a_template_that_cannot_import_leaves_trials_cold(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", PROBE)
    config = build_config(tmp_path, trialPreload=["json", "no_such_module_here"], trialConcurrency=1)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            out = tmp_path / "seen.json"
            info = await (await c.submit({"mode": "ok", "out": str(out)})).wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, info.reason
            assert not json.loads(out.read_text())["warm"]
            stderr = (Path(json.loads(out.read_text())["env"]["TRIALKEEPER_TRIAL_DIR"]) / "stderr.log").read_text()
            assert "importing no_such_module_here failed" in stderr and "started cold" in stderr

    run_async(body, timeout=120.0)


def test_trial_preload_names_modules(tmp_path: Path) -> None:
    from trialkeeper.coordinator.config.experiment import ConfigError

    assert build_config(tmp_path).trial_preload == []
    with pytest.raises(ConfigError, match=r"trial_preload\[1\]|trialPreload\[1\]"):
        build_config(tmp_path, trialPreload=["numpy", "not a module"])
