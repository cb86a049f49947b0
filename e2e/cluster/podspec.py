"""Turn a pod spec into what a local process needs: its environment, its volumes as directories,
and its command with mount paths rewritten.

Choices (the runner has no containers, so no mount namespaces):
- Each volume is materialized under `<pod dir>/volumes/<volume name>/` (ConfigMap and Secret keys as
  files, downward-API items, service-account token, emptyDir empty, hostPath as the host path).
- A container's mount path is rewritten to that directory wherever it appears as a path in its
  command, args, env values and workingDir (`/etc/plan/plan.json` → `<pod dir>/volumes/plan/plan.json`).
  `ANNEAL_MOUNTS` (JSON, mount path → local path) is set for programs that build paths themselves.
- The service-account volume becomes a kubeconfig carrying the pod's token: `KUBECONFIG` points at
  it, so the kubernetes client and kopf log in as the pod's service account (RBAC applies).
- `KUBERNETES_SERVICE_HOST/PORT` point at the real API server on loopback.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
from pathlib import Path
from typing import Callable

from .pki import write_token_kubeconfig

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class ConfigError(RuntimeError):
    """The pod references something missing (a ConfigMap, a Secret, a key): CreateContainerConfigError."""


def field_value(pod: dict, path: str, pod_ip: str) -> str:
    """The value of a downward-API fieldRef (`metadata.name`, `metadata.labels['app']`, `status.podIP`)."""
    meta, spec = pod["metadata"], pod["spec"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return meta.get(m.group(1), {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
    }
    if path == "metadata.labels":
        return "\n".join(f'{k}="{v}"' for k, v in sorted(meta.get("labels", {}).items()))
    if path == "metadata.annotations":
        return "\n".join(f'{k}="{v}"' for k, v in sorted(meta.get("annotations", {}).items()))
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef {path!r}")
    return simple[path]


def resource_value(container: dict, ref: dict) -> str:
    """A resourceFieldRef value, in the divisor's units (default 1); unset limits read as node capacity."""
    kind, _, res = ref["resource"].partition(".")
    qty = container.get("resources", {}).get(kind, {}).get(res)
    if qty is None:
        qty = {"cpu": "32", "memory": "256Gi"}.get(res, "0")
    value = _quantity(qty)
    divisor = _quantity(str(ref.get("divisor", "1")))
    return str(max(1, math.ceil(value / divisor)) if value else 0)


def _quantity(q: str) -> float:
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20,
                "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", q.strip())
    if not m or (m.group(2) and m.group(2) not in suffixes):
        raise ConfigError(f"cannot read quantity {q!r}")
    return float(m.group(1)) * suffixes.get(m.group(2), 1)


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, `$$` escapes, unknown ones stay."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, s)


