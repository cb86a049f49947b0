"""AsyncEngine around a real random:tiny Engine: streaming, admission limit, aborts, plan swaps."""

from __future__ import annotations

import asyncio

import pytest

from anneal.engine.async_engine import AsyncEngine, EngineOverloaded, EngineShuttingDown
from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.metrics import EngineMetrics
from anneal.engine.plan import Plan, SchedulerKnobs
from anneal.engine.sampling_params import SamplingParams

PLAN = Plan(scheduler=SchedulerKnobs(max_num_seqs=2), cuda_graph_batch_sizes=[])


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def engine(request):
    """Every test twice: the plain scheduler, and overlap scheduling (a decode step in flight while
    the engine thread hands out the previous one's tokens, takes aborts and swaps plans)."""
    plan = PLAN.model_copy(update={"scheduler": PLAN.scheduler.model_copy(update={"overlap": request.param})})
    return Engine(EngineArgs(model="random:tiny", device="cpu", plan=plan, max_model_len=512,
                             num_kv_blocks=128))


def run(engine, body, **kw):
    """Run ``body(async_engine)`` in a fresh loop with a started AsyncEngine, then shut it down."""

    async def main():
        ae = AsyncEngine(engine, metrics=EngineMetrics(), **kw)
        ae.start()
        try:
            return await body(ae)
        finally:
            await ae.shutdown(grace_s=5)
            assert ae.stats.num_free_blocks == ae.stats.num_blocks
            assert ae.stats.num_running == ae.stats.num_waiting == 0

    return asyncio.run(main())


def params(n, seed=0):
    return SamplingParams(max_tokens=n, seed=seed, ignore_eos=True)


async def collect(stream):
    return [t async for out in stream for t in out.new_token_ids]


def test_streams_match_offline_generate(engine):
    expected = engine.generate([[1, 2, 3], [4, 5]], [params(8, 1), params(5, 2)])

    async def body(ae):
        a = await ae.add_request("a", [1, 2, 3], params(8, 1))
        b = await ae.add_request("b", [4, 5], params(5, 2))
        return await asyncio.gather(collect(a), collect(b))

    assert run(engine, body) == expected


def test_admission_is_bounded_and_slots_come_back(engine):
    async def body(ae):
        assert ae.capacity == 2 + 1
        streams = [await ae.add_request(f"r{i}", [1, 2], params(30)) for i in range(3)]
        with pytest.raises(EngineOverloaded) as e:
            await ae.add_request("r3", [1, 2], params(30))
        assert e.value.retry_after >= 1
        await asyncio.gather(*(collect(s) for s in streams))
        assert ae.num_inflight == 0
        return await collect(await ae.add_request("r4", [1, 2], params(3)))

    assert len(run(engine, body, max_waiting=1)) == 3


def test_engine_rejection_reaches_the_caller_and_frees_the_slot(engine):
    async def body(ae):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await ae.add_request("bad", [10_000], params(3))
        assert ae.num_inflight == 0

    run(engine, body)


def test_closing_a_stream_aborts_and_frees_blocks_at_once(engine):
    async def body(ae):
        stream = await ae.add_request("long", list(range(1, 60)), params(400))
        async for out in stream:
            break  # the consumer goes away after the first token
        for _ in range(200):
            if ae.stats.num_running == 0 and ae.stats.num_free_blocks == ae.stats.num_blocks:
                break
            await asyncio.sleep(0.01)
        assert ae.stats.num_free_blocks == ae.stats.num_blocks
        assert ae.stats.num_running == 0

    run(engine, body)


def test_cancelling_the_consumer_task_aborts(engine):
    async def body(ae):
        stream = await ae.add_request("c", [1, 2, 3], params(400))
        task = asyncio.ensure_future(collect(stream))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ae.num_inflight == 0

    run(engine, body)


def test_apply_plan_waits_for_in_flight_requests_and_updates_plan_info(engine):
    new_plan = Plan(scheduler=SchedulerKnobs(max_num_seqs=3), cuda_graph_batch_sizes=[])

    async def body(ae):
        stream = await ae.add_request("x", [1, 2], params(20))
        consumer = asyncio.ensure_future(collect(stream))
        report = await ae.apply_plan(new_plan)
        assert consumer.done() and len(consumer.result()) == 20  # finished before the swap
        assert report.plan_hash == new_plan.hash == engine.plan.hash
        assert f'plan_hash="{new_plan.hash}"' in ae.metrics.render().decode()
        await ae.apply_plan(PLAN)

    run(engine, body)


def test_shutdown_aborts_what_is_left_and_refuses_new_requests(engine):
    async def body(ae):
        stream = await ae.add_request("s", [1, 2], params(450))
        consumer = asyncio.ensure_future(collect(stream))
        await ae.shutdown(grace_s=0.05)
        with pytest.raises(EngineShuttingDown):
            await consumer
        with pytest.raises(EngineShuttingDown):
            await ae.add_request("t", [1], params(1))

    run(engine, body)


def test_run_in_engine_runs_on_the_engine_thread(engine):
    import threading

    async def body(ae):
        name = await ae.run_in_engine(lambda e: threading.current_thread().name)
        assert name == "anneal-engine"
        with pytest.raises(ZeroDivisionError):
            await ae.run_in_engine(lambda e: 1 / 0)

    run(engine, body)


