"""The dashboard's JSON answers, built from read-model snapshots only.

Each function takes an open :class:`ReadModel` and plain arguments and returns plain JSON data;
the server (``server.py``) only routes, authorises and streams. Charts get a sample where the
whole would be too much for a browser: at most a few hundred points a series."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trialkeeper.agent import nnicompat

from .. import TrialStatus  # the public API
from ..read import pages
from ..read.failures import failure_summary
from ..read.model import CheckpointInfo, ReadModel, TrialSnapshot, optimize_mode, to_json
from ..read.pages import GpuPoint
from ..read.results import reported, result_keys

SERIES_POINTS = 400  # points a time series is thinned to
LOG_CHUNK = 256 * 1024  # bytes of a log answered at once
TAIL_BYTES = 1024 * 1024  # at most this much of a log's end is answered for its last lines
WAITING_SHOWN = 200
ENV_TRIALS_SHOWN = 10  # trial ids listed with each environment (a thousand environments stay light)
ENV_PAGE = 100  # environments in a page of /api/environments, unless it asks for another number
ENV_PAGE_MAX = 1000


class NotFound(LookupError):
    pass


def thin(points: Sequence[Any], n: int = SERIES_POINTS) -> list[Any]:
    """At most ``n`` of ``points``, evenly spread, the last one always kept."""
    if len(points) <= n:
        return list(points)
    step = len(points) / n
    picked = [points[int(i * step)] for i in range(n - 1)]
    return [*picked, points[-1]]


def _max_trials(config: Mapping[str, Any] | None) -> int | None:
    value = (config or {}).get("maxTrialNumber", (config or {}).get("max_trial_number"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def config_mode(config: Mapping[str, Any] | None) -> str:
    tuner = (config or {}).get("tuner")
    args = tuner.get("classArgs", tuner.get("class_args")) if isinstance(tuner, dict) else None
    return optimize_mode(args if isinstance(args, dict) else None)


def trial_json(t: TrialSnapshot) -> dict[str, Any]:
    data = to_json(t)
    data["failure_summary"] = failure_summary(t)  # a failed trial's reason with its stderr's last word
    data["duration_s"] = t.duration(time.time())  # every attempt's, the running one's so far
    return data


def overview(model: ReadModel, now: float | None = None) -> dict[str, Any]:
    """Status, counts, best trial, elapsed time and ETA, and trials finished and best metric over time."""
    exp = model.experiment()
    if exp is None:
        raise NotFound("the store holds no experiment")
    config = model.stored_config()
    now = time.time() if now is None else now
    end = exp.ended_at if exp.ended_at is not None else now
    elapsed = end - exp.started_at if exp.started_at is not None else None
    max_trials = _max_trials(config)
    series = pages.ended_series(model, exp.optimize_mode, SERIES_POINTS)
    ended = series[-1].ended if series else 0
    eta = None
    if max_trials and ended and elapsed is not None and exp.ended_at is None:
        eta = max(0.0, elapsed / ended * (max_trials - ended))
    data = to_json(exp)
    data.pop("coordinator_address", None)  # where agents dial in: nothing a page needs
    data["best"] = trial_json(exp.best) if exp.best is not None else None
    data.update(
        elapsed_s=elapsed, eta_s=eta, max_trials=max_trials, ended=ended, now=now,
        finished_over_time=[(p.at, p.ended) for p in series],
        best_over_time=[(p.at, p.best) for p in series if p.best is not None],
    )
    return data


def trials(model: ReadModel, query: Mapping[str, str]) -> dict[str, Any]:
    """A page of the trials table; ``query`` holds the URL's arguments (see README)."""
    status = query.get("status") or None
    page = pages.trial_page(
        model, status=status, environment=query.get("environment") or None, search=query.get("q", ""),
        sort=query.get("sort", "sequence"), descending=query.get("order", "asc") == "desc",
        offset=int_arg(query, "offset", 0), limit=int_arg(query, "limit", 100),
    )
    return {
        "total": page.total, "offset": page.offset, "trials": [table_row(model, t) for t in page.trials],
        "parameters": list(pages.parameter_names(model)), "result_keys": list(pages.result_keys(model)),
    }


