"""How the coordinator (`anneal compile --report-to NAMESPACE/NAME`) tells its CompilationJob how
the search goes, and hands over the result. Torch-free; uses the coordinator's namespaced Role.

    from anneal.operator import progress
    progress.report("ml", "llama-chat-1", phase="Searching", experiments=12, best_speedup=1.31)
    progress.publish_result("ml", "llama-chat-1", compiled_plan)   # before exiting 0

`report` merges into `status.progress` (the operator derives `status.phase` from it and from the
coordinator Job); `publish_result` writes the CompiledPlan JSON into the ConfigMap
`<name>-result` that the operator created. The job succeeds only when the coordinator Job
completes *and* that ConfigMap holds a CompiledPlan whose `verification.passed` is true.
`save_ledger` / `load_ledger` keep the coordinator's experiment ledger in `<name>-ledger`, so the
coordinator the operator starts after an engine restart resumes the search instead of redoing it.
"""

from __future__ import annotations

import base64
import logging
from typing import Any, Literal

from kubernetes import client

from anneal.engine.plan import CompiledPlan
from anneal.operator import naming
from anneal.operator.api.base import GROUP, VERSION, now_iso
from anneal.operator.api.compilation_job import PLURAL

log = logging.getLogger(__name__)
ReportPhase = Literal["Searching", "Verifying", "Done"]
_client: client.ApiClient | None = None


def parse_report_to(value: str) -> tuple[str, str]:
    """`NAMESPACE/NAME` -> (namespace, name), with a clear error."""
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"--report-to must be NAMESPACE/NAME, got {value!r}")
    return namespace, name


def _api(api_client: client.ApiClient | None) -> client.ApiClient:
    global _client
    if api_client is not None:
        return api_client
    if _client is None:
        from anneal.operator.kube import load_config

        _client = load_config()
    return _client


def progress_patch(
    *, phase: ReportPhase | None = None, experiments: int | None = None, best_speedup: float | None = None,
    best_plan_hash: str | None = None, message: str | None = None, now: str | None = None,
) -> dict[str, Any]:
    """The status merge patch of one report (only the given fields)."""
    if phase is not None and phase not in ("Searching", "Verifying", "Done"):
        raise ValueError(f"phase must be Searching, Verifying or Done, got {phase!r}")
    if experiments is not None and experiments < 0:
        raise ValueError("experiments must be >= 0")
    fields = {
        "phase": phase, "experiments": experiments, "bestSpeedup": best_speedup,
        "bestPlanHash": best_plan_hash, "message": message,
    }
    body = {k: v for k, v in fields.items() if v is not None}
    body["updatedAt"] = now or now_iso()
    return {"status": {"progress": body}}


def report(
    namespace: str, name: str, *, phase: ReportPhase | None = None, experiments: int | None = None,
    best_speedup: float | None = None, best_plan_hash: str | None = None, message: str | None = None,
    api_client: client.ApiClient | None = None, strict: bool = False,
) -> bool:
    """Merge progress into the CompilationJob's status. A failed report is logged, not raised
    (a monitoring hiccup must not kill a search), unless `strict`. True when it was written."""
    body = progress_patch(
        phase=phase, experiments=experiments, best_speedup=best_speedup, best_plan_hash=best_plan_hash, message=message
    )
    try:
        client.CustomObjectsApi(_api(api_client)).patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body, _content_type="application/merge-patch+json"
        )
        return True
    except Exception as exc:
        if strict:
            raise
        log.warning("progress report to %s/%s failed: %s", namespace, name, exc)
        return False


def publish_result(
    namespace: str, name: str, compiled: CompiledPlan | str, *, api_client: client.ApiClient | None = None
) -> str:
    """Write the CompiledPlan into `<name>-result`; returns its plan hash. Raises on failure."""
    plan = compiled if isinstance(compiled, CompiledPlan) else CompiledPlan.model_validate_json(compiled)
    body = {
        "metadata": {"annotations": {naming.ANNOTATION_PLAN_HASH: plan.plan_hash}},
        "data": {naming.PLAN_KEY: plan.model_dump_json(indent=2)},
    }
    client.CoreV1Api(_api(api_client)).patch_namespaced_config_map(
        naming.result_config_map(name), namespace, body, _content_type="application/merge-patch+json"
    )
    return plan.plan_hash


# A ConfigMap holds at most 1 MiB, and binaryData is base64 (4/3): what the ledger may take of it.
LEDGER_MAX_BYTES = 700_000


def save_ledger(namespace: str, name: str, snapshot: bytes, *, api_client: client.ApiClient | None = None) -> None:
    """Write a gzipped ledger (agents.ledger.Ledger.snapshot) into `<name>-ledger`. Raises on failure."""
    if len(snapshot) > LEDGER_MAX_BYTES:
        raise ValueError(f"a ledger snapshot of {len(snapshot)} bytes is over the {LEDGER_MAX_BYTES} a ConfigMap takes")
    body = {"binaryData": {naming.LEDGER_KEY: base64.b64encode(snapshot).decode()}}
    client.CoreV1Api(_api(api_client)).patch_namespaced_config_map(
        naming.ledger_config_map(name), namespace, body, _content_type="application/merge-patch+json"
    )


def load_ledger(namespace: str, name: str, *, api_client: client.ApiClient | None = None) -> bytes | None:
    """The ledger an earlier coordinator of this job saved, or None (none saved, or no such ConfigMap)."""
    try:
        cm = client.CoreV1Api(_api(api_client)).read_namespaced_config_map(naming.ledger_config_map(name), namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    raw = (cm.binary_data or {}).get(naming.LEDGER_KEY)
    return base64.b64decode(raw) if raw else None
