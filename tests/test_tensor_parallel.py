"""An engine split across processes (tensor parallelism, gloo on the CPU) against the same engine
whole: the same tokens, plans swapped on every rank, verification's writes on every rank, and a
worker that dies made an error, not a hang."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from anneal.engine.benchmark import BenchmarkRequest, run_benchmark
from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.plan import COLLECTIVES, Plan
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.tensor_parallel import shard_config, shard_weights
from anneal.engine.sequence import Sequence
from anneal.engine.tp_workers import TensorParallelError, for_workers
from anneal.engine.verify import VerifyRequest, verify
from anneal.engine.weights import random_weights, resolve_config
from live_server import LiveServer

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 200, 300, 400, 500, 260, 300, 11, 12, 13, 14], [1, 2, 3, 4, 5, 6]]


def params(logprobs: int | None = 3) -> list[SamplingParams]:
    """Greedy and seeded sampled requests; one with log-probs (which overlap scheduling does not
    pipeline: ``logprobs=None`` leaves them out)."""
    return [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=14, seed=5, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=logprobs),
            SamplingParams(temperature=1.0, max_tokens=11, seed=9, ignore_eos=True)]


def engine(tp: int, model: str = "random:tiny", **knobs) -> Engine:
    plan = Plan(parallelism={"tensor_parallel": tp}, scheduler=knobs)
    return Engine(EngineArgs(model=model, device="cpu", block_size=4, num_kv_blocks=96, max_model_len=64,
                             plan=plan, seed=3))


def with_logprobs(eng: Engine, logprobs: int | None = 3) -> dict:
    """Each request's (token, logprob) per step, the prompts added at once."""
    for i, (p, sp) in enumerate(zip(PROMPTS, params(logprobs))):
        eng.add_request(f"r{i}", p, sp)
    out: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            lps = o.new_logprobs or [None] * len(o.new_token_ids)
            out[o.request_id] += [(t, lp and round(lp.logprob, 4)) for t, lp in zip(o.new_token_ids, lps)]
    return out


# (model, scheduler knobs at degree 2, the requests' log-probs). Degree 1 runs without overlap
# scheduling (the same tokens: tests/test_overlap.py), so a mistake both paths share still shows.
CASES = [
    ("random:tiny", {}, 3),
    ("random:tiny", {"max_num_batched_tokens": 16}, 3),  # chunked prompts: mixed varlen steps
    ("random:tiny-qwen3", {}, 3),  # q/k norms on each rank's heads
    ("random:tiny", {"overlap": True}, None),  # the next step fed the last one's tokens on every rank
]


def key(model: str, knobs: dict) -> tuple:
    return model, tuple(knobs.items())


@pytest.fixture(scope="module")
def whole():
    """Degree 1's answers, per case."""
    answers = {}
    for model, knobs, logprobs in CASES:
        eng = engine(1, model, **{k: v for k, v in knobs.items() if k != "overlap"})
        answers[key(model, knobs)] = with_logprobs(eng, logprobs)
        eng.close()
    return answers


@pytest.mark.parametrize("model, knobs, logprobs", CASES)
def test_degree_two_gives_degree_ones_tokens_and_logprobs(whole, model, knobs, logprobs):
    """Greedy and seeded sampled requests in one batch: each rank gathers the whole logits row, so
    every rank picks the same token; the log-probs match degree 1's (fp32, 4 places)."""
    eng = engine(2, model, **knobs)
    try:
        assert eng.runner.cfg.num_attention_heads * 2 == eng.config.num_attention_heads  # a shard
        assert with_logprobs(eng, logprobs) == whole[key(model, knobs)]
        # a prefix-cache hit at degree 2 computes the same tokens as the miss did
        again = eng.generate([PROMPTS[0] * 3, PROMPTS[0] * 3], SamplingParams(temperature=0, max_tokens=5))
        assert again[0] == again[1]
        assert eng.stats().prefix_hit_tokens > 0
        assert eng.stats().pipelined_steps >= 10 if knobs.get("overlap") else True
    finally:
        eng.close()


def test_plans_swap_on_every_rank_and_another_degree_is_refused(whole):
    eng = engine(2)
    try:
        report = eng.apply_plan(Plan(parallelism={"tensor_parallel": 2}, scheduler={"max_num_batched_tokens": 16}))
        assert report.plan_hash == eng.plan.hash
        assert with_logprobs(eng) == whole[key("random:tiny", {"max_num_batched_tokens": 16})]
        before = eng.plan
        for bad, why in ((Plan(), "tensor_parallel=1: this engine runs at tensor_parallel=2"),
                         (Plan(parallelism={"tensor_parallel": 2}, fusions={"linear_norm": True}),
                          "linear_norm adds the residual inside o_proj / down_proj, before the all-reduce")):
            for call in (eng.check_plan, eng.apply_plan):
                with pytest.raises(ValueError, match=why):
                    call(bad)
        assert eng.plan == before
        assert with_logprobs(eng) == whole[key("random:tiny", {"max_num_batched_tokens": 16})]
    finally:
        eng.close()


