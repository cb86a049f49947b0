"""Resolve `service.namespace` to a ready pod IP and port, the way kube-proxy would pick a backend.

There is no kube-proxy and no cluster DNS: tests reach a Service through its EndpointSlices (the
runner publishes them for its loopback pods). Only loopback endpoints are returned; an endpoint on
a kwok node has no process behind it, so asking for one is an error rather than traffic to nowhere.
"""

from __future__ import annotations

import ipaddress
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cluster import LocalCluster


class ServiceNotReady(RuntimeError):
    pass


def _service_port(svc: dict, port: int | str | None) -> dict:
    ports = svc["spec"].get("ports", [])
    if not ports:
        raise ServiceNotReady(f"service {svc['metadata']['name']} has no ports")
    if port is None:
        return ports[0]
    for p in ports:
        if p.get("name") == port or p["port"] == port or str(p["port"]) == str(port):
            return p
    raise ServiceNotReady(f"service {svc['metadata']['name']} has no port {port!r} "
                          f"(it has {[p.get('name') or p['port'] for p in ports]})")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def lookup(core, discovery, name: str, namespace: str, port: int | str | None) -> tuple[str, int]:
    """One attempt: (ip, port) of a ready loopback endpoint, or ServiceNotReady saying why not."""
    from kubernetes.client.exceptions import ApiException
    try:
        svc = core.read_namespaced_service(name, namespace).to_dict()
    except ApiException as e:
        raise ServiceNotReady(f"service {namespace}/{name}: {e.reason}") from None
    svc = {"metadata": svc["metadata"], "spec": {"ports": [
        {"name": p.get("name"), "port": p["port"]} for p in (svc["spec"].get("ports") or [])]}}
    want = _service_port(svc, port)
    slices = discovery.list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={name}").items
    remote = []
    for sl in slices:
        ports = {p.name or "": p.port for p in (sl.ports or [])}
        target = ports.get(want.get("name") or "")
        if target is None:
            continue
        for ep in sl.endpoints or []:
            if not (ep.conditions and ep.conditions.ready):
                continue
            for addr in ep.addresses:
                if _loopback(addr):
                    return addr, target
                remote.append(addr)
    if remote:
        raise ServiceNotReady(f"service {namespace}/{name} has only endpoints on fake (kwok) nodes "
                              f"{remote}: nothing runs there")
    raise ServiceNotReady(f"service {namespace}/{name} has no ready endpoint yet")


def resolve_service(cluster: "LocalCluster", name: str, namespace: str, port: int | str | None,
                    timeout: float) -> tuple[str, int]:
    """Wait up to `timeout` seconds for a ready endpoint of the Service."""
    from kubernetes import client
    api = cluster.api()
    core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return lookup(core, discovery, name, namespace, port)
        except ServiceNotReady as e:
            if time.monotonic() >= deadline or "kwok" in str(e):
                raise ServiceNotReady(f"{e} (waited {timeout:.0f} s)") from None
        time.sleep(0.5)
