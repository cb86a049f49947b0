"""The admin API: how the compiler and the operator drive a running engine (engine/ADMIN_API.md).

Its own port, every call authenticated with the bearer token from ``ANNEAL_ADMIN_TOKEN``. Work that
needs the engine to itself (apply, benchmark, verify) drains in-flight requests first and runs on
the engine thread; a failure comes back as an error response and the previous plan keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from anneal.engine.async_engine import dead_message
from anneal.engine.benchmark import BenchmarkRequest, run_benchmark
from anneal.engine.kernel_source import check_in_subprocess, register
from anneal.engine.ops.registry import OpError, all_ops
from anneal.engine.plan import KernelSource, ParamValue, Plan
from anneal.engine.verify import VerifyRequest, verify

log = logging.getLogger("anneal.admin")


class KernelRequest(BaseModel):
    op: str
    impl: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    source: str = Field(max_length=200_000)
    params: dict[str, list[ParamValue]] = Field(default_factory=dict)
    timeout_s: float = Field(60.0, gt=0, le=600)


class PrepareRequest(BaseModel):
    plans: list[Plan] = Field(min_length=1, max_length=64)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _variants(device_type: str) -> dict[str, dict[str, dict[str, list]]]:
    """The search space this engine can run: variants for its device, with their params, each
    param's default first (the candidate space's contract: a tuner times an implementation at its
    first choices before it descends; listed in declared order, the GEMVs were timed at their
    smallest tiles (the bf12 o_proj 64 µs a 2-layer step against cuBLAS's 39) and never chosen: session 45)."""
    return {
        op: {impl: {p.name: [p.default, *(c for c in p.search_values if c != p.default)] for p in v.params}
             for impl, v in d.variants.items() if device_type in v.devices}
        for op, d in all_ops().items()
    }


def _hardware(engine) -> dict[str, Any]:
    cached = getattr(engine, "_hardware", None)
    if cached is None:
        from anneal.engine.hardware import measure

        cached = engine._hardware = measure(engine.device)
    return cached


def create_admin_app(async_engine, token: str | None = None) -> FastAPI:
    token = token or os.environ.get("ANNEAL_ADMIN_TOKEN") or ""
    if not token:
        raise ValueError("the admin API needs a token (ANNEAL_ADMIN_TOKEN)")
    app = FastAPI(title="Anneal admin API", docs_url=None, redoc_url=None, openapi_url=None)
    lock = asyncio.Lock()  # one exclusive operation at a time

    async def auth(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
            raise HTTPException(401, "missing or wrong bearer token")

    @app.exception_handler(HTTPException)
    async def _http_error(_req: Request, exc: HTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 503: "engine_dead"}.get(exc.status_code, "invalid_request_error")
        return _error(exc.status_code, str(exc.detail), kind)

    async def body(request: Request, model: type[BaseModel]) -> BaseModel:
        try:
            raw = await request.body()
            return model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            raise HTTPException(422, f"invalid {model.__name__}: {e.errors(include_url=False)}") from e

    def alive() -> None:
        """A dead engine (its CUDA context lost) answers 503 to any work: the failure is the engine's,
        not the plan's or kernel's the call carries, and the server is exiting."""
        if async_engine.dead is not None:
            raise HTTPException(503, dead_message(async_engine.dead))

    async def exclusive(fn, drain_timeout_s: float = 120.0):
        """Drain in-flight requests, then run ``fn(engine)`` on the engine thread."""
        async with lock:
            deadline = time.monotonic() + drain_timeout_s
            while async_engine.num_inflight or async_engine.engine.has_unfinished_requests():
                if time.monotonic() > deadline:
                    raise HTTPException(409, "requests still in flight; try again later")
                alive()
                await asyncio.sleep(0.01)
            try:
                return await async_engine.run_in_engine(fn)
            except Exception:
                alive()  # the call killed the engine: say so, not that the call failed
                raise

    @app.get("/admin/state", dependencies=[Depends(auth)])
    async def state() -> dict[str, Any]:
        e = async_engine.engine
        hw = await async_engine.run_in_engine(_hardware)
        variants = _variants(e.device.type)
        return {
            "model": e.config.name,
            "device": str(e.device),
            "gpu_name": hw.get("gpu_name"),
            "dtype": str(e.dtype).replace("torch.", ""),
            "num_layers_loaded": e.num_layers,
            "num_layers_total": e.config.num_hidden_layers,
            "max_model_len": e.max_model_len,
            "config": e.config.model_dump(mode="json"),
            "plan": e.plan.model_dump(mode="json"),
            "plan_hash": e.plan.hash,
            "tensor_parallel": {"degree": e.tp.size, "devices": e.tp_devices()},
            "kv": {"num_blocks": e.blocks.num_blocks, "free_blocks": e.blocks.num_free_blocks,
                   "block_size": e.blocks.block_size},
            "ops": {op: sorted(v) for op, v in variants.items()},
            "variants": variants,
            "hardware": hw,
            "startup": e.startup,
            "compile_ahead": {k: (len(v) if k in ("done", "compiling") else v)
                              for k, v in e.compile_ahead.status().items()},
        }

    @app.post("/admin/prepare", dependencies=[Depends(auth), Depends(alive)])
    async def prepare(request: Request) -> Any:
        """Queue plans for compile-ahead (engine/compile_ahead.py); answers at once. The engine keeps
        serving; a plan whose kernels fail to compile is reported here later, not rejected now."""
        req = await body(request, PrepareRequest)
        e = async_engine.engine
        try:
            for plan in req.plans:  # the checks apply_plan makes before any swap, minus the build
                e.check_plan(plan)
        except (OpError, ValueError) as ex:
            return _error(400, f"plan rejected: {ex}")
        queued = e.compile_ahead.submit(req.plans)
        return {"queued": queued, "plan_hashes": [p.hash for p in req.plans], **e.compile_ahead.status()}

    @app.get("/admin/prepare", dependencies=[Depends(auth)])
    async def prepare_status() -> Any:
        return async_engine.engine.compile_ahead.status()

    @app.put("/admin/plan", dependencies=[Depends(auth), Depends(alive)])
    async def put_plan(request: Request) -> Any:
        plan = await body(request, Plan)
        try:
            async with lock:
                report = await async_engine.apply_plan(plan)
        except (OpError, ValueError) as e:
            return _error(400, f"plan rejected, previous plan still serving: {e}")
        except TimeoutError as e:
            return _error(409, str(e))
        except Exception as e:  # noqa: BLE001 - a failed apply is an answer, not a crash
            alive()
            log.exception("applying plan %s failed", plan.hash)
            return _error(500, f"applying the plan failed, previous plan still serving: "
                               f"{type(e).__name__}: {e}", "apply_error")
        return {"plan_hash": report.plan_hash,
                "timings": {"build_s": report.build_s, "warmup_s": report.warmup_s,
                            "capture_s": report.capture_s, "total_s": report.total_s,
                            **({"ahead_wait_s": report.ahead_wait_s} if report.ahead_wait_s else {}),
                            **({"prompt_warmup_s": report.prompt_warmup_s}
                               if report.prompt_warmup_s is not None else {}),
                            **({"parallel_jit_s": report.parallel_jit_s,
                                "parallel_jit_kernels": report.parallel_jit_kernels}
                               if report.parallel_jit_s is not None else {})},
                **({"token_graphs": {"kept": report.token_graph_sizes, "dropped": report.token_graph_sizes_dropped}}
                   if report.token_graph_sizes is not None else {}),
                **({"inert_fusions": report.inert_fusions} if report.inert_fusions else {})}

    @app.post("/admin/kernels", dependencies=[Depends(auth), Depends(alive)])
    async def kernels(request: Request) -> Any:
        req = await body(request, KernelRequest)
        if req.op not in all_ops():
            return _error(400, f"unknown op {req.op!r}; known: {sorted(all_ops())}")
        if req.impl == "reference":
            return _error(400, "the reference implementation cannot be replaced")
        e = async_engine.engine
        ks = KernelSource(op=req.op, impl=req.impl, source=req.source, params=req.params)
        check = await asyncio.to_thread(
            check_in_subprocess, ks, e.config.model_dump(mode="json"), str(e.device),
            str(e.dtype).replace("torch.", ""), req.timeout_s)
        if not check.ok:
            return check.model_dump()
        try:
            await async_engine.run_in_engine(lambda _e: register(ks))
        except Exception as ex:  # noqa: BLE001
            alive()
            return {**check.model_dump(), "ok": False, "stage": "register",
                    "error": f"{type(ex).__name__}: {ex}"}
        return {**check.model_dump(), "stage": "registered"}

    @app.post("/admin/benchmark", dependencies=[Depends(auth), Depends(alive)])
    async def benchmark(request: Request) -> Any:
        req = await body(request, BenchmarkRequest)
        try:
            result = await exclusive(lambda e: run_benchmark(e, req))
        except (ValueError, OpError) as ex:
            return _error(400, str(ex))
        except HTTPException:
            raise
        except Exception as ex:  # noqa: BLE001
            log.exception("benchmark failed")
            return _error(500, f"benchmark failed: {type(ex).__name__}: {ex}", "benchmark_error")
        if async_engine.metrics is not None:
            async_engine.metrics.set_plan(async_engine.engine.plan.hash)
        return result.model_dump()

    @app.post("/admin/verify", dependencies=[Depends(auth), Depends(alive)])
    async def verify_plan(request: Request) -> Any:
        req = await body(request, VerifyRequest)
        try:
            report = await exclusive(lambda e: verify(e, req))
        except (ValueError, OpError) as ex:
            return _error(400, str(ex))
        except HTTPException:
            raise
        except Exception as ex:  # noqa: BLE001 - e.g. a kernel that crashed during the checks
            log.exception("verification failed to run")
            return {"passed": False, "plan_hash": req.plan.hash, "seconds": 0.0,
                    "checks": [{"name": "run", "passed": False,
                                "detail": f"{type(ex).__name__}: {ex}", "metrics": {}}]}
        return report.model_dump()

    return app
