"""Helpers for the dashboard's tests: a real experiment served by `trialkeeper run --ui`, a
stored one served by `trialkeeper ui`, a store of many trials, and plain HTTP."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from conftest import write_script
from test_cli import _script
from trialkeeper.coordinator.store.store import GpuSampleRow, MetricRow, Store

HTTP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str
    experiment_dir: Path
    lines: list[str]

    @property
    def token(self) -> str:
        return (self.experiment_dir / ".token").read_text().strip()


def http(
    method: str, url: str, *, token: str | None = None, body: Any = None, timeout: float = HTTP_TIMEOUT_S
) -> tuple[int, dict[str, str], bytes]:
    """One request: its status, headers and body (an error status is an answer, not a raise)."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def tk_bare(*args: str | Path, timeout: float = HTTP_TIMEOUT_S * 3) -> subprocess.CompletedProcess[str]:
    """``trialkeeper ARGS`` with no PATH (so no tensorboard, whatever this machine has) and no
    dashboard token from the caller's environment."""
    env = {k: v for k, v in os.environ.items() if k != "TRIALKEEPER_UI_TOKEN"}
    env["PATH"] = os.devnull
    return subprocess.run(
        [_script(), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def get_json(url: str, **kw: Any) -> Any:
    status, _, body = http("GET", url, **kw)
    assert status == 200, (url, status, body[:500])
    return json.loads(body)


def first_event(url: str, token: str | None = None) -> dict[str, Any]:
    """The first `change` event of the dashboard's live stream."""
    request = urllib.request.Request(url + "/api/events")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as stream:
        event = ""
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "change":
                return dict(json.loads(line.removeprefix("data: ")))
    raise AssertionError("the live stream ended without an event")


def every_answer(url: str, token: str | None = None) -> dict[str, bytes]:
    """Every page and answer the dashboard at ``url`` gives, by path: its pages and scripts, the
    experiment and its context (the config), every trial (its detail and both logs), comparison and
    importance, the trials exported, every environment (and its GPUs), /metrics and the live
    stream's first event."""
    paths = ["/", "/static/app.js", "/static/app.css", "/api/experiment", "/api/trials?limit=1000", "/api/compare",
             "/api/environments", "/metrics", "/api/context", "/static/context.js", "/static/table.js",
             "/static/plots.js", "/api/importance", "/api/trials/export?format=csv", "/api/trials/export?format=json"]
    for t in get_json(url + "/api/trials?limit=1000", token=token)["trials"]:
        paths += [
            f"/api/trials/{t['id']}",
            f"/api/trials/{t['id']}/log?stream=stdout",
            f"/api/trials/{t['id']}/log?stream=stderr",
        ]
    paths += [
        f"/api/environments/{e['id']}/gpus" for e in get_json(url + "/api/environments", token=token)["environments"]
    ]
    answers = {}
    for path in paths:
        status, _, body = http("GET", url + path, token=token)
        assert status == 200, (path, status, body[:300])
        answers[path] = body
    answers["/api/events"] = json.dumps(first_event(url, token)).encode()
    return answers


# A trial that prints, reports three intermediate results, then waits (90 s at most) until the
# directory $GATES holds a file named by its sequence id, or one named "all", prints that it was
# let through and reports x.
GATED_TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
print("trial output for x =", p["x"], flush=True)
for i in range(3):
    trial.report_intermediate_result(p["x"] * (i + 1) / 3)
gates = pathlib.Path(os.environ["GATES"])
mine, every = gates / os.environ["TRIALKEEPER_SEQUENCE_ID"], gates / "all"
deadline = time.monotonic() + 90
while not (mine.exists() or every.exists()) and time.monotonic() < deadline:
    time.sleep(0.02)
print("let through", flush=True)
trial.report_final_result(float(p["x"]))
"""


def gated_config(root: Path, *, trials: int, concurrency: int, gates: Path, **overrides: Any) -> Path:
    """A config whose trials wait to be let through one by one (see GATED_TRIAL); ``overrides``
    replace its top-level fields (another ``trainingService``, ``trialEnv`` entries of one's own)."""
    gates.mkdir(parents=True, exist_ok=True)
    write_script(root, "trial.py", GATED_TRIAL)
    data: dict[str, Any] = {
        "experimentName": "dashboard", "trialCommand": "python3 trial.py", "trialCodeDirectory": str(root),
        "trialConcurrency": concurrency, "maxTrialNumber": trials,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3, 4, 5, 6]}},
        "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize", "seed": 5}},
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 20, "trialLostTimeout": 40},
        "trainingService": {"platform": "local"},
        **overrides,
    }
    data["trialEnv"] = {"GATES": str(gates), **overrides.get("trialEnv", {})}
    config = root / "config.yml"
    config.write_text(yaml.safe_dump(data))
    return config


