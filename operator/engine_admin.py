"""The operator's side of an engine pod's HTTP APIs (torch-free): which plan a replica serves
(``GET /health`` on the public port) and applying a plan in place (``PUT /admin/plan`` on the
token-protected admin port; engine/ADMIN_API.md)."""

from __future__ import annotations

import logging

import httpx

from anneal.operator import naming

log = logging.getLogger(__name__)


class Unreachable(RuntimeError):
    """The engine did not answer, or answered 'busy' (409 drain timeout): try again later."""


class PlanRefused(RuntimeError):
    """The engine answered and refused the plan; its previous plan keeps serving."""


def served_plan_hash(pod_ip: str, timeout: float = 5.0, port: int = naming.PUBLIC_PORT) -> str | None:
    """The plan hash a replica reports on /health, or None when it does not answer."""
    try:
        r = httpx.get(f"http://{pod_ip}:{port}/health", timeout=timeout)
        if r.status_code != 200:
            return None
        return r.json().get("plan_hash")
    except (httpx.HTTPError, ValueError) as err:
        log.debug("no /health from %s: %s", pod_ip, err)
        return None


def apply_plan(pod_ip: str, token: str, plan_json: str, timeout: float = 300.0,
               port: int = naming.ADMIN_PORT) -> str:
    """PUT the plan; returns the hash the engine now serves."""
    try:
        r = httpx.put(
            f"http://{pod_ip}:{port}/admin/plan",
            content=plan_json,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=timeout,
        )
    except httpx.HTTPError as err:
        raise Unreachable(f"admin API of {pod_ip} unreachable: {err}") from err
    if r.status_code == 409 or r.status_code == 503:
        raise Unreachable(f"engine at {pod_ip} busy: {r.text[:300]}")
    if r.status_code == 401:
        raise PlanRefused("admin token refused (401)")
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:500]
        raise PlanRefused(f"HTTP {r.status_code}: {message}")
    return str(r.json().get("plan_hash"))
