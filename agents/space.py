"""The candidate space: what a plan may choose, read from the engine, with moves for plan search.

Search spaces are data (STYLE.md 4): op variants and their parameters come from the registry as
the engine reports it (``GET /admin/state`` -> ``variants``), the engine knobs (CUDA-graph buckets,
scheduler, fusions) from the Plan schema. Plan-level search samples, mutates and crosses plans
over this space; it never enumerates it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from anneal.engine.plan import FP8_WEIGHT_IMPL, OpChoice, Plan, SchedulerKnobs, fusion_blockers, fusion_conflicts
from anneal.agents.types import EngineState

MAX_NUM_SEQS = (8, 16, 32, 64, 128, 256)
MAX_BATCHED_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
GRAPH_SETS = (
    (),
    (1, 2, 4, 8),
    (1, 2, 4, 8, 16, 32),
    (1, 2, 4, 8, 16, 32, 64, 128),
    (1, 4, 16, 64),
)
# Token buckets of prompt and mixed steps: none, or every 64 / 128 tokens (the padding to the next
# bucket costs GEMM rows, the graphs take the host's launches out of the step: session 15, an 8B
# 415-token mixed step ran 12.8 ms eager for 10.8 ms of kernels). Large steps are kernel-bound, and
# each bucket costs a capture and a few timed replays at apply, so none above 1024.
TOKEN_GRAPH_SETS = (
    (),
    tuple(range(64, 513, 64)),
    tuple(range(128, 1025, 128)),
)


@dataclass
class OpSpace:
    """The implementations of one op and each one's parameter choices (first = default)."""

    op: str
    impls: dict[str, dict[str, list[Any]]]

    def configs(self, impl: str) -> list[dict[str, Any]]:
        """Every parameter combination of ``impl`` (a variant declares few, so this stays small)."""
        params = self.impls.get(impl, {})
        if not params:
            return [{}]
        names = sorted(params)
        return [dict(zip(names, vals)) for vals in itertools.product(*(params[n] for n in names))]

    def default(self, impl: str) -> dict[str, Any]:
        return {n: ch[0] for n, ch in self.impls.get(impl, {}).items() if ch}

    def random_choice(self, rng: random.Random) -> OpChoice:
        impl = rng.choice(sorted(self.impls))
        params = {n: rng.choice(ch) for n, ch in self.impls[impl].items() if ch}
        return OpChoice(impl=impl, params=params)

    def mutate(self, choice: OpChoice, rng: random.Random) -> OpChoice:
        """Change one parameter of the current impl, or (less often) switch impl."""
        params = self.impls.get(choice.impl, {})
        tunable = [n for n, ch in params.items() if len(ch) > 1]
        if tunable and (len(self.impls) == 1 or rng.random() < 0.7):
            name = rng.choice(tunable)
            others = [v for v in params[name] if v != choice.params.get(name, params[name][0])]
            return OpChoice(impl=choice.impl, params={**choice.params, name: rng.choice(others)})
        return self.random_choice(rng)

    @property
    def size(self) -> int:
        total = 0
        for params in self.impls.values():
            n = 1
            for ch in params.values():
                n *= max(1, len(ch))
            total += n
        return total