class PodContext:
    """Reads the API objects a pod refers to (cached per pod) and lays out its directory."""

    def __init__(self, pod: dict, pod_dir: Path, pod_ip: str, get: Callable[[str], dict | None],
                 request_token: Callable[[dict], str], server: str, base_env: dict[str, str]) -> None:
        self.pod, self.dir, self.ip = pod, pod_dir, pod_ip
        self._get, self._request_token = get, request_token
        self.server, self.base_env = server, base_env
        self.ns = pod["metadata"]["namespace"]
        self._cache: dict[str, dict | None] = {}
        self.volume_dirs: dict[str, Path] = {}
        self.kubeconfig: Path | None = None

    def _obj(self, kind: str, name: str) -> dict | None:
        key = f"{kind}/{name}"
        if key not in self._cache:
            self._cache[key] = self._get(f"/api/v1/namespaces/{self.ns}/{kind}/{name}")
        return self._cache[key]

    def _data(self, kind: str, name: str, optional: bool) -> dict[str, str] | None:
        """A ConfigMap's or Secret's data as text (Secret values decoded)."""
        obj = self._obj(kind, name)
        if obj is None:
            if optional:
                return None
            raise ConfigError(f"{kind[:-1]} {self.ns}/{name} not found")
        if kind == "secrets":
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in obj.get("data", {}).items()}
        data = dict(obj.get("data", {}))
        for k, v in obj.get("binaryData", {}).items():
            data[k] = base64.b64decode(v).decode(errors="replace")
        return data

    def _key(self, kind: str, ref: dict) -> str | None:
        data = self._data(kind, ref["name"], ref.get("optional", False))
        if data is None:
            return None
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(f"key {ref['key']!r} not in {kind[:-1]} {self.ns}/{ref['name']}")
        return data[ref["key"]]

    # ------------------------------------------------------------ volumes

    def materialize_volumes(self, refresh: bool = False) -> None:
        """Write every volume's files; with `refresh`, re-read ConfigMaps and Secrets and rewrite
        changed files (as the kubelet updates mounted ConfigMaps), leaving the token alone."""
        if refresh:
            self._cache.clear()
        for vol in self.pod["spec"].get("volumes", []):
            name = vol["name"]
            if refresh and not any(k in vol for k in ("configMap", "secret", "projected")):
                continue
            if "hostPath" in vol:
                self.volume_dirs[name] = Path(vol["hostPath"]["path"])
                continue
            d = self.dir / "volumes" / name
            d.mkdir(parents=True, exist_ok=True)
            self.volume_dirs[name] = d
            if "configMap" in vol:
                self._write_items(d, self._data("configmaps", vol["configMap"]["name"],
                                                vol["configMap"].get("optional", False)), vol["configMap"].get("items"))
            elif "secret" in vol:
                self._write_items(d, self._data("secrets", vol["secret"]["secretName"],
                                                vol["secret"].get("optional", False)), vol["secret"].get("items"))
            elif "downwardAPI" in vol:
                self._write_downward(d, vol["downwardAPI"].get("items", []))
            elif "projected" in vol:
                for src in vol["projected"].get("sources", []):
                    self._write_projection(d, src)
            # emptyDir, persistentVolumeClaim and others: a plain local directory.

    def _write_items(self, d: Path, data: dict[str, str] | None, items: list | None) -> None:
        if data is None:
            return
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, rel in pairs:
            if key not in data:
                raise ConfigError(f"volume item key {key!r} is missing")
            target = d / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_if_changed(target, data[key])

    def _write_downward(self, d: Path, items: list) -> None:
        for item in items:
            if "fieldRef" in item:
                value = field_value(self.pod, item["fieldRef"]["fieldPath"], self.ip)
            else:
                value = resource_value(self.pod["spec"]["containers"][0], item["resourceFieldRef"])
            target = d / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_if_changed(target, value)

    def _write_projection(self, d: Path, src: dict) -> None:
        if "configMap" in src:
            c = src["configMap"]
            self._write_items(d, self._data("configmaps", c["name"], c.get("optional", False)), c.get("items"))
        elif "secret" in src:
            s = src["secret"]
            self._write_items(d, self._data("secrets", s["name"], s.get("optional", False)), s.get("items"))
        elif "downwardAPI" in src:
            self._write_downward(d, src["downwardAPI"].get("items", []))
        elif "serviceAccountToken" in src:
            t = src["serviceAccountToken"]
            if (d / t["path"]).exists():
                return  # requested once per pod, valid for a day
            token = self._request_token(t)
            (d / t["path"]).write_text(token)
            self.kubeconfig = self.dir / "kubeconfig"
            self._token_path = d / t["path"]

    def finish_service_account(self) -> None:
        """Write the pod's kubeconfig once the token and ca.crt of its projected volume exist."""
        if self.kubeconfig is None:
            return
        d = self._token_path.parent
        ca = d / "ca.crt"
        write_token_kubeconfig(self.kubeconfig, self.server, ca, self._token_path.read_text())

    # ------------------------------------------------------------ containers

    def mounts(self, container: dict) -> dict[str, str]:
        """mount path → local path for one container (subPath honoured)."""
        out = {}
        for m in container.get("volumeMounts", []):
            base = self.volume_dirs.get(m["name"])
            if base is None:
                raise ConfigError(f"volumeMount {m['name']!r} names no volume of the pod")
            local = base / m["subPath"] if m.get("subPath") else base
            out[m["mountPath"].rstrip("/") or "/"] = str(local)
        return out

    def rewrite(self, s: str, mounts: dict[str, str]) -> str:
        """Replace mount paths that stand as whole path prefixes, in one pass (a replacement is
        never rewritten again, `/tmp` does not match inside `/var/tmp` or `/tmpfoo`)."""
        if not mounts:
            return s
        alternatives = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        pattern = rf"(?<![\w./-])({alternatives})(?=$|/|[^\w.-])"
        return re.sub(pattern, lambda m: mounts[m.group(1)], s)

    def env(self, container: dict, mounts: dict[str, str]) -> dict[str, str]:
        env = dict(self.base_env)
        env["HOSTNAME"] = self.pod["metadata"]["name"]
        host, _, port = self.server.removeprefix("https://").partition(":")
        env.update({"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
                    "KUBERNETES_SERVICE_PORT_HTTPS": port})
        if self.kubeconfig is not None and any(m == SA_MOUNT for m in mounts):
            env["KUBECONFIG"] = str(self.kubeconfig)
        env["ANNEAL_MOUNTS"] = json.dumps(mounts)
        if "/tmp" in mounts:
            env["TMPDIR"] = mounts["/tmp"]
        for src in container.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                data = self._data("configmaps", src["configMapRef"]["name"], src["configMapRef"].get("optional", False))
            else:
                data = self._data("secrets", src["secretRef"]["name"], src["secretRef"].get("optional", False))
            for k, v in (data or {}).items():
                env[prefix + k] = self.rewrite(v, mounts)
        for e in container.get("env", []):
            if "valueFrom" not in e:
                env[e["name"]] = self.rewrite(expand(e.get("value", ""), env), mounts)
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                value = field_value(self.pod, vf["fieldRef"]["fieldPath"], self.ip)
            elif "resourceFieldRef" in vf:
                value = resource_value(container, vf["resourceFieldRef"])
            elif "secretKeyRef" in vf:
                value = self._key("secrets", vf["secretKeyRef"])
            elif "configMapKeyRef" in vf:
                value = self._key("configmaps", vf["configMapKeyRef"])
            else:
                raise ConfigError(f"unsupported valueFrom in env {e['name']!r}")
            if value is not None:
                env[e["name"]] = self.rewrite(value, mounts)
        return env

    def argv(self, container: dict, env: dict[str, str], mounts: dict[str, str]) -> list[str]:
        """command + args; with no command (an image's entrypoint), args alone are the argv."""
        argv = [self.rewrite(expand(a, env), mounts)
                for a in container.get("command", []) + container.get("args", [])]
        if not argv:
            raise ConfigError(f"container {container['name']!r} has no command or args: the local runner "
                              "ignores images, so it needs an explicit command")
        return argv

    def workdir(self, container: dict, mounts: dict[str, str]) -> Path:
        wd = container.get("workingDir")
        if not wd:
            return self.dir
        path = Path(self.rewrite(wd, mounts))
        if not path.is_dir():
            path = self.dir / "workdir" / wd.lstrip("/")
            path.mkdir(parents=True, exist_ok=True)
        return path


def _write_if_changed(target: Path, text: str) -> None:
    """Replace a volume file atomically, so a reader never sees half of it."""
    if target.exists() and target.read_text(errors="replace") == text:
        return
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    tmp.replace(target)


def base_env(venv: Path, pod_dir: Path, marker: tuple[str, str]) -> dict[str, str]:
    """A clean environment like a container's: the venv's bin on PATH, HOME in the pod directory.
    The host's thread counts carry over: every pod shares the host's cores, as a container's CPU
    limit would cap them, and torch's default of a thread a core makes each spin on the others."""
    path = f"{venv / 'bin'}{os.pathsep}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {"PATH": path, "HOME": str(pod_dir / "home"), "TMPDIR": str(pod_dir / "tmp"),
           "LANG": os.environ.get("LANG", "C.UTF-8"), "PYTHONUNBUFFERED": "1", marker[0]: marker[1]}
    (pod_dir / "home").mkdir(parents=True, exist_ok=True)
    (pod_dir / "tmp").mkdir(parents=True, exist_ok=True)
    for k in ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
              "OMP_NUM_THREADS"):
        if k in os.environ:
            env[k] = os.environ[k]
    return env
