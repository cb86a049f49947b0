"""The model runner: the only part that touches the device.

It owns the KV cache and turns a scheduled batch into tensors, runs the model, and samples. Mixed
and prefill steps run through the varlen path: eagerly, or on the GPU as a CUDA graph per token
bucket when the plan asks (padded to the bucket's tokens and sequences). Decode-only steps on the
GPU replay a CUDA graph captured per batch-size bucket. Padding rows store nothing and attend to
nothing; graphs share one memory pool, and all inputs live in static buffers refilled before each
replay. Greedy steps take the argmax inside the graph; sampled requests take the graph's logits
through the plan's `sample` op.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from anneal.engine.config import ModelConfig
from anneal.engine.context import AttnContext
from anneal.engine.gc_control import collection_paused
from anneal.engine.models.transformer import Transformer
from anneal.engine.op_table import OpTable
from anneal.engine.parallel_jit import precompile
from anneal.engine.plan import token_graph_seqs, token_graph_size
from anneal.engine.prompt_warmup import Layout, prompt_step_layouts
from anneal.engine.sequence import Sequence, TokenLogprobs
from anneal.engine.tensor_parallel import TensorParallel
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


def no_faster_than_a_larger(ms: dict[int, float]) -> list[int]:
    """The sizes whose time (``ms``, by size) is not below that of some larger size."""
    out, best = [], float("inf")
    for size in sorted(ms, reverse=True):
        if ms[size] >= best:
            out.append(size)
        best = min(best, ms[size])
    return sorted(out)


class NotCapturable(ValueError):
    """A plan's step waits on the device (a host sync), so no CUDA graph can hold it."""