def table_row(model: ReadModel, t: TrialSnapshot) -> dict[str, Any]:
    """A trial as the trials table shows it: with its latest intermediate result (as reported:
    a number, or a dict of keys), what a running or stopped trial is judged by."""
    data = trial_json(t)
    last = model.read("metrics", lambda: model.store.last_metric(t.id, "intermediate"))
    data["latest_intermediate"] = to_json(reported(last.value, last.value_json)) if last is not None else None
    data["latest_index"] = last.index if last is not None else None
    return data


def int_arg(query: Mapping[str, str], name: str, default: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a whole number") from None


def trial(model: ReadModel, trial_id: str) -> dict[str, Any]:
    detail = model.trial_detail(trial_id)
    if detail is None:
        raise NotFound(f"no trial {trial_id!r}")
    data = to_json(detail)
    data["trial"] = trial_json(detail.trial)
    data.pop("stdout")  # paths on the coordinator's machine: the log endpoint serves them
    data.pop("stderr")
    data["intermediate"] = [[i, v] for i, v in thin(list(enumerate(detail.intermediate)), 2000)]
    # Dict results with every key as reported (NNI's web UI shows them all): a curve per key.
    results, final = detail.intermediate_results, detail.trial.final_metric_value
    data["result_keys"] = result_keys([*results, final])
    shown = thin(list(enumerate(results)), 2000) if data["result_keys"] else []
    data["intermediate_results"] = [[i, to_json(r)] for i, r in shown]
    data["final_result"] = to_json(final)
    data["gpu_series"] = gpu_series(pages.gpu_series(model, trial_id=trial_id))
    data["checkpoints"] = [checkpoint_json(c, model.experiment_dir) for c in model.checkpoints(trial_id)]
    return data


def checkpoint_json(c: CheckpointInfo, experiment_dir: Path) -> dict[str, Any]:
    """A checkpoint kept, with ``where`` its files are: its object storage URL, or its
    directory in the experiment's checkpoint directory (on the coordinator's machine)."""
    data = to_json(c)
    data["where"] = c.location or str(Path(experiment_dir) / "checkpoints" / c.trial_id / str(c.step))
    return data


def gpu_series(points: Sequence[GpuPoint]) -> list[dict[str, Any]]:
    """Per GPU: its utilisation and memory used over time, thinned."""
    by_gpu: dict[tuple[str, str], list[GpuPoint]] = {}
    for p in points:
        by_gpu.setdefault((p.environment_id, p.uuid), []).append(p)
    return [
        {
            "environment_id": env, "uuid": uuid,
            "utilization": [[p.at, p.utilization_percent] for p in thin(ps)],
            "memory_used_bytes": [[p.at, p.memory_used_bytes] for p in thin(ps)],
            "memory_total_bytes": ps[-1].memory_total_bytes,
        }
        for (env, uuid), ps in sorted(by_gpu.items())
    ]


def log_path(model: ReadModel, trial_id: str, stream: str) -> Path:
    """Where the trial's ``stream`` is written (it may not exist yet)."""
    return _trial_log(model, trial_id, stream)[1]


def _trial_log(model: ReadModel, trial_id: str, stream: str) -> tuple[TrialSnapshot, Path]:
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream: {stream!r} is not stdout or stderr")
    t = model.trial(trial_id)
    if t is None:
        raise NotFound(f"no trial {trial_id!r}")
    return t, Path(model.experiment_dir) / "trials" / trial_id / f"{stream}.log"


def log(
    model: ReadModel, trial_id: str, stream: str, offset: int, nni_results: bool = False, *,
    tail: int = 0, before: int | None = None,
) -> dict[str, Any]:
    """The trial's output from ``offset`` on (a chunk at most), and whether more may come.
    ``tail``: its last ``tail`` lines instead (``TAIL_BYTES`` at most), what a page shows first;
    ``before``: the chunk that ends at that offset, from a line's start, for a page going back.
    The lines NNI trials report results with are left out unless ``nni_results``."""
    t, path = _trial_log(model, trial_id, stream)
    if tail < 0 or (before is not None and before < 0):
        raise ValueError("tail and before: not below 0")
    data, size, start = b"", 0, 0
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            end = size
            if tail:
                start = max(0, size - TAIL_BYTES)
            elif before is not None:
                end = min(before, size)
                start = max(0, end - LOG_CHUNK)
            else:
                start = max(0, min(offset, size))
                end = min(size, start + LOG_CHUNK)
            f.seek(start)
            data = f.read(end - start)
    except FileNotFoundError:
        pass
    if before is None and (start + len(data) < size or t.active):
        data = data[:_whole_chars(data)]  # a character cut in two comes whole with the next chunk
    if tail or before is not None:
        cut = _last_lines(data, tail, whole=start == 0) if tail else _first_line_start(data, whole=start == 0)
        start, data = start + cut, data[cut:]
    consumed = len(data)
    if stream == "stdout" and not nni_results:
        # What comes before an offset is whole: only a chunk that ends at the file's end may
        # stop inside a result line still being written.
        final = before is not None or (not t.active and start + len(data) >= size)
        data, held = nnicompat.without_results(data, final=final)
        if len(held) < LOG_CHUNK:  # a result line the chunk cut is asked for again, whole
            consumed -= len(held)
        else:
            data += held
    text = data.decode("utf-8", "replace")
    return {
        "offset": start, "next_offset": start + consumed, "size": size, "text": text, "following": t.active,
        # The text is the file's bytes as they are: a page may cut it at a line and know the offset.
        "exact": len(data) == consumed and text.encode() == data,
    }


def _last_lines(data: bytes, n: int, *, whole: bool) -> int:
    """Where the last ``n`` lines of ``data`` begin; a first line cut short (``data`` is not
    ``whole``, from the file's start) is left out."""
    pos = len(data) - 1 if data.endswith(b"\n") else len(data)  # the last newline ends the last line
    for _ in range(n):
        pos = data.rfind(b"\n", 0, pos)
        if pos < 0:
            return 0 if whole else _first_line_start(data, whole=False)
    return pos + 1


def _whole_chars(data: bytes) -> int:
    """``len(data)`` less a UTF-8 character cut short at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:  # the character's first byte says how long it is
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= length else len(data) - back
    return len(data)


def _first_line_start(data: bytes, *, whole: bool) -> int:
    """Where the first whole line of ``data`` begins (0 when ``whole``, or when it is all one line)."""
    if whole:
        return 0
    cut = data.find(b"\n") + 1
    return cut if 0 < cut < len(data) else 0


def environments(model: ReadModel, query: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A page of the environments (``offset``, ``limit``: at most :data:`ENV_PAGE_MAX`), each
    with its GPUs' latest samples, and why the waiting trials wait."""
    query = query or {}
    offset = max(0, int_arg(query, "offset", 0))
    limit = int_arg(query, "limit", ENV_PAGE)
    if not 1 <= limit <= ENV_PAGE_MAX:
        raise ValueError(f"limit: {limit} is not between 1 and {ENV_PAGE_MAX}")
    waiting = pages.trial_page(model, status=TrialStatus.WAITING.value, limit=WAITING_SHOWN)
    # The page's environments alone, with their latest trials only (the trials page lists them
    # all) and their counts, read from the store's index by environment.
    page = model.environments(latest=ENV_TRIALS_SHOWN, offset=offset, limit=limit)
    counts = model.trials_per_environment([e.id for e in page])
    envs = []
    for e in page:
        data = to_json(e)
        data["trial_count"] = counts.get(e.id, 0)
        envs.append(data)
    return {
        "total": model.environment_count(),
        "offset": offset,
        "limit": limit,
        "environments": envs,
        "waiting_total": waiting.total,
        "waiting": [{"id": t.id, "reason": t.waiting_reason, "submitted_at": t.submitted_at} for t in waiting.trials],
    }


def environment_gpus(model: ReadModel, env_id: str) -> dict[str, Any]:
    return {"environment_id": env_id, "gpus": gpu_series(pages.gpu_series(model, environment_id=env_id))}


def change_marker(model: ReadModel) -> dict[str, Any]:
    """What the live stream sends: cheap to read, and it changes whenever a page's data may."""
    exp = model.experiment()
    if exp is None:
        return {}
    return {
        "status": exp.status, "trials": dict(exp.trials), "trial_count": exp.trial_count, "metrics": exp.metrics,
        "best": exp.best.id if exp.best else None, "environments": exp.environments,
    }
