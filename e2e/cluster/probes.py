"""Readiness and liveness probes, run the way the kubelet runs them, against the pod's loopback IP."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


def _port(value, container: dict) -> int:
    """A probe port: a number, or the name of one of the container's ports."""
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for p in container.get("ports", []):
        if p.get("name") == value:
            return int(p["containerPort"])
    raise ValueError(f"probe port {value!r} names no port of container {container['name']!r}")


def run_probe(probe: dict, container: dict, pod_ip: str, env: dict[str, str], cwd: str) -> tuple[bool, str]:
    """Run one probe once; returns (success, message)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            h = probe["httpGet"]
            host = h.get("host") or pod_ip
            url = f"{h.get('scheme', 'HTTP').lower()}://{host}:{_port(h['port'], container)}{h.get('path', '/')}"
            req = urllib.request.Request(url, headers={x["name"]: x["value"] for x in h.get("httpHeaders", [])})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return 200 <= r.status < 400, f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                return False, f"HTTP probe failed with statuscode: {e.code}"
        if "tcpSocket" in probe:
            t = probe["tcpSocket"]
            with socket.create_connection((t.get("host") or pod_ip, _port(t["port"], container)), timeout=timeout):
                return True, "connected"
        if "exec" in probe:
            r = subprocess.run(probe["exec"]["command"], env=env, cwd=cwd, capture_output=True, timeout=timeout)
            return r.returncode == 0, f"exit {r.returncode}"
        return False, "unsupported probe type (grpc probes are not run by the local runner)"
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return False, f"probe error: {e}"


@dataclass
class ProbeState:
    """Kubelet's counting rules: initial delay, period, success and failure thresholds."""

    probe: dict
    started: float = field(default_factory=time.monotonic)
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    result: bool = False

    def __post_init__(self) -> None:
        self.next_at = self.started + float(self.probe.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> bool:
        """Count one outcome; returns the (possibly flipped) probe result."""
        self.next_at = now + float(self.probe.get("periodSeconds", 10))
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.result = False
        return self.result
