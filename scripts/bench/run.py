"""trialkeeper's benchmark suite: one command, a table of figures, a JSON file.

    python scripts/bench/run.py [--quick | --smoke] [--peers] [--json OUT] [--markdown OUT]

Every figure is given as min / median / max over its repeats, beside its floor measured in
the same run and the ratio of the two (figure / floor). Each stage runs in its own
process with a deadline; a stage that misses it is reported as "did not finish in X s".
See docs/benchmarks.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import PYTHON, percentile, run_json_child, summary

PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "n": 200,
        "ks": (1, 2),
        "repeats": 3,
        "sequential": 10,
        "ingest": (4, 25_000),
        "ingest_repeats": 3,
        "footprint_s": 3.0,
        "failure_repeats": 3,
        "lease": True,
        "scale": (100, 1000, 10_000),
        "bare": (100, 1000, 10_000),
        "burst": 10_000,
        "burst_timeout": 40,
        "sched": (100, 1000, 5000),
        "waiting": 10_000,
        "peer_n": 40,
        "window": 3.0,
        "nni": (40, 5, 2),
        "warm_starts": 10,
        "store": (1_000_000, 5),
    },
    "quick": {
        "n": 50,
        "ks": (1, 2),
        "repeats": 2,
        "sequential": 6,
        "ingest": (4, 5_000),
        "ingest_repeats": 2,
        "footprint_s": 2.0,
        "failure_repeats": 2,
        "lease": False,
        "scale": (100, 500),
        "bare": (500,),
        "burst": 2_000,
        "burst_timeout": 15,
        "sched": (100, 1000),
        "waiting": 10_000,
        "peer_n": 10,
        "window": 2.0,
        "nni": (10, 3, 1),
        "warm_starts": 5,
        "store": (100_000, 3),
    },
    "smoke": {
        "n": 6,
        "ks": (1, 2),
        "repeats": 1,
        "sequential": 2,
        "ingest": (2, 200),
        "ingest_repeats": 1,
        "footprint_s": 0.5,
        "failure_repeats": 1,
        "lease": False,
        "scale": (5,),
        "bare": (5,),
        "burst": 60,
        "burst_timeout": 15,
        "sched": (10,),
        "waiting": 100,
        "peer_n": 4,
        "window": 0.5,
        "nni": (4, 1, 1),
        "warm_starts": 1,
        "store": (2_000, 1),
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stage(*args: Any, timeout: float, sample: bool = False) -> dict[str, Any]:
    argv = [PYTHON, str(HERE / "stages.py"), *map(str, args)]
    t = time.monotonic()
    out = run_json_child(argv, timeout, sample=sample)
    if "error" in out:
        log(f"  {' '.join(map(str, args))}: {out['error']} {out.get('stderr_tail', '')[-300:]}")
    else:
        log(f"  {' '.join(map(str, args[:3]))}: {time.monotonic() - t:.1f} s")
    return out


def ok(r: dict[str, Any]) -> bool:
    return isinstance(r, dict) and "error" not in r


def pcts(values: list[float]) -> tuple[float | None, float | None]:
    return percentile(values, 50), percentile(values, 99)


# ---- the stages -------------------------------------------------------------------------


def run_overhead(p: dict[str, Any], R: dict[str, Any]) -> None:
    log("1+2. per-trial overhead and dispatch latency")
    for k in p["ks"]:
        floors, tks = [], []
        for r in range(p["repeats"]):
            floors.append(stage("floor", "--n", p["n"], "--width", k, timeout=300))
            seq = p["sequential"] if k == 1 else 0
            tks.append(stage("overhead", "--n", p["n"], "--k", k, "--sequential", seq, timeout=300))
        R[f"overhead_k{k}"] = {"floor": floors, "trialkeeper": tks}


def run_ingest(p: dict[str, Any], R: dict[str, Any]) -> None:
    log("3. metric ingest")
    trials, metrics = p["ingest"]
    runs, floors = [], []
    for _ in range(p["ingest_repeats"]):
        floors.append(stage("ingest_floor", "--trials", trials, "--metrics", metrics, timeout=120))
        runs.append(stage("ingest", "--trials", trials, "--metrics", metrics, timeout=180, sample=True))
    # Taken in turn with the bare server, three times each: the two share a loaded machine.
    edge = [stage("edge", "--batch", b, "--messages", m, *extra, timeout=120)
            for b, m in ((1, 5000), (100, 2000)) for _ in range(p["ingest_repeats"]) for extra in ((), ("--bare",))]
    R["ingest"] = {"trials": trials, "metrics": metrics, "floor": floors, "trialkeeper": runs, "edge": edge}


def run_footprint(p: dict[str, Any], R: dict[str, Any]) -> None:
    log("5. agent footprint")
    R["footprint"] = stage("footprint", "--seconds", p["footprint_s"], "--windows", 3, timeout=120)


def run_failure(p: dict[str, Any], R: dict[str, Any]) -> None:
    log("6. failure detection")
    R["failure_local"] = [stage("failure", "--mode", "local", timeout=120) for _ in range(p["failure_repeats"])]
    R["failure_lease"] = [stage("failure", "--mode", "lease", timeout=120)] if p["lease"] else []
    R["exit_floor"] = stage("exit_floor", "--repeats", 5, timeout=60)


def run_scale(p: dict[str, Any], R: dict[str, Any], out_dir: Path) -> None:
    log("4. scale (simulated agents)")
    R["scale"] = {}
    for n in p["scale"]:
        sim_procs = 1 if n <= 1000 else 2
        # The burst's target is on 1,000 agents; a larger fleet is measured joining and held.
        burst = p["burst"] if n <= 1000 else 0
        for bare in (False, True):
            if bare and n not in p["bare"]:
                continue
            f = out_dir / f"scale-{n}{'-bare' if bare else ''}.json"
            f.unlink(missing_ok=True)
            connect = min(60.0, 20 + n * 0.03)
            timeout = 30 + connect + 5 * p["window"] + (0 if bare or not burst else p["burst_timeout"] + burst * 0.002)
            args = ["scale", "--agents", n, "--sim-procs", sim_procs, "--burst", burst,
                    "--burst-timeout", p["burst_timeout"], "--connect-timeout", connect, "--out", f,
                    "--window", p["window"], "--settle", min(2.0, p["window"])]
            if bare:
                args.append("--bare")
            res = stage(*args, timeout=timeout)
            data = json.loads(f.read_text()) if f.exists() else {}
            if not ok(res):
                data["stage_error"] = res["error"]
                data["stage_timeout_s"] = timeout
            R["scale"][f"{n}{'_bare' if bare else ''}"] = data
    R["sched"] = {
        n: stage("schedbench", "--envs", n, "--waiting", p["waiting"], "--repeats", 3, timeout=120) for n in p["sched"]
    }


def run_peers(p: dict[str, Any], R: dict[str, Any], cache: Path) -> None:
    import peers

    log("7. peers: setting up their virtualenvs (bounded)")
    status = peers.setup(cache, timeout_s=420, log=log)
    n, width = p["peer_n"], 2
    R["peers"] = {"n": n, "width": width, "setup": status}
    R["peers"]["floor"] = stage("floor", "--n", n, "--width", width, timeout=120)
    R["peers"]["trialkeeper"] = stage("overhead", "--n", n, "--k", width, timeout=300)
    for name, why in status.items():
        if why:
            log(f"  {name}: skipped: {why}")
            R["peers"][name] = {"error": f"not installed: {why}"}
            continue
        log(f"  {name}: {n} trials, {width} at a time")
        R["peers"][name] = peers.run_peer(name, n, width, cache, timeout_s=600)


def run_search(profile: str, R: dict[str, Any], out_dir: Path) -> None:
    """Search quality per wall time (searchbench.py; its own figures, not in the table)."""
    seeds, trials, methods = {"full": (3, 20, ""), "quick": (2, 12, ""), "smoke": (1, 4, "random,tpe+sha")}[profile]
    log(f"8. search quality: {seeds} seeds x {trials} trials per method")
    argv = [PYTHON, str(HERE / "searchbench.py"), "--seeds", str(seeds), "--trials", str(trials),
            "--json", str(out_dir / "search-bench.json")]
    argv += ["--methods", methods] if methods else []
    R["search"] = run_json_child(argv, timeout_s=3600)
    # Multi-fidelity methods against Ray Tune's on curves whose best configurations start slow.
    seeds, trials, methods = {"full": (5, 40, ""), "quick": (2, 20, ""), "smoke": (1, 4, "asha,pbt")}[profile]
    log(f"8b. multi-fidelity search: {seeds} seeds x {trials} configurations per method")
    argv = [PYTHON, str(HERE / "mfbench.py"), "--seeds", str(seeds), "--trials", str(trials),
            "--json", str(out_dir / "mf-bench.json")]
    argv += ["--methods", methods] if methods else []
    R["multifidelity"] = run_json_child(argv, timeout_s=3600)


def run_nni(p: dict[str, Any], R: dict[str, Any], nni_python: str) -> None:
    """9. An unmodified NNI trial under trialkeeper and under NNI's local training service,
    in alternate rounds: the load on a shared machine drifts over minutes."""
    n, starts, rounds = p["nni"]
    R["nni"] = {"n": n, "width": 2, "trialkeeper": [], "nni": []}
    if not nni_python or not Path(nni_python).is_file():
        R["nni"]["error"] = "no interpreter with nni: give --nni-python or set TRIALKEEPER_NNI_PYTHON"
        return
    args = [str(x) for x in ("--n", n, "--width", 2, "--starts", starts)]
    for i in range(rounds):
        log(f"9. NNI trials, round {i + 1}/{rounds}: {n}, 2 at a time, under trialkeeper")
        R["nni"]["trialkeeper"].append(
            run_json_child([PYTHON, str(HERE / "nni_bench.py"), "trialkeeper", "--nni-python", nni_python, *args], 600)
        )
        log(f"9. NNI trials, round {i + 1}/{rounds}: {n}, 2 at a time, under NNI's local training service")
        R["nni"]["nni"].append(run_json_child([nni_python, str(HERE / "nni_bench.py"), "nni", *args], 600))


def run_warm(p: dict[str, Any], R: dict[str, Any], nni_python: str, ray_python: str) -> None:
    """10. Warm trial starts (trialPreload): submit -> a trial's first line after its imports."""
    starts = p["warm_starts"]
    log(f"10. warm starts: numpy + scikit-learn trial, {starts} cold and {starts} warm")
    R["warm"] = {"sklearn": run_json_child([PYTHON, str(HERE / "warmbench.py"), "--trial", "sklearn",
                                            "--starts", str(starts)], 600)}
    if nni_python and Path(nni_python).is_file():
        log(f"10. warm starts: `import nni` trial, {starts} cold and {starts} warm")
        R["warm"]["nni"] = run_json_child([os.path.abspath(nni_python), str(HERE / "warmbench.py"), "--trial", "nni",
                                           "--starts", str(starts)], 600)
    else:
        R["warm"]["nni"] = {"error": "no interpreter with nni: give --nni-python or set TRIALKEEPER_NNI_PYTHON"}
    if ray_python and Path(ray_python).is_file():
        log(f"10. warm starts: the same trial under Ray Tune, {starts} with and without reuse_actors")
        R["warm"]["ray"] = run_json_child([os.path.abspath(ray_python), str(HERE / "peer_ray_warm.py"),
                                           "--starts", str(starts)], 600)


