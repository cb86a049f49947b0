"""The engine: weights loaded once, a KV cache, a scheduler, and a plan that can be swapped live.

``step()`` reads as schedule -> run -> postprocess. The engine is not thread-safe: one thread owns
it (the server's engine loop); others hand it requests through a queue. The API contract is in
engine/ENGINE_API.md.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from anneal.engine.block_manager import BlockManager
from anneal.engine.compile_ahead import CompileAhead
from anneal.engine.overlap import OverlapStepper
from anneal.engine.config import ModelConfig
from anneal.engine.op_table import OpTable
from anneal.engine.plan import WEIGHT_FIELDS, Plan, check_parallelism, inert_fusions, weight_copies
from anneal.engine.runner import ModelRunner
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.scheduler import Scheduler
from anneal.engine.sequence import RequestOutput, Sequence, positions_attended
from anneal.engine.speculation import Speculator
from anneal.engine.tensor_parallel import TensorParallel, rank_device, shard_config, shard_weights
from anneal.engine.tp_workers import Workers, free_address
from anneal.engine.weights import DTYPES, FOLDED_FIELDS, fold_norms, load_weights, resolve_config, set_weight_copies


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: str = Field("random:tiny", description="HF model folder or random:<preset>")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field("auto", description="auto | float32 | float16 | bfloat16")
    layers: int | None = Field(None, ge=1, description="load only the first k layers (fast tier)")
    max_model_len: int | None = Field(None, ge=2)
    block_size: int = Field(16, ge=1, le=256)
    num_kv_blocks: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0.05, le=0.98)
    parallel_jit: bool = Field(False, description="compile a plan's Triton kernels in parallel before its "
                                                  "warm-up (engine/parallel_jit.py); off: no gain measured on the H200")
    compile_ahead_processes: int | None = Field(
        None, ge=0, description="child processes that compile queued plans' kernels (POST /admin/prepare); "
                                "None: a quarter of the cores, at most 4, started by the first prepare; N > 0: "
                                "started with the engine; 0: a thread of the engine process compiles them")
    warm_prompt_steps: bool | None = Field(
        None, description="compile the Triton kernels a plan's prompt steps launch when it is applied "
                          "(engine/prompt_warmup.py), not in the first requests after it; None: on for the whole "
                          "model (serving, the slow tier), off for a --layers tier, whose candidates are timed "
                          "on decode steps")
    seed: int = 0
    plan: Plan = Field(default_factory=Plan)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    last_batch_size: int
    last_num_tokens: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    steps: int
    last_decode_only: bool = False  # the last step carried no prompt tokens
    pipelined_steps: int = 0  # decode steps launched before the last one's tokens were read (overlap)
    last_context_tokens: int = 0  # KV positions the last step's tokens attend, summed (its KV reads)
    speculative_steps: int = 0  # decode steps that checked n-gram drafts (scheduler.speculative_tokens)
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class ApplyReport:
    plan_hash: str
    build_s: float
    warmup_s: float
    capture_s: float
    total_s: float
    parallel_jit_s: float | None = None  # of warmup_s, with EngineArgs.parallel_jit
    parallel_jit_kernels: int | None = None
    prompt_warmup_s: float | None = None  # of warmup_s, with EngineArgs.warm_prompt_steps
    token_graph_sizes: list[int] | None = None  # the plan's token graphs kept (no slower than a larger one)
    token_graph_sizes_dropped: list[int] | None = None
    ahead_wait_s: float = 0.0  # of build_s: waiting for this plan's compile-ahead to finish
    inert_fusions: dict[str, str] | None = None  # enabled fusions that run nothing on this model -> why


def _up_to_first_holding(sizes: list[int], most: int) -> list[int]:
    cap = next((b for b in sorted(sizes) if b >= most), None)
    return [b for b in sorted(sizes) if cap is None or b <= cap]


def graph_sizes(plan: Plan) -> list[int]:
    """The plan's CUDA-graph buckets that a step can use: none above the first bucket that holds
    ``max_num_seqs`` (a larger one is never replayed, and its capture holds memory the KV cache
    could use — with the reference attention, many GB)."""
    return _up_to_first_holding(plan.cuda_graph_batch_sizes, plan.scheduler.max_num_seqs)


def graph_shapes(plan: Plan) -> tuple[list[int], int, list[int]]:
    """``ModelRunner.capture``'s arguments for ``plan``: its decode buckets, its sequences a step,
    and its token buckets up to the first that holds a whole step's token budget."""
    tokens = _up_to_first_holding(plan.cuda_graph_token_sizes, plan.scheduler.max_num_batched_tokens)
    return graph_sizes(plan), plan.scheduler.max_num_seqs, tokens