def test_verification_runs_on_every_rank():
    """Its reference logits, poisoned cache blocks and teacher-forced steps all split: a rank
    left out would hang the others in a collective, or pass checks it never ran."""
    eng = engine(2)
    try:
        report = verify(eng, VerifyRequest(plan=eng.plan, num_prompts=3, min_prompt_len=4, max_prompt_len=20,
                                           steps=6))
        assert report.passed, [c for c in report.checks if not c.passed]
        assert {c.name for c in report.checks} >= {"quality", "kv_contamination"}
    finally:
        eng.close()


def test_the_per_op_profile_times_the_collectives_apart_from_the_projections():
    """At degree 2 an all-reduce follows each o_proj / down_proj and a gather each lm_head; the
    per-op profile times them as ops of their own (``plan.COLLECTIVES``), so a projection's time is
    its kernel's and the cost model fits the link from what it measured. Under gloo on the CPU a
    collective is a host round trip (~1 ms), so a projection that still held one would show it."""
    spec = BenchmarkRequest(mode="decode", batch_size=3, context_len=20, steps=2, warmup=1, per_op=True)
    one = engine(1)
    try:
        whole = run_benchmark(one, spec).per_op_ms
    finally:
        one.close()
    two = engine(2)
    try:
        split = run_benchmark(two, spec).per_op_ms
        assert two.runner.model.ops.o_proj is not two.runner.plan_ops.o_proj  # the serving table is back
    finally:
        two.close()
    assert not set(COLLECTIVES) & set(whole) and set(COLLECTIVES) <= set(split)
    layers = len(two.runner.model.w.layers)
    # two all-reduces a layer and one gather, each slower than any projection call around it
    assert split["all_reduce"] / (2 * layers) > max(split["o_proj"], split["down_proj"]) / layers
    assert split["gather_logits"] > split["lm_head"]


@pytest.mark.parametrize("plan, why", [
    ({"tensor_parallel": 8}, "num_attention_heads=4, num_key_value_heads=2 of random:tiny do not split 8 ways"),
    ({"tensor_parallel": 3}, "do not split 3 ways"),
])
def test_a_degree_the_model_does_not_split_is_refused_before_any_worker_starts(plan, why):
    with pytest.raises(ValueError, match=why):
        Engine(EngineArgs(model="random:tiny", device="cpu", plan=Plan(parallelism=plan)))


def test_a_worker_that_dies_is_an_error_not_a_hang():
    eng = engine(2)
    try:
        worker = eng.workers.procs[0]
        worker.kill()
        worker.wait()
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
    finally:
        eng.close()


def test_close_stops_the_workers():
    eng = engine(2)
    procs = list(eng.workers.procs)
    eng.close()
    assert [p.poll() for p in procs] == [0]
    eng.close()  # again: nothing left to stop


def test_serve_at_degree_two_answers_the_openai_client():
    server = LiveServer("--tensor-parallel-size", "2", "--max-model-len", "256", "--num-kv-blocks", "128",
                        env={"ANNEAL_ADMIN_TOKEN": "tok"}).wait_ready()
    workers = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "anneal.engine.tp_workers"],
                             capture_output=True, text=True).stdout.split()
    try:
        assert len(workers) == 1  # rank 1
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        a = client.completions.create(model="random:tiny", prompt="Hello", max_tokens=8, temperature=0)
        b = client.completions.create(model="random:tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert a.usage.completion_tokens == 8 and a.choices[0].text == b.choices[0].text
        state = httpx.get(f"http://127.0.0.1:{server.admin_port}/admin/state",
                          headers={"Authorization": "Bearer tok"}, timeout=60).json()
        assert state["tensor_parallel"] == {"degree": 2, "devices": ["cpu", "cpu"]}
        assert state["plan"]["parallelism"]["tensor_parallel"] == 2
    finally:
        assert server.stop() == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)  # stopped with the server


def test_serve_refuses_a_degree_it_cannot_split():
    server = LiveServer("--tensor-parallel-size", "3")
    with pytest.raises(RuntimeError, match="do not split 3 ways"):
        server.wait_ready()


