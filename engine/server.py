"""`anneal serve`: the public OpenAI-compatible HTTP API, /health and /metrics.

Routes on the public port: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when
``stream``), ``GET /v1/models``, ``GET /health`` (engine state, including free KV blocks),
``GET /metrics`` (Prometheus text). Nothing under ``/admin``: the admin API (``anneal.engine.admin``)
listens on ``--admin-port`` only, and only when ``ANNEAL_ADMIN_TOKEN`` is set.

Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (malformed
JSON, invalid UTF-8, wrong types, empty prompt or messages, context overflow), 404 for an unknown
model or route, 429 + ``Retry-After`` when the in-flight limit is reached, 503 + ``Retry-After``
while draining, 500 if the engine fails (the server keeps serving).

SIGTERM/SIGINT: stop accepting, let in-flight requests finish for ``--shutdown-timeout`` seconds,
abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from anneal.engine import kernel_cache
from anneal.engine import openai_protocol as p
from anneal.engine import openai_serving as serving
from anneal.engine.async_engine import (
    AsyncEngine,
    EngineOverloaded,
    EngineShuttingDown,
    EngineStepError,
    dead_message,
)
from anneal.engine.metrics import CONTENT_TYPE, EngineMetrics
from anneal.engine.openai_serving import APIError, ServingContext

log = logging.getLogger("anneal.serve")


# ---- request bodies ---------------------------------------------------------------------------


def _validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    for err in errors:
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, p.UnsupportedParam):
            return APIError(400, str(cause), param=cause.param)
    first_loc = errors[0]["loc"] if errors else ()
    param = str(first_loc[0]) if first_loc else None
    parts: list[str] = []
    for err in errors:
        where = ".".join(str(x) for x in err["loc"]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        part = f"{where}: {msg}"
        if part not in parts:
            parts.append(part)
    more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return APIError(400, "invalid request: " + "; ".join(parts[:3]) + more, param=param)


MAX_BODY_BYTES = 16 * 2**20  # a 128k-token prompt as JSON ids is under 1 MiB
# uvicorn closes idle connections after 5 s, the same expiry httpx (so the openai client) pools them
# for: a client reusing one as the server closes it gets a reset or an empty reply (a 2-core CI run,
# loaded: 3 of 195 requests after ~5 s idle failed). 75 s outlasts those pools and the 60 s idle
# timeout of common load balancers in front of a server.
KEEP_ALIVE_S = 75.0


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise _validation_error(e) from e


# ---- the app ----------------------------------------------------------------------------------


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, EngineOverloaded):
        return APIError(
            429, str(e), type="rate_limit_error", code="too_many_requests",
            headers={"Retry-After": str(e.retry_after)},
        )
    if isinstance(e, EngineShuttingDown):
        return APIError(503, str(e), type="server_error", code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), type="server_error", code="engine_error")
    if isinstance(e, UnicodeEncodeError):
        return APIError(400, "the text contains invalid Unicode (a lone surrogate)")
    raise e


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; cancel it (which aborts its engine request) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


def create_app(ctx: ServingContext, metrics: EngineMetrics) -> FastAPI:
    """The public app. ``ctx.engine`` must be started by whoever runs the app."""
    app = FastAPI(title="Anneal", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error_response(APIError(exc.status_code, message, type=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(500, f"internal error: {exc}", type="server_error"))

    async def generation(request: Request, req_model: type[BaseModel], prepare: Callable) -> Any:
        arrival = time.monotonic()
        try:
            req = await parse_body(request, req_model)
            gen = prepare(ctx, req, arrival)
            if req.stream is True:
                engine_stream = await serving.start_stream(ctx, gen)
                return StreamingResponse(
                    serving.stream(ctx, gen, engine_stream),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            body = await _unless_disconnected(request, serving.complete(ctx, gen))
            return body if isinstance(body, Response) else JSONResponse(body)
        except APIError:
            metrics.observe_rejected()
            raise
        except Exception as e:  # noqa: BLE001 - mapped to an OpenAI error or re-raised
            metrics.observe_rejected()
            raise _engine_error(e) from e

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generation(request, p.CompletionRequest, serving.prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generation(request, p.ChatCompletionRequest, serving.prepare_chat)

    @app.get("/v1/models")
    async def models() -> Any:
        card = p.ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)
        return p.ModelList(data=[card]).model_dump(mode="json")

    @app.get("/health")
    async def health() -> Any:
        s = ctx.engine.stats
        body = {
            "status": "ok" if ctx.engine.dead is None else "dead",
            "model": ctx.model_name,
            "plan_hash": ctx.engine.engine.plan.hash,
            "num_inflight": ctx.engine.num_inflight,
            "capacity": ctx.engine.capacity,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv": {"free_blocks": s.num_free_blocks, "num_blocks": s.num_blocks},
        }
        return JSONResponse(body, status_code=200 if ctx.engine.dead is None else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


# ---- the command ------------------------------------------------------------------------------


def _port(text: str) -> int:
    """An argparse type: a TCP port (0: any free one), so a bad one is a usage error, not a bind() traceback."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535")
    return port


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``anneal serve``."""
    parser.add_argument("--model", required=True, help="a Hugging Face model folder or random:<preset>")
    parser.add_argument("--plan", help="a Plan or CompiledPlan file (JSON/YAML); default: the device's default "
                        "plan (on CUDA the hand-set Triton plan with overlap scheduling, on the CPU the reference)")
    parser.add_argument("--host", default="0.0.0.0", help="address of both ports (default 0.0.0.0)")
    parser.add_argument("--port", type=_port, default=8000, help="public OpenAI API + /metrics (default 8000)")
    parser.add_argument(
        "--admin-port", type=_port, default=8001,
        help="admin API (default 8001); listens only when ANNEAL_ADMIN_TOKEN is set",
    )
    parser.add_argument("--layers", type=int, help="load only the first K layers (fast tier)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    parser.add_argument("--num-kv-blocks", type=int, help="KV-cache blocks (default: sized by the engine)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.85,
        help="share of the GPU's memory this engine may fill, weights + KV (default 0.85); engines that "
             "share a GPU take their share of what is free when they size the KV cache",
    )
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, choices=range(1, 9), metavar="N",
        help="GPUs the model is split across, one process each, from --device's on (overrides the plan's "
             "parallelism.tensor_parallel; default: the plan's, 1)")
    parser.add_argument("--max-num-seqs", type=int, help="sequences per step (overrides the plan)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="token budget per step (overrides the plan)"
    )
    parser.add_argument(
        "--max-waiting", "--max-queue", dest="max_waiting", type=int, default=256,
        help="requests that may wait beyond max-num-seqs (default 256); more get 429 + Retry-After",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed for random: models")
    parser.add_argument(
        "--parallel-jit", action="store_true",
        help="compile each plan's Triton kernels in parallel before its warm-up (measured on the H200: "
             "no gain for a candidate's few new kernels)",
    )
    parser.add_argument(
        "--compile-ahead-processes", type=int, default=None, metavar="N",
        help="child processes that compile the kernels of plans queued with POST /admin/prepare "
             "(default: a quarter of the cores, at most 4, started by the first prepare; N > 0: started "
             "with the server; 0: a thread of the server process compiles them)",
    )
    parser.add_argument(
        "--warm-prompt-steps", action=argparse.BooleanOptionalAction, default=None,
        help="compile the kernels a plan's prompt steps launch when it is applied, not in the first "
             "requests after it (default: on for the whole model, off with --layers)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="seconds in-flight requests may finish after SIGTERM before they are aborted (default 30)",
    )
    parser.add_argument(
        "--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
        help=f"seconds an idle HTTP connection stays open (default {KEEP_ALIVE_S:g}: longer than clients "
             "keep idle connections pooled, so a client never reuses one the server is closing)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _plan_from_args(args: argparse.Namespace, device: str) -> Any:
    """``--plan`` with the knob flags applied; without ``--plan`` the device's default plan."""
    from anneal.engine.plan import Plan, default_plan, load_plan

    plan = load_plan(Path(args.plan).read_text()) if args.plan else default_plan(device)
    knobs = {
        k: v
        for k, v in {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        }.items()
        if v is not None
    }
    if knobs:
        data = plan.model_dump(mode="json")
        data["scheduler"].update(knobs)
        plan = Plan.model_validate(data)
    tp = getattr(args, "tensor_parallel_size", None)
    return plan if tp is None else plan.with_tensor_parallel(tp)


