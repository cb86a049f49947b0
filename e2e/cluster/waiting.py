"""Polling for e2e tests: wait until a condition holds, or fail saying what never happened."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(fn: Callable[[], Any], timeout: float = 60, what: str = "condition", every: float = 0.5) -> Any:
    """``fn()``'s first truthy value within ``timeout`` seconds, polled every ``every`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")