def run_store(p: dict[str, Any], R: dict[str, Any], cache: Path) -> None:
    """11. An experiment's store at scale: the CLI and the dashboard over it (storebench.py)."""
    trials, repeats = p["store"]
    log(f"11. store at scale: {trials} trials, {trials * 10} metrics (built once under {cache})")
    R["store"] = run_json_child([PYTHON, str(HERE / "storebench.py"), "--trials", str(trials),
                                 "--repeats", str(repeats), "--cache", str(cache)], 1200)


def store_rows(rows: list[dict[str, Any]], R: dict[str, Any]) -> None:
    r = R.get("store")
    if r is None:
        return
    if not ok(r):
        row(rows, "11. store at scale", f"failed: {r.get('error', 'no result')}")
        return
    size = f"{r['trials']:,} trials, {r['metrics']:,} metrics"
    for name, s in r["cli"].items():
        row(
            rows,
            f"11. trialkeeper {name.replace(', fresh process', '')} ({size})"
            f"{' as a new process' if 'fresh' in name else ''} (s)",
            s,
            target="≤ 0.5 s",
            digits=3,
            note="" if "fresh" in name else "the CLI's code in the bench's process",
        )
    for path, s in r["ui"].items():
        row(rows, f"11. dashboard {path} ({size}) (s)", s, target="≤ 0.5 s", digits=3)
    row(
        rows,
        "11. store size per trial (bytes)",
        fmt(r["bytes_per_trial"], digits=0),
        note="row, indexes and 2 status events",
    )
    row(rows, "11. store size per metric (bytes)", fmt(r["bytes_per_metric"], digits=0))


