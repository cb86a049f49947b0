"""A client for one engine's admin API (engine/ADMIN_API.md): state, plan, kernels, benchmark, verify.

Torch-free (httpx only), so the coordinator image needs no torch. Every answer is parsed into the
types of ``anneal.agents.types``; an engine error becomes an ``EngineError`` carrying the engine's
own message, so a ledger row says what the engine said.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

from anneal.engine.plan import Plan
from anneal.agents.types import (
    BenchSpec, EngineState, KernelResult, Measurement, VerifyReport,
)


class EngineError(RuntimeError):
    """The engine answered with an error (or not at all)."""

    def __init__(self, message: str, status: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind  # the answer's error type: "engine_dead" when the engine's device context is lost

    @property
    def engine_dead(self) -> bool:
        return self.kind == "engine_dead"


class EngineClient:
    """Admin API of one engine process (one tier)."""

    def __init__(
        self, url: str, token: str | None = None, *, timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None, name: str = "",
    ):
        self.url = url.rstrip("/")
        self.name = name or self.url
        token = token if token is not None else os.environ.get("ANNEAL_ADMIN_TOKEN", "")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            r = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"{self.name}: {method} {path} failed: {e}") from e
        if r.status_code >= 400:
            try:
                msg, kind = r.json()["error"]["message"], r.json()["error"].get("type")
            except Exception:
                msg, kind = r.text[:500], None
            hint = " (is ANNEAL_ADMIN_TOKEN the engine's token?)" if r.status_code == 401 else ""
            raise EngineError(f"{self.name}: {method} {path} -> {r.status_code}: {msg}{hint}", r.status_code, kind)
        return r.json()

    # ---- the admin API -------------------------------------------------------------------------

    def state(self) -> EngineState:
        return EngineState.model_validate(self._call("GET", "/admin/state"))

    def put_plan(self, plan: Plan) -> dict[str, Any]:
        return self._call("PUT", "/admin/plan", plan.model_dump(mode="json"))

    def prepare(self, plans: list[Plan]) -> dict[str, Any]:
        """Queue plans for compile-ahead: their kernels compile while the engine does other work."""
        return self._call("POST", "/admin/prepare", {"plans": [p.model_dump(mode="json") for p in plans]})

    def register_kernel(
        self, op: str, impl: str, source: str, params: dict[str, list[Any]] | None = None,
        timeout_s: float = 120.0,
    ) -> KernelResult:
        body = {"op": op, "impl": impl, "source": source, "params": params or {}, "timeout_s": timeout_s}
        return KernelResult.model_validate(self._call("POST", "/admin/kernels", body))

    def benchmark(
        self, plan: Plan | None, spec: BenchSpec, traffic: dict[str, Any] | None = None
    ) -> Measurement:
        body: dict[str, Any] = spec.model_dump(exclude_none=True)
        if plan is not None:
            body["plan"] = plan.model_dump(mode="json")
        if traffic is not None:
            body["traffic"] = traffic
        data = self.benchmark_answer(body)
        # Workload latency tails may come nested under "extra"; lift the ones the compiler reads.
        extra = data.get("extra") or {}
        for k in ("itl_p90_ms", "ttft_p90_ms", "per_op_ms", "time_split", "decode_batches", "speculation"):
            if data.get(k) is None and extra.get(k) is not None:
                data[k] = extra[k]
        return Measurement.model_validate(data)

    def benchmark_answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /admin/benchmark`` with a whole request body; the engine's whole answer (what
        bench/plans.py reads, beyond the fields a Measurement lifts)."""
        return self._call("POST", "/admin/benchmark", body)

    def verify(
        self, plan: Plan, checks: list[str] | None = None, *, num_prompts: int = 6,
        steps: int = 16, seed: int = 0, **options: Any,
    ) -> VerifyReport:
        """Run the verification suite; ``options`` are extra request fields (rel_tol, ...)."""
        body: dict[str, Any] = {
            "plan": plan.model_dump(mode="json"), "num_prompts": num_prompts, "steps": steps,
            "seed": seed, **{k: v for k, v in options.items() if v is not None},
        }
        if checks:
            body["checks"] = checks
        return VerifyReport.model_validate(self._call("POST", "/admin/verify", body))

    def wait_ready(self, timeout_s: float = 300.0, proc_alive: Any = None) -> EngineState:
        """Poll ``/admin/state`` until it answers; ``proc_alive()`` False aborts early."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc_alive is not None and not proc_alive():
                raise EngineError(f"{self.name}: engine process exited before it was ready ({last})")
            try:
                return self.state()
            except EngineError as e:
                if e.status == 401:
                    raise
                last = e
            time.sleep(0.5)
        raise EngineError(f"{self.name}: not ready after {timeout_s:.0f}s: {last}")
