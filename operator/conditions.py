"""Typed conditions, aggregated into one `Ready`, with transition times that only move on change.

Pure functions over plain condition lists, so status computation is unit-testable without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from anneal.operator.api.base import Condition, ConditionStatus, now_iso

READY = "Ready"


@dataclass(frozen=True)
class Observation:
    """What a reconcile found for one condition type."""

    type: str
    ok: bool | None  # None: unknown (not checked yet / not applicable yet)
    reason: str
    message: str = ""

    @property
    def status(self) -> ConditionStatus:
        return "Unknown" if self.ok is None else ("True" if self.ok else "False")


def aggregate(observations: Iterable[Observation]) -> Observation:
    """Ready is True only when every condition is True; else it names the first that is not."""
    obs = list(observations)
    for o in obs:
        if o.ok is not True:
            return Observation(READY, False, o.reason, f"{o.type}: {o.message}".rstrip(": "))
    return Observation(READY, True, "AllConditionsMet", "")


def merge(
    previous: list[dict], observations: Iterable[Observation], generation: int | None, now: str | None = None,
    ready: Observation | None = None,
) -> list[dict]:
    """New condition list (wire form): transition time kept unless the status flipped. `ready`
    replaces the all-True aggregate where Ready means something else (a finished job)."""
    now = now or now_iso()
    old = {c.get("type"): c for c in previous or []}
    obs = list(observations)
    out = []
    for o in [*obs, ready or aggregate(obs)]:
        before = old.get(o.type, {})
        changed = before.get("status") != o.status
        cond = Condition(
            type=o.type,
            status=o.status,
            reason=o.reason,
            message=o.message,
            last_transition_time=now if changed or not before.get("lastTransitionTime") else before["lastTransitionTime"],
            observed_generation=generation,
        )
        out.append(cond.wire())
    return out


def transitions(previous: list[dict], current: list[dict]) -> list[dict]:
    """Conditions whose status or reason changed (for events: False/ReplicasNotReady turning into
    False/EngineCrashing is news)."""
    old = {c.get("type"): (c.get("status"), c.get("reason")) for c in previous or []}
    return [c for c in current if old.get(c["type"]) != (c["status"], c.get("reason"))]


def find(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)