def warm_rows(rows: list[dict[str, Any]], R: dict[str, Any]) -> None:
    for key, label, target in (("sklearn", "numpy + scikit-learn", "≥ 10×"), ("nni", "import nni", "≥ 20×")):
        r = R.get("warm", {}).get(key)
        if r is None:
            continue
        if not ok(r):
            row(rows, f"10. warm start, {label}", f"skipped: {r.get('error', 'no result')}")
            continue
        row(rows, f"10. {label} trial: submit → first own line, cold (s)", r["cold_s"], r["floor_s"],
            fmt(r["cold_s"]["median"] / r["floor_s"]["median"], "×", 2), note="floor: Popen of the trial", digits=3)
        row(rows, f"10. {label} trial: submit → first own line, trialPreload (s)", r["warm_s"], None,
            fmt(r["cold_over_warm"], "×", 0) + " sooner than cold", target, digits=3)
    ray = R.get("warm", {}).get("ray")
    if ray is not None and not ok(ray):
        row(rows, "10. Ray Tune, same trial", f"failed: {ray.get('error', 'no result')}")
    elif ray is not None:
        for key, label in (("new_worker_per_trial", "a new worker per trial"), ("reuse_actors", "reuse_actors=True")):
            row(rows, f"10. Ray Tune, {label}: one trial's end → next one's first own line (s)", ray[f"{key}_gap_s"],
                note="numpy + scikit-learn trial, one at a time", digits=3)