def build_engine(args: argparse.Namespace) -> Any:
    """The Engine the flags describe (loads the weights)."""
    from anneal.engine.llm import Engine, EngineArgs

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        kernel_cache.ensure_writable()
    plan = _plan_from_args(args, device)
    if not args.plan:
        log.info("no --plan: serving %s (%s)", plan.hash, plan.name)
    return Engine(
        EngineArgs(
            model=args.model,
            device=device,
            plan=plan,
            layers=args.layers,
            max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            parallel_jit=args.parallel_jit,
            compile_ahead_processes=args.compile_ahead_processes,
            warm_prompt_steps=args.warm_prompt_steps,
            seed=args.seed,
        )
    )


def build_engine_off_the_main_thread(args: argparse.Namespace) -> Any:
    """``build_engine`` on a thread of its own, so the event loop's thread never runs torch's CPU
    thread pool: once it has (loading weights does), every other thread's parallel torch ops ran
    ~2.3x slower on a 2-core CPU (OpenMP keeps a team per calling thread), and the engine steps on a
    thread of its own (session 17: a CPU decode step 4.5-5.0 ms in the server against 2.1 built
    here). Ctrl-C still reaches the main thread while the weights load."""
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["engine"] = build_engine(args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            built["error"] = e

    t = threading.Thread(target=build, name="anneal-build", daemon=True)
    t.start()
    t.join()
    if "error" in built:
        raise built["error"]
    return built["engine"]


def startup_summary(startup: dict[str, float], device: str) -> str:
    """One line on where an engine's start went. On CUDA the warm-up is mostly Triton compiling the
    plan's kernels unless its cache has them, so the line names the cache: a pod's log then shows
    whether a kept one (InferenceDeployment.spec.kernelCache) is doing its work."""
    names = (("weights_s", "weights"), ("kv_cache_s", "KV cache"), ("warmup_s", "warm-up"), ("capture_s", "graphs"))
    parts = ", ".join(f"{label} {startup[k]:.1f} s" for k, label in names if k in startup)
    line = f"engine ready in {sum(startup.values()):.1f} s: {parts}"
    return f"{line} (Triton kernel cache {kernel_cache.cache_dir()})" if device == "cuda" else line


class _Server:
    """A uvicorn server whose signals are handled by ``run_serve`` (uvicorn re-raises them)."""

    def __init__(self, app: Any, host: str, port: int, args: argparse.Namespace):
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[override]
                yield

        config = uvicorn.Config(
            app, host=host, port=port, lifespan="off", log_level=args.log_level,
            timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)),
            timeout_keep_alive=args.timeout_keep_alive,
            access_log=args.log_level == "debug",
        )
        self.server = Quiet(config)