@dataclass
class CandidateSpace:
    """Everything a plan may choose on one engine."""

    ops: dict[str, OpSpace]
    fusions: list[str] = field(default_factory=list)
    graph_sets: tuple[tuple[int, ...], ...] = GRAPH_SETS
    token_graph_sets: tuple[tuple[int, ...], ...] = TOKEN_GRAPH_SETS
    max_num_seqs: tuple[int, ...] = MAX_NUM_SEQS
    max_batched_tokens: tuple[int, ...] = MAX_BATCHED_TOKENS
    uses_graphs: bool = False  # CUDA graphs exist only on the GPU
    max_model_len: int | None = None  # without chunked prefill, a step must fit the longest prompt

    @classmethod
    def from_state(cls, state: EngineState, fp8_weights: bool = False) -> "CandidateSpace":
        """Read the registry's declared variants as the engine reports them. The weight-only fp8
        projections are lossy by design: only with ``fp8_weights`` (the user asked for them)."""
        ops: dict[str, OpSpace] = {}
        for op, impls in state.variants.items():
            usable = set(state.ops.get(op, impls))  # ops lists what runs on this device
            if not fp8_weights:
                usable.discard(FP8_WEIGHT_IMPL)
            chosen = {i: {p: list(ch) for p, ch in prm.items()} for i, prm in impls.items() if i in usable}
            chosen.setdefault("reference", {})
            ops[op] = OpSpace(op=op, impls=chosen)
        for op, impls in state.ops.items():
            if op not in ops:
                ops[op] = OpSpace(op=op, impls={i: {} for i in impls} or {"reference": {}})
        gpu = state.device.startswith("cuda")
        fusions = list((state.model_extra or {}).get("fusions") or [])
        if not fusions and gpu:  # fused kernels exist on the GPU only
            from anneal.engine import plan as plan_mod

            fusions = sorted(getattr(plan_mod, "FUSIONS", {}))
        mml = (state.model_extra or {}).get("max_model_len")
        return cls(ops=ops, fusions=fusions, uses_graphs=gpu, max_model_len=int(mml) if mml else None)

    def forget(self, op: str, impl: str) -> bool:
        """Drop an impl the engine cannot run (the reference stays); True when it was there."""
        cur = self.ops.get(op)
        if cur is None or impl not in cur.impls or impl == "reference":
            return False
        self.ops[op] = OpSpace(op=op, impls={i: p for i, p in cur.impls.items() if i != impl})
        return True

    # ---- the searchable parts ------------------------------------------------------------------

    def tunable_ops(self) -> list[str]:
        """Ops with more than one configuration: where kernel tuning can matter."""
        return sorted(op for op, s in self.ops.items() if s.size > 1)

    @property
    def size(self) -> int:
        n = 1
        for s in self.ops.values():
            n *= s.size
        n *= 2 ** len(self.fusions) * len(self.max_num_seqs) * len(self.max_batched_tokens) * 2
        return n * (len(self.graph_sets) * len(self.token_graph_sets) if self.uses_graphs else 1)

    def random_plan(self, rng: random.Random, base: Plan | None = None) -> Plan:
        base = base or Plan()
        ops = {op: s.random_choice(rng) for op, s in self.ops.items()}
        fusions = {f: rng.random() < 0.5 for f in self.fusions}
        upd: dict[str, Any] = {"ops": ops, "fusions": fusions, "name": None}
        if self.uses_graphs:
            upd["cuda_graph_batch_sizes"] = list(rng.choice(self.graph_sets))
            upd["cuda_graph_token_sizes"] = list(rng.choice(self.token_graph_sets))
        return normalized(base.model_copy(update=upd))

    def mutate(self, plan: Plan, rng: random.Random, n: int = 1,
               moves: tuple[str, ...] = ("op", "fusion", "graphs", "sched")) -> Plan:
        """``n`` small moves among ``moves``: one op's parameter or impl, a fusion flag, the decode
        or token graph sizes, or a scheduler knob.

        A move that lands on the same plan is retried (a few times), so a mutation changes something.
        """
        for _ in range(n):
            for _attempt in range(8):
                moved = normalized(self._move(plan, rng, moves))
                if moved.hash != plan.hash:
                    plan = moved
                    break
        return normalized(with_used_kernels(plan.model_copy(update={"name": None}), plan.kernels))

    def _move(self, plan: Plan, rng: random.Random, allowed: tuple[str, ...]) -> Plan:
        tunable = [op for op, s in self.ops.items() if s.size > 1]
        moves = (["op"] * 4 if tunable else []) + (["fusion"] if self.fusions else [])
        moves += ["graphs"] if self.uses_graphs else []
        moves += ["sched"]
        moves = [m for m in moves if m in allowed]
        if not moves:
            return plan
        move = rng.choice(moves)
        if move == "op":
            op = rng.choice(sorted(tunable))
            return plan.with_ops(**{op: self.ops[op].mutate(plan.choice(op), rng)})
        if move == "fusion":
            f = rng.choice(self.fusions)
            return plan.model_copy(update={"fusions": {**plan.fusions, f: not plan.fusions.get(f, False)}})
        if move == "graphs":
            if rng.random() < 0.5:
                return plan.model_copy(update={"cuda_graph_token_sizes": list(rng.choice(self.token_graph_sets))})
            return plan.model_copy(update={"cuda_graph_batch_sizes": list(rng.choice(self.graph_sets))})
        return plan.model_copy(update={"scheduler": self.mutate_scheduler(plan.scheduler, rng)})

    def token_budgets(self, chunked: bool) -> tuple[int, ...]:
        """Step token budgets: without chunked prefill a step must hold a whole max-length prompt."""
        if chunked or not self.max_model_len:
            return self.max_batched_tokens
        big = tuple(t for t in self.max_batched_tokens if t >= self.max_model_len)
        return big or (self.max_model_len,)

    def mutate_scheduler(self, s: SchedulerKnobs, rng: random.Random) -> SchedulerKnobs:
        knob = rng.choice(["max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "mixed_prefill",
                           "overlap"])
        if knob == "overlap":  # an overlapped step cannot check drafts: speculation goes with it
            return s.model_copy(update={"overlap": not s.overlap, "speculative_tokens": 0})
        if knob == "mixed_prefill":
            return s.model_copy(update={knob: not getattr(s, knob)})
        if knob == "chunked_prefill":
            chunked = not s.chunked_prefill
            budgets = self.token_budgets(chunked)
            tok = s.max_num_batched_tokens if s.max_num_batched_tokens in budgets else rng.choice(budgets)
            return s.model_copy(update={"chunked_prefill": chunked, "max_num_batched_tokens": tok})
        if knob == "max_num_seqs":
            return s.model_copy(update={"max_num_seqs": rng.choice(self.max_num_seqs)})
        return s.model_copy(update={"max_num_batched_tokens": rng.choice(self.token_budgets(s.chunked_prefill))})

    def crossover(self, a: Plan, b: Plan, rng: random.Random) -> Plan:
        """Each op, fusion and knob group taken from one parent at random.

        Agent-written kernels travel with the op that uses them (from either parent), so the child
        can be rebuilt on an engine that has never seen them (the slow tier).
        """
        ops_all = set(self.ops) | set(a.ops) | set(b.ops)
        ops = {op: (a if rng.random() < 0.5 else b).choice(op) for op in sorted(ops_all)}
        fusions = {f: (a if rng.random() < 0.5 else b).fusions.get(f, False) for f in self.fusions}
        child = a.model_copy(update={
            "ops": ops, "fusions": fusions, "name": None,
            "scheduler": (a if rng.random() < 0.5 else b).scheduler,
            "cuda_graph_batch_sizes": (a if rng.random() < 0.5 else b).cuda_graph_batch_sizes,
            "cuda_graph_token_sizes": (a if rng.random() < 0.5 else b).cuda_graph_token_sizes,
        })
        return normalized(with_used_kernels(child, [*a.kernels, *b.kernels]))

    def scheduler_grid(self, limit_seqs: int | None = None) -> list[SchedulerKnobs]:
        """The scheduler knob settings the scheduler agent sweeps (small: a few dozen)."""
        out = []
        for seqs in self.max_num_seqs:
            if limit_seqs and seqs > limit_seqs * 2:
                continue
            for chunked in (True, False):
                for tok in self.token_budgets(chunked):
                    if tok < seqs:
                        continue
                    for mixed in (True, False):
                        out.append(SchedulerKnobs(max_num_seqs=seqs, max_num_batched_tokens=tok,
                                                  chunked_prefill=chunked, mixed_prefill=mixed))
        return out