def nni_rows(rows: list[dict[str, Any]], R: dict[str, Any]) -> None:
    nni = R.get("nni")
    if not nni:
        return
    n = nni["n"]
    if "error" in nni:
        row(rows, "9. NNI trials", f"skipped: {nni['error']}")
        return
    floor_walls = [w for r in nni["trialkeeper"] if ok(r) for w in r["floor_wall_s"]]
    for key, label in (("trialkeeper", "trialkeeper (local, reuse)"), ("nni", "NNI's local training service")):
        runs = [r for r in nni[key] if ok(r)]
        for r in nni[key]:
            if not ok(r):
                row(rows, f"9. {label}", f"failed: {r.get('error', 'no result')}")
        if not runs:
            continue
        row(rows, f"9. NNI trial start under {label}: submit → first line after import nni (s)",
            fsum(summary([x for r in runs for x in r["start_s"]]), digits=2),
            fsum(summary([x for r in runs for x in r["floor_start_s"]]), digits=2), None, "",
            "floor: Popen → that line (the cost of import nni)"
            + ("; NNI: from the startTime it records" if key == "nni" else "; warm agent, one trial at a time"))
        walls = [r["wall_s"] for r in runs]
        note = f"{sum(r['ok'] for r in runs)}/{n * len(runs)} succeeded over {len(runs)} round(s)"
        if key == "nni":
            note += f"; manager start {fmt(statistics.median(r['manager_start_s'] for r in runs))} s not counted"
        row(
            rows,
            f"9. {n} NNI trials, 2 at a time, under {label}: wall (s)",
            fsum(summary(walls), digits=1),
            fsum(summary(floor_walls), digits=1),
            fsum(ratio_summary(walls, [statistics.median(floor_walls)] * len(walls)), "×", 2) if floor_walls else None,
            "",
            note,
        )


# ---- the table --------------------------------------------------------------------------


def fmt(x: float | None, unit: str = "", digits: int = 1) -> str:
    if x is None:
        return "—"
    if abs(x) >= 10_000:
        return f"{x:,.0f}{unit}"
    return f"{x:.{digits}f}{unit}"


def fsum(s: dict[str, float] | None, unit: str = "", digits: int = 1) -> str:
    if not s:
        return "—"
    if s["n"] == 1:
        return fmt(s["median"], unit, digits)
    return f"{fmt(s['median'], unit, digits)} [{fmt(s['min'], '', digits)}–{fmt(s['max'], '', digits)}]"


def ratio_summary(values: list[float], floors: list[float]) -> dict[str, float] | None:
    pairs = [v / f for v, f in zip(values, floors) if v is not None and f]
    return summary(pairs)


def row(rows: list[dict[str, Any]], figure: str, value: Any, floor: Any = None, ratio: Any = None,
        target: str = "", note: str = "", unit: str = "", digits: int = 1) -> None:
    rows.append({
        "figure": figure,
        "value": value if isinstance(value, str) else fsum(value, unit, digits),
        "floor": floor if isinstance(floor, str) or floor is None else fsum(floor, unit, digits),
        "ratio": ratio if isinstance(ratio, str) or ratio is None else fsum(ratio, "×", 2),
        "target": target, "note": note,
        "raw": {"value": value, "floor": floor, "ratio": ratio},
    })