def _admin_app(async_engine: AsyncEngine) -> Any | None:
    if not os.environ.get("ANNEAL_ADMIN_TOKEN"):
        return None
    if importlib.util.find_spec("anneal.engine.admin") is None:
        log.warning("ANNEAL_ADMIN_TOKEN is set but this build has no admin API; not listening")
        return None
    from anneal.engine.admin import create_admin_app

    return create_admin_app(async_engine)


async def serve(args: argparse.Namespace, engine: Any, tokenizer: Any) -> int:
    """Serve until SIGTERM/SIGINT, then drain and stop the engine: exit code 0. When the engine dies
    (its CUDA context lost, ``device_faults``), stop at once: exit code 1, for a new process."""
    metrics = EngineMetrics()
    metrics.set_plan(engine.plan.hash)
    died: list[BaseException] = []

    def on_dead(error: BaseException) -> None:
        died.append(error)
        log.error("exiting: %s", dead_message(error))
        for s in servers:
            s.server.should_exit = True

    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting, metrics=metrics, on_dead=on_dead)
    async_engine.start()
    ctx = ServingContext(
        engine=async_engine,
        tokenizer=tokenizer,
        model_name=args.served_model_name or args.model,
        max_model_len=engine.max_model_len,
        vocab_size=engine.config.vocab_size,
    )
    servers = [_Server(create_app(ctx, metrics), args.host, args.port, args)]
    admin = _admin_app(async_engine)
    if admin is not None:
        servers.append(_Server(admin, args.host, args.admin_port, args))
    loop = asyncio.get_running_loop()

    def stop() -> None:
        log.info("shutting down: draining in-flight requests")
        for s in servers:
            s.server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await asyncio.gather(*(s.server.serve() for s in servers))
    finally:
        await async_engine.shutdown(grace_s=0.0 if died else 1.0)
    return 1 if died else 0


def run_serve(args: argparse.Namespace) -> int:
    """``anneal serve``: load the model, serve until SIGTERM, return the exit code."""
    from anneal.engine.tokenizer import TokenizerError, load_tokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build_engine_off_the_main_thread(args)
        tokenizer = load_tokenizer(args.model, engine.config.vocab_size, engine.config.eos_token_ids)
    except (OSError, ValueError, RuntimeError, TokenizerError) as e:
        log.error("cannot start: %s", e)
        return 2
    log.info("%s", startup_summary(engine.startup, engine.device.type))
    return asyncio.run(serve(args, engine, tokenizer))


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(prog="anneal serve", description=__doc__.splitlines()[0]))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
