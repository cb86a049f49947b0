"""A thin, idempotent layer over the Kubernetes API for the handlers: server-side apply for
objects the operator fully owns, create-if-absent for objects that must never be rewritten
(tokens, bare pods, Jobs), and 404-tolerant reads and deletes. Torch-free."""

from __future__ import annotations

import json
import threading
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError

FIELD_MANAGER = "anneal-operator"


def load_config() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    """Dict-in, dict-out access to any kind, by apiVersion and kind."""

    def __init__(self, api_client: client.ApiClient | None = None):
        self.api_client = api_client or load_config()
        self.dyn = DynamicClient(self.api_client)
        self._lock = threading.Lock()
        self._resources: dict[tuple[str, str], Any] = {}

    def resource(self, api_version: str, kind: str) -> Any:
        key = (api_version, kind)
        with self._lock:
            if key not in self._resources:
                self._resources[key] = self.dyn.resources.get(api_version=api_version, kind=kind)
            return self._resources[key]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: a no-op on the server when nothing changed."""
        res = self.resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        out = res.server_side_apply(
            body=obj, name=meta["name"], namespace=meta.get("namespace"),
            field_manager=FIELD_MANAGER, force_conflicts=True,
        )
        return out.to_dict()

    def create_if_absent(self, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(object, created): an existing object is returned unchanged."""
        res = self.resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        try:
            return res.create(body=obj, namespace=meta.get("namespace")).to_dict(), True
        except ConflictError:
            return res.get(name=meta["name"], namespace=meta.get("namespace")).to_dict(), False

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in (labels or {}).items()) or None
        out = self.resource(api_version, kind).get(namespace=namespace, label_selector=selector)
        return [item for item in out.to_dict().get("items", [])]

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """True when something was deleted (or is being deleted)."""
        try:
            self.resource(api_version, kind).delete(
                name=name, namespace=namespace, body={"propagationPolicy": "Background"}
            )
            return True
        except NotFoundError:
            return False

    def patch_merge(self, api_version: str, kind: str, name: str, namespace: str, body: dict[str, Any], status: bool = False) -> dict[str, Any]:
        res = self.resource(api_version, kind)
        if status:
            res = res.subresources["status"]
        return res.patch(
            body=body, name=name, namespace=namespace, content_type="application/merge-patch+json"
        ).to_dict()

    def config_map(self, namespace: str, name: str) -> tuple[dict[str, str], dict[str, str]] | None:
        cm = self.get("v1", "ConfigMap", name, namespace)
        if cm is None:
            return None
        return cm.get("data") or {}, cm.get("metadata", {}).get("annotations") or {}


def api_message(exc: ApiException) -> str:
    """The API server's own message of a failed call (what a user should read)."""
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)


__all__ = ["ApiException", "Kube", "api_message", "load_config", "FIELD_MANAGER"]