def build_table(p: dict[str, Any], R: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    n = p["n"]
    for k in p["ks"]:
        data = R.get(f"overhead_k{k}")
        if not data:
            continue
        fl = [r["wall_s"] if ok(r) else None for r in data["floor"]]
        tk = [r["wall_s"] if ok(r) else None for r in data["trialkeeper"]]
        per = [(t - f) * 1000 * k / n if t and f else None for t, f in zip(tk, fl)]
        row(rows, f"1. wall, {n} trivial trials, k={k} agents (s)", summary(tk), summary(fl),
            ratio_summary(tk, fl), "≤ 1.10×", "floor: plain subprocess pool of width k", digits=2)
        row(rows, f"1. overhead per trial, k={k} (ms of slot time)", summary(per), None, None, "",
            "(wall − floor) × k / N")
        starts = [r["agent_start_s"] * 1000 for r in data["trialkeeper"] if ok(r)]
        row(rows, f"   agent start-up, k={k} (ms, not in the wall time)", summary(starts))
        bad = [r for r in data["trialkeeper"] if ok(r) and r["succeeded"] != n]
        if bad or not all(ok(r) for r in data["trialkeeper"]):
            rows[-1]["note"] = "some runs failed or lost trials; see JSON"
        if k == 1:
            tk_ok = [r for r in data["trialkeeper"] if ok(r)]
            fl_ok = [r for r in data["floor"] if ok(r)]
            spawn_p50 = [percentile(r["spawn_to_first_line_ms"], 50) for r in fl_ok]
            spawn_p99 = [percentile(r["spawn_to_first_line_ms"], 99) for r in fl_ok]
            for key, label in (("submit_to_first_line_ms", "idle warm agent"),):
                p50 = [percentile(r[key], 50) for r in tk_ok if r.get(key)]
                p99 = [percentile(r[key], 99) for r in tk_ok if r.get(key)]
                row(rows, f"2. submit → trial's first line, p50, {label} (ms)", summary(p50),
                    summary(spawn_p50), ratio_summary(p50, spawn_p50), "≤ 5 ms beyond spawn",
                    f"beyond spawn: {fmt(_diff(p50, spawn_p50))} ms; floor: Popen → first line")
                row(rows, f"2. submit → trial's first line, p99, {label} (ms)", summary(p99),
                    summary(spawn_p99), ratio_summary(p99, spawn_p99), "≤ 20 ms beyond spawn",
                    f"beyond spawn: {fmt(_diff(p99, spawn_p99))} ms")
            gaps = [percentile(r["end_to_next_first_line_ms"], 50) for r in tk_ok]
            fgaps = [percentile(r["end_to_next_first_line_ms"], 50) for r in fl_ok]
            row(rows, "2. trial end → next trial's first line, same agent, p50 (ms)", summary(gaps), summary(fgaps),
                ratio_summary(gaps, fgaps), "≤ 10 ms beyond spawn",
                f"beyond: {fmt(_diff(gaps, fgaps))} ms; floor: same gap in a width-1 subprocess loop")
            gaps99 = [percentile(r["end_to_next_first_line_ms"], 99) for r in tk_ok]
            fgaps99 = [percentile(r["end_to_next_first_line_ms"], 99) for r in fl_ok]
            row(rows, "2. trial end → next trial's first line, p99 (ms)", summary(gaps99), summary(fgaps99),
                ratio_summary(gaps99, fgaps99))
            agent = [percentile(r["agent_end_to_next_spawn_ms"], 50) for r in tk_ok]
            row(rows, "   of which agent: trial reaped → next spawned, p50 (ms)", summary(agent))
    ing = R.get("ingest")
    if ing:
        tk = [r["rate_per_s"] if ok(r) else None for r in ing["trialkeeper"]]
        fl = [r["rate_per_s"] if ok(r) else None for r in ing["floor"]]
        row(rows, f"3. metric ingest, {ing['trials']} trials × {ing['metrics']:,}, stored + acked (metrics/s)",
            summary(tk), summary(fl), ratio_summary(tk, fl), "≥ 0.9× the floor",
            "floor: same trials into a bare datagram socket", digits=0)
        to_end = [r.get("rate_to_end_per_s") if ok(r) else None for r in ing["trialkeeper"]]
        if any(to_end):
            row(rows, "   the same, to the last trial's end stored (metrics/s)", summary(to_end), summary(fl),
                ratio_summary(to_end, fl), "", "the trial's exit, reaping and end come after its last metric", digits=0)
        # The same per CPU-second of every process involved (trials and what receives them):
        # what the rate would be on a machine of its own, where the others' load on a shared
        # one moves both rates.
        per_cpu = [
            r["stored"] / sum(r["cpu_s"].values()) if ok(r) and r.get("cpu_s") else None for r in ing["trialkeeper"]
        ]
        fper_cpu = [
            r["received"] / sum(r["cpu_s"].values()) if ok(r) and r.get("cpu_s") else None for r in ing["floor"]
        ]
        if any(per_cpu) and any(fper_cpu):
            row(rows, "   the same, metrics per CPU-second of trials + agents + coordinator", summary(per_cpu),
                summary(fper_cpu), ratio_summary(per_cpu, fper_cpu), "",
                "floor: per CPU-second of the trials + the bare socket's reader", digits=0)
        peak = [r["peak_rss_mib"] for r in ing["trialkeeper"] if ok(r) and "peak_rss_mib" in r]
        base = [r["rss_before_mib"] for r in ing["trialkeeper"] if ok(r)]
        row(rows, "3. coordinator RSS during ingest, peak (MiB)", summary(peak), summary(base),
            ratio_summary(peak, base), "", "floor: its RSS just before")
        cpu = [r["cpu_s"]["coordinator"] / r["stored"] * 1e6 for r in ing["trialkeeper"] if ok(r) and r.get("stored")]
        acpu = [r["cpu_s"]["agents"] / r["stored"] * 1e6 for r in ing["trialkeeper"] if ok(r) and r.get("stored")]
        row(rows, "   CPU per metric: coordinator / agents (µs)",
            f"{fsum(summary(cpu))} / {fsum(summary(acpu))}")
        edge: dict[tuple[Any, str], list[dict[str, Any]]] = {}
        for e in ing["edge"]:
            if ok(e):
                edge.setdefault((e.get("batch"), "bare" if "stored" not in e else "tk"), []).append(e)
        for b in (1, 100):
            tk_e, bare_e = edge.get((b, "tk"), []), edge.get((b, "bare"), [])
            if tk_e:
                rate = [e["metrics_per_s"] for e in tk_e]
                brate = [e["metrics_per_s"] for e in bare_e]
                cpu = summary([e["server_cpu_us_per_message"] for e in tk_e])
                bcpu = summary([e["server_cpu_us_per_message"] for e in bare_e])
                row(
                    rows,
                    f"   coordinator alone, {b}-metric messages (metrics/s; CPU µs/message)",
                    f"{fsum(summary(rate), digits=0)}; {fmt(cpu['median'], digits=0) if cpu else '—'}",
                    f"{fsum(summary(brate), digits=0)}; {fmt(bcpu['median'], digits=0) if bcpu else '—'}"
                    if bare_e
                    else None,
                    ratio_summary(rate, brate) if bare_e else None,
                    "≥ 0.6×" if b == 100 else "",
                    "floor: bare gRPC server (read, ack), taken in turn",
                )
    for key, data in (R.get("scale") or {}).items():
        if key.endswith("_bare"):
            continue
        nag = data.get("agents", key)
        bare = (R.get("scale") or {}).get(f"{key}_bare", {})
        load = f"load average {fmt(data.get('connect_load'))}" if data.get("connect_load") is not None else ""
        cpu_note = (
            f"CPU: coordinator {fmt(data['connect_cpu_s'])} s, "
            f"simulated agents {fmt(data.get('connect_sim_cpu_s'))} s; {load}"
            if data.get("connect_cpu_s") is not None
            else ""
        )
        if data.get("connect_gc_cpu_s") is not None:
            bgc = f" (floor {fmt(bare['connect_gc_cpu_s'])} s)" if bare.get("connect_gc_cpu_s") is not None else ""
            cpu_note += (f"; in the garbage collector {fmt(data['connect_gc_cpu_s'])} s{bgc}, "
                         f"{data['connect_full_collections']} full collections, thresholds {data.get('gc_thresholds')}")
        if "connect_s" not in data:
            row(rows, f"4. N={nag}: agents connected", data.get("connect_error") or data.get("stage_error") or "failed",
                None, None, "10,000 in ≤ 30 s" if nag >= 10_000 else "", cpu_note)
            continue
        bconnect = bare.get("connect_s")
        row(
            rows,
            f"4. N={nag}: all agents connected (s)",
            fmt(data["connect_s"]),
            fmt(bconnect) if bconnect else None,
            fmt(data["connect_s"] / bconnect, "×", 2) if bconnect else None,
            "≤ 30 s at N=10000" if nag >= 10_000 else "",
            cpu_note + ("; floor: the same agents joining a bare gRPC server" if bconnect else ""),
        )
        cpu = [w["cpu_percent"] for w in data.get("heartbeat_windows", [])]
        hbs = [w["heartbeats_per_s"] for w in data.get("heartbeat_windows", [])]
        bcpu = [w["cpu_percent"] for w in bare.get("heartbeat_windows", [])]
        row(
            rows,
            f"4. N={nag}: coordinator CPU, heartbeats at 1 s (% of one core)",
            summary(cpu),
            summary(bcpu) if bcpu else None,
            ratio_summary(cpu, bcpu) if bcpu else None,
            "≤ 1.2× the floor at N=1000",
            f"{fmt(statistics.median(hbs), digits=0)} heartbeats/s; floor: bare gRPC server" if hbs else "",
        )
        per = data.get("rss_per_agent_kib")
        bper = bare.get("rss_per_agent_kib")
        row(rows, f"4. N={nag}: coordinator RSS per connected agent (KiB)", fmt(per), fmt(bper) if bper else None,
            fmt(per / bper, "×", 2) if per and bper else None, "", f"connected in {fmt(data['connect_s'])} s")
        b = data.get("burst")
        if b:
            passes = [x for x in data.get("schedule_passes", []) if x[1] >= 0.9 * b["trials"] and x[2] == 0]
            if passes:
                med = statistics.median(x[0] for x in passes) * 1000
                idle = data.get("counters", {}).get("passes_idle", 0)
                row(rows, f"4. N={nag}: one scheduling pass, ≥{int(0.9 * b['trials']):,} waiting, nothing placed (ms)",
                    fmt(med, digits=3), None, None, "≤ 1 ms",
                    f"{len(passes)} passes ran; {idle} asked found nothing changed and returned at once")
            if "placed_s" in b:
                # Counted from the last submit, as the target is.
                val = f"{fmt(b['placed_s'] - b['submit_s'], ' s')} placed"
                val += (
                    f", {fmt(b['running_s'] - b['submit_s'], ' s')} running"
                    if "running_s" in b
                    else f"; running {b['running']:,} of {b['target']:,} in {b['deadline_s']:.0f} s"
                )
            elif "submit_s" in b:
                val = (
                    f"did not finish in {b['deadline_s']:.0f} s "
                    f"(placed {b.get('placed', '?')}, running {b.get('running', '?')} of {b['target']:,})"
                )
                if data.get("stage_error"):
                    val = f"did not finish in {data['stage_timeout_s']:.0f} s (stage killed)"
            else:
                val = "did not start"
            row(
                rows,
                f"4. N={nag}: burst of {b['trials']:,} trials → {b['target']:,} placed/running, after the last submit",
                val,
                None,
                None,
                "all running ≤ 5 s",
                f"submitting took {fmt(b.get('submit_s'), ' s')}",
            )
    for n_envs, s in (R.get("sched") or {}).items():
        if ok(s):
            real = [x * 1000 for x in s["pass_s"]]
            ref = [x * 1000 for x in s["reference_pass_s"]]
            row(
                rows,
                f"4. scheduler alone: {s['waiting']:,} waiting, {n_envs} full envs, 1 free GPU: one placement (ms)",
                summary(real),
                summary(ref),
                ratio_summary(real, ref),
                "≤ the reference",
                "the coordinator's indexed pass; floor: indexed reference picker",
                digits=2,
            )
            if s.get("plain_pass_s"):
                plain = [x * 1000 for x in s["plain_pass_s"]]
                row(
                    rows,
                    "4. scheduler alone: the same with the plain pass over the whole queue (ms)",
                    summary(plain),
                    summary(ref),
                    ratio_summary(plain, ref),
                    "",
                    "the proof's model, not run by the coordinator",
                    digits=2,
                )
        else:
            row(rows, f"4. scheduler alone, {n_envs} envs", s.get("error", "failed"))
    fp = R.get("footprint")
    if fp and ok(fp):
        row(rows, "5. idle agent RSS (MiB)", fmt(fp["agent"]["rss_mib"]), fmt(fp["floor"]["rss_mib"]),
            fmt(fp["agent"]["rss_mib"] / fp["floor"]["rss_mib"], "×", 2), "≤ 40 MB",
            f"USS {fmt(fp['agent']['uss_mib'])} MiB; floor: a bare gRPC client with heartbeats")
        row(rows, "5. idle agent CPU (%)", summary(fp["agent"]["cpu_percent"]), summary(fp["floor"]["cpu_percent"]),
            ratio_summary(fp["agent"]["cpu_percent"], fp["floor"]["cpu_percent"]), "≤ 0.5 %", digits=2)
    loc = [r["detect_s"] * 1000 for r in R.get("failure_local", []) if ok(r)]
    if loc or R.get("failure_local"):
        ef = R.get("exit_floor", {})
        efl = [x * 1000 for x in ef.get("detect_s", [])] if ok(ef) else []
        row(rows, "6. kill -9 of a local agent → its trial marked (ms)", summary(loc), summary(efl),
            ratio_summary(loc, [statistics.median(efl)] * len(loc)) if efl else None, "≤ 3 s",
            "floor: asyncio noticing a SIGKILLed child", digits=1)
    for r in R.get("failure_lease", []):
        if ok(r):
            row(rows, "6. kill -9, agent seen only through heartbeats → env LOST / trial marked (s)",
                f"{fmt(r.get('env_marked_s'))} / {fmt(r['detect_s'])}",
                f"{fmt(r['agent_lost_timeout_s'])} / {fmt(r.get('trial_lost_timeout_s'))}", None, "≤ 3 s",
                "floor: the configured timeouts (agentLostTimeout / trialLostTimeout)")
        else:
            row(rows, "6. kill -9, heartbeat-only detection", r.get("error", "failed"))
    peers = R.get("peers")
    if peers:
        n_p, fl = peers["n"], peers.get("floor", {})
        flw = fl.get("wall_s") if ok(fl) else None
        items = [("trialkeeper (k=2 agents)", peers.get("trialkeeper", {}), "wall_s")]
        items += [("Ray Tune, new worker per trial", peers.get("ray", {}), "new_worker_per_trial_wall_s"),
                  ("Ray Tune, reuse_actors=True", peers.get("ray", {}), "reuse_actors_wall_s"),
                  ("NNI, local training service", peers.get("nni", {}), "wall_s")]
        for label, r, key in items:
            if ok(r) and key in r:
                row(rows, f"7. {label}: {n_p} trivial trials, 2 at a time (s)", fmt(r[key], digits=2),
                    fmt(flw, digits=2), fmt(r[key] / flw, "×", 1) if flw else None, "",
                    "excludes start-up" + (f" (ray.init {fmt(r['init_s'])} s)" if "init_s" in r else "")
                    + (f" (NNI start {fmt(r['start_s'])} s)" if "start_s" in r else ""))
            else:
                row(rows, f"7. {label}", f"skipped: {r.get('error', 'no result')}")
    nni_rows(rows, R)
    warm_rows(rows, R)
    store_rows(rows, R)
    return rows


def _diff(a: list[float], b: list[float]) -> float | None:
    a = [x for x in a if x is not None]
    b = [x for x in b if x is not None]
    if not a or not b:
        return None
    return statistics.median(a) - statistics.median(b)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("figure", "value", "floor", "ratio", "target")
    widths = {c: max([len(c), *(len(str(r[c] or "")) for r in rows)]) for c in cols}  # rows may be none (--only search)
    widths["figure"] = min(widths["figure"], 84)
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(r[c] or "").ljust(widths[c]) for c in cols) + (f"  {r['note']}" if r["note"] else ""))


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| figure | value: median [min–max] | floor | ratio | target | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            "| "
            + " | ".join(
                str(r[c] or "").replace("|", "/") for c in ("figure", "value", "floor", "ratio", "target", "note")
            )
            + " |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (about 2 minutes)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every stage runs")
    ap.add_argument("--peers", action="store_true", help="also run Ray Tune and NNI (installs them once)")
    ap.add_argument(
        "--only",
        default="",
        help="comma list of stages: overhead,ingest,scale,footprint,failure,peers,search,nni,warm,store",
    )
    ap.add_argument("--nni-python", default=os.environ.get("TRIALKEEPER_NNI_PYTHON", ""),
                    help="an interpreter with nni installed, for the nni stage (default: $TRIALKEEPER_NNI_PYTHON)")
    ap.add_argument("--ray-python", default="", help="an interpreter with ray[tune] and scikit-learn, for the "
                    "warm stage's Ray Tune comparison (default: the peers' Ray virtualenv, where it exists)")
    ap.add_argument("--json", type=Path, default=Path("bench-results.json"), help="where to write the results")
    ap.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    ap.add_argument(
        "--cache", type=Path, default=None, help="where the peers' virtualenvs and the store stage's store go"
    )
    a = ap.parse_args()
    profile = "smoke" if a.smoke else "quick" if a.quick else "full"
    p = PROFILES[profile]
    only = set(filter(None, a.only.split(","))) or {"overhead", "ingest", "scale", "footprint", "failure"}
    if a.peers:
        only.add("peers")
    out_dir = a.json.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    R: dict[str, Any] = {}
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    log(f"profile {profile}; stages {sorted(only)}")
    if "overhead" in only:
        run_overhead(p, R)
    if "ingest" in only:
        run_ingest(p, R)
    if "footprint" in only:
        run_footprint(p, R)
    if "failure" in only:
        run_failure(p, R)
    if "scale" in only:
        run_scale(p, R, out_dir)
    if "peers" in only:
        import peers

        run_peers(p, R, a.cache or peers.DEFAULT_CACHE)
    if "search" in only:
        run_search(profile, R, out_dir)
        for row in R["search"].get("summary", []):
            print(f"search: {row['method']}: best {row['best']}, wall {[round(w, 1) for w in row['wall_s']]} s, "
                  f"reached Ray Tune's best at {row['to_ray_best_over_ray_wall']} of its wall time")


    if "nni" in only:
        run_nni(p, R, a.nni_python)
    if "warm" in only:
        import peers

        run_warm(p, R, a.nni_python, a.ray_python or str(peers.venv_python(a.cache or peers.DEFAULT_CACHE, "ray")))
    if "store" in only:
        import peers

        run_store(p, R, a.cache or peers.DEFAULT_CACHE)
    rows = build_table(p, R)
    elapsed = time.monotonic() - t0
    meta = {
        "profile": profile, "started": started, "elapsed_s": elapsed, "python": sys.version.split()[0],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    a.json.write_text(json.dumps({"meta": meta, "profile": p, "table": rows, "results": R}, indent=1, default=str))
    print_table(rows)
    print(f"\n{profile} run took {elapsed:.0f} s; results in {a.json}")
    if a.markdown:
        a.markdown.write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
