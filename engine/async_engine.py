"""AsyncEngine: one thread owns the (not thread-safe) Engine and steps it; asyncio consumes outputs.

The event loop never touches the Engine. It hands the engine thread commands (add a request, abort
one, run a function between steps) through a locked deque, and each request gets an
``asyncio.Queue`` that the engine thread fills with ``call_soon_threadsafe`` after every step.

- Admission is bounded: at most ``max_num_seqs`` (from the current plan) + ``max_waiting`` requests
  are in flight; beyond that :class:`EngineOverloaded` says when to retry (HTTP 429).
- A consumer that goes away (client disconnect, cancelled task) aborts its request, which frees
  its KV blocks at the engine thread's next turn.
- ``stats`` is a snapshot the engine thread publishes after every turn (free blocks, running, ...).
- ``shutdown`` lets in-flight requests finish for a grace period, then aborts the rest.
- A failed step fails the requests in it, and a failed admin call aborts what it left in the engine,
  so nothing is stepped again that would fail again. An error that loses the CUDA context
  (``device_faults``) makes the engine dead: every request and call fails at once, ``on_dead`` tells
  the server, and the server exits for a new process.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from anneal.engine.device_faults import is_fatal

log = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """Too many requests in flight; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineShuttingDown(Exception):
    """The server is draining; new requests are refused."""


class EngineStepError(RuntimeError):
    """The engine failed while running this request (it was aborted; the server keeps serving)."""


class EngineDead(EngineShuttingDown):
    """The engine's device context is lost (a CUDA error that every later call repeats): the server
    exits, and only a new process serves again."""


@dataclass
class _Tracked:
    """Engine-thread book-keeping of one request, for latency metrics."""

    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0


