"""The board the proposer agents share: the search setting and the best findings so far.

Why: agents run concurrently and build on each other (plan search seeds from the tuned kernels;
the final plan composes the tuned ops, the fitted graph buckets and the chosen scheduler knobs).
They talk through this board, never through each other.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from anneal.engine.plan import (
    GEMV_FUSION_PROJECTIONS, KernelSource, OpChoice, Plan, SchedulerKnobs, fusion_blockers, fusion_conflicts,
    retiled_fusions,
)
from anneal.agents.space import CandidateSpace, normalized
from anneal.agents.types import BenchSpec, LatencyObjective


@dataclass
class SearchSetting:
    """What every agent needs to know about this compilation."""

    space: CandidateSpace
    base: Plan  # the baseline plan (the engine's current/reference plan)
    decode_spec: BenchSpec  # the plan-level fast-tier objective: one decode step at the typical batch
    batch_dist: dict[int, float]  # decode batch size -> probability, from the traffic shape
    buckets: list[int]  # representative decode batch sizes for per-op tuning
    context_len: int
    prompt_len: int
    objective: LatencyObjective = field(default_factory=LatencyObjective)
    seed: int = 0
    workload_requests: int = 8
    long_context_len: int | None = None  # the traffic's p90 context: attention is also tuned there
    seeds: list[Plan] = field(default_factory=list)  # plans the plan search starts from besides the base
    # steps with prompt tokens per decode step in a replay of the traffic (an estimate from its
    # lengths): what a millisecond of prefill attention is worth beside one of a decode op
    prefill_steps_per_decode_step: float = 1.0
    # the engine's model config (``GET /admin/state``), when it reports one: which fusions can run
    model_config: dict[str, Any] | None = None

    def rng(self, agent: str) -> random.Random:
        """A reproducible random stream per agent (a resumed run proposes the same candidates)."""
        return random.Random(f"{self.seed}/{agent}")

    def spec_for(self, op: str, batch_size: int, context_len: int | None = None) -> BenchSpec:
        """How to time ``op``: decode ops in a decode step; prefill attention in the steps that carry
        prompt tokens, which under a mixed-prefill scheduler also carry the decode rows (a prompt
        chunk beside the typical batch: on the H200 those rows made the prefill kernel 63 µs per
        layer in a step a lone prompt would not show)."""
        if op == "attention_prefill":
            rows = self.decode_spec.batch_size if self.base.scheduler.mixed_prefill else 0
            if rows > 1:
                return BenchSpec(mode="mixed", batch_size=rows, prompt_len=self.prompt_len,
                                 context_len=self.context_len, steps=2, warmup=1, repeats=3,
                                 per_op=self.decode_spec.per_op)
            return BenchSpec(mode="prefill", batch_size=1, prompt_len=self.prompt_len,
                             context_len=self.prompt_len, steps=2, warmup=1, repeats=3,
                             per_op=self.decode_spec.per_op)
        return self.decode_spec.model_copy(
            update={"batch_size": batch_size, "context_len": context_len or self.decode_spec.context_len})

    def steps_weight(self, op: str) -> float:
        """How often the step ``op`` is timed in comes round, per decode step of a replay."""
        return self.prefill_steps_per_decode_step if self.spec_for(op, 1).mode != "decode" else 1.0

    def shape_buckets(self, op: str) -> list[tuple[int, int | None]]:
        """(batch, context) shapes an op is tuned at: decode attention also at the long context."""
        if op == "attention_prefill":
            return [(1, None)]
        out: list[tuple[int, int | None]] = [(b, None) for b in self.buckets]
        if op == "attention_decode" and self.long_context_len and self.long_context_len > self.context_len:
            out += [(b, self.long_context_len) for b in self.buckets]
        return out

    def workload_spec(self) -> BenchSpec:
        # One uncounted replay first: the first requests after a plan change pay its warm-up.
        return BenchSpec(mode="workload", num_requests=self.workload_requests, steps=1, warmup=1,
                         repeats=1, context_len=self.context_len, prompt_len=self.prompt_len)


TIED_SHARE = 0.03  # fast-tier plans this close to the fastest are told apart on the slow tier


@dataclass
class Board:
    """Best findings so far, per concern; thread-safe."""

    best_ops: dict[str, tuple[OpChoice, float]] = field(default_factory=dict)  # op -> (choice, ms)
    kernels: dict[str, KernelSource] = field(default_factory=dict)  # "op/impl" -> agent-written source
    scheduler: SchedulerKnobs | None = None
    scheduler_runners_up: list[SchedulerKnobs] = field(default_factory=list)
    graph_batch_sizes: list[int] | None = None
    token_graph_sizes: list[int] | None = None
    # fusions whose paired trial against the base won -> their step ratio projected to the whole model
    fusions: dict[str, float] = field(default_factory=dict)
    # the same for the GEMV fusions the tuned ops retile, each tried again beside the tuned ops
    # (``fusion_retrials``), and the plan each was tried on: its projections' tiles are the ones
    # that ratio holds for (the tuned ops', or for a fusion retried on the common tiles, those)
    retried_fusions: dict[str, float] = field(default_factory=dict)
    retrial_bases: dict[str, Plan] = field(default_factory=dict)
    # for a fusion retried on the common tiles: the tuned ops its ratio is against (it counts only
    # while the composite's ops are still those, moved onto the retrial's tiles)
    retrial_against: dict[str, Plan] = field(default_factory=dict)
    # every fusion's decided trial against the base, won or lost: the order of their retrials
    fusion_ratios: dict[str, float] = field(default_factory=dict)
    plans: list[tuple[float, Plan, str]] = field(default_factory=list)  # (ms, plan, agent) decode-spec
    notes: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def offer_op(self, op: str, choice: OpChoice, ms: float, kernel: KernelSource | None = None) -> None:
        with self._lock:
            if kernel is not None:
                self.kernels[f"{op}/{choice.impl}"] = kernel
            if op not in self.best_ops or ms < self.best_ops[op][1]:
                self.best_ops[op] = (choice, ms)

    def drop_op(self, op: str) -> None:
        """``op``'s tuned choice lost its step trial (``op_trials``): the composite leaves it at the base."""
        with self._lock:
            self.best_ops.pop(op, None)

    def offer_plan(self, ms: float, plan: Plan, agent: str) -> None:
        with self._lock:
            if any(p.hash == plan.hash for _, p, _ in self.plans):
                return
            self.plans.append((ms, plan, agent))
            self.plans.sort(key=lambda t: t[0])

    def set(self, **kw: Any) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, v)

    def note(self, text: str) -> None:
        with self._lock:
            self.notes.append(text)

    def top_plans(self, k: int, distinct_fusions: bool = False,
                  rank: Callable[[float, Plan], float] | None = None) -> list[tuple[float, Plan, str]]:
        """The ``k`` fastest plans, by ``rank(ms, plan)`` when given (the step projected to the whole
        model: ``CostModel.whole_model_ms``), else by their fast-tier ms. With ``distinct_fusions``,
        of the plans within ``TIED_SHARE`` of the fastest, the fastest of each set of enabled
        fusions first: the slow tier then chooses between structures, not between tile tweaks of
        one. Session 26's 30-minute compile promoted three plans with the same fusions, 0.551-0.554
        ms on the fast tier, which replayed 1937-2055 tok/s; a 2-layer step is no finer a judge
        than that."""
        with self._lock:
            plans = list(self.plans)
        if rank is not None:
            keys = {id(e): rank(e[0], e[1]) for e in plans}
            plans.sort(key=lambda e: keys[id(e)])
        else:
            keys = {id(e): e[0] for e in plans}
        if not distinct_fusions or not plans:
            return plans[:k]
        fastest = keys[id(plans[0])]
        tied = [e for e in plans if keys[id(e)] <= fastest * (1 + TIED_SHARE)]
        firsts, seen = [], set()
        for entry in tied:
            key = frozenset(f for f, on in entry[1].fusions.items() if on)
            if key not in seen:
                seen.add(key)
                firsts.append(entry)
        return (firsts + [e for e in plans if not any(e is f for f in firsts)])[:k]

    def record_fusion_ratio(self, name: str, ratio: float) -> None:
        with self._lock:
            self.fusion_ratios[name] = ratio

    def keep_fusion(self, name: str, ratio: float) -> None:
        with self._lock:
            self.fusions[name] = min(ratio, self.fusions.get(name, ratio))

    def keep_retried_fusion(self, tuned: Plan, name: str, ratio: float, against: Plan | None = None) -> None:
        """``name`` won its trial on the ops of ``tuned`` (``fusion_retrials``); ``against``: the
        tuned ops its ratio was read against where those are not ``tuned``'s (a retrial on the
        common tiles: the tiles' loss is in its ratio)."""
        with self._lock:
            if name not in self.retried_fusions or ratio < self.retried_fusions[name]:
                self.retried_fusions[name] = ratio
                self.retrial_bases[name] = tuned
                if against is None:
                    self.retrial_against.pop(name, None)
                else:
                    self.retrial_against[name] = against

    def drop_fusion(self, name: str) -> None:
        """``name`` gained nothing beside the composite's other fusions (``fusion_stack_check``): the
        composite no longer carries it, whichever trial kept it."""
        with self._lock:
            for kept in (self.fusions, self.retried_fusions, self.retrial_bases, self.retrial_against):
                kept.pop(name, None)

    def tuned_ops(self, base: Plan) -> Plan:
        """``base`` with every tuned op (and the agent-written kernels they name), nothing else."""
        with self._lock:
            ops = {op: ch for op, (ch, _) in self.best_ops.items()}
            return base.with_ops(**ops).model_copy(update={"kernels": [*base.kernels, *self._sources(ops)]})

    def _sources(self, ops: dict[str, OpChoice]) -> list[KernelSource]:
        """The agent-written kernels ``ops`` name (lock held)."""
        return [self.kernels[f"{op}/{ch.impl}"] for op, ch in sorted(ops.items()) if f"{op}/{ch.impl}" in self.kernels]

    @staticmethod
    def _fusion_set(ratios: dict[str, float]) -> tuple[list[str], float]:
        """Of the kept fusions (-> their trials' ratios), the set the engine runs together
        (``plan.FUSION_CONFLICTS``) whose trials' ratios multiply to the least, and that product: each trial ran one
        fusion beside the base, and their gains are taken to compound. Session 26's 30-minute chat
        compile kept norm_stats x0.981, rope_attention x0.981, folded_norm x0.983 and gate_up_silu
        x0.985; taking the fastest first gave norm_stats + gate_up_silu (x0.966), where
        rope_attention + folded_norm (x0.964) is the hand-set best's pair."""
        names = sorted(ratios, key=ratios.get)  # ties go to the faster trials
        best, best_ratio = [], 1.0
        for r in range(len(names), 0, -1):
            for combo in itertools.combinations(names, r):
                ratio = math.prod(ratios[f] for f in combo)
                if ratio < best_ratio and not fusion_conflicts(combo):
                    best, best_ratio = list(combo), ratio
        return best, best_ratio

    def _compatible_fusions(self, plan: Plan, base: Plan) -> tuple[list[str], float]:
        """The best set (``_fusion_set``) of the kept fusions that ``plan``'s ops allow and
        leave as their trials ran them, and its ratio: a fusion whose GEMV the tuned projections
        retile is another kernel, so it counts only by its retrial (``retried_fusions``), if it had
        one, and only while ``plan``'s projections keep the tiles that retrial ran."""
        every = dict.fromkeys([*self.fusions, *self.retried_fusions], True)
        blocked = fusion_blockers(plan.model_copy(update={"fusions": every}))
        changed = retiled_fusions(plan, base)
        ratios = {f: r for f, r in self.fusions.items() if f not in blocked and f not in changed}
        ratios.update({f: r for f, r in self.retried_fusions.items()
                       if f not in blocked and f in changed and f not in retiled_fusions(plan, self.retrial_bases[f])})
        return self._fusion_set(ratios)

    def _retiled_for_fusions(self, plan: Plan, base: Plan) -> tuple[Plan, list[str]]:
        """``plan`` (the tuned ops) or, where a fusion won its retrial on other tiles than the tuned
        ops' (``fusion_retrials``: on the common ones), ``plan`` on that retrial's projections,
        whichever set of fusions it then allows goes furthest (each retrial's ratio is against the
        tuned ops, the tiles' cost in it). Session 47: norm_stats x0.980 on the common bf12 tiles,
        x1.010 on gate_up's own (64-wide, 8 warps), which unfused gain 3%."""
        best_plan, (best, best_ratio) = plan, self._compatible_fusions(plan, base)
        for f, against in sorted(self.retrial_against.items()):
            if f in retiled_fusions(plan, against):
                continue  # the tuned ops moved since: the ratio is against other tiles than these
            tried_on = self.retrial_bases[f]
            ops = {p: tried_on.choice(p) for p in GEMV_FUSION_PROJECTIONS.get(f, ())
                   if tried_on.choice(p) != plan.choice(p)}
            if not ops:
                continue
            other = plan.with_ops(**ops)
            fusions, ratio = self._compatible_fusions(other, base)
            if f in fusions and ratio < best_ratio:
                best_plan, best, best_ratio = other, fusions, ratio
        return best_plan, best

    def composite(self, base: Plan, fusions_first: bool = False, tuned_ops: bool = True) -> Plan:
        """The base plan with every tuned op, the fitted graph buckets, the token graphs and the
        best set of the fusions whose trials won, and the chosen scheduler. A tuned op can rule out
        a fusion (a Triton o_proj rules out folded_norm) or retile it (the fused GEMVs take their
        projections' params): by default the op stays and the fusion goes; ``fusions_first`` keeps
        the fusions and leaves such ops at the base's choice. Session 26's compile had only the
        first, and fused GEMVs on the tuned projections' tiles: its composite replayed x0.95 the
        baseline on the slow tier. Without ``tuned_ops`` every op stays at the base's choice."""
        with self._lock:
            ops = {op: ch for op, (ch, _) in self.best_ops.items()} if tuned_ops else {}
            if fusions_first and self.fusions:
                wanted, _ = self._fusion_set(dict(self.fusions))
                on = {"fusions": dict.fromkeys(wanted, True)}

                def spoils(op: str, ch: OpChoice) -> bool:
                    alone = base.with_ops(**{op: ch})
                    return bool(set(wanted) & (set(fusion_blockers(alone.model_copy(update=on)))
                                               | set(retiled_fusions(alone, base))))

                ops = {op: ch for op, ch in ops.items() if not spoils(op, ch)}
            plan = base.with_ops(**ops)
            fused: list[str] = []
            if self.fusions or self.retried_fusions:
                plan, fused = self._retiled_for_fusions(plan, base)
            upd: dict[str, Any] = {"name": "composite", "kernels": [*base.kernels, *self._sources(ops)]}
            if self.scheduler is not None:
                upd["scheduler"] = self.scheduler
            if self.graph_batch_sizes is not None:
                upd["cuda_graph_batch_sizes"] = list(self.graph_batch_sizes)
            if self.token_graph_sizes is not None:
                upd["cuda_graph_token_sizes"] = list(self.token_graph_sizes)
            if self.fusions or self.retried_fusions:
                upd["fusions"] = {**base.fusions, **{f: True for f in fused}}
        return normalized(plan.model_copy(update=upd))

    def serving(self, plan: Plan, base: Plan) -> Plan:
        """``plan`` as it would serve: the scheduler and the token graphs this board chose, where
        ``plan`` keeps the base's. The plan search moves neither (they do not change a decode step),
        so its fast-tier winners reached the slow tier on the base's scheduler and lost there to
        the composite by overlap scheduling alone (session 27: two at 10237-10458 ms a replay
        against the composite's 8942), which said nothing about their decode steps."""
        with self._lock:
            upd: dict[str, Any] = {}
            if self.scheduler is not None and plan.scheduler == base.scheduler:
                upd["scheduler"] = self.scheduler
            if self.token_graph_sizes is not None and plan.cuda_graph_token_sizes == base.cuda_graph_token_sizes:
                upd["cuda_graph_token_sizes"] = list(self.token_graph_sizes)
        return normalized(plan.model_copy(update=upd)) if upd else plan

    @property
    def best_ms(self) -> float:
        with self._lock:
            return self.plans[0][0] if self.plans else math.inf
