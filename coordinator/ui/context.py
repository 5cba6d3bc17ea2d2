"""The experiment's context page: the config it runs with (secrets redacted), its search
space, tuner, assessor and platforms, and the limits ``update`` may change while it runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config.experiment import _is_secret, without_url_password
from ..config.redacted import REDACTED, find_redacted
from ..read.model import ReadModel, to_json
from .views import NotFound

# The limits the page edits, by the config's names, and how the control channel takes them.
LIMIT_KEYS = ("trialConcurrency", "maxTrialNumber", "maxExperimentDuration")


def redacted(value: Any) -> Any:
    """``value`` with every secret hidden, as the store keeps it: a config an older version
    stored, or a hand-edited store, shows no secret either."""
    if isinstance(value, Mapping):
        return {
            str(k): REDACTED if _is_secret(str(k)) and isinstance(v, str) and v else redacted(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redacted(v) for v in value]
    if isinstance(value, str):
        return without_url_password(value)
    return value


def _algorithm(config: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """The tuner's, assessor's or advisor's name (a built-in's or a class's) and arguments."""
    part = config.get(key)
    if not isinstance(part, Mapping):
        return None
    name = part.get("name") or part.get("className") or ""
    args = part.get("classArgs")
    args = args if isinstance(args, Mapping) else {}
    return {"name": str(name), "builtin": bool(part.get("name")), "class_args": args}


def _platforms(service: Any) -> list[dict[str, Any]]:
    """Each platform the trials run on, with its settings (a hybrid service's, one by one)."""
    if isinstance(service, list):
        return [p for s in service for p in _platforms(s)]
    if not isinstance(service, Mapping):
        return []
    if service.get("platform") == "hybrid" and isinstance(service.get("platforms"), list):
        return _platforms(service["platforms"])
    settings = {k: v for k, v in service.items() if k != "platform" and v is not None}
    return [{"platform": str(service.get("platform", "")), "settings": settings}]


def _space(space: Any) -> list[dict[str, Any]]:
    if not isinstance(space, Mapping):
        return []
    out = []
    for name, spec in space.items():
        kind = spec.get("_type") if isinstance(spec, Mapping) else None
        values = spec.get("_value") if isinstance(spec, Mapping) else spec
        out.append({"name": str(name), "type": str(kind or ""), "values": values})
    return out


def context(model: ReadModel) -> dict[str, Any]:
    exp = model.experiment()
    if exp is None:
        raise NotFound("the store holds no experiment")
    stored = model.stored_config() or {}
    config = redacted(stored)
    return {
        "id": exp.id, "name": exp.name, "status": exp.status, "reason": exp.reason, "directory": exp.directory,
        "started_at": exp.started_at, "ended_at": exp.ended_at, "optimize_mode": exp.optimize_mode,
        "submitted": exp.trial_count,
        "limits": {k: config.get(k) for k in LIMIT_KEYS},
        "search_space": _space(config.get("searchSpace")),
        "tuner": _algorithm(config, "tuner"), "assessor": _algorithm(config, "assessor"),
        "advisor": _algorithm(config, "advisor"),
        "platforms": _platforms(config.get("trainingService")),
        "trial": {k: config.get(k) for k in ("trialCommand", "trialCodeDirectory", "trialGpuNumber")},
        "redacted": [r.where for r in find_redacted(config)],
        "config": to_json(config),
    }
