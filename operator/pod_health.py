"""Why a pod is not serving, in words a user can act on (read from the pod status the kubelet
and scheduler write). Feeds conditions instead of letting a bad spec crash-loop silently."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName"}
_CONFIG = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str
    fatal: bool  # will not fix itself without a spec or cluster change


def _short(text: str, limit: int = 400) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else "…" + text[-limit:]


def terminated(container_status: dict[str, Any]) -> dict[str, Any] | None:
    """How a container last ended (its exit code, reason, message), or None if it has not."""
    cs = container_status
    return (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated")


def problem(pod: dict[str, Any]) -> Problem | None:
    """The first reason this pod is not (going to be) ready, or None."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return Problem("Unschedulable", f"pod {name}: {_short(cond.get('message', ''))}", fatal=False)
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in _PULL:
            return Problem("ImagePullFailed", f"pod {name}: {reason}: {_short(waiting.get('message', ''))}", fatal=True)
        if reason in _CONFIG:
            return Problem("ContainerConfigError", f"pod {name}: {_short(waiting.get('message', ''))}", fatal=True)
        last = terminated(cs)
        if reason == "CrashLoopBackOff" or (last and last.get("exitCode", 0) != 0):
            msg = _short((last or {}).get("message") or waiting.get("message", ""))
            code = (last or {}).get("exitCode")
            return Problem("EngineCrashing", f"pod {name} exited with code {code}: {msg}", fatal=reason == "CrashLoopBackOff")
    if status.get("phase") == "Failed":
        return Problem("PodFailed", f"pod {name}: {status.get('reason', '')} {_short(status.get('message', ''))}".strip(), fatal=True)
    return None


def is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


def max_allocatable(nodes: list[dict[str, Any]], resource: str, selector: dict[str, str]) -> int:
    """Largest amount of `resource` one node matching `selector` can give a pod (0 if none)."""
    best = 0
    for node in nodes:
        labels = node.get("metadata", {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        if (node.get("spec") or {}).get("unschedulable"):
            continue
        raw = ((node.get("status") or {}).get("allocatable") or {}).get(resource, "0")
        try:
            best = max(best, int(str(raw)))
        except ValueError:
            continue
    return best