def test_the_shards_partition_every_split_weight():
    """Each projection's rows (q|k|v, gate|up) or columns (o, down) and lm_head's vocabulary, cut in
    two, put back together are the whole: nothing dropped, nothing read twice; the embedding whole."""
    cfg = resolve_config("random:tiny")
    w = random_weights(cfg, torch.device("cpu"), torch.float32, 2, seed=1)
    a, b = (shard_weights(w, cfg, 2, r) for r in (0, 1))
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for L, A, B in zip(w.layers, a.layers, b.layers):
        # each rank's qkv rows: its half of q, then of k, then of v
        for (lo, hi), (whole_lo, whole_hi) in zip(((0, q // 2), (q // 2, q // 2 + kv // 2), (q // 2 + kv // 2, None)),
                                                  ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
            assert torch.equal(torch.cat([A.qkv[lo:hi], B.qkv[lo:hi]]), L.qkv[whole_lo:whole_hi])
        assert torch.equal(torch.cat([A.gate_up[:inter // 2], B.gate_up[:inter // 2]]), L.gate_up[:inter])
        assert torch.equal(torch.cat([A.gate_up[inter // 2:], B.gate_up[inter // 2:]]), L.gate_up[inter:])
        assert torch.equal(torch.cat([A.o, B.o], dim=1), L.o)
        assert torch.equal(torch.cat([A.down, B.down], dim=1), L.down)
    assert torch.equal(torch.cat([a.lm_head, b.lm_head]), w.lm_head)  # tied: the embedding's rows
    assert a.embed is w.embed and b.embed is w.embed
    assert shard_config(cfg, 2).num_key_value_heads == 1 and shard_config(cfg, 2).vocab_size == 256


def test_workers_are_sent_what_a_step_reads_not_the_whole_history():
    """A decode step of a sequence 8192 tokens long sends its last token and its block table; the
    runner reads the tokens by absolute position, and a read of an unsent one fails loudly."""
    seq = Sequence("r", list(range(8192)), SamplingParams(temperature=0.5, top_k=7, logprobs=2), seed=11)
    seq.block_table, seq.num_computed_tokens = list(range(512)), 8191
    (item,) = pickle.loads(pickle.dumps(for_workers([(seq, 1)])))
    got, n = item
    assert n == 1 and len(got) == 8192 and got.token_ids[-1] == 8191 and got.token_ids[8191:8192] == [8191]
    assert list(got.block_table) == seq.block_table and got.num_computed_tokens == 8191 and got.seed == 11
    assert (got.params.temperature, got.params.top_k, got.params.logprobs) == (0.5, 7, 2)
    assert len(pickle.dumps(for_workers([(seq, 1)]))) < 3000  # the whole sequence pickles to ~40 KB
    with pytest.raises(IndexError, match="not sent"):
        got.token_ids[100:101]
    prompt = Sequence("p", list(range(40)), SamplingParams(), seed=0)
    prompt.num_computed_tokens = 16  # a chunked prompt: positions 16.. still to compute
    sent = for_workers(prompt)
    assert sent.token_ids[16:40] == list(range(16, 40)) and len(sent) == 40


@pytest.mark.parametrize("busy, code", [(True, 70), (False, 0)])
def test_a_worker_that_dies_while_rank_0_waits_on_it_ends_the_process(busy, code):
    """Under NCCL a collective whose peer died waits for the 10-minute timeout: rank 0 exits
    instead when it stays busy (starting, or in a mirrored call) past the grace period. Idle, it
    lives on, and its next call raises TensorParallelError (above)."""
    snippet = (
        "import subprocess, sys, time\n"
        "from anneal.engine.tp_workers import Workers\n"
        "w = Workers.__new__(Workers)\n"
        "w.conns, w.procs, w._closing = [], [subprocess.Popen([sys.executable, '-c', 'pass'])], False\n"
        f"w.watch(lambda: {busy}, grace_s=0.5)\n"
        "time.sleep(4)\n")
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    assert "tensor-parallel rank 1 exited with code 0" in r.stderr
    assert ("will never join: exiting" in r.stderr) == busy


def test_a_worker_that_cannot_start_is_named_at_once(monkeypatch):
    """A worker process that exits before it connects (a broken environment) fails the start with
    its exit code, without waiting out the connect timeout, and the engine leaves nothing behind."""
    from anneal.engine import tp_workers

    monkeypatch.setattr(tp_workers.Workers, "COMMAND", [sys.executable, "-c", "import sys; sys.exit(3)"])
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited with code 3 before it connected"):
        engine(2)
    assert time.monotonic() - t0 < 30
    assert not torch.distributed.is_initialized()


def test_a_degree_above_the_visible_gpus_is_refused_with_both_numbers():
    from anneal.engine.plan import check_parallelism

    with pytest.raises(ValueError, match="tensor_parallel=4 needs 4 GPUs, one a rank, .* 2 visible there"):
        check_parallelism(Plan(parallelism={"tensor_parallel": 4}), devices=2)
    check_parallelism(Plan(parallelism={"tensor_parallel": 2}), devices=2)