def test_a_caller_cancelled_while_adding_leaves_nothing_behind(engine):
    async def body(ae):
        # Keep the engine thread busy so the add is still queued when the caller is cancelled.
        busy = await ae.add_request("busy", list(range(1, 200)), params(50))
        consumer = asyncio.ensure_future(collect(busy))
        adds = [asyncio.ensure_future(ae.add_request(f"x{i}", [1, 2], params(400))) for i in range(2)]
        await asyncio.sleep(0)
        for a in adds:
            a.cancel()
        for a in adds:
            try:
                stream = await a
            except asyncio.CancelledError:
                continue
            stream.close()  # the add won the race: closing must abort it
        await consumer
        for _ in range(300):
            if ae.stats.num_running == ae.stats.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert ae.dead is None and ae.num_inflight == 0
        assert ae.stats.num_running == ae.stats.num_waiting == 0

    run(engine, body)


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(engine):
    import json

    from anneal.engine import openai_protocol as p
    from anneal.engine import openai_serving as serving
    from anneal.engine.tokenizer import ByteTokenizer

    async def body(ae):
        ctx = serving.ServingContext(ae, ByteTokenizer(512), "random:tiny", engine.max_model_len, 512)
        req = p.CompletionRequest(model="random:tiny", prompt="hi", max_tokens=450, stream=True,
                                  ignore_eos=True)
        gen = serving.prepare_completion(ctx, req, arrival=0.0)
        events = serving.stream(ctx, gen, await serving.start_stream(ctx, gen))
        first = json.loads((await anext(events))[6:])
        assert first["choices"][0]["finish_reason"] is None
        await ae.shutdown(grace_s=0.0)
        rest = [e async for e in events]
        assert rest[-1] == "data: [DONE]\n\n"
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "server_error" and "shut" in error["message"]

    run(engine, body)


def test_a_failed_admin_call_leaves_no_request_behind(engine):
    """A benchmark replay adds its requests to the engine itself; one that fails midway left them
    there, and the engine thread stepped them for ever (session 55). Nothing of it may stay."""

    def fails_midway(e):
        e.add_request("replay-0", [1, 2, 3], params(400))
        raise RuntimeError("the replay failed")

    async def body(ae):
        with pytest.raises(RuntimeError, match="the replay failed"):
            await ae.run_in_engine(fails_midway)
        assert await ae.run_in_engine(lambda e: e.request_ids()) == []
        assert ae.dead is None
        return await collect(await ae.add_request("next", [1, 2], params(3)))

    assert len(run(engine, body)) == 3


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(engine, monkeypatch):
    calls = []
    step = engine.step

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a kernel raised")
        return step()

    monkeypatch.setattr(engine, "step", fails_once)

    async def body(ae):
        from anneal.engine.async_engine import EngineStepError

        with pytest.raises(EngineStepError, match="a kernel raised"):
            await collect(await ae.add_request("a", [1, 2], params(5)))
        assert ae.dead is None
        return await collect(await ae.add_request("b", [1, 2], params(4)))

    assert len(run(engine, body)) == 4


def test_a_lost_device_context_kills_the_engine_and_tells_the_server(engine, monkeypatch):
    """A CUDA error that every later call repeats (a device-side assert) is not a failed step: the
    engine is dead, every request and call fails at once (none waits on a thread that is gone) and
    ``on_dead`` fires, for the server to exit (session 55: the engine failed 775 000 steps instead)."""
    from anneal.engine.async_engine import EngineDead

    calls = []

    def lost():
        calls.append(1)
        raise RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be ...")

    monkeypatch.setattr(engine, "step", lost)
    told = []

    async def body(ae):
        ae.on_dead = told.append
        with pytest.raises(EngineDead, match="device-side assert triggered"):
            await collect(await ae.add_request("a", [1, 2], params(5)))
        await asyncio.sleep(0.05)
        assert len(told) == 1 and "device-side assert" in str(told[0])
        assert ae.dead is not None and len(calls) == 1
        with pytest.raises(EngineDead):
            await ae.add_request("b", [1, 2], params(5))
        with pytest.raises(EngineDead):
            await asyncio.wait_for(ae.run_in_engine(lambda e: 1), timeout=5)
        assert engine.request_ids() == []

    run(engine, body)


def test_an_admin_call_that_loses_the_device_context_kills_the_engine(engine):
    from anneal.engine.async_engine import EngineDead

    def loses_it(e):
        e.add_request("verify-0", [1, 2, 3], params(50))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def body(ae):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await ae.run_in_engine(loses_it)
        assert ae.dead is not None
        with pytest.raises(EngineDead):
            await asyncio.wait_for(ae.run_in_engine(lambda e: 1), timeout=5)
        assert engine.request_ids() == []

    run(engine, body)


@pytest.mark.parametrize("message,fatal", [
    ("CUDA error: device-side assert triggered", True),
    ("CUDA error: an illegal memory access was encountered", True),
    ("Triton Error [CUDA]: unspecified launch failure", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("the replay failed", False),
])
def test_which_errors_lose_the_device_context(message, fatal):
    from anneal.engine.device_faults import is_fatal

    assert is_fatal(RuntimeError(message)) is fatal
    try:  # and when it is the cause of what reached the caller
        try:
            raise RuntimeError(message)
        except RuntimeError as inner:
            raise ValueError("benchmark failed") from inner
    except ValueError as outer:
        assert is_fatal(outer) is fatal
