"""The checkpoint benchmark: what checkpoints save when environments die, and what a save costs.

    python scripts/bench/ckptbench.py [--quick | --smoke] [--only chaos,transfer] [--ray-python PY]
                                      [--json OUT] [--markdown OUT]

1. chaos: N trials of E epochs (each a fixed sleep, or a fixed CPU cost with --work cpu),
   2 at a time, while environments die at the times of a Poisson process (each lives an
   exponential time whose mean is --lifetime trial lengths): under trialkeeper the agent
   process of a running trial is killed -9 (with its trial: the machine is gone), under
   Ray Tune the worker process of a running trial. Each with a checkpoint saved after every
   epoch and without checkpoints; the same seeds give both systems the same kill times.
   Figures: losses, compute lost per loss (epochs computed again plus the part of the epoch
   under way), epochs computed / needed, wall time to finish (and beside it the same
   workload with no kills).
2. transfer: save_checkpoint of 100 MiB through the coordinator (a local agent told of no
   shared directory, so it uploads it up its stream, as on another machine) against the
   same bytes sent over a loopback TCP socket by a plain Python sender to a receiver that
   writes them to disk, taken in turn; and saves of local agents sharing the experiment's
   directory (by rename), 1 KiB to 100 MiB.

Every figure is printed with its floor; nothing here is a pass or fail. Stages run in
processes of their own with deadlines (``ckptbench.py stage NAME ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ckpt_chaos import Killer, ancestor_below, summarise
from common import PYTHON, kill_group, run_json_child, summary

TRIAL = HERE / "ckpt_trial.py"
MIB = 1 << 20

PROFILES: dict[str, dict[str, Any]] = {
    # trials, epochs, epoch_s, lifetime (trial lengths), seeds; transfer MiB, repeats, rounds
    "full": {"chaos": (12, 10, 0.5, 3.0, (1, 2, 3)), "transfer": (100, 5, 3)},
    "quick": {"chaos": (8, 10, 0.3, 3.0, (1,)), "transfer": (100, 3, 2)},
    "smoke": {"chaos": (3, 4, 0.2, 3.0, (1,)), "transfer": (2, 2, 1)},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- stages (each in a process of its own) ----------------------------------------------


def _config(d: Path, **keys: Any) -> Any:
    from trialkeeper.coordinator.config.experiment import parse_config

    data = {"trialCommand": f"{PYTHON} {TRIAL}", "trialConcurrency": 2, "trainingService": {"platform": "local"},
            "trialCodeDirectory": str(HERE), "experimentWorkingDirectory": str(d / "experiments"), **keys}
    return parse_config(data, d)


async def _ready(c: Any, n: int, timeout: float) -> None:
    from trialkeeper.coordinator.engine.states import EnvStatus

    deadline = time.monotonic() + timeout
    while sum(1 for e in c.environments() if e.status in (EnvStatus.READY, EnvStatus.BUSY) and e.connected) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} agents did not register within {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def _chaos(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    from trialkeeper.coordinator.core import Coordinator
    from trialkeeper.coordinator.engine.states import TrialStatus

    events = d / "events"
    # Losses are the point: far more retries than any run needs.
    config = _config(d, trialConcurrency=a.width, maxTrialRetries=1000)
    params = {"mode": "epochs", "epochs": a.epochs, "epoch_s": a.epoch_s, "work": a.work, "blob": a.blob,
              "ckpt": not a.no_ckpt, "events": str(events)}
    me = os.getpid()
    async with Coordinator(config, experiment_dir=d / "exp") as c:
        await _ready(c, a.width, 60)
        # The agent is this process's child; its trial lies below it.
        killer = None
        if a.lifetime_s > 0:
            killer = Killer(events, a.lifetime_s, a.width, a.seed, lambda pid: ancestor_below(pid, me), tree=True)
        t = time.perf_counter()
        for i in range(a.trials):
            await c.submit({**params, "key": f"t{i}"})
        if killer is not None:
            killer.start()
        try:
            infos = await c.wait_all(a.timeout)
        finally:
            if killer is not None:
                await asyncio.to_thread(killer.stop)
        wall = time.perf_counter() - t
        out = {"system": "trialkeeper", "ckpt": not a.no_ckpt, "width": a.width, "wall_s": wall,
               "succeeded": sum(1 for i in infos if i.status is TrialStatus.SUCCEEDED),
               "attempts": sum(i.attempts for i in infos), "misses": killer.misses if killer else 0}
        out.update(summarise(events, killer.kills if killer else [], a.trials, a.epochs))
        return out


def stage_chaos(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tk-ckptbench-") as d:
        return asyncio.run(_chaos(a, Path(d)))


def _uploading_service(exp: Path) -> Any:
    from trialkeeper.coordinator.services.local import LocalEnvironmentService

    class UploadingLocal(LocalEnvironmentService):
        """Local agents told of no shared checkpoint directory: they upload each checkpoint
        up their stream, as agents on machines of their own do."""

        def shared_checkpoints(self, experiment_dir: Path) -> None:
            return None

    return UploadingLocal(exp, HERE)


async def _saves(a: argparse.Namespace, d: Path, upload: bool) -> dict[str, Any]:
    from trialkeeper.coordinator.core import Coordinator
    from trialkeeper.coordinator.engine.states import TrialStatus

    out_file, exp = d / "saves", (d / "exp").resolve()
    sizes = [int(s) for s in a.sizes.split(",")]
    service = _uploading_service(exp) if upload else None
    async with Coordinator(_config(d, trialConcurrency=1), experiment_dir=exp, service=service) as c:
        h = await c.submit({"mode": "save", "sizes": sizes, "repeats": a.repeats, "out": str(out_file)})
        info = await h.wait(a.timeout)
        if info.status is not TrialStatus.SUCCEEDED:
            return {"error": f"the saving trial ended {info.status.value}: {info.reason} {info.stderr_tail[-500:]}"}
        [kept] = c.checkpoints(h.id)
        # Which way it went: an upload leaves the agent's own copy in its cache beside the
        # coordinator's; a save on the shared directory leaves only the latter.
        cached = (exp / "checkpoint-cache" / h.id / str(kept.step)).is_dir()
        stored = (exp / "checkpoints" / h.id / str(kept.step) / "blob.bin").stat().st_size
        way = "upload" if cached else "shared"
        if way != ("upload" if upload else "shared") or stored != sizes[-1]:
            return {"error": f"the checkpoint went by {way} ({stored} bytes stored), not as asked"}
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    saved = [r for r in rows if "error" not in r]
    return {"way": way, "saves": {str(s): [r["s"] for r in saved if r["bytes"] == s] for s in sizes},
            "refused": [r["error"] for r in rows if "error" in r]}


def stage_upload(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tk-ckptbench-") as d:
        return asyncio.run(_saves(a, Path(d), upload=True))


def stage_local(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tk-ckptbench-") as d:
        return asyncio.run(_saves(a, Path(d), upload=False))


def _write_blob(path: Path, size: int, piece: bytes) -> None:
    with open(path, "wb") as f:
        f.writelines(piece for _ in range(size // len(piece)))
        f.write(piece[: size % len(piece)])


def stage_recv(a: argparse.Namespace) -> dict[str, Any]:
    """The TCP floor's receiver: each transfer (an 8-byte size, then the bytes) written to a
    file of its own, then one byte back once the file is closed."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(60)
        conn, _ = server.accept()
        buf = memoryview(bytearray(MIB))
        n, previous = 0, None
        with conn:
            conn.settimeout(a.timeout)
            while header := conn.recv(8, socket.MSG_WAITALL):
                (left,) = struct.unpack("!Q", header)
                target = Path(a.dir) / f"copy-{n}"
                with open(target, "wb") as f:
                    while left:
                        got = conn.recv_into(buf, min(left, MIB))
                        if not got:
                            raise ConnectionError("the sender went away mid-transfer")
                        f.write(buf[:got])
                        left -= got
                conn.sendall(b"k")
                if previous is not None:  # as the coordinator keeps one checkpoint per trial
                    previous.unlink()
                previous, n = target, n + 1
    return {"received": n}


