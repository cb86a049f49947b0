"""The model runner: the only part that touches the device.

It owns the KV cache and turns a scheduled batch into tensors, runs the model, and samples. Mixed
and prefill steps run eagerly through the varlen path. Decode-only steps on the GPU replay a CUDA
graph captured per batch-size bucket (padded up to the bucket; padding rows store nothing and
attend to nothing); graphs share one memory pool, and all inputs live in static buffers refilled
before each replay. Greedy decode takes the argmax inside the graph; sampled requests take the
graph's logits through the plan's `sample` op.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from anneal.engine.config import ModelConfig
from anneal.engine.context import AttnContext
from anneal.engine.models.transformer import Transformer
from anneal.engine.op_table import OpTable
from anneal.engine.parallel_jit import precompile
from anneal.engine.prompt_warmup import Layout, prompt_step_layouts
from anneal.engine.sequence import Sequence, TokenLogprobs
from anneal.engine.weights import Weights


class _LazyLogits:
    """Logits of a fused greedy graph, computed from its hidden states only when needed."""

    def __init__(self, model: Transformer, hidden: torch.Tensor):
        self.model, self.hidden = model, hidden

    def compute(self) -> torch.Tensor:
        return self.model.logits(self.hidden).float()


@dataclass
class StepResult:
    token_ids: list[int | None]  # per item: the sampled token, or None for a partial prefill chunk
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@contextlib.contextmanager
def collection_paused():
    """No cyclic garbage collection inside. In a graph capture, a collection can free an old
    engine's CUDA graphs, a call CUDA forbids while capturing: it invalidates the capture and leaves
    the device's RNG marked as capturing (seen on the H200: every later engine in the process
    failed). In timed steps, as timeit does: a collection lands in one step's host time at random.
    No full collection first: in a serving process (~280k objects) that alone took 120 ms, more than
    a candidate's 30-step benchmark (session 4)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        ops: OpTable,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
    ):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.model = Transformer(cfg, weights, ops, max_model_len)
        L = len(weights.layers)
        self.kv = torch.empty(
            L, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
            device=device, dtype=dtype,
        )
        self.kv.normal_()  # never zeros: stale reads must show up as wrong outputs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.replay_events: list | None = None  # (start, end) CUDA events per graph replay, when set
        self._graph_pool = None
        self._bufs: dict[str, torch.Tensor] = {}
        self.parallel_jit = False  # compile a plan's Triton kernels all at once before its warm-up
        self.warm_prompt_steps = False  # compile a plan's prompt-step kernels when it is applied (prompt_warmup.py)
        self.device_lock = threading.Lock()  # captures vs compile-ahead passes (engine/compile_ahead.py)

    @property
    def ops(self) -> OpTable:
        return self.model.ops

    # ---- inputs ---------------------------------------------------------------------------------

    @staticmethod
    def _block_table_rows(tables: list[list[int]], width: int) -> torch.Tensor:
        """``[len(tables), width]`` int32, each row a block table padded with 0. Built in numpy: a
        torch.tensor per row cost 0.72 ms of host time per decode step at batch 64, context 1024
        (2.6 ms at 8192) against 0.09 ms (0.54 ms) this way — time the GPU sat idle."""
        bt = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        return torch.from_numpy(bt)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _sampling_tensors(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        d = self.device
        return dict(
            temperature=torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=d),
            top_p=torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=d),
            top_k=torch.tensor([s.params.top_k for s in seqs], dtype=torch.int32, device=d),
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=d),
            steps=torch.tensor([len(s) for s in seqs], dtype=torch.int64, device=d),
        )

    # ---- running ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, items: list[tuple[Sequence, int]], decode_only: bool) -> StepResult:
        seqs = [s for s, _ in items]
        if decode_only and self.graphs and len(seqs) <= max(self.graphs):
            logits, greedy = self._replay(seqs)
        else:
            logits, greedy, sample_rows = self.extend(items, decode_only)
            seqs_sampling = [seqs[i] for i in sample_rows]
            return self._finish(items, sample_rows, seqs_sampling, logits, greedy)
        return self._finish(items, list(range(len(seqs))), seqs, logits, greedy)

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of ``seqs`` (greedy or sampled, no log-probs), left running on the
        device: returns its tokens as a device tensor of their own (the graph's output buffer
        belongs to the next replay). ``ids`` (on the device, one per row) stands in for the rows'
        last tokens when the host does not know them yet: overlap scheduling (engine/overlap.py)
        feeds a step's tokens to the next. The tokens are the ones ``run`` would pick."""
        if self.graphs and len(seqs) <= max(self.graphs):
            logits, greedy = self._replay(seqs, ids)
        else:
            logits, greedy, _ = self.extend([(s, 1) for s in seqs], decode_only=True, ids=ids)
        return self._pick(seqs, logits, greedy)[0].clone()

    def _pick(self, seqs: list[Sequence], logits, greedy, need_logits: bool = False):
        """The tokens of ``seqs`` (on the device) and their logits, materialized when sampling or
        ``need_logits`` asks: the graph's argmax (or one argmax kernel, no sort over the
        vocabulary) when every row is greedy, else every row through the sampler, seeded per
        sequence and step."""
        all_greedy = all(s.params.temperature == 0 for s in seqs)
        if isinstance(logits, _LazyLogits) and (not all_greedy or need_logits):
            logits = logits.compute()
        if all_greedy:
            return (greedy if greedy is not None else self.ops.argmax(logits)), logits
        return self.ops.sample(logits, **self._sampling_tensors(seqs)), logits

    def _finish(self, items, rows, seqs, logits, greedy) -> StepResult:
        out: list[int | None] = [None] * len(items)
        lps: list[TokenLogprobs | None] = [None] * len(items)
        if not rows:
            return StepResult(out, lps)
        want_lp = [s.params.logprobs is not None for s in seqs]
        tokens, logits = self._pick(seqs, logits, greedy, need_logits=any(want_lp))
        if any(want_lp):
            lp = torch.log_softmax(logits.float(), dim=-1)
            n_top = max(s.params.logprobs or 0 for s in seqs)
            chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()
            top_v, top_i = lp.topk(max(n_top, 1), dim=-1)
            top_v, top_i = top_v.tolist(), top_i.tolist()
        token_list = tokens.tolist()  # the one host sync of the step
        for j, r in enumerate(rows):
            out[r] = token_list[j]
            if want_lp[j]:
                n = seqs[j].params.logprobs or 0
                lps[r] = TokenLogprobs(
                    token_list[j], chosen[j], {top_i[j][t]: top_v[j][t] for t in range(n)}
                )
        return StepResult(out, lps)

    def extend(self, items: list[tuple[Sequence, int]], decode_only: bool = False,
               ids: torch.Tensor | None = None):
        """Varlen pass over each item's next ``n`` tokens; logits of the items that finish their chunk.
        ``ids``: the token ids on the device instead of the sequences' (decode steps only)."""
        host_ids, pos, slots, cu, sample_rows = self._rows(items)
        if ids is None:
            ids = torch.tensor(host_ids, dtype=torch.int64, device=self.device)
        logits = self._varlen_logits(self.model, self.kv, ids, pos, slots, cu,
                                     [s.num_computed_tokens + n for s, n in items],
                                     [s.block_table for s, _ in items], decode_only,
                                     [cu[i + 1] - 1 for i in sample_rows])
        return logits, None, sample_rows

    def _rows(self, items: list[tuple[Sequence, int]]):
        """The host side of an eager step over each item's next ``n`` tokens: token ids, positions,
        cache slots, cumulative row counts, and the items that finish their chunk (sampled)."""
        ids, pos, slots, cu, sample_rows = [], [], [], [0], []
        for i, (s, n) in enumerate(items):
            start = s.num_computed_tokens
            ids += s.token_ids[start : start + n]
            pos += range(start, start + n)
            slots += self._slots(s, start, start + n)
            cu.append(cu[-1] + n)
            if start + n == len(s):
                sample_rows.append(i)
        return ids, pos, slots, cu, sample_rows

    def _varlen_logits(self, model: Transformer, kv: torch.Tensor, ids: torch.Tensor, positions: list[int],
                       slots: list[int], cu: list[int], context_lens: list[int], tables: list[list[int]],
                       decode_only: bool, last_idx: list[int]) -> torch.Tensor | None:
        """An eager step: the varlen forward pass over rows ``cu[i]:cu[i+1]`` of each sequence, and
        the fp32 logits of the rows in ``last_idx`` (None when there are none)."""
        d = self.device
        # On the GPU a decode step's block table is as wide as a graph's: the attention kernel's
        # split count and Triton specialization then depend on the batch alone, as in a replay, and
        # the prompt-step warm-up covers every eager decode step (an H200 test found one it had
        # missed). The CPU compiles nothing, and its reference attention reads the whole width.
        wide = decode_only and d.type == "cuda"
        width = self.max_blocks_per_seq if wide else max(len(t) for t in tables)
        ctx = AttnContext(
            is_prefill=not decode_only,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=d),
            block_tables=self._block_table_rows(tables, width).to(d),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=d),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=d),
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
        )
        hidden = model.forward(ids, torch.tensor(positions, dtype=torch.int64, device=d), ctx, kv)
        if not last_idx:
            return None
        return model.logits(hidden[torch.tensor(last_idx, device=d)]).float()

    @torch.inference_mode()
    def decode_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step for ``seqs`` (graph when captured), no sampling."""
        if self.graphs and len(seqs) <= max(self.graphs):
            logits = self._replay(seqs)[0]
            return logits.compute() if isinstance(logits, _LazyLogits) else logits.to(torch.float32, copy=True)
        logits, _, _ = self.extend([(s, 1) for s in seqs], decode_only=True)
        return logits

    @torch.inference_mode()
    def prefill_all_logits(self, items: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Logits at every scheduled position (tests compare them to Hugging Face)."""
        ids, pos, slots, cu, _ = self._rows(items)
        return self._varlen_logits(self.model, self.kv, torch.tensor(ids, dtype=torch.int64, device=self.device),
                                   pos, slots, cu, [s.num_computed_tokens + n for s, n in items],
                                   [s.block_table for s, _ in items], False, list(range(cu[-1])))

    # ---- CUDA graphs ----------------------------------------------------------------------------

    def _static_buffers(self, max_bs: int) -> dict[str, torch.Tensor]:
        d = self.device
        return dict(
            ids=torch.zeros(max_bs, dtype=torch.int64, device=d),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=d),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=d),
            block_tables=torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=d),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=d),
        )

    def _decode_body(self, bs: int, model: Transformer | None = None, bufs: dict | None = None,
                     kv: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """One decode step of ``bs`` rows on the static buffers (what a graph captures); the
        compile-ahead pass runs it on a two-layer view with buffers and a cache of its own."""
        model, b, kv = model or self.model, bufs or self._bufs, self.kv if kv is None else kv
        ops = model.ops
        ctx = AttnContext(
            is_prefill=False,
            slot_mapping=b["slot_mapping"][:bs],
            block_tables=b["block_tables"][:bs],
            context_lens=b["context_lens"][:bs],
        )
        hidden = model.forward(b["ids"][:bs], b["positions"][:bs], ctx, kv)
        if ops.lm_head_argmax is not None:  # fused: the graph writes no logits
            return {"hidden": hidden, "logits": None, "greedy": ops.lm_head_argmax(hidden, model.w.lm_head)}
        # Logits stay in the model's dtype inside the graph (a [bs, vocab] fp32 copy cost 4 µs of a
        # 1 ms step): greedy needs none, sampling and logprobs convert outside the graph.
        logits = model.logits(hidden)
        return {"hidden": hidden, "logits": logits, "greedy": ops.argmax(logits)}

    def _view(self, ops: OpTable):
        """The first two layers (the first layer's path and every later one's) with ``ops``, their
        weights shared read-only, a small KV cache and a CUDA stream of their own: passes on it
        launch the kernels the engine's steps would, touching nothing the engine uses."""
        view = copy.copy(self.model)
        view.ops = ops
        view.w = dataclasses.replace(self.model.w, layers=self.model.w.layers[:2])
        view.num_layers = len(view.w.layers)
        L, _, nb, *rest = self.kv.shape
        # Per-layer cache strides do not depend on the block count; its divisibility by 16 is kept
        # in case a kernel takes the count as an argument (Triton specializes on it).
        kv = torch.empty(view.num_layers, 2, 16 if nb % 16 == 0 else 17, *rest,
                         device=self.device, dtype=self.dtype)
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            # Buffers made before this (and, right after an engine start, the weights) are still queued on
            # this thread's stream; the passes' stream does not wait for it by itself (PyTorch's
            # streams are non-blocking). Without this an H200 test read garbage token ids in the
            # embedding: a device-side assert that took the whole process down.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return view, kv, stream

    def ahead_passes(self, ops: OpTable, batch_sizes: list[int], max_seqs: int = 0) -> list:
        """Passes that launch every Triton kernel ``ops`` would launch in ``capture(batch_sizes,
        max_seqs)``: decode steps on static buffers and, when the engine warms prompt steps, those
        steps too, all on a two-layer view (``_view``). For ``parallel_jit.precompile`` on another
        thread."""
        bufs = self._static_buffers(max(batch_sizes)) if batch_sizes else {}
        view, kv, stream = self._view(ops)  # its stream waits for the buffers' zeros too

        def run(bs: int) -> None:
            with torch.inference_mode(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                self._decode_body(bs, view, bufs, kv)

        decode = [functools.partial(run, bs) for bs in sorted(batch_sizes, reverse=True)]
        if not (self.warm_prompt_steps and max_seqs):
            return decode
        return decode + self._prompt_passes(view, kv, stream, max_seqs, max(batch_sizes, default=0))

    def _prompt_passes(self, view: Transformer, kv: torch.Tensor, stream, max_seqs: int, largest_graph: int) -> list:
        """One pass per ``prompt_warmup.prompt_step_layouts`` step on the view: the forward pass, the
        sampled rows' logits and their argmax, as an eager step runs them."""
        bs, nb = self.block_size, kv.shape[2]

        def run(layout: Layout) -> None:
            pos, slots, cu, lens, tables = [], [], [0], [], []
            for n, ctx in layout.rows:
                table = [j % nb for j in range(-(-ctx // bs))]
                pos += range(ctx - n, ctx)
                slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
                cu.append(cu[-1] + n)
                lens.append(ctx)
                tables.append(table)
            with torch.inference_mode(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                ids = torch.zeros(cu[-1], dtype=torch.int64, device=self.device)
                logits = self._varlen_logits(view, kv, ids, pos, slots, cu, lens, tables, layout.decode_only,
                                             [c - 1 for c in cu[1:]])
                view.ops.argmax(logits)

        layouts = prompt_step_layouts(self.max_model_len, max_seqs, largest_graph)
        return [functools.partial(run, layout) for layout in layouts]

    def capture(self, batch_sizes: list[int], max_seqs: int = 0) -> dict[str, float | int]:
        """Warm the kernels up and capture one decode graph per bucket; when the engine warms
        prompt steps, first run the eager steps of ``prompt_warmup`` for a plan of ``max_seqs``
        sequences a step, so that none of its prompt steps compiles a kernel while serving.
        Returns timings (s)."""
        self.graphs.clear()
        self._graph_pool = None
        if self.device.type != "cuda":
            return {"warmup_s": 0.0, "capture_s": 0.0}
        with self.device_lock:  # a compile-ahead pass's torch ops wait until the capture is done
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prompt_passes = []
            if self.warm_prompt_steps and max_seqs:
                view, kv, stream = self._view(self.ops)
                prompt_passes = self._prompt_passes(view, kv, stream, max_seqs, max(batch_sizes, default=0))
            self._bufs = self._static_buffers(max(batch_sizes)) if batch_sizes else {}
            jit: dict = {}
            with torch.inference_mode():
                if self.parallel_jit:
                    jit = precompile([functools.partial(self._decode_body, bs) for bs in batch_sizes] + prompt_passes)
                for run_pass in prompt_passes:
                    run_pass()
                torch.cuda.synchronize()
                prompt = {"prompt_warmup_s": time.perf_counter() - t0} if prompt_passes else {}
                for bs in sorted(batch_sizes, reverse=True):  # warm-up compiles every kernel variant
                    self._decode_body(bs)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                with collection_paused():
                    self._capture_graphs(batch_sizes)
        torch.cuda.synchronize()
        timings = {"warmup_s": t1 - t0, "capture_s": time.perf_counter() - t1, **prompt}  # prompt's is part of warmup_s
        if jit:  # part of warmup_s: the parallel compile, and how many kernels it compiled
            timings.update(parallel_jit_s=jit["s"], parallel_jit_kernels=jit["kernels"])
        return timings

    def _capture_graphs(self, batch_sizes: list[int]) -> None:
        """One graph per bucket, largest first, sharing one memory pool."""
        for bs in sorted(batch_sizes, reverse=True):
            g = torch.cuda.CUDAGraph()
            # thread_local: the compile-ahead thread's Triton compiles may make CUDA calls
            # that a global-mode capture would count against this one.
            with torch.cuda.graph(g, pool=self._graph_pool, capture_error_mode="thread_local"):
                outputs = self._decode_body(bs)
            if self._graph_pool is None:
                self._graph_pool = g.pool()
            self.graphs[bs] = (g, outputs)

    def _replay(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(seqs)
        bs = min(b for b in self.graphs if b >= n)
        b = self._bufs
        positions = [len(s) - 1 for s in seqs]
        host = torch.full((4, bs), -1, dtype=torch.int64)
        host[0, :n] = torch.tensor([s.token_ids[-1] for s in seqs])
        host[1, :n] = torch.tensor(positions)
        host[2, :n] = torch.tensor([self._slots(s, p, p + 1)[0] for s, p in zip(seqs, positions)])
        host[3, :n] = torch.tensor([p + 1 for p in positions])
        host[0, n:] = 0
        host[1, n:] = 0
        host[3, n:] = 0
        dev = host.to(self.device, non_blocking=True)
        b["ids"][:bs].copy_(dev[0])
        if ids is not None:  # last tokens still on the device (overlap scheduling)
            b["ids"][:n].copy_(ids)
        b["positions"][:bs].copy_(dev[1])
        b["slot_mapping"][:bs].copy_(dev[2])
        b["context_lens"][:bs].copy_(dev[3].to(torch.int32))
        bt = self._block_table_rows([s.block_table for s in seqs], self.max_blocks_per_seq)
        b["block_tables"][:n].copy_(bt.to(self.device, non_blocking=True))
        b["block_tables"][n:bs].zero_()
        g, outputs = self.graphs[bs]
        if self.replay_events is not None:  # a benchmark wants the device time of the replay alone
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            self.replay_events.append((start, end))
        else:
            g.replay()
        logits = outputs["logits"]
        if logits is None:  # fused greedy graph: logits only when someone samples
            return _LazyLogits(self.model, outputs["hidden"][:n]), outputs["greedy"][:n]
        return logits[:n], outputs["greedy"][:n]  # model dtype; sampling converts
