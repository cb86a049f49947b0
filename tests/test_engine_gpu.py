"""The engine on a GPU: CUDA-graph decode equals eager decode, and the Triton plan equals the
reference plan (greedy tokens, logits within bf16 tolerance). Run with `pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.plan import Plan, load_plan
from anneal.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

# The hand-set Triton plan of the benchmarks.
TRITON = load_plan((Path(__file__).resolve().parents[1] / "bench/plans/triton.json").read_text()).ops


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def _prompts(vocab: int, n: int = 6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (int(L),), generator=g).tolist()
            for L in torch.randint(5, 200, (n,), generator=g)]


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3", "random:qwen3-0.6b"])
def test_graph_decode_equals_eager(cuda, model):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eager = Engine(EngineArgs(model=model, device="cuda", dtype="float32", num_kv_blocks=512,
                              max_model_len=512, plan=Plan(cuda_graph_batch_sizes=[])))
    prompts = _prompts(eager.config.vocab_size)
    ref = eager.generate(prompts, params)
    del eager
    graphed = Engine(EngineArgs(model=model, device="cuda", dtype="float32", num_kv_blocks=512,
                                max_model_len=512, plan=Plan(cuda_graph_batch_sizes=[1, 2, 4, 8])))
    assert graphed.runner.graphs, "no graphs captured"
    assert graphed.generate(prompts, params) == ref


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
def test_triton_plan_equals_reference(cuda, model):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    eng = Engine(EngineArgs(model=model, device="cuda", dtype="float32", num_kv_blocks=512,
                            max_model_len=512))
    prompts = _prompts(eng.config.vocab_size)
    ref = eng.generate(prompts, params)
    eng.apply_plan(Plan(ops=TRITON))
    got = eng.generate(prompts, params)
    agree = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / sum(len(r) for r in ref)
    assert agree > 0.98, agree


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
def test_the_cuda_default_plan_gives_the_reference_plans_tokens(cuda, model):
    """What `anneal serve` runs on a GPU when no plan is named (Triton ops, overlap scheduling):
    fp32, so the plans differ only by summation order."""
    from anneal.engine.plan import default_plan

    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    eng = Engine(EngineArgs(model=model, device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512))
    prompts = _prompts(eng.config.vocab_size)
    ref = eng.generate(prompts, params)
    eng.apply_plan(default_plan("cuda"))
    got = eng.generate(prompts, params)
    agree = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / sum(len(r) for r in ref)
    assert agree > 0.98, agree


def test_generate_without_a_plan_serves_the_cuda_default(cuda, capsys):
    from anneal.cli import main
    from anneal.engine.plan import default_plan

    assert main(["generate", "--model", "random:tiny", "--device", "cuda", "--prompt", "Hi", "--max-tokens", "8"]) == 0
    assert f"plan {default_plan('cuda').hash}" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
def test_token_graphs_give_the_eager_steps_tokens(cuda, model):
    """Prompt and mixed steps replaying token graphs (padded to the bucket's tokens and sequences)
    against the same plan with every such step eager: greedy and seeded-sampled tokens, with
    prompts of 5-200 tokens in steps of up to 256 tokens (chunks, mixed steps, every bucket)."""
    def run(token_sizes: list[int], temperature: float):
        plan = Plan.model_validate({"ops": TRITON, "cuda_graph_batch_sizes": [1, 2, 4, 8],
                                    "cuda_graph_token_sizes": token_sizes,
                                    "scheduler": {"max_num_batched_tokens": 256, "max_num_seqs": 8}})
        eng = Engine(EngineArgs(model=model, device="cuda", dtype="float32", num_kv_blocks=512,
                                max_model_len=512, plan=plan))
        kept = sorted(eng.runner.token_graphs)  # those no faster than a larger one are dropped
        assert set(kept) <= set(token_sizes) and kept[-1:] == token_sizes[-1:], kept
        eager_prompt_steps = []
        extend = eng.runner.extend
        eng.runner.extend = lambda items, decode_only=False, ids=None: (
            eager_prompt_steps.append(not decode_only), extend(items, decode_only, ids))[1]
        prompts = _prompts(eng.config.vocab_size, n=12)
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)
        out = eng.generate(prompts, params)
        return out, eng.runner.token_graph_replays, sum(eager_prompt_steps)

    for temperature in (0.0, 0.8):
        eager, none, eager_steps = run([], temperature)
        graphed, replays, left = run([32, 64, 128, 256], temperature)
        assert none == 0 and eager_steps >= 4, (none, eager_steps)
        assert replays == eager_steps and left == 0, (replays, eager_steps, left)  # every prompt step replayed
        agree = sum(a == b for r, g in zip(eager, graphed) for a, b in zip(r, g)) / sum(len(r) for r in eager)
        assert agree > 0.98, (temperature, agree)


def test_a_plan_whose_prompt_steps_wait_on_the_device_gets_no_token_graphs(cuda):
    """The reference attention_prefill reads its sequence lengths on the host: a graph cannot hold
    it. The apply fails naming it, before any capture, and the old plan keeps serving."""
    from anneal.engine.runner import NotCapturable

    eng = Engine(EngineArgs(model="random:tiny", device="cuda", num_kv_blocks=256, max_model_len=256,
                            plan=Plan.model_validate({"ops": TRITON})))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = eng.generate([[1, 2, 3, 4, 5]], params)
    old = eng.plan
    # the code that waits, by name and file (the message's hint names attention_prefill anyway)
    with pytest.raises(NotCapturable, match=r"attention_prefill \(\S*reference\.py:\d+\) waits on the device"):
        eng.apply_plan(Plan(cuda_graph_token_sizes=[64]))
    assert eng.plan == old and not eng.runner.token_graphs and eng.runner.graphs
    assert eng.generate([[1, 2, 3, 4, 5]], params) == before


AHEAD_RACE = """
import torch
from anneal.engine.llm import Engine, EngineArgs
eng = Engine(EngineArgs(model="random:tiny", device="cuda", num_kv_blocks=64, max_model_len=256))
torch.cuda.synchronize()
junk = [torch.full((64,), 10**12, dtype=torch.int64, device="cuda") for _ in range(2000)]
del junk  # freed small blocks full of out-of-range token ids, for the next small allocations
torch.cuda._sleep(400_000_000)  # the current stream busy (as after an engine start)
for run_pass in eng.runner.ahead_passes(eng.runner.model.ops, [2, 4]):
    run_pass()
torch.cuda.synchronize()
print("ok")
"""


def test_compile_ahead_passes_wait_for_what_is_queued_before_them(cuda):
    """Session 12's GPU suite: a compile-ahead pass ran on its own stream while its buffers' zeros
    were still queued behind other work, read garbage token ids and hit a device-side assert that
    failed every later test of the worker. Here the stream is held busy and the freed memory holds
    out-of-range ids; the pass must wait (a child process: an assert would poison this one)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", AHEAD_RACE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


AHEAD_FREE_RACE = """
import torch
from anneal.engine.llm import Engine, EngineArgs
eng = Engine(EngineArgs(model="random:tiny", device="cuda", num_kv_blocks=64, max_model_len=256))
torch.cuda.synchronize()
for _ in range(3):
    torch.cuda._sleep(400_000_000)  # the passes' stream waits behind this: their work is still queued
    passes = eng.runner.ahead_passes(eng.runner.model.ops, [1, 2, 4, 8])
    for run_pass in passes:
        run_pass()
    del passes  # their buffers go back to the allocator
    # the engine's next small tensors, full of out-of-range token ids
    junk = [torch.full((64,), 10**12, dtype=torch.int64, device="cuda") for _ in range(2000)]
    torch.cuda.synchronize()
    del junk
print("ok")
"""


def test_compile_ahead_buffers_outlive_the_work_queued_on_them(cuda):
    """Session 55: a compile-ahead pass's buffers, made on the engine's stream, went back to that
    stream's pool while the pass's kernels were still queued; the engine's next tensors took them,
    and the pass read the engine's data as token ids: a device-side assert that lost the fast-tier
    engine of an H100 compile. The passes' tensors come from their own stream's pool, and the last
    pass waits for their work (a child process: an assert would poison this one)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", AHEAD_FREE_RACE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_parallel_jit_compiles_a_new_plan_ahead_and_changes_no_output(cuda):
    """With parallel_jit, applying a plan whose kernel parameters this process never compiled
    reports the kernels the parallel pass compiled, and generates what the one-by-one path does."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    # Parameters no other test in this process uses, so their kernels are new here.
    ops = {**TRITON, "attention_decode": {"impl": "triton_splitk",
                                          "params": {"split_k": 4, "block_n": 32, "num_warps": 2}}}
    plan = Plan.model_validate({"ops": ops, "cuda_graph_batch_sizes": [1, 2, 4, 8]})
    args = dict(model="random:tiny", device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512)
    one_by_one = Engine(EngineArgs(**args))
    prompts = _prompts(one_by_one.config.vocab_size)
    one_by_one.apply_plan(plan)
    ref = one_by_one.generate(prompts, params)
    del one_by_one
    parallel = Engine(EngineArgs(**args, parallel_jit=True))
    other = {"split_k": 4, "block_n": 32, "num_warps": 4}  # differ again from the run above
    ops2 = {**ops, "attention_decode": {"impl": "triton_splitk", "params": other}}
    report = parallel.apply_plan(Plan.model_validate({"ops": ops2, "cuda_graph_batch_sizes": [1, 2, 4, 8]}))
    assert report.parallel_jit_kernels and report.parallel_jit_kernels >= 1, report
    assert report.parallel_jit_s <= report.warmup_s
    parallel.apply_plan(plan)
    assert parallel.generate(prompts, params) == ref


def test_graph_decode_benchmark_ranks_on_replay_events_with_the_wall_clock_beside(cuda):
    from anneal.engine.benchmark import BenchmarkRequest, run_benchmark

    eng = Engine(EngineArgs(model="random:tiny", device="cuda", max_model_len=512, num_kv_blocks=512,
                            plan=Plan(ops=TRITON, cuda_graph_batch_sizes=[1, 2, 4])))
    assert eng.runner.graphs, "no graphs captured"
    res = run_benchmark(eng, BenchmarkRequest(mode="decode", batch_size=2, context_len=300, steps=8, warmup=2))
    assert res.extra["timing"].startswith("graph replay") and len(res.samples_ms) == 8
    # The replay is part of each timed step, so it cannot take longer than the step's wall time.
    assert 0 < res.median_ms <= res.extra["wall_median_ms"]
    assert res.extra["host_median_ms"] >= 0


def test_compile_ahead_compiles_a_queued_plan_while_serving_and_changes_no_output(cuda):
    """A plan queued for compile-ahead gets its kernels compiled on the worker thread while the
    engine generates; applying it afterwards generates what a plain apply does."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ops = {**TRITON, "attention_decode": {"impl": "triton_splitk",  # parameters no other test uses
                                          "params": {"split_k": 8, "block_n": 32, "num_warps": 2}}}
    plan = Plan.model_validate({"ops": ops, "cuda_graph_batch_sizes": [1, 2, 4, 8]})
    args = dict(model="random:tiny", device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512)
    eng = Engine(EngineArgs(**args))
    prompts = _prompts(eng.config.vocab_size)
    before = eng.generate(prompts, params)
    assert eng.compile_ahead.submit([plan]) == 1
    assert eng.generate(prompts, params) == before  # serving on, undisturbed, while it compiles
    assert eng.compile_ahead.wait(300)
    done = eng.compile_ahead.status()["done"][plan.hash]
    assert "error" not in done and done["kernels"] >= 1, done
    eng.apply_plan(plan)
    got = eng.generate(prompts, params)
    del eng
    plain = Engine(EngineArgs(**args))
    plain.apply_plan(plan)
    assert got == plain.generate(prompts, params)


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "children"])
def test_applying_a_prepared_plan_compiles_no_kernel(cuda, processes, tmp_path, monkeypatch):
    """Compile-ahead is only worth its thread if the apply that follows finds every kernel: the
    view's launches must specialize exactly as the engine's. Fails listing what the apply compiled.
    With child processes, the engine process itself must only load what they wrote (a fresh Triton
    cache, so nothing else can have put it there)."""
    import triton
    from triton.runtime.jit import JITFunction

    # parameters no other test uses, and a different set per variant (a worker process keeps the
    # kernels an earlier variant compiled in memory)
    ops = {**TRITON, "attention_decode": {"impl": "triton_splitk",
                                          "params": {"split_k": 16, "block_n": 32, "num_warps": 2,
                                                     "num_stages": 3 if processes else 2}}}
    plan = Plan.model_validate({"ops": ops, "cuda_graph_batch_sizes": [1, 2, 4, 8, 16],
                                "cuda_graph_token_sizes": [64, 256]})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # before the children start
    eng = Engine(EngineArgs(model="random:tiny", device="cuda", num_kv_blocks=700, max_model_len=512,
                            compile_ahead_processes=processes))
    if processes:
        assert eng.compile_ahead.start_children(wait_s=180), eng.compile_ahead.status()["processes"]
    compiles: list[tuple[str, str]] = []
    loads: list[tuple[str, bool]] = []
    original = JITFunction._do_compile

    def recording(self, key, *args, **kwargs):
        import threading

        compiles.append((threading.current_thread().name, f"{self.__name__} {key}"))
        return original(self, key, *args, **kwargs)

    def listener(*, src, cache_hit, **_):
        loads.append((src.name, cache_hit))

    JITFunction._do_compile = recording
    triton.knobs.compilation.listener = listener
    try:
        assert eng.compile_ahead.submit([plan]) == 1
        assert eng.compile_ahead.wait(300)
        ahead = [k for t, k in compiles if t == "anneal-compile-ahead"]
        compiles.clear()
        eng.apply_plan(plan)
    finally:
        JITFunction._do_compile = original
        triton.knobs.compilation.listener = None
        eng.compile_ahead.close()
    done = eng.compile_ahead.status()["done"][plan.hash]
    assert "error" not in done, done
    assert ahead, "the compile-ahead pass compiled nothing"
    if processes:
        assert done["child_kernels"] > 0 and not done.get("child_errors") and "child_error" not in done, done
        assert loads and all(hit for _, hit in loads), \
            "the engine process compiled what the children should have: " + str([n for n, h in loads if not h])
    assert not compiles, "compiled again at apply:\n" + "\n".join(k for _, k in compiles) + \
        "\nahead:\n" + "\n".join(ahead)


@pytest.mark.parametrize("warm", [True, False], ids=["warmed", "not-warmed"])
def test_a_prompt_step_after_an_apply_compiles_no_kernel(cuda, warm):
    """Applying a plan warms what its prompt and mixed steps launch (engine/prompt_warmup.py), so
    requests of any prompt length and batch compile nothing afterwards. Session 13: a compiled plan
    lost 2.6 s of its first replay after the apply to such compiles. Without the warm-up the same
    requests compile kernels, so the test can fail. Parameters no other test uses, a set per
    variant: a kernel compiled earlier in this process is never compiled again."""
    from triton.runtime.jit import JITFunction

    stages = 3 if warm else 4
    gemv = {"impl": "triton_gemv_splitk", "params": {"block_n": 32, "block_k": 64, "num_warps": 2,
                                                     "num_stages": stages, "max_m": 64}}
    plan = Plan.model_validate({
        "ops": {**TRITON, "gate_up_proj": gemv, "o_proj": gemv, "down_proj": gemv, "qkv_proj": gemv,
                "attention_prefill": {"impl": "triton", "params": {"block_m": 32, "block_n": 32, "num_warps": 2,
                                                                   "num_stages": stages}}},
        "fusions": {"gate_up_silu": True, "norm_stats": True},
        "cuda_graph_batch_sizes": [1, 2, 4, 8],
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512}})
    eng = Engine(EngineArgs(model="random:tiny", device="cuda", num_kv_blocks=512, max_model_len=512,
                            warm_prompt_steps=warm))
    compiles: list[str] = []
    original = JITFunction._do_compile

    def recording(self, key, *args, **kwargs):
        compiles.append(f"{self.__name__} {key}")
        return original(self, key, *args, **kwargs)

    JITFunction._do_compile = recording
    try:
        report = eng.apply_plan(plan)
        at_apply = len(compiles)
        compiles.clear()
        g = torch.Generator().manual_seed(1)
        # prompt lengths 1-400 in batches of 1-16: prompt steps of 1 to 512 rows, mixed steps
        # (decode rows beside a chunk), block tables of 1 to 25 blocks
        for n in (1, 3, 16, 9):
            lengths = torch.randint(1, 400, (n,), generator=g).tolist()
            prompts = [torch.randint(0, eng.config.vocab_size, (L,), generator=g).tolist() for L in lengths]
            eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    finally:
        JITFunction._do_compile = original
    if warm:
        assert report.prompt_warmup_s is not None and at_apply > 0
        assert not compiles, "compiled while serving after the apply:\n" + "\n".join(compiles)
    else:
        assert report.prompt_warmup_s is None
        assert compiles, "nothing left to compile without the warm-up: this test cannot fail"


@pytest.mark.parametrize("graphs", [[1, 2, 4, 8], []], ids=["graphs", "eager"])
def test_overlap_scheduling_gives_the_plain_schedulers_tokens(cuda, graphs):
    """With ``scheduler.overlap`` the next step reads its ids from the device while the host is one
    step behind: the plain scheduler's tokens, and it really pipelines. Requests of one length
    finish together and must match exactly; staggered ones leave a stopped row in one more step,
    which can move the live rows to another graph bucket (other GEMM tiles), so they are held to
    the agreement the plan tests use (fp32, random weights)."""
    def run(overlap: bool, lengths):
        plan = Plan.model_validate({"ops": TRITON, "cuda_graph_batch_sizes": graphs,
                                    "scheduler": {"overlap": overlap}})
        eng = Engine(EngineArgs(model="random:tiny", device="cuda", dtype="float32", num_kv_blocks=512,
                                max_model_len=512, plan=plan))
        pipelined: list[bool] = []
        launch = eng.runner.launch_decode
        eng.runner.launch_decode = lambda seqs, ids=None: (pipelined.append(ids is not None), launch(seqs, ids))[1]
        prompts = _prompts(eng.config.vocab_size)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        out = eng.generate(prompts, params)
        assert not eng.has_unfinished_requests()
        eng.blocks.check_consistency()
        return out, sum(pipelined)

    same = [40] * 6
    plain, _ = run(False, same)
    overlapped, n = run(True, same)
    assert overlapped == plain
    assert n > 30, f"only {n} pipelined launches"
    staggered = [3, 9, 17, 30, 44, 60]
    plain, _ = run(False, staggered)
    overlapped, _ = run(True, staggered)
    assert [len(o) for o in overlapped] == staggered
    agree = sum(a == b for r, g in zip(plain, overlapped) for a, b in zip(r, g)) / sum(staggered)
    assert agree > 0.98, agree


def test_per_op_times_are_kernel_times_not_launch_times(cuda):
    """The kernel tuner and the cost model read the engine's per-op times. Eager events timed the
    host's launches (H200: the ops summed to 1.51-1.64 ms for a 0.575 ms graph step, add_rmsnorm
    0.24-0.27 ms); with the device asleep while the host queues each op, 0.622 ms."""
    from anneal.engine.benchmark import BenchmarkRequest, run_benchmark

    eng = Engine(EngineArgs(model="random:llama-3.1-8b", layers=2, device="cuda", dtype="bfloat16",
                            num_kv_blocks=2048, max_model_len=2048, plan=Plan(ops=TRITON)))
    res = run_benchmark(eng, BenchmarkRequest(mode="decode", batch_size=12, context_len=800, steps=20,
                                              per_op=True))
    per_op = res.per_op_ms
    print("graph step", res.median_ms, "ms; per op", per_op)
    assert per_op and res.extra["graph"]
    # 2 layers: the norms are a few µs each in a graph, not tens (launch-bound, they read 12x4096)
    assert per_op["add_rmsnorm"] < 0.03 and per_op["rmsnorm"] < 0.03
    assert 0.8 * res.median_ms < sum(per_op.values()) < 1.3 * res.median_ms
    # the fused lm_head + argmax, which only decode graphs run, is timed beside the eager steps:
    # one pass over the same 1 GB of weights as lm_head's
    fused = run_benchmark(eng, BenchmarkRequest(
        plan=Plan(ops=TRITON, fusions={"lm_head_argmax": True}), mode="decode", batch_size=12, context_len=800,
        steps=20, per_op=True)).per_op_ms
    print("fused head", fused["lm_head_argmax"], "ms; lm_head + argmax", fused["lm_head"] + fused["argmax"])
    assert 0.6 * fused["lm_head"] < fused["lm_head_argmax"] < 1.5 * (fused["lm_head"] + fused["argmax"])


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
def test_speculative_decoding_gives_the_plain_decodes_tokens(cuda, model):
    """The hand-set plan with its decode graphs, and the same plan checking n-gram drafts in eager
    varlen steps (Triton prefill attention over the paged cache): the drafts that hold must be the
    graph steps' tokens. fp32; the tiny models loop, so most drafts hold."""
    def run(speculative: int):
        plan = Plan.model_validate({"ops": TRITON, "cuda_graph_batch_sizes": [1, 2, 4, 8],
                                    "scheduler": {"speculative_tokens": speculative}})
        eng = Engine(EngineArgs(model=model, device="cuda", dtype="float32", num_kv_blocks=512,
                                max_model_len=512, plan=plan))
        prompts = _prompts(eng.config.vocab_size)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 17, 30, 44, 60)]
        out = eng.generate(prompts, params)
        eng.blocks.check_consistency()
        return out, eng.stats()

    plain, _ = run(0)
    spec, st = run(4)
    assert st.speculative_steps > 0 and st.accepted_tokens > 0
    agree = sum(a == b for r, g in zip(plain, spec) for a, b in zip(r, g)) / sum(len(r) for r in plain)
    assert [len(o) for o in spec] == [len(o) for o in plain] and agree > 0.98, agree


def test_room_for_weight_copies_leaves_out_a_graph_pools_cached_blocks(cuda):
    """A capture's freed intermediates stay cached in its private pool, where no ordinary
    allocation can reuse them: the room check must not lend them to a weight copy (sessions 49-50:
    bf12 packing ran an H100 out of memory with 10 GiB of them counted as free); once the graphs
    are dropped they are free again."""
    from anneal.engine.weights import free_memory

    dev, mib = torch.device("cuda"), 2**20
    x = torch.ones(1, device=dev)

    def step():
        big = torch.empty(512 * mib, dtype=torch.uint8, device=dev)  # an intermediate, freed inside
        big.fill_(1)
        return x + big[:1].float()

    step()  # its kernels loaded before anything is counted (module loading takes device memory too)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, _ = free_memory(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = step()
    during, pools = free_memory(dev)
    assert before - during >= 500 * mib, (before - during) / mib
    assert pools >= 500 * mib
    g.replay()
    assert y.item() == 2.0
    del g, y
    torch.cuda.empty_cache()
    after, pools = free_memory(dev)
    assert after - during >= 500 * mib
    assert pools < mib