@contextlib.contextmanager
def capturable(what: str):
    """Inside, an op that makes the host wait on the device raises ``NotCapturable`` naming the
    code that did, before a capture would fail on it (a failed capture can leave the device's RNG
    marked as capturing: see ``collection_paused``). The reference ``attention_prefill`` reads its
    sequence lengths on the host, so a plan with it cannot graph its prompt steps. The mode is
    process-wide: it is on only while ``capture`` holds ``device_lock``, which compile-ahead's
    passes wait for."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as e:
        if "synchronizing" not in str(e):
            raise
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
        where = f"{frames[-1].name} ({frames[-1].filename}:{frames[-1].lineno})" if frames else "an op"
        raise NotCapturable(f"the CUDA graph of {what} cannot be captured: {where} waits on the device "
                            f"({e}). Use ops that do not (a Triton attention_prefill), or no "
                            "cuda_graph_token_sizes") from e
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def mirrored(local: tuple[str, ...] = ()):
    """A runner call that every tensor-parallel rank makes: on rank 0 (``workers`` set) it is sent to
    the workers first (tp_workers.py), unless it runs inside another mirrored call, which they make
    themselves. ``local``: keyword arguments only rank 0 has (its already-built op table)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kw):
            if self.workers is None or self._mirroring:
                return fn(self, *args, **kw)
            self.workers.send(fn.__name__, args, {k: v for k, v in kw.items() if k not in local})
            self._mirroring = True
            try:
                return fn(self, *args, **kw)
            finally:
                self._mirroring = False
        return call
    return wrap


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
        tp: TensorParallel | None = None,
    ):
        """``cfg`` and ``weights``: this rank's shard at tensor-parallel degree > 1 (``tp``)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.tp = tp or TensorParallel(0, 1)
        self.workers = None  # rank 0 of a tensor-parallel engine: the other ranks (tp_workers.Workers)
        self._mirroring = False
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.plan_ops = ops  # as the plan built them; the model runs them with this rank's collectives
        self.model = Transformer(cfg, weights, self.tp.wrap(ops), max_model_len)
        L = len(weights.layers)
        self.kv = torch.empty(
            L, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
            device=device, dtype=dtype,
        )
        self.kv.normal_()  # never zeros: stale reads must show up as wrong outputs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict]] = {}  # decode steps, by batch size
        self.token_graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict]] = {}  # prompt/mixed steps, by tokens
        self.token_graph_replays = 0
        self.replay_events: list | None = None  # (start, end) CUDA events per graph replay, when set
        self._graph_pool = None
        self._bufs: dict[str, torch.Tensor] = {}
        self._token_bufs: dict[str, torch.Tensor] = {}
        self._token_max_seqs = 0  # the plan's max_num_seqs, when it captures token graphs
        self.parallel_jit = False  # compile a plan's Triton kernels all at once before its warm-up
        self.warm_prompt_steps = False  # compile a plan's prompt-step kernels when it is applied (prompt_warmup.py)
        self.device_lock = threading.Lock()  # captures vs compile-ahead passes (engine/compile_ahead.py)
        self._launched: torch.Tensor | None = None  # the last launch_decode's tokens (overlap scheduling)
        self._stashed: tuple[dict, dict] = ({}, {})  # the graphs put aside by eager()

    @property
    def ops(self) -> OpTable:
        return self.model.ops

    @mirrored(local=("ops",))
    def use_plan(self, plan, ops: OpTable | None = None) -> None:
        """Run ``plan``'s ops from now on (``ops``: already built from it, on rank 0). Captures
        nothing: ``capture`` follows."""
        if ops is None:
            from anneal.engine.llm import register_plan_kernels

            register_plan_kernels(plan)
            ops = OpTable.from_plan(plan, self.device.type)
        self.plan_ops = ops
        self.model.ops = self.tp.wrap(ops)

    @mirrored()
    def mirror(self, fn, *args, **kw):
        """``fn(runner, *args, **kw)`` on every rank (``fn`` a module-level function: verification's
        reference logits, its cache poisoning); rank 0's result."""
        return fn(self, *args, **kw)

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

    @mirrored()
    @torch.inference_mode()
    def run(self, items: list[tuple[Sequence, int]], decode_only: bool) -> StepResult:
        seqs = [s for s, _ in items]
        if decode_only and self.graphs and len(seqs) <= max(self.graphs):
            logits, greedy = self._replay(seqs)
        else:
            tokens = None if decode_only else self.token_bucket(items)
            if tokens is not None:
                logits, greedy, sample_rows = self._replay_tokens(items, tokens)
            else:
                logits, greedy, sample_rows = self.extend(items, decode_only)
            seqs_sampling = [seqs[i] for i in sample_rows]
            return self._finish(items, sample_rows, seqs_sampling, logits, greedy)
        return self._finish(items, list(range(len(seqs))), seqs, logits, greedy)

    @mirrored()
    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], prev_rows: list[int] | None = None) -> torch.Tensor:
        """One decode step of ``seqs`` (greedy or sampled, no log-probs), left running on the
        device: returns its tokens as a device tensor of their own (the graph's output buffer
        belongs to the next replay). ``prev_rows``: each row's row in the previous launch, whose
        tokens (still on the device) stand in for the rows' last tokens when the host does not know
        them yet: overlap scheduling (engine/overlap.py) feeds a step's tokens to the next. The
        tokens are the ones ``run`` would pick."""
        ids = None
        if prev_rows is not None:
            last = self._launched
            ids = last if prev_rows == list(range(len(last))) else \
                last[torch.tensor(prev_rows, device=last.device)]
        if self.graphs and len(seqs) <= max(self.graphs):
            logits, greedy = self._replay(seqs, ids)
        else:
            logits, greedy, _ = self.extend([(s, 1) for s in seqs], decode_only=True, ids=ids)
        self._launched = self._pick(seqs, logits, greedy)[0].clone()
        return self._launched

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

    @mirrored()
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

    @mirrored()
    @torch.inference_mode()
    def decode_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step for ``seqs`` (graph when captured), no sampling."""
        if self.graphs and len(seqs) <= max(self.graphs):
            logits = self._replay(seqs)[0]
            return logits.compute() if isinstance(logits, _LazyLogits) else logits.to(torch.float32, copy=True)
        logits, _, _ = self.extend([(s, 1) for s in seqs], decode_only=True)
        return logits

    @mirrored()
    @torch.inference_mode()
    def prefill_all_logits(self, items: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Logits at every scheduled position (tests compare them to Hugging Face)."""
        ids, pos, slots, cu, _ = self._rows(items)
        return self._varlen_logits(self.model, self.kv, torch.tensor(ids, dtype=torch.int64, device=self.device),
                                   pos, slots, cu, [s.num_computed_tokens + n for s, n in items],
                                   [s.block_table for s, _ in items], False, list(range(cu[-1])))

    @mirrored()
    @torch.inference_mode()
    def verify_drafts(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Speculative decoding's check (engine/speculation.py): each item's next ``n`` tokens (its last
        token, then its drafts) in one eager varlen pass, and the greedy token after every one of them."""
        tokens = self.ops.argmax(self.prefill_all_logits(items)).tolist()  # the step's one host sync
        ends = itertools.accumulate(n for _, n in items)
        return [tokens[end - n:end] for (_, n), end in zip(items, ends)]

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
        ctx = AttnContext(
            is_prefill=False,
            slot_mapping=b["slot_mapping"][:bs],
            block_tables=b["block_tables"][:bs],
            context_lens=b["context_lens"][:bs],
        )
        return self._heads(model, model.forward(b["ids"][:bs], b["positions"][:bs], ctx, kv))

    @staticmethod
    def _heads(model: Transformer, hidden: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """A graph's outputs from the hidden states of its sampled rows: the greedy tokens, and the
        logits unless the fused lm_head + argmax writes none."""
        ops = model.ops
        if ops.lm_head_argmax is not None:  # fused: the graph writes no logits
            return {"hidden": hidden, "logits": None, "greedy": ops.lm_head_argmax(hidden, model.w.lm_head)}
        # Logits stay in the model's dtype inside the graph (a [bs, vocab] fp32 copy cost 4 µs of a
        # 1 ms step): greedy needs none, sampling and logprobs convert outside the graph.
        logits = model.logits(hidden)
        return {"hidden": hidden, "logits": logits, "greedy": ops.argmax(logits)}

    # ---- CUDA graphs of prompt and mixed steps ----------------------------------------------------

    def _token_buffers(self, max_tokens: int, max_seqs: int) -> dict[str, torch.Tensor]:
        """Static inputs of the token graphs, in three tensors so a replay fills them in three copies:
        per token (ids, positions, cache slots), per sequence (context lengths, the cumulative query
        rows, the sampled rows) and the block tables, as wide as a decode graph's."""
        d = self.device
        rows = torch.zeros(3, max_tokens, dtype=torch.int64, device=d)
        rows[2].fill_(-1)
        per_seq = torch.zeros(3, max_seqs + 1, dtype=torch.int32, device=d)
        tables = torch.zeros(max_seqs, self.max_blocks_per_seq, dtype=torch.int32, device=d)
        return dict(rows=rows, per_seq=per_seq, block_tables=tables)

    def _token_body(self, tokens: int, seqs: int, model: Transformer | None = None, bufs: dict | None = None,
                    kv: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """One prompt or mixed step of ``tokens`` rows from ``seqs`` sequences on the static buffers
        (what a token graph captures). Sequences past the step's own have no rows (their programs
        return at once); rows past its tokens belong to no sequence and store nothing. The attention
        grid is sized for a sequence of all ``tokens`` rows, so no host value of the step sizes it."""
        model, b, kv = model or self.model, bufs or self._token_bufs, self.kv if kv is None else kv
        rows, per_seq = b["rows"], b["per_seq"]
        ctx = AttnContext(
            is_prefill=True,
            slot_mapping=rows[2, :tokens],
            block_tables=b["block_tables"][:seqs],
            context_lens=per_seq[0, :seqs],
            cu_seqlens_q=per_seq[1, : seqs + 1],
            max_seqlen_q=tokens,
        )
        hidden = model.forward(rows[0, :tokens], rows[1, :tokens], ctx, kv)
        return self._heads(model, hidden.index_select(0, per_seq[2, :seqs]))

    def _token_seqs(self, tokens: int) -> int:
        return token_graph_seqs(tokens, self._token_max_seqs)

    def token_bucket(self, items: list[tuple[Sequence, int]]) -> int | None:
        """The token graph a step of ``items`` replays; None for an eager step."""
        return token_graph_size(list(self.token_graphs), sum(k for _, k in items), len(items), self._token_max_seqs)

    def _fill_token_buffers(self, items: list[tuple[Sequence, int]], tokens: int, seqs: int) -> list[int]:
        """Write a step's inputs into the token buffers, padded to ``tokens`` rows and ``seqs``
        sequences; returns the items whose logits the step samples."""
        ids, pos, slots, cu, sample_rows = self._rows(items)
        n, k, b = cu[-1], len(items), self._token_bufs
        rows = np.zeros((3, tokens), dtype=np.int64)
        rows[0, :n], rows[1, :n], rows[2, n:] = ids, pos, -1
        rows[2, :n] = slots
        per_seq = np.zeros((3, seqs + 1), dtype=np.int32)
        per_seq[0, :k] = [s.num_computed_tokens + m for s, m in items]
        per_seq[1, : k + 1], per_seq[1, k + 1 :] = cu, n
        per_seq[2, : len(sample_rows)] = [cu[i + 1] - 1 for i in sample_rows]
        b["rows"][:, :tokens].copy_(torch.from_numpy(rows), non_blocking=True)
        b["per_seq"][:, : seqs + 1].copy_(torch.from_numpy(per_seq), non_blocking=True)
        tables = self._block_table_rows([s.block_table for s, _ in items] + [[]] * (seqs - k),
                                        self.max_blocks_per_seq)
        b["block_tables"][:seqs].copy_(tables, non_blocking=True)
        return sample_rows

    def _replay_tokens(self, items: list[tuple[Sequence, int]], tokens: int):
        g, outputs = self.token_graphs[tokens]
        sample_rows = self._fill_token_buffers(items, tokens, self._token_seqs(tokens))
        self._launch_graph(g)
        self.token_graph_replays += 1
        return self._graph_outputs(outputs, len(sample_rows)) + (sample_rows,)

    def _graph_outputs(self, outputs: dict, n: int):
        """The first ``n`` rows of a graph's logits (lazy when the graph wrote none) and tokens."""
        logits = outputs["logits"]
        if logits is None:  # fused greedy graph: logits only when someone samples
            return _LazyLogits(self.model, outputs["hidden"][:n]), outputs["greedy"][:n]
        return logits[:n], outputs["greedy"][:n]  # model dtype; sampling converts

    def _launch_graph(self, g: torch.cuda.CUDAGraph) -> None:
        if self.replay_events is not None:  # a benchmark wants the device time of the replay alone
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            self.replay_events.append((start, end))
        else:
            g.replay()

    def all_graph_outputs(self) -> list[dict]:
        return [outputs for _g, outputs in [*self.graphs.values(), *self.token_graphs.values()]]

    @contextlib.contextmanager
    def eager(self):
        """Every step eager inside (per-op timing); the graphs come back after."""
        self._stash_graphs()
        try:
            yield
        finally:
            self._restore_graphs()

    @mirrored()
    def _stash_graphs(self) -> None:
        self._stashed = (dict(self.graphs), dict(self.token_graphs))
        self.graphs.clear()
        self.token_graphs.clear()

    @mirrored()
    def _restore_graphs(self) -> None:
        self.graphs.update(self._stashed[0])
        self.token_graphs.update(self._stashed[1])
        self._stashed = ({}, {})

    def _view(self, ops: OpTable):
        """The first two layers (the first layer's path and every later one's) with ``ops``, their
        weights shared read-only, a small KV cache and a CUDA stream of their own: passes on it
        launch the kernels the engine's steps would, touching nothing the engine uses."""
        view = copy.copy(self.model)
        view.ops = ops
        view.w = dataclasses.replace(self.model.w, layers=self.model.w.layers[:2])
        view.num_layers = len(view.w.layers)
        L, _, nb, *rest = self.kv.shape
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            # Right after an engine start the weights are still queued on this thread's stream; the
            # passes' stream does not wait for it by itself (PyTorch's streams are non-blocking).
            # Without this an H200 test read garbage token ids in the embedding: a device-side
            # assert that took the whole process down.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on(stream):
            # Per-layer cache strides do not depend on the block count; its divisibility by 16 is kept
            # in case a kernel takes the count as an argument (Triton specializes on it).
            kv = torch.empty(view.num_layers, 2, 16 if nb % 16 == 0 else 17, *rest,
                             device=self.device, dtype=self.dtype)
        return view, kv, stream

    @staticmethod
    def _on(stream):
        """Allocate (and run) on ``stream``: memory a side stream's passes use must come from that
        stream's pool. Made on the engine's stream, it went back to that pool when the passes' Python
        returned, with their kernels still queued, and the engine's next tensors got it while they
        ran: session 55's compile-ahead read the engine's data as token ids in the view's embedding,
        a device-side assert that lost the whole process (and, most likely, session 6's overrun)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def ahead_passes(self, ops: OpTable, batch_sizes: list[int], max_seqs: int = 0,
                     token_sizes: list[int] = ()) -> list:
        """Passes that launch every Triton kernel ``ops`` would launch in ``capture(batch_sizes,
        max_seqs, token_sizes)``: decode and token-graph steps on static buffers and, when the engine
        warms prompt steps, those steps too, all on a two-layer view (``_view``). For
        ``parallel_jit.precompile`` on another thread."""
        token_sizes = sorted(token_sizes) if max_seqs else []
        view, kv, stream = self._view(ops)
        with self._on(stream):  # the passes' inputs come from their stream's pool too (``_on``)
            bufs = self._static_buffers(max(batch_sizes)) if batch_sizes else {}
            tbufs = (self._token_buffers(token_sizes[-1], token_graph_seqs(token_sizes[-1], max_seqs))
                     if token_sizes else {})

        def run(body, buffers: dict, *args) -> None:
            with torch.inference_mode(), self._on(stream):
                body(*args, model=view, bufs=buffers, kv=kv)

        passes = [functools.partial(run, self._token_body, tbufs, t, token_graph_seqs(t, max_seqs))
                  for t in reversed(token_sizes)]
        passes += [functools.partial(run, self._decode_body, bufs, bs) for bs in sorted(batch_sizes, reverse=True)]
        if self.warm_prompt_steps and max_seqs:
            passes += self._prompt_passes(view, kv, stream, max_seqs, max(batch_sizes, default=0))
        if stream is not None:
            # last: the passes' work done before their tensors go back (and before the lock that
            # keeps them from captures is let go)
            passes.append(stream.synchronize)
        return passes

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
            with torch.inference_mode(), self._on(stream):
                ids = torch.zeros(cu[-1], dtype=torch.int64, device=self.device)
                logits = self._varlen_logits(view, kv, ids, pos, slots, cu, lens, tables, layout.decode_only,
                                             [c - 1 for c in cu[1:]])
                view.ops.argmax(logits)

        layouts = prompt_step_layouts(self.max_model_len, max_seqs, largest_graph)
        return [functools.partial(run, layout) for layout in layouts]

    @mirrored()
    def drop_graphs(self) -> None:
        """Forget every captured graph (and any put aside by ``eager``) and give their memory pool
        back: what its blocks hold free only a capture into it can reuse (10 GiB in session 50's
        out-of-memory error), and a plan's weight copies, made between the old plan's graphs and the
        new one's capture, may need that room (engine/llm.py ``apply_plan``)."""
        self.graphs.clear()
        self.token_graphs.clear()
        self._stashed = ({}, {})
        self._graph_pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @mirrored()
    def capture(self, batch_sizes: list[int], max_seqs: int = 0, token_sizes: list[int] = ()) -> dict[str, float | int]:
        """Warm the kernels up and capture one decode graph per batch bucket and, for a plan of
        ``max_seqs`` sequences a step, one prompt/mixed-step graph per token bucket; when the engine
        warms prompt steps, first run the eager steps of ``prompt_warmup``, so that none of its
        prompt steps compiles a kernel while serving. Returns timings (s)."""
        self.drop_graphs()
        if self.device.type != "cuda":
            return {"warmup_s": 0.0, "capture_s": 0.0}
        token_sizes = sorted(token_sizes) if max_seqs else []
        with self.device_lock:  # a compile-ahead pass's torch ops wait until the capture is done
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prompt_passes = []
            if self.warm_prompt_steps and max_seqs:
                view, kv, stream = self._view(self.ops)
                prompt_passes = self._prompt_passes(view, kv, stream, max_seqs, max(batch_sizes, default=0))
            self._bufs = self._static_buffers(max(batch_sizes)) if batch_sizes else {}
            self._token_max_seqs = max_seqs if token_sizes else 0
            self._token_bufs = (self._token_buffers(token_sizes[-1], self._token_seqs(token_sizes[-1]))
                                if token_sizes else {})
            bodies = self._graph_bodies(batch_sizes, token_sizes)
            jit: dict = {}
            with torch.inference_mode():
                if self.parallel_jit:
                    jit = precompile([body for _, _, body in bodies] + prompt_passes)
                for run_pass in prompt_passes:
                    run_pass()
                torch.cuda.synchronize()
                prompt = {"prompt_warmup_s": time.perf_counter() - t0} if prompt_passes else {}
                for graphs, key, body in bodies:  # warm-up compiles every kernel variant
                    with capturable(f"{'token' if graphs is self.token_graphs else 'batch'} size {key}"):
                        body()
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                with collection_paused():
                    self._capture_graphs(bodies)
                dropped = self._drop_slower_token_graphs()
        torch.cuda.synchronize()
        timings = {"warmup_s": t1 - t0, "capture_s": time.perf_counter() - t1, **prompt}  # prompt's is part of warmup_s
        if token_sizes:  # part of capture_s: the token graphs' replays timed, and those no faster than a larger one
            timings.update(token_graph_sizes=sorted(self.token_graphs), token_graph_sizes_dropped=dropped)
        if jit:  # part of warmup_s: the parallel compile, and how many kernels it compiled
            timings.update(parallel_jit_s=jit["s"], parallel_jit_kernels=jit["kernels"])
        return timings

    def _drop_slower_token_graphs(self, reps: int = 3) -> list[int]:
        """Drop each token graph whose replay is no faster than a larger one's: the steps it would
        hold then run padded to that one at no cost, and in no slower a graph. Why: cuBLAS picks
        GEMM kernels by row count, not monotonically; on the H200 the 8B's gate_up took 270 µs at
        448 rows against 149 at 416 and 161 at 480 (session 15), so a 448-token graph ran 5 ms a
        step slower than the 480 one. The replays run on the buffers as the capture left them: no
        sequence, nothing stored. Returns the dropped sizes."""
        if len(self.token_graphs) < 2:
            return []
        ms: dict[int, float] = {}
        for size, (g, _) in self.token_graphs.items():
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            g.replay()  # the first replay uploads the graph
            for start, end in events:
                start.record()
                g.replay()
                end.record()
            torch.cuda.synchronize()
            ms[size] = min(start.elapsed_time(end) for start, end in events)
        dropped = self.tp.rank0s(no_faster_than_a_larger(ms))  # every rank replays the same graphs
        for size in dropped:
            del self.token_graphs[size]
        return dropped

    def _graph_bodies(self, batch_sizes: list[int], token_sizes: list[int]) -> list:
        """``(graph dict, key, body)`` per graph to capture: decode graphs, then token graphs, each
        largest first (a larger capture's freed blocks serve the smaller ones in the shared pool).
        Decode first so that a plan's decode graphs get the pool as they would without token graphs;
        session 16 found no effect of the order on the decode wall beyond the replays' ±4% round
        noise (bench/NOTES.md)."""
        decode = [(self.graphs, bs, functools.partial(self._decode_body, bs))
                  for bs in sorted(batch_sizes, reverse=True)]
        return decode + [(self.token_graphs, t, functools.partial(self._token_body, t, self._token_seqs(t)))
                         for t in sorted(token_sizes, reverse=True)]

    def _capture_graphs(self, bodies: list) -> None:
        """One graph per body, in order, sharing one memory pool."""
        for graphs, key, body in bodies:
            g = torch.cuda.CUDAGraph()
            # thread_local: the compile-ahead thread's Triton compiles may make CUDA calls
            # that a global-mode capture would count against this one.
            with torch.cuda.graph(g, pool=self._graph_pool, capture_error_mode="thread_local"):
                outputs = body()
            if self._graph_pool is None:
                self._graph_pool = g.pool()
            graphs[key] = (g, outputs)

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
        self._launch_graph(g)
        return self._graph_outputs(outputs, n)