def register_plan_kernels(plan: Plan) -> None:
    """Agent-written kernels a plan carries become registry variants before its ops are built."""
    if plan.kernels:
        from anneal.engine.kernel_source import register

        for ks in plan.kernels:
            register(ks)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return d


def _device_count(device: torch.device) -> int | None:
    """GPUs a tensor-parallel engine on ``device`` can use, from it on; None on the CPU, whose ranks
    are processes sharing it (the plan bounds the degree)."""
    if device.type != "cuda":
        return None
    return torch.cuda.device_count() - (device.index or 0)


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # bf16 matmuls are slow on most CPUs
        return DTYPES["bfloat16" if cfg.torch_dtype == "float32" else cfg.torch_dtype]
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class Engine:
    def __init__(self, args: EngineArgs | None = None, *, tp_rank: int = 0, tp_init: str | None = None, **kw):
        """``tp_rank`` / ``tp_init``: set by a tensor-parallel worker process (tp_workers.py) only;
        rank 0 starts the workers itself when the plan asks for ``tensor_parallel`` > 1."""
        args = args or EngineArgs(**kw)
        self.args = args
        t_init = time.perf_counter()
        self.startup: dict[str, float] = {}  # seconds per start-up phase (iteration benchmark)
        self.config = resolve_config(args.model)
        degree = args.plan.parallelism.tensor_parallel
        self.shard_config = shard_config(self.config, degree) if degree > 1 else self.config
        base = resolve_device(args.device)
        self.device = rank_device(base, tp_rank)
        check_parallelism(args.plan, devices=_device_count(base))  # before minutes of weight loading
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        cfg = self.config
        self.max_model_len = min(args.max_model_len or min(cfg.max_position_embeddings, 8192),
                                 cfg.max_position_embeddings)
        self.workers: Workers | None = None
        self.tp = TensorParallel(0, 1)
        self._closed = False
        self._starting = True  # until every rank's engine is up (the worker watch: tp_workers.Workers.watch)
        self._threads: int | None = None  # the process's torch threads before a CPU tensor-parallel start
        if degree > 1:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            else:  # the ranks share the cores: more threads than cores slowed each step 4-9x under gloo
                self._threads = torch.get_num_threads()
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // degree))
            try:
                if tp_rank == 0:
                    tp_init = free_address()
                    self.workers = Workers(args, degree, tp_init)
                    self.workers.watch(self._waiting_on_workers)
                self.tp = TensorParallel.join(tp_rank, degree, tp_init, self.device)
            except BaseException:
                self.close()
                raise
        try:
            self._start(args, cfg, t_init)
        except BaseException:
            self.close()
            raise

    def _start(self, args: EngineArgs, cfg: ModelConfig, t_init: float) -> None:
        t0 = time.perf_counter()
        self.weights = load_weights(args.model, cfg, self.device, self.dtype, args.layers, args.seed)
        if self.tp.size > 1:  # this rank's slices; the whole copy goes
            self.weights = shard_weights(self.weights, cfg, self.tp.size, self.tp.rank)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.load_s = time.perf_counter() - t0
        self.num_layers = len(self.weights.layers)
        t0 = time.perf_counter()
        self._set_weight_copies(args.plan)  # a plan's second copies of weights (folded, fp8), before the KV cache takes the memory
        num_blocks = args.num_kv_blocks or self._auto_num_blocks()
        num_blocks = self.tp.smallest(num_blocks, self.device)  # every rank's cache holds the same blocks
        need = -(-self.max_model_len // args.block_size)
        if num_blocks < need:
            raise ValueError(
                f"{num_blocks} KV blocks of {args.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len} (needs {need}); lower max_model_len or add blocks"
            )
        self.plan = args.plan
        register_plan_kernels(self.plan)
        ops = OpTable.from_plan(self.plan, self.device.type)
        self.blocks = BlockManager(num_blocks, args.block_size, self.plan.scheduler.enable_prefix_caching)
        self.runner = ModelRunner(
            self.shard_config, self.weights, ops, self.device, self.dtype, num_blocks, args.block_size,
            self.max_model_len, tp=self.tp,
        )
        self.runner.parallel_jit = args.parallel_jit
        self.runner.warm_prompt_steps = args.layers is None if args.warm_prompt_steps is None else args.warm_prompt_steps
        # kernels of plans the compiler will try next
        self.compile_ahead = CompileAhead(self.runner, processes=args.compile_ahead_processes)
        if args.compile_ahead_processes and self.device.type == "cuda" and self.tp.rank == 0:
            self.compile_ahead.start_children()  # asked for by name: ready before the first prepare
        self.scheduler = Scheduler(self.plan.scheduler, self.blocks, self.max_model_len)
        kv_s = time.perf_counter() - t0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # weight-init temporaries go back before graphs take their pool
        captured = self.runner.capture(*graph_shapes(self.plan))
        # phases only, so they add up to the start (the parallel JIT's share is inside warmup_s)
        self.startup = {"config_s": t0 - t_init - self.load_s, "weights_s": self.load_s, "kv_cache_s": kv_s,
                        "warmup_s": captured["warmup_s"], "capture_s": captured["capture_s"]}
        self._rng = random.Random(args.seed)
        self._overlap = OverlapStepper(self)  # scheduler.overlap: the decode step in flight
        self._speculator = Speculator()  # scheduler.speculative_tokens: drafts and their n-gram indexes
        self._requests: dict[str, Sequence] = {}
        self._steps = 0
        self._last = (0, 0, False, 0)  # batch, tokens, decode-only, tokens attended (see stats)
        if self.workers is not None:  # their engines are up too (each captured its own graphs)
            self.workers.wait_ready()
            self.runner.workers = self.workers
        self._starting = False

    def tp_devices(self) -> list[str]:
        """Each rank's device, rank 0's first (one entry at degree 1)."""
        return [str(rank_device(self.device, r)) for r in range(self.tp.size)]

    def _waiting_on_workers(self) -> bool:
        """Whether rank 0 may be in a collective now: starting, or inside a mirrored runner call."""
        runner = getattr(self, "runner", None)
        return self._starting or (runner is not None and runner._mirroring)

    def close(self) -> None:
        """Stop what the engine started beside it: compile-ahead children, tensor-parallel workers
        and the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ahead = getattr(self, "compile_ahead", None)
        if ahead is not None:
            ahead.close()
        if self.workers is not None:
            self.workers.close()
        self.tp.leave()
        if self._threads is not None:
            torch.set_num_threads(self._threads)

    # ---- sizing -----------------------------------------------------------------------------------

    def _block_bytes(self) -> int:
        c = self.shard_config
        return 2 * self.num_layers * self.args.block_size * c.kv_size * self.dtype.itemsize

    def _auto_num_blocks(self) -> int:
        per_block = self._block_bytes()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = total * (1 - self.args.gpu_memory_utilization) + 2 * 2**30  # activations, graphs
            budget = max(free - reserve, 0)
        else:
            budget = 256 * 2**20
        return max(int(budget // per_block), -(-self.max_model_len // self.args.block_size))

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        V = self.config.vocab_size
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < V)), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {V})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; this engine's context is "
                f"{self.max_model_len} tokens (prompt + at least one generated token)"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, arrival=time.monotonic())
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        self._speculator.forget(request_id)
        return seq is not None

    def request_ids(self) -> list[str]:
        """The requests added and not finished or aborted yet."""
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._overlap.inflight is not None

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.plan.scheduler.overlap or self._overlap.inflight is not None:
            return self._overlap.step()
        return self._step_plain()

    def _step_plain(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        # Read before the step: afterwards a sequence that finished has had its blocks freed
        # (num_computed_tokens 0), and the property would call the step a prefill.
        decode_only = batch.decode_only
        knobs = self.plan.scheduler
        if decode_only and knobs.speculative_tokens:
            drafts = self._speculator.propose(batch.items, knobs.speculative_tokens, knobs.max_num_batched_tokens,
                                              self.max_model_len)
            if drafts is not None:
                return self._speculator.step(self, batch.items, drafts)
        attended = positions_attended(batch.items)
        result = self.runner.run(batch.items, decode_only)
        outputs = []
        for (seq, n), token, lp in zip(batch.items, result.token_ids, result.logprobs):
            seq.num_computed_tokens += n
            self.blocks.mark_computed(seq)
            if token is None:
                continue
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason:
                self._finish(seq, reason)
            outputs.append(
                RequestOutput(
                    request_id=seq.request_id,
                    new_token_ids=[token],
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens,
                    num_output_tokens=seq.num_output_tokens,
                    new_logprobs=[lp] if lp is not None else None,
                )
            )
        self._note_step(len(batch), batch.num_tokens, decode_only, attended)
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` ends (its stop token or length): its blocks freed, the engine forgets it."""
        self.scheduler.finish(seq, reason)
        self._requests.pop(seq.request_id, None)
        self._speculator.forget(seq.request_id)

    def _note_step(self, batch: int, tokens: int, decode_only: bool, attended: int) -> None:
        """A step ran: what ``stats`` reports of the last one."""
        self._steps += 1
        self._last = (batch, tokens, decode_only, attended)

    def _stop_reason(self, seq: Sequence, token: int, length: int | None = None) -> str | None:
        """Why ``seq`` ends with ``token``, if it does; ``length``: its length with that token
        (overlap scheduling may have appended the next step's placeholder already)."""
        p = seq.params
        if not p.ignore_eos and token in self.config.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        n = len(seq) if length is None else length
        if n - seq.num_prompt_tokens >= p.max_tokens or n >= self.max_model_len:
            return "length"
        return None

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_free_blocks=self.blocks.num_free_blocks,
            num_blocks=self.blocks.num_blocks,
            last_batch_size=self._last[0],
            last_num_tokens=self._last[1],
            prefix_queried_tokens=self.blocks.queried_tokens,
            prefix_hit_tokens=self.blocks.hit_tokens,
            num_preemptions=s.num_preemptions,
            steps=self._steps,
            last_decode_only=self._last[2],
            last_context_tokens=self._last[3],
            pipelined_steps=self._overlap.pipelined,
            speculative_steps=self._speculator.steps,
            drafted_tokens=self._speculator.drafted,
            accepted_tokens=self._speculator.accepted,
        )

    # ---- plans ------------------------------------------------------------------------------------

    def check_plan(self, plan: Plan) -> None:
        """What ``apply_plan`` would refuse before building anything: a parallelism this engine does
        not run, scheduler knobs, unknown ops or variants, variants that do not run here, parameters
        outside their choices (a plan's own kernels are checked when they are built). Raises
        ValueError/OpError."""
        check_parallelism(plan, running=self.tp.size)
        Scheduler.check_knobs(plan.scheduler, self.max_model_len)
        OpTable.resolve(plan, self.device.type, frozenset((k.op, k.impl) for k in plan.kernels))

    def apply_plan(self, plan: Plan) -> ApplyReport:
        """Swap the forward pass without reloading weights. On any failure the old plan keeps serving."""
        if self.has_unfinished_requests():
            raise RuntimeError("apply_plan needs an idle engine (drain or pause requests first)")
        t0 = time.perf_counter()
        old_plan, old_ops = self.plan, self.runner.plan_ops
        check_parallelism(plan, running=self.tp.size)
        Scheduler.check_knobs(plan.scheduler, self.max_model_len)
        # A plan whose kernels compile ahead right now: let that finish rather than compile the
        # same kernels a second time here, on the engine thread, competing with it.
        ahead_wait_s = self.compile_ahead.wait_for(plan.hash)
        register_plan_kernels(plan)
        ops = OpTable.from_plan(plan, self.device.type)  # validates everything before any swap
        t1 = time.perf_counter()
        try:
            self.runner.use_plan(plan, ops=ops)
            self.runner.drop_graphs()  # the old graphs' pool goes before the new copies need room
            self._set_weight_copies(plan)
            timings = self.runner.capture(*graph_shapes(plan))
        except Exception:
            self.runner.use_plan(old_plan, ops=old_ops)
            self._set_weight_copies(old_plan)
            self.runner.capture(*graph_shapes(old_plan))
            raise
        self.plan = plan
        self.blocks.reset_prefix_cache()
        self.scheduler.knobs = plan.scheduler
        self.blocks.enable_prefix_caching = plan.scheduler.enable_prefix_caching
        return ApplyReport(
            plan_hash=plan.hash,
            build_s=t1 - t0,
            warmup_s=timings["warmup_s"],
            capture_s=timings["capture_s"],
            total_s=time.perf_counter() - t0,
            parallel_jit_s=timings.get("parallel_jit_s"),
            parallel_jit_kernels=timings.get("parallel_jit_kernels"),
            prompt_warmup_s=timings.get("prompt_warmup_s"),
            token_graph_sizes=timings.get("token_graph_sizes"),
            token_graph_sizes_dropped=timings.get("token_graph_sizes_dropped"),
            ahead_wait_s=ahead_wait_s,
            inert_fusions=inert_fusions(plan, self.config.model_dump()) or None,
        )

    def _set_weight_copies(self, plan: Plan) -> None:
        """The second copies of weights ``plan`` needs (``folded_norm``'s folded weights, the
        projections' fp8 or bf12 copies), made before its capture (a graph must not replay making them),
        or given back before it when it needs none: on an 8B they are 9 GB and 7 GB, which the
        capture of the next plan may need. An H200 compile (session 19) lost its slow tier to
        out-of-memory errors because a candidate's folded weights outlived it."""
        # What the plan does not use goes first: on an H100 an 8B's fp8 copies left by the previous
        # plan made the next one's folded weights not fit (session 43).
        copies = {WEIGHT_FIELDS[p]: fmt for p, fmt in weight_copies(plan).items()}
        # qkv / gate_up copies hang on the folded weights while the plan folds (Weights.copy_targets):
        # when folding starts or stops, those of the tensors left behind go before anything is made
        moving = ("folded_norm" in plan.fusions) != (self.weights.folded is not None)
        keep = {f: fmt for f, fmt in copies.items() if not (moving and f in FOLDED_FIELDS)}
        freed = set_weight_copies(self.weights, keep, make=False) > 0
        if "folded_norm" not in plan.fusions and self.weights.folded is not None:
            self.weights.folded = None
            freed = True
        if freed and self.device.type == "cuda":
            torch.cuda.empty_cache()
        if "folded_norm" in plan.fusions:
            fold_norms(self.weights)
        set_weight_copies(self.weights, copies)

    # ---- offline ----------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run prompts to completion; returns each one's generated token ids."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = [f"gen-{self._steps}-{i}" for i in range(len(prompts))]
        added: list[str] = []
        try:
            for rid, p, sp in zip(ids, prompts, plist):
                self.add_request(rid, p, sp)
                added.append(rid)
        except Exception:
            for rid in added:  # all or nothing: a bad prompt leaves none of this call in flight
                self.abort_request(rid)
            raise
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for o in self.step():
                if o.request_id in out:  # other requests in flight keep running alongside
                    out[o.request_id] += o.new_token_ids
        return [out[r] for r in ids]