@dataclass
class RequestStream:
    """The outputs of one request, in order; iterate it with ``async for``."""

    request_id: str
    _engine: "AsyncEngine"
    _queue: asyncio.Queue
    finished: bool = False
    _closed: bool = field(default=False, repr=False)
    _stop_reason: str = field(default="abort", repr=False)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = bool(item.finished)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Release the admission slot; abort the request if it has not finished."""
        if self._closed:
            return
        self._closed = True
        self._engine._release(self.request_id, abort=not self.finished, reason=self._stop_reason)

    def stop(self) -> None:
        """The server finished the request itself (a stop string matched): free it now."""
        self._stop_reason = "stop"
        self.close()


class AsyncEngine:
    """Owns the engine thread. Create it inside a running event loop, then ``start()``."""

    def __init__(
        self,
        engine: Any,
        *,
        max_waiting: int = 256,
        metrics: Any = None,
        retry_after_s: int = 1,
        on_dead: Callable[[BaseException], None] | None = None,
    ):
        self.engine = engine
        self.on_dead = on_dead  # called on the event loop once the engine is dead
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.stats = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cv = threading.Condition()
        self._cmds: collections.deque[tuple] = collections.deque()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._inflight: set[str] = set()  # event loop only
        self._ids = itertools.count()
        self._stopping = False
        self._draining = False
        self._thread: threading.Thread | None = None
        self._resumed: asyncio.Event | None = None  # cleared while a plan is being applied
        self.dead: BaseException | None = None

    # ---- event-loop side -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.engine.plan.scheduler.max_num_seqs + self.max_waiting

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._thread = threading.Thread(target=self._run, name="anneal-engine", daemon=True)
        self._thread.start()

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() % 10**9:09d}"

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: Any, arrival: float | None = None
    ) -> RequestStream:
        """Submit a request; raises EngineOverloaded, EngineShuttingDown or the engine's ValueError.

        While a plan is being applied, new requests wait here until it is done.
        """
        if self._resumed is not None and not self._resumed.is_set():
            await self._resumed.wait()
        if self.dead is not None:
            raise EngineDead(dead_message(self.dead))
        if self._draining or self._stopping:
            raise EngineShuttingDown("the server is shutting down")
        if len(self._inflight) >= self.capacity:
            raise EngineOverloaded(
                f"{len(self._inflight)} requests in flight, the limit is {self.capacity} "
                f"(max_num_seqs + max_waiting); retry later",
                retry_after=self.retry_after_s,
            )
        queue: asyncio.Queue = asyncio.Queue()
        tracked = _Tracked(queue, arrival or time.monotonic(), len(prompt_token_ids))
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._inflight.add(request_id)
        try:
            self._submit(("add", request_id, prompt_token_ids, params, tracked, added))
            await asyncio.wrap_future(added)
        except BaseException:
            # Rejected by the engine (nothing was added), or the caller was cancelled meanwhile:
            # then the abort, queued behind the add, frees whatever the add did.
            self._inflight.discard(request_id)
            rejected = added.done() and not added.cancelled() and added.exception() is not None
            if not rejected:
                self.abort(request_id)
            raise
        return RequestStream(request_id, self, queue)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Free the request's KV blocks at the engine thread's next turn."""
        self._submit(("abort", request_id, reason))

    async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    async def apply_plan(self, plan: Any, drain_timeout_s: float = 120.0) -> Any:
        """Hot-swap the plan between requests: hold new requests, let in-flight ones finish, apply
        it on the engine thread (the old plan keeps serving if that fails), resume.

        Raises TimeoutError (nothing changed) when in-flight requests outlast ``drain_timeout_s``.
        """
        assert self._resumed is not None, "start() first"
        self._resumed.clear()
        try:
            deadline = time.monotonic() + drain_timeout_s
            while self._inflight:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{len(self._inflight)} requests still in flight after {drain_timeout_s}s; "
                        "the plan was not applied"
                    )
                await asyncio.sleep(0.01)
            report = await self.run_in_engine(lambda engine: engine.apply_plan(plan))
            if self.metrics is not None:
                self.metrics.set_plan(self.engine.plan.hash)
            return report
        finally:
            self._resumed.set()

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for ``grace_s``, abort the rest, stop."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()  # its compile-ahead children and tensor-parallel workers, if it started any

    def _release(self, request_id: str, abort: bool, reason: str = "abort") -> None:
        self._inflight.discard(request_id)
        if abort:
            self.abort(request_id, reason)

    def _submit(self, cmd: tuple) -> None:
        with self._cv:
            if self.dead is None:
                self._cmds.append(cmd)
                self._cv.notify()
                return
        _refuse(cmd, EngineDead(dead_message(self.dead)))  # no engine thread will ever take it

    # ---- engine-thread side ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._cmds and not self._stopping and not self._busy():
                        self._cv.wait()
                    cmds = list(self._cmds)
                    self._cmds.clear()
                    stopping = self._stopping
                for cmd in cmds:
                    self._apply(cmd)
                if stopping:
                    self._abort_all("the server shut down")
                    self._publish(False)
                    return
                stepped = self.dead is None and self._busy()
                if stepped:
                    self._step()
                self._publish(stepped)
                if self.dead is not None:
                    return
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            log.exception("engine thread died")
            self._die(e, EngineStepError(f"the engine thread died: {e}"))

    def _busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _apply(self, cmd: tuple) -> None:
        if self.dead is not None:  # queued before the engine died, behind what killed it
            _refuse(cmd, EngineDead(dead_message(self.dead)))
            return
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, tracked, added = cmd
            if not added.set_running_or_notify_cancel():
                return  # the caller gave up before the engine saw the request
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                added.set_exception(e)
                return
            self._tracked[rid] = tracked
            added.set_result(None)
        elif kind == "abort":
            _, rid, reason = cmd
            tracked = self._tracked.pop(rid, None)
            if tracked is not None:
                self.engine.abort_request(rid)
                self._observe_end(tracked, reason, "success" if reason == "stop" else "aborted")
        elif kind == "call":
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                if is_fatal(e):  # dead before the caller hears of it
                    self._die(e)
                fut.set_exception(e)
            finally:
                if self.dead is None:
                    self._abort_untracked()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            if is_fatal(e):
                self._die(e)
                return
            log.exception("engine step failed; aborting the requests in flight")
            self._fail_all(EngineStepError(f"the engine step failed: {e}"))
            self._abort_untracked()
            return
        now = time.monotonic()
        deliveries: list[tuple[asyncio.Queue, Any]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted meanwhile
            self._observe_tokens(tracked, out, now)
            deliveries.append((tracked.queue, out))
            if out.finished:
                del self._tracked[out.request_id]
                self._observe_end(tracked, out.finish_reason or "stop", "success")
        if self._tracked and not self.engine.has_unfinished_requests():
            # The engine dropped requests without a final output: never leave a client hanging.
            self._fail_all(EngineStepError("the engine dropped the request without finishing it"))
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _observe_end(self, tracked: _Tracked, finish_reason: str, status: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(
                prompt_tokens=tracked.num_prompt_tokens,
                generation_tokens=tracked.num_output_tokens,
                latency_s=time.monotonic() - tracked.arrival,
                finish_reason=finish_reason,
                status=status,
            )

    def _observe_tokens(self, tracked: _Tracked, out: Any, now: float) -> None:
        n = len(out.new_token_ids)
        if n == 0:
            return
        if tracked.first_token is None:
            tracked.first_token = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - tracked.arrival)
            n -= 1
        elif self.metrics is not None and tracked.last_token is not None:
            gap = (now - tracked.last_token) / n
            for _ in range(n):
                self.metrics.observe_itl(gap)
        tracked.last_token = now
        tracked.num_output_tokens += len(out.new_token_ids)

    def _abort_all(self, reason: str) -> None:
        self._fail_all(EngineShuttingDown(reason))

    def _abort_untracked(self) -> None:
        """Abort the requests no client holds: those an admin call (a benchmark replay, a
        verification) added and left when it failed. Nothing would finish them, and the loop would
        step them, and fail, for ever (session 55: 775 000 failed steps in six minutes)."""
        for rid in self.engine.request_ids():
            if rid not in self._tracked:
                self.engine.abort_request(rid)

    def _die(self, error: BaseException, to_callers: BaseException | None = None) -> None:
        """The engine cannot run again in this process: fail everything and tell the server."""
        with self._cv:
            self.dead = error
            cmds = list(self._cmds)
            self._cmds.clear()
        log.error("%s; failing every request", dead_message(error))
        dead = to_callers or EngineDead(dead_message(error))
        for cmd in cmds:
            _refuse(cmd, dead)
        self._fail_all(dead)
        with contextlib.suppress(Exception):  # host-side book-keeping only; best effort
            self._abort_untracked()
        if self.on_dead is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_dead, error)

    def _fail_all(self, error: BaseException) -> None:
        deliveries = []
        for rid, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort while failing
                log.exception("abort of %s failed", rid)
            deliveries.append((tracked.queue, error))
            self._observe_end(tracked, "abort", "aborted")
        self._tracked.clear()
        if deliveries and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _publish(self, stepped: bool) -> None:
        self.stats = self.engine.stats()
        if self.metrics is not None:
            self.metrics.observe_engine(self.stats, stepped=stepped)


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)


def _refuse(cmd: tuple, error: Exception) -> None:
    """Fail a command the engine thread will never take (the engine is dead)."""
    fut = cmd[-1] if cmd[0] in ("add", "call") else None
    if fut is not None and fut.set_running_or_notify_cancel():
        fut.set_exception(error)


def dead_message(error: BaseException) -> str:
    """What a dead engine answers: the error that lost its context, on one line."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"the engine is dead ({type(error).__name__}: {first}); only a new process serves again"