def stage_tcp(a: argparse.Namespace) -> dict[str, Any]:
    """The floor: the same bytes read from a file and sent over loopback TCP to a receiver
    (another process) that writes them to disk; timed from the first read to its answer."""
    size = int(a.sizes.split(",")[-1])
    piece = os.urandom(MIB)
    times, digests = [], []
    with tempfile.TemporaryDirectory(prefix="tk-ckptbench-") as d:
        recv = subprocess.Popen([PYTHON, __file__, "stage", "recv", "--dir", d, "--timeout", str(a.timeout)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert recv.stdout is not None
            port = int(recv.stdout.readline())
            src = Path(d) / "blob.bin"
            with socket.create_connection(("127.0.0.1", port), timeout=a.timeout) as s:
                buf = bytearray(MIB)
                for _ in range(a.repeats):
                    _write_blob(src, size, piece)
                    os.sync()  # as the trial does before its timed save
                    t = time.perf_counter()
                    s.sendall(struct.pack("!Q", size))
                    with open(src, "rb", buffering=0) as f:
                        while got := f.readinto(buf):
                            s.sendall(memoryview(buf)[:got])
                    if s.recv(1) != b"k":
                        raise ConnectionError("the receiver did not answer")
                    times.append(time.perf_counter() - t)
                    # What the agent adds on top of the copy: the digest over the same bytes.
                    t = time.perf_counter()
                    h = hashlib.sha256()
                    with open(src, "rb", buffering=0) as f:
                        while got := f.readinto(buf):
                            h.update(memoryview(buf)[:got])
                    digests.append(time.perf_counter() - t)
        finally:
            kill_group(recv)
    return {"bytes": size, "tcp_s": times, "sha256_s": digests}


def stage_grpcrecv(a: argparse.Namespace) -> dict[str, Any]:
    """The gRPC floor's receiver: a bare grpc.aio server with one bidirectional stream of
    raw bytes; each message written to the current file, an empty one closes it and is
    answered with one byte."""
    import grpc

    async def serve() -> None:
        async def transfer(requests: Any, context: Any) -> Any:
            n, previous, f = 0, None, None
            async for data in requests:
                if f is None:
                    target = Path(a.dir) / f"copy-{n}"
                    # On the loop, as the coordinator writes an upload's pieces; closed by the empty message.
                    f = open(target, "wb")  # noqa: ASYNC230, SIM115
                if data:
                    f.write(data)
                    continue
                f.close()
                f = None
                yield b"k"
                if previous is not None:
                    previous.unlink()
                previous, n = target, n + 1

        handler = grpc.stream_stream_rpc_method_handler(transfer)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 * MIB)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Floor", {"Transfer": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination(a.timeout)

    asyncio.run(serve())
    return {}


def stage_grpc(a: argparse.Namespace) -> dict[str, Any]:
    """A second floor: the same bytes, read from the file 1 MiB at a time (the chunk size of
    an upload), sent as messages of one bidirectional gRPC stream (grpc.aio, no protobuf) to
    a bare server (another process) that writes them to disk; timed to its answer."""
    import grpc

    size = int(a.sizes.split(",")[-1])
    piece = os.urandom(MIB)

    async def send(port: int, src: Path) -> list[float]:
        times = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/bench.Floor/Transfer")()
            for _ in range(a.repeats):
                _write_blob(src, size, piece)
                os.sync()
                t = time.perf_counter()
                with open(src, "rb", buffering=0) as f:  # noqa: ASYNC230 - read as the agent reads its chunks
                    while data := f.read(MIB):
                        await call.write(data)
                await call.write(b"")
                if await asyncio.wait_for(call.read(), a.timeout) != b"k":
                    raise ConnectionError("the receiver did not answer")
                times.append(time.perf_counter() - t)
            await call.done_writing()
        return times

    with tempfile.TemporaryDirectory(prefix="tk-ckptbench-") as d:
        recv = subprocess.Popen([PYTHON, __file__, "stage", "grpcrecv", "--dir", d, "--timeout", str(a.timeout)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert recv.stdout is not None
            port = int(recv.stdout.readline())
            times = asyncio.run(send(port, Path(d) / "blob.bin"))
        finally:
            kill_group(recv)
    return {"bytes": size, "grpc_s": times}


STAGES = {"chaos": stage_chaos, "upload": stage_upload, "local": stage_local, "tcp": stage_tcp, "recv": stage_recv,
          "grpc": stage_grpc, "grpcrecv": stage_grpcrecv}


def stage_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="ckptbench.py stage")
    p.add_argument("name", choices=sorted(STAGES))
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--epoch-s", type=float, default=0.2)
    p.add_argument("--work", choices=("sleep", "cpu"), default="sleep")
    p.add_argument("--blob", type=int, default=0)
    p.add_argument("--width", type=int, default=2)
    p.add_argument("--lifetime-s", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-ckpt", action="store_true")
    p.add_argument("--sizes", default=str(100 * MIB))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="")
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    print(json.dumps(STAGES[a.name](a)), flush=True)


# ---- the harness ------------------------------------------------------------------------


def run_chaos(prof: dict[str, Any], a: argparse.Namespace, R: dict[str, Any]) -> None:
    trials, epochs, epoch_s, lifetime, seeds = prof["chaos"]
    trial_s = epochs * epoch_s
    lifetime_s = lifetime * trial_s
    ideal = trials / 2 * trial_s
    # Room for trialkeeper's retry backoff (1, 2, 4, ... s for a trial lost without progress).
    timeout = 120 + 25 * ideal
    common = ["--trials", trials, "--epochs", epochs, "--epoch-s", epoch_s, "--work", a.work, "--blob", a.blob]
    R["chaos"] = {"trials": trials, "epochs": epochs, "epoch_s": epoch_s, "work": a.work, "lifetime_s": lifetime_s,
                  "ideal_wall_s": ideal, "seeds": list(seeds), "runs": []}
    systems = ["trialkeeper"] + (["ray"] if a.ray_python else [])
    if not a.ray_python:
        R["chaos"]["ray_error"] = "no interpreter with ray[tune]: give --ray-python"
    # Per seed and system: no kills (the floor of that round), kills with checkpoints, kills
    # without; in turn, as the load on a shared machine drifts.
    variants = [(s, ck, seed, kills) for seed in seeds for s in systems
                for ck, kills in ((True, False), (True, True), (False, True))]
    for system, ckpt, seed, kills in variants:
        args = [*common, "--seed", seed, "--lifetime-s", lifetime_s if kills else 0]
        args += [] if ckpt else ["--no-ckpt"]
        what = f"{system}, {'checkpoints' if ckpt else 'no checkpoints'}, seed {seed}" + ("" if kills else ", no kills")
        log(f"chaos: {what}")
        t = time.monotonic()
        if system == "trialkeeper":
            argv = [PYTHON, __file__, "stage", "chaos", *map(str, args), "--timeout", str(timeout)]
        else:
            argv = [a.ray_python, str(HERE / "peer_ray_ckpt.py"), *map(str, args)]
        r = run_json_child(argv, timeout + 60)
        r.update(system=system, ckpt=ckpt, seed=seed, kills=kills)
        log(f"  {r.get('error') or 'done'} in {time.monotonic() - t:.1f} s")
        R["chaos"]["runs"].append(r)


def run_transfer(prof: dict[str, Any], R: dict[str, Any]) -> None:
    mib, repeats, rounds = prof["transfer"]
    size = str(mib * MIB)
    R["transfer"] = {"bytes": mib * MIB, "repeats": repeats, "upload": [], "tcp": [], "grpc": []}
    for i in range(rounds):
        # Taken in turn: the load on a shared machine drifts over minutes.
        log(f"transfer, round {i + 1}/{rounds}: {mib} MiB saved by upload, then over plain TCP, then over a bare "
            f"gRPC stream ({repeats} each)")
        R["transfer"]["upload"].append(run_json_child(
            [PYTHON, __file__, "stage", "upload", "--sizes", size, "--repeats", str(repeats)], 600))
        R["transfer"]["tcp"].append(run_json_child(
            [PYTHON, __file__, "stage", "tcp", "--sizes", size, "--repeats", str(repeats)], 600))
        R["transfer"]["grpc"].append(run_json_child(
            [PYTHON, __file__, "stage", "grpc", "--sizes", size, "--repeats", str(repeats)], 600))
    sizes = ",".join(str(s) for s in sorted({1024, MIB, mib * MIB}))
    log(f"transfer: saves on the shared directory, sizes {sizes} bytes")
    R["transfer"]["local"] = run_json_child(
        [PYTHON, __file__, "stage", "local", "--sizes", sizes, "--repeats", str(max(repeats, 3))], 600)


def _ok(r: Any) -> bool:
    return isinstance(r, dict) and "error" not in r


def fmt(s: dict[str, float] | None, unit: str = "", digits: int = 2) -> str:
    if not s:
        return "—"
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def chaos_rows(ch: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    label = {True: "checkpoint per epoch", False: "no checkpoints"}
    for r in ch["runs"]:
        if not _ok(r):
            rows.append((f"1. {r['system']}, {label[r['ckpt']]}, seed {r['seed']}{'' if r['kills'] else ', no kills'}",
                         f"failed: {r['error']}", r.get("stderr_tail", "")[-200:].replace("\n", " ")))
    if "ray_error" in ch:
        rows.append(("1. Ray Tune", f"skipped: {ch['ray_error']}", ""))
    for system, name in (("trialkeeper", "trialkeeper"), ("ray", "Ray Tune")):
        floors = {r["seed"]: r["wall_s"] for r in ch["runs"] if _ok(r) and r["system"] == system and not r["kills"]}
        if floors:
            ideal = (f"ideal {ch['ideal_wall_s']:.1f} s ({ch['trials']} trials × {ch['epochs']} epochs × "
                     f"{ch['epoch_s']} s, 2 at a time)")
            rows.append((f"1. {name}, no kills: wall (s)", fmt(summary(list(floors.values())), digits=1), ideal))
        for ckpt in (True, False):
            runs = [r for r in ch["runs"] if _ok(r) and r["system"] == system and r["ckpt"] is ckpt and r["kills"]]
            if not runs:
                continue
            head = f"1. {name}, {label[ckpt]}"
            losses = sum(r["losses"] for r in runs)
            lost = sum(r["epochs_recomputed"] + r["partial_epochs_lost"] for r in runs)
            rows.append((f"{head}: losses (kills that hit a running trial)", str(losses),
                         f"{sum(r['misses'] for r in runs)} kills found the slot empty; {len(runs)} seed(s)"))
            per_seed = ", ".join("—" if r["lost_epochs_per_loss"] is None else f"{r['lost_epochs_per_loss']:.2f}"
                                 for r in runs)
            note = (f"all seeds pooled; per seed {per_seed}; epochs computed again "
                    f"({sum(r['epochs_recomputed'] for r in runs)}) + parts of epochs under way")
            rows.append((f"{head}: compute lost per loss (epochs)", f"{lost / losses:.2f}" if losses else "—", note))
            note = (f"needed {runs[0]['epochs_needed']}; trials finished: "
                    f"{sum(r['trials_finished'] for r in runs)}/{sum(r['trials'] for r in runs)}")
            computed = fmt(summary([r["computed_over_needed"] for r in runs]), "×")
            rows.append((f"{head}: epochs computed / needed", computed, note))
            walls = [r["wall_s"] for r in runs]
            ratios = [r["wall_s"] / floors[r["seed"]] for r in runs if r["seed"] in floors]
            rows.append((f"{head}: wall to finish (s)", fmt(summary(walls), digits=1),
                         f"over the same seed's run with no kills: {fmt(summary(ratios), '×')}" if ratios else ""))
            back = [x for r in runs for x in r["kill_to_next_run_s"]]
            rows.append((f"{head}: kill → the trial's next run begins (s)", fmt(summary(back)), f"{len(back)} kills"))
    return rows


def table(R: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    if R.get("chaos"):
        rows += chaos_rows(R["chaos"])
    tr = R.get("transfer")
    if tr:
        up = [x for r in tr["upload"] if _ok(r) for x in next(iter(r["saves"].values()))]
        tcp = [x for r in tr["tcp"] if _ok(r) for x in r["tcp_s"]]
        sha = [x for r in tr["tcp"] if _ok(r) for x in r["sha256_s"]]
        mib = tr["bytes"] // MIB
        for r in tr["upload"] + tr["tcp"] + tr.get("grpc", []):
            if not _ok(r):
                rows.append(("2. transfer stage", f"failed: {r['error']}", r.get("stderr_tail", "")[-300:]))
        refused = [e for r in tr["upload"] if _ok(r) for e in r.get("refused", [])]
        note = "local agent told of no shared directory"
        if refused:
            note += f"; {len(refused)} of {len(up) + len(refused)} saves refused, e.g. {refused[0][:160]}"
        rows.append((f"2. save_checkpoint of {mib} MiB, uploaded to the coordinator (s)", fmt(summary(up), digits=3),
                     note))
        rows.append((f"2. floor: {mib} MiB over loopback TCP to a process writing it to disk (s)",
                     fmt(summary(tcp), digits=3), f"sha256 of the same bytes: {fmt(summary(sha), digits=3)} s"))
        grpc_s = [x for r in tr.get("grpc", []) if _ok(r) for x in r["grpc_s"]]
        if grpc_s:
            rows.append((f"2. floor: {mib} MiB as 1 MiB messages of a bare gRPC stream to a process writing it (s)",
                         fmt(summary(grpc_s), digits=3), "grpc.aio, no protobuf; upload / this: "
                         + (f"{statistics.median(up) / statistics.median(grpc_s):.2f}×" if up else "—")))
        if up and tcp:
            per_round = [statistics.median(next(iter(u["saves"].values()))) / statistics.median(t["tcp_s"])
                         for u, t in zip(tr["upload"], tr["tcp"], strict=True) if _ok(u) and _ok(t)]
            rows.append(("2. upload / TCP floor (ratio of medians; per round)",
                         f"{statistics.median(up) / statistics.median(tcp):.2f}×",
                         "target ≤ 1.5×; rounds: " + ", ".join(f"{x:.2f}×" for x in per_round)))
            rows.append(("2. upload / TCP floor (fastest of each)", f"{min(up) / min(tcp):.2f}×",
                         "what is left when neither waits on the rest of a loaded machine"))
        loc = tr.get("local")
        if loc is not None and not _ok(loc):
            rows.append(("2. local saves", f"failed: {loc['error']}", loc.get("stderr_tail", "")[-300:]))
        elif loc is not None:
            for size, times in loc["saves"].items():
                n = int(size)
                label = f"{n // MIB} MiB" if n >= MIB else f"{n // 1024} KiB"
                rows.append((f"2. save_checkpoint of {label} on the shared directory, by rename (ms)",
                             fmt(summary([x * 1000 for x in times]), digits=1), f"{len(times)} saves"))
            if loc.get("refused"):
                rows.append(("2. local saves refused", str(len(loc["refused"])), loc["refused"][0][:160]))
    return rows


def print_table(rows: list[tuple[str, str, str]], markdown: Path | None) -> None:
    w0 = max([len(r[0]) for r in rows] + [6])
    w1 = max([len(r[1]) for r in rows] + [5])
    for f, v, n in rows:
        print(f"{f.ljust(w0)}  {v.ljust(w1)}  {n}")
    if markdown is not None:
        lines = ["| figure | value: median [min–max] | note |", "| --- | --- | --- |"]
        lines += [f"| {f} | {v} | {n.replace('|', '/')} |" for f, v, n in rows]
        markdown.write_text("\n".join(lines) + "\n")


def default_ray_python() -> str:
    import peers

    venv = peers.venv_python(peers.DEFAULT_CACHE, "ray")
    if venv.exists():
        return str(venv)
    probe = subprocess.run([PYTHON, "-c", "import ray.tune"], capture_output=True, timeout=120, check=False)
    return PYTHON if probe.returncode == 0 else ""


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "stage":
        stage_main(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (about 4 minutes)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every part runs")
    ap.add_argument("--only", default="chaos,transfer", help="comma list: chaos, transfer")
    ap.add_argument("--work", choices=("sleep", "cpu"), default="sleep", help="what an epoch is (default sleep)")
    ap.add_argument("--blob", type=int, default=0, help="bytes of extra state in each checkpoint (default 0)")
    ap.add_argument("--ray-python", default=None, help="an interpreter with ray[tune] (default: the peers' "
                    "virtualenv of run.py --peers, else this one if it has ray.tune); '' leaves Ray out")
    ap.add_argument("--json", type=Path, default=Path("ckpt-bench.json"))
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    if a.ray_python is None:
        a.ray_python = default_ray_python()
    profile = "smoke" if a.smoke else "quick" if a.quick else "full"
    prof = PROFILES[profile]
    only = set(filter(None, a.only.split(",")))
    R: dict[str, Any] = {}
    t0 = time.monotonic()
    if "chaos" in only:
        run_chaos(prof, a, R)
    if "transfer" in only:
        run_transfer(prof, R)
    rows = table(R)
    meta = {"profile": profile, "elapsed_s": time.monotonic() - t0, "ray_python": a.ray_python,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "load_average": os.getloadavg(), "command": " ".join([Path(sys.executable).name, *sys.argv])}
    a.json.write_text(json.dumps({"meta": meta, "profile": prof, "table": rows, "results": R}, indent=1, default=str))
    print_table(rows, a.markdown)
    print(f"\n{profile} run took {meta['elapsed_s']:.0f} s; results in {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
