"""Progress and result hand-over to the CompilationJob (`--report-to NAMESPACE/NAME`).

Why separate: the operator package is optional for a local compile; these are the only calls
into it, and a status write that fails must never end a search (the result hand-over must).
"""

from __future__ import annotations

import sys
from typing import Any

from anneal.engine.plan import CompiledPlan


def publish_result(target: str | None, compiled: CompiledPlan) -> None:
    """Hand the CompiledPlan to the CompilationJob's result ConfigMap (raises: the job needs it)."""
    if not target:
        return
    from anneal.operator import progress  # noqa: PLC0415

    ns, name = progress.parse_report_to(target)
    progress.publish_result(ns, name, compiled)


def report_progress(target: str | None, **fields: Any) -> None:
    """Progress into the CompilationJob's status, when asked and the operator package provides it."""
    if not target:
        return
    try:
        from anneal.operator import progress  # noqa: PLC0415
    except ImportError:
        return
    ns, _, name = target.partition("/")
    fn = getattr(progress, "report", None)
    if fn is None or not name:
        return
    try:
        fn(ns, name, **fields)
    except Exception as e:  # noqa: BLE001 - a status write must not end the compile
        print(f"anneal compile: progress report to {target} failed: {e}", file=sys.stderr)