def first_line(
    proc: subprocess.Popen[str], pick: Callable[[str], str | None], timeout: float = START_TIMEOUT_S
) -> tuple[str, list[str]]:
    """Follow ``proc``'s output from a thread until ``pick`` finds something in a line; returns
    that ("" when the output ended or ``timeout`` passed first) and the lines so far (still growing)."""
    lines: list[str] = []
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            picked = pick(line)
            if picked:
                found.put(picked)
        found.put("")

    threading.Thread(target=read, daemon=True).start()
    try:
        return found.get(timeout=timeout), lines
    except queue.Empty:
        return "", lines


def _start(args: list[str], experiment_dir: Path, cwd: Path, env: dict[str, str] | None = None) -> Served:
    proc = subprocess.Popen(
        [_script(), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
        stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    url, lines = first_line(
        proc, lambda line: line.removeprefix("dashboard: ").strip() if line.startswith("dashboard: ") else None
    )
    if not url:
        proc.kill()
        proc.wait(STOP_TIMEOUT_S)
        raise AssertionError(f"no dashboard started: {''.join(lines)}")
    return Served(proc, url.rstrip("/"), experiment_dir, lines)


def _end(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.terminate()
    try:
        served.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait(STOP_TIMEOUT_S)


@dataclass
class Gates:
    directory: Path

    def release(self, sequence_id: int) -> None:
        (self.directory / str(sequence_id)).touch()

    def release_all(self) -> None:
        (self.directory / "all").touch()


@contextmanager
def live_experiment(
    root: Path, *, trials: int = 6, concurrency: int = 2, address: str = "127.0.0.1:0", **overrides: Any,
) -> Iterator[tuple[Served, Gates]]:
    """`trialkeeper run --ui` of a gated experiment (``overrides`` as :func:`gated_config`
    takes them); yields it and its gates. Its trials are let through and it is ended (SIGTERM)
    when the block leaves."""
    gates = Gates(root / "gates")
    config = gated_config(root, trials=trials, concurrency=concurrency, gates=gates.directory, **overrides)
    exp = root / "exp"
    served = _start(["run", str(config), "--experiment-dir", str(exp), "--quiet", "--ui", address], exp, root)
    try:
        yield served, gates
    finally:
        gates.release_all()
        _end(served)


@contextmanager
def stored_dashboard(
    experiment_dir: Path, address: str = "127.0.0.1:0", env: dict[str, str] | None = None
) -> Iterator[Served]:
    served = _start(["ui", str(experiment_dir), "--address", address], experiment_dir, experiment_dir.parent, env)
    try:
        yield served
    finally:
        _end(served)


@contextmanager
def home_dashboard(
    directory: Path, address: str = "127.0.0.1:0", command: str = "ui", env: dict[str, str] | None = None
) -> Iterator[Served]:
    """`trialkeeper ui --dir DIRECTORY` (or `view --dir`): the experiments home."""
    served = _start([command, "--dir", str(directory), "--address", address], directory, directory, env)
    try:
        yield served
    finally:
        _end(served)


def many_trials(experiment_dir: Path, n: int, *, seed: int = 1) -> None:
    """A finished experiment's store with ``n`` trials (as a long experiment leaves it)."""
    rng = random.Random(seed)
    store = Store.in_dir(experiment_dir)
    store.create_experiment(
        "bigexp", "many", {"maxTrialNumber": n, "tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize"}}}
    )
    statuses = ["SUCCEEDED"] * 8 + ["FAILED", "USER_CANCELED"]
    with store.transaction():
        for seq in range(n):
            status = rng.choice(statuses)
            start = 1_700_000_000.0 + seq
            row = {
                "id": f"tr{seq:05d}", "seq": seq, "status": status,
                "parameters_json": json.dumps({"lr": round(rng.uniform(1e-4, 1), 6), "layers": rng.randint(1, 8),
                                               "opt": rng.choice(["sgd", "adam", "rmsprop"])}),
                "command": "python3 train.py", "gpu_number": 0, "environment_id": f"env-{seq % 7}",
                "submitted_at": start, "started_at": start, "ended_at": start + rng.uniform(1, 100),
                "final_metric": round(rng.random(), 6) if status == "SUCCEEDED" else None,
            }
            store.insert_trial({**row, "ran_s": row["ended_at"] - start})  # one attempt each
        store.add_metrics(
            [
                MetricRow(f"tr{seq:05d}", i, "intermediate", i / 10, json.dumps(i / 10), 1.0)
                for seq in range(n)
                for i in range(3)
            ]
        )
    # Seven environments; env-0 has a GPU sampled while tr00000 ran on it.
    gpu = {"index": 0, "uuid": "GPU-0000", "name": "NVIDIA H100", "memory_total_bytes": 80 * 2**30}
    for e in range(7):
        store.insert_env(f"env-{e}", "remote", "STOPPED")
    store.update_env("env-0", hostname="gpu-host", info_json=json.dumps({"gpus": [gpu]}))
    store.add_gpu_samples(
        [
            GpuSampleRow(1_700_000_000.0 + i, "env-0", "GPU-0000", 10.0 * i, i * 2**30, 80 * 2**30, ("tr00000",))
            for i in range(6)
        ]
    )
    store.set_experiment_status("DONE", ended=True)
    store.close()
    (experiment_dir / ".token").write_text("stored-experiment-token-0123456789")
