"""Checks the Kubernetes platform tests share, whichever API server holds the objects (the
real one of tests/kube, or the fake kept for FrameworkController)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

from trialkeeper.coordinator.services.base import Observation
from trialkeeper.coordinator.services.kubernetes.service import KubernetesEnvironmentService


def assert_token_only_in_its_secret(created: list[dict[str, Any]], token: str) -> None:
    """The experiment's token is in no object it created but its Secret, and its pods take
    it from there."""
    encoded = base64.b64encode(token.encode()).decode()
    assert any(o["kind"] == "Pod" for o in created), [o["kind"] for o in created]
    for obj in created:
        if obj["kind"] == "Secret":
            continue
        text = json.dumps(obj)
        assert token not in text and encoded not in text, f"the token in {obj['kind']} {obj['metadata']['name']}"
    for pod in (o for o in created if o["kind"] == "Pod"):
        env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
        assert (
            "value" not in env["TRIALKEEPER_TOKEN"]
            and env["TRIALKEEPER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
        )


async def poll_until(
    service: KubernetesEnvironmentService, env_id: str, state: str, detail: str = "", *, wait_s: float
) -> Observation:
    """Poll until the service reports ``state`` (with ``detail`` in its detail) for ``env_id``."""
    deadline = time.monotonic() + wait_s
    while not ((seen := (await service.poll([env_id]))[env_id]).state == state and detail in seen.detail):
        assert time.monotonic() < deadline, f"{env_id} never became {state} ({detail}): {seen}"
        await asyncio.sleep(0.1)
    return seen