def with_used_kernels(plan: Plan, kernels) -> Plan:
    """``plan`` carrying exactly the agent-written kernels its op choices use (deduplicated)."""
    used, seen = [], set()
    for k in kernels:
        if plan.choice(k.op).impl == k.impl and (k.op, k.impl) not in seen:
            seen.add((k.op, k.impl))
            used.append(k)
    return plan.model_copy(update={"kernels": used})


def normalized(plan: Plan) -> Plan:
    """The plan re-validated, so equal plans hash equal (``model_copy`` skips the validators that
    sort graph sizes and drop disabled fusions). Without token graphs when its attention_prefill is
    the reference, which reads sequence lengths on the host: the engine refuses that pair
    (``runner.NotCapturable``), so proposing it would only spend an experiment."""
    data = plan.model_dump(mode="json")
    if plan.choice("attention_prefill").impl == "reference":
        data["cuda_graph_token_sizes"] = []
    # Fusions the engine refuses together (plan.FUSION_CONFLICTS): the first of a pair wins. And
    # those the op choices rule out (plan.fusion_blockers: folded_norm needs o / down on a variant that
    # adds its residual in place, rope_attention the split-K decode attention).
    fusions = data["fusions"]
    for f in fusion_blockers(plan):
        del fusions[f]
    for _, other in fusion_conflicts(fusions):
        fusions.pop(other, None)
    return Plan.model_validate(data)
