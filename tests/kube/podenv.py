"""What a container of the stand-in kubelet sees: its env and its volumes, as local things.

A process cannot mount, so a volume is a local folder and paths under its mountPath are
rewritten to that folder in command, args, env and workingDir (``path_rewriter``): ``nfs`` is
the folder named by its path (the tests export a local folder), ``hostPath`` is itself,
``emptyDir`` a folder in the pod's sandbox, a PersistentVolumeClaim a folder kept per claim
(once the claim exists), and ``configMap``, ``secret``, ``downwardAPI`` and ``projected``
volumes (the service-account token among them, from the TokenRequest API) are written out as
files. Env takes values with ``$(VAR)`` references, Secret and ConfigMap keys, ``envFrom`` and
the downward API's ``fieldRef``. What cannot be had yet (a Secret not there) is ``Waiting``.
"""

from __future__ import annotations

import re
from base64 import b64decode
from pathlib import Path
from typing import Any

Obj = dict[str, Any]


class Waiting(Exception):
    """The container cannot start yet; ``reason`` and the message go into its waiting state."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PodView:
    """Resolves env and volumes through the API server, as the kubelet of ``node_name``."""

    def __init__(self, cluster: Any, node_name: str, claims: Path) -> None:
        self.cluster = cluster
        self.node_name = node_name
        self.claims = claims

    def _object(self, kind: str, namespace: str, name: str) -> Obj | None:
        status, answer = self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/{kind}/{name}")
        return answer if status == 200 else None

    def _keys(self, kind: str, namespace: str, name: str, optional: bool) -> dict[str, str]:
        """The decoded data of a Secret or ConfigMap ({} when optional and missing)."""
        obj = self._object(kind, namespace, name)
        if obj is None:
            if optional:
                return {}
            raise Waiting("CreateContainerConfigError", f'{kind[:-1]} "{name}" not found')
        if kind == "secrets":
            return {k: b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    def _field(self, pod: Obj, path: str) -> str:
        match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if match:
            return str((pod["metadata"].get(match.group(1)) or {}).get(match.group(2), ""))
        values = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
                  "metadata.uid": pod["metadata"]["uid"], "spec.nodeName": self.node_name,
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
                  "status.hostIP": "127.0.0.1", "status.podIP": "127.0.0.1", "status.podIPs": "127.0.0.1"}
        if path not in values:
            raise Waiting("CreateContainerConfigError", f"fieldRef {path} is not supported by the stand-in")
        return values[path]

    def environment(self, pod: Obj, container: Obj) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
                if key in source:
                    ref = source[key]
                    data = self._keys(kind, ns, ref["name"], bool(ref.get("optional")))
                    env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = expander(env)(str(var.get("value", "")))
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                env[var["name"]] = self._field(pod, source["fieldRef"]["fieldPath"])
                continue
            for kind, key in (("secrets", "secretKeyRef"), ("configmaps", "configMapKeyRef")):
                if key in source:
                    ref = source[key]
                    data = self._keys(kind, ns, ref["name"], bool(ref.get("optional")))
                    if ref["key"] not in data and not ref.get("optional"):
                        raise Waiting(
                            "CreateContainerConfigError",
                            f"couldn't find key {ref['key']} in {kind[:-1]} {ns}/{ref['name']}",
                        )
                    if ref["key"] in data:
                        env[var["name"]] = data[ref["key"]]
            if "resourceFieldRef" in source:
                raise Waiting("CreateContainerConfigError", "resourceFieldRef is not supported by the stand-in")
        return env

    def volumes(self, pod: Obj, sandbox: Path, container: Obj) -> dict[str, str]:
        """mountPath -> the local folder standing for its volume (written out where it has files)."""
        ns = pod["metadata"]["namespace"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        out: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            local = sandbox / "volumes" / mount["name"]
            if "nfs" in volume:
                local = Path(volume["nfs"]["path"])
            elif "hostPath" in volume:
                local = Path(volume["hostPath"]["path"])
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if self._object("persistentvolumeclaims", ns, claim) is None:
                    raise Waiting("ContainerCreating", f'persistentvolumeclaim "{claim}" not found')
                local = self.claims / ns / claim
            elif "emptyDir" not in volume:
                self._write_files(pod, volume, local)
            if mount.get("subPath"):
                local = local / mount["subPath"]
            local.mkdir(parents=True, exist_ok=True)
            out[mount["mountPath"].rstrip("/") or "/"] = str(local)
        return out

    def _write_files(self, pod: Obj, volume: Obj, folder: Path) -> None:
        ns = pod["metadata"]["namespace"]
        files: dict[str, str] = {}
        sources = volume["projected"]["sources"] if "projected" in volume else [volume]
        for source in sources:
            for kind, key, name_key in (("secrets", "secret", "secretName"), ("configmaps", "configMap", "name")):
                if key in source:
                    ref = source[key]
                    name = ref.get(name_key) or ref.get("name")
                    data = self._keys(kind, ns, name, bool(ref.get("optional")))
                    items = ref.get("items") or [{"key": k, "path": k} for k in data]
                    files.update({i["path"]: data[i["key"]] for i in items if i["key"] in data})
            if "downwardAPI" in source:
                for item in source["downwardAPI"].get("items") or []:
                    if "fieldRef" in item:
                        files[item["path"]] = self._field(pod, item["fieldRef"]["fieldPath"])
            if "serviceAccountToken" in source:
                files[source["serviceAccountToken"]["path"]] = self._token(pod, source["serviceAccountToken"])
        if not files and not any(k in volume for k in ("secret", "configMap", "downwardAPI", "projected")):
            raise Waiting(
                "CreateContainerConfigError", f"volume {volume['name']}: the stand-in cannot provide {sorted(volume)}"
            )
        for path, text in files.items():
            target = folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)

    def _token(self, pod: Obj, source: Obj) -> str:
        account = pod["spec"].get("serviceAccountName") or "default"
        meta = pod["metadata"]
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [source["audience"]] if source.get("audience") else [],
            "expirationSeconds": source.get("expirationSeconds", 3600),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
        status, answer = self.cluster.request(
            "POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token", request
        )
        if status != 201:
            raise Waiting("CreateContainerConfigError", f"service account token: {status} {answer.get('message')}")
        return str(answer["status"]["token"])


def path_rewriter(mounts: dict[str, str]) -> Any:
    """Rewrites a path under a mountPath to the local folder standing for that volume."""
    order = sorted(mounts, key=len, reverse=True)

    def rewrite(text: str) -> str:
        for mount in order:
            if mounts[mount] != mount and (text == mount or text.startswith(mount + "/")):
                return mounts[mount] + text[len(mount):]
        return text

    return rewrite


def expander(env: dict[str, str]) -> Any:
    """Kubernetes' $(VAR) references: replaced when VAR is defined, $$ escapes."""
    def expand(text: str) -> str:
        return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                      lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)

    return expand
