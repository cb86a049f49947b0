"""A small JSON client for the API server, from an admin kubeconfig (client certificate).

Why not the kubernetes package here: the runner wants plain API dicts (as kubectl shows them) and
exact patch content types; httpx gives both in a few lines.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import yaml


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {body[:500]}")
        self.status = status


class Rest:
    def __init__(self, kubeconfig: Path) -> None:
        cfg = yaml.safe_load(Path(kubeconfig).read_text())
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        self.server = cluster["server"]
        self.ca = cluster["certificate-authority"]
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(user["client-certificate"], user["client-key"])
        self._http = httpx.Client(base_url=self.server, verify=ctx, timeout=30)

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                params: dict | None = None, ok404: bool = False) -> dict | None:
        data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
        r = self._http.request(method, path, content=data, params=params,
                               headers={"Content-Type": content_type} if data is not None else None)
        if r.status_code == 404 and ok404:
            return None
        if r.status_code >= 400:
            raise ApiError(r.status_code, method, path, r.text)
        return r.json() if r.content else {}

    def get(self, path: str, **params) -> dict | None:
        return self.request("GET", path, params=params or None, ok404=True)

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: dict) -> dict:
        return self.request("PATCH", path, body, "application/merge-patch+json")

    def apply(self, path: str, body: dict, manager: str) -> dict:
        """Server-side apply (idempotent create-or-update)."""
        return self.request("PATCH", path, body, "application/apply-patch+yaml",
                            params={"fieldManager": manager, "force": "true"})

    def delete(self, path: str, body: dict | None = None) -> dict | None:
        return self.request("DELETE", path, body, ok404=True)

    def close(self) -> None:
        self._http.close()
