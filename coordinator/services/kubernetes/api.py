"""The API server, as the Kubernetes service talks to it: create, list, get and delete the
objects of one namespace through the official client, whose calls block. Each runs in a
thread under the configured timeout; every failure is an :class:`ApiFailure` with the
HTTP status and the server's own message."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import KubernetesPlatformConfig
from .objects import Kind

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


class KubernetesSetupError(ValueError):
    """The service cannot be created as configured (client missing, kubeconfig unusable)."""


class ApiFailure(Exception):
    """A call to the API server failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KubeApi:
    """The objects of ``config.namespace``, by :class:`~.objects.Kind`."""

    def __init__(self, config: KubernetesPlatformConfig, api_client: Any) -> None:
        from kubernetes import client

        self.namespace = config.namespace
        self.timeout = config.api_timeout
        self.client = api_client
        self._core = client.CoreV1Api(api_client)
        self._batch = client.BatchV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        kwargs["_request_timeout"] = (CONNECT_TIMEOUT_S, self.timeout)
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as e:
            raise ApiFailure(e.status or 0, _api_message(e)) from None
        except Exception as e:  # noqa: BLE001 - urllib3/socket errors: the server did not answer
            raise ApiFailure(0, f"{type(e).__name__}: {e}") from None

    async def create(self, kind: Kind, body: dict[str, Any], *, exists_ok: bool,
                     dry_run: bool = False) -> None:
        ns = self.namespace
        # Strict: a field the server does not know (a misspelt toleration key, say) is refused
        # with its name, where the server's default would drop it with a mere warning.
        strict: dict[str, str] = {"field_validation": "Strict"}
        if dry_run:  # checked and admitted, not stored
            strict["dry_run"] = "All"
        try:
            if kind.custom:
                await self.call(self._custom.create_namespaced_custom_object, kind.group,
                                kind.version, ns, kind.plural, body, **strict)
            else:
                create: dict[str, Callable[..., Any]] = {
                    "pods": self._core.create_namespaced_pod,
                    "secrets": self._core.create_namespaced_secret,
                    "persistentvolumeclaims": self._core.create_namespaced_persistent_volume_claim,
                    "jobs": self._batch.create_namespaced_job}
                await self.call(create[kind.plural], ns, body, **strict)
        except ApiFailure as e:
            if not (exists_ok and e.status == 409):
                raise

    async def replace_secret(self, body: dict[str, Any]) -> None:
        await self.call(self._core.replace_namespaced_secret, body["metadata"]["name"],
                        self.namespace, body)

    async def list(self, kind: Kind, label_selector: str) -> list[dict[str, Any]]:
        ns = self.namespace
        if kind.custom:
            answer = await self.call(self._custom.list_namespaced_custom_object, kind.group,
                                     kind.version, ns, kind.plural, label_selector=label_selector)
            return list(answer.get("items", []))
        list_fn = {"pods": self._core.list_namespaced_pod,
                   "jobs": self._batch.list_namespaced_job,
                   "persistentvolumeclaims": self._core.list_namespaced_persistent_volume_claim,
                   }[kind.plural]
        answer = await self.call(list_fn, ns, label_selector=label_selector)
        return [self.client.sanitize_for_serialization(item) for item in answer.items]

    async def get(self, kind: Kind, name: str) -> dict[str, Any] | None:
        """The object, or None where the server has none of that name."""
        ns = self.namespace
        try:
            if kind.custom:
                return dict(await self.call(self._custom.get_namespaced_custom_object, kind.group,
                                            kind.version, ns, kind.plural, name))
            read = {"pods": self._core.read_namespaced_pod,
                    "jobs": self._batch.read_namespaced_job}[kind.plural]
            return dict(self.client.sanitize_for_serialization(await self.call(read, name, ns)))
        except ApiFailure as e:
            if e.status == 404:
                return None
            raise

    async def delete(self, kind: Kind, name: str, grace_s: float) -> None:
        """Delete the object (its pods after ``grace_s``); one already gone is no error."""
        ns = self.namespace
        options = {"grace_period_seconds": max(0, int(grace_s)), "propagation_policy": "Background"}
        try:
            if kind.custom:
                await self.call(self._custom.delete_namespaced_custom_object, kind.group,
                                kind.version, ns, kind.plural, name, **options)
            else:
                delete = {"pods": self._core.delete_namespaced_pod,
                          "jobs": self._batch.delete_namespaced_job,
                          "secrets": self._core.delete_namespaced_secret,
                          "persistentvolumeclaims":
                              self._core.delete_namespaced_persistent_volume_claim,
                          }[kind.plural]
                await self.call(delete, name, ns, **options)
        except ApiFailure as e:
            if e.status != 404:
                raise

    async def delete_quietly(self, kind: Kind, name: str) -> None:
        try:
            await self.delete(kind, name, 0.0)
        except ApiFailure as e:
            log.warning("could not delete %s %s: %s", kind.plural, name, e)

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


def _api_message(e: Exception) -> str:
    body = getattr(e, "body", None)
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    return f"{getattr(e, 'status', '?')} {getattr(e, 'reason', '')}: {message or body or e}"


def api_client(ts: KubernetesPlatformConfig) -> Any:
    """A client for the cluster: the kubeconfig given, else $KUBECONFIG or ~/.kube/config,
    else the pod's own service account (in-cluster)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesSetupError(
            f"platform {ts.platform} needs the kubernetes client: install trialkeeper[k8s]"
        ) from None
    path = ts.kubeconfig
    if path is None:
        env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        default = Path("~/.kube/config").expanduser()
        path = Path(env) if env else default if default.is_file() else None
    try:
        if path is not None:
            return config.new_client_from_config(config_file=str(path), context=ts.context,
                                                 persist_config=False)
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except Exception as e:  # noqa: BLE001 - a broken file fails deep in yaml or the client
        where = (f"kubeconfig {path}" if path
                 else "no kubeconfig (KUBECONFIG, ~/.kube/config) and not in a cluster")
        raise KubernetesSetupError(f"platform {ts.platform}: cannot use {where}: {e}") from None
