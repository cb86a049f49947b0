"""`anneal compile`: one compilation from engines to a verified CompiledPlan and its report.

The loop: connect to (or start) the fast- and slow-tier engines; read the search space and the
hardware from the fast tier; run the proposer agents concurrently until the search share of the
budget is spent; try each op the kernel tuner tuned alone on the fast tier's decode step, keeping
only those whose step wins (``op_trials``); promote the best candidates on the slow tier (traffic
replay, verification, consistent re-measurement, baseline in the same run); write ``plan.json``,
``report.md`` + plots and ``ledger.sqlite``. Re-running with the same ``--out`` resumes: finished
experiments are reused, and the budget is what the earlier runs there left of it (``budget_spent``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from anneal.engine.config import ModelError, config_from_hf
from anneal.engine.plan import CompiledPlan, Plan
from anneal.engine.presets import is_random, preset_config
from anneal.agents.board import Board, SearchSetting
from anneal.agents.cost_model import CostModel
from anneal.agents.engine_client import EngineClient, EngineError
from anneal.agents.graph_buckets import GraphBucketAgent
from anneal.agents.job_report import LedgerCheckpoints, publish_result, report_progress, restore_ledger
from anneal.agents.kernel_tuner import KernelTuner
from anneal.agents.lab import BudgetExhausted, EngineUnavailable, Lab
from anneal.agents.ledger import Ledger
from anneal.agents.llm_writer import maybe_writer
from anneal.agents.local_engines import LocalEngines, exit_on_sigterm
from anneal.agents.op_trials import op_trials
from anneal.agents.plan_search import PlanSearch, fusion_additions, fusion_retrials, fusion_stack_check
from anneal.agents.promotion import Promotion, promote, slow_tier_candidates
from anneal.agents.report import now_iso, write_artifact, write_report
from anneal.agents.scheduler_tuner import SchedulerTuner, score
from anneal.agents.setting import CPU_MAX_LEN, make_setting, workload_requests
from anneal.agents.tp_measure import at_degree, degrees_to_measure, measure_degrees
from anneal.agents.swarm import run_swarm, summary
from anneal.agents.types import BenchSpec, Candidate, CompileSettings
from anneal.operator.naming import EXIT_ENGINES_LOST

AGENT_NAMES = ("kernel-tuner", "plan-search", "graph-buckets", "scheduler-tuner", "llm-writer")
ENGINE_STOP_GRACE_S = 20.0  # a finished compile's engines: time to exit cleanly
# Times the engines this compile started are started again after one died (a CUDA error that lost its
# context: session 55) or stopped answering; each restart resumes from the ledger on what is left of
# the budget. Engines given by URL are another supervisor's to restart.
ENGINE_RESTARTS = 2
INTERRUPTED_STOP_GRACE_S = 3.0  # a failed or interrupted one's: their work is abandoned
SEARCH_SHARE = 0.55  # of the budget for the fast-tier search; the rest promotes and verifies
# Fresh request samples promotion replays on the CPU (quick mode): a tiny model's replay takes ~50 ms,
# so three cost about a second; with one, the demo once promoted a scheduler-only plan at x1.626 on a
# 44-ms replay whose decode steps a scheduler change cannot speed up (session 31; x1.000 in the next
# two runs).
QUICK_ROUNDS = 3
OP_TRIALS_SHARE = 0.1  # of the budget, after the search: the op trials' readings (op_trials)
FUSION_RETRIALS_SHARE = 0.1  # after them: the retiled fusions beside the tuned ops (fusion_retrials)
FUSION_ADDITIONS_SHARE = 0.05  # then the fusions the composite lacks, each on it (fusion_additions)
FUSION_STACK_SHARE = 0.05  # then the composite's fusions timed together (fusion_stack_check)
PROMOTION_SHARE = 0.85  # no further slow-tier candidate once one is measured; the winner's rounds run on
EXTRA_PROMOTED = 12  # more fast-tier plans replayed on the slow tier while the promotion deadline allows


class CompileError(RuntimeError):
    """A compile that cannot go on; the message says what to do."""


class EngineGone(CompileError):
    """A tier engine died or stopped answering during the search."""


def add_compile_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `anneal compile` (the lead wires this into the CLI)."""
    p = parser
    p.add_argument("--model", required=True, help="Hugging Face model folder or random:<preset>")
    p.add_argument("--traffic", required=True, help="preset (chat, rag, agentic, batch) or a YAML/JSON TrafficShape")
    p.add_argument("--budget", type=float, default=120.0,
                   help="seconds of search and promotion once the engines are up (default 120), over all "
                        "the runs in one --out: a rerun there spends what the earlier runs left; the "
                        "winner's checks and re-measurements run past it (the report says how long)")
    p.add_argument("--out", default="anneal-out",
                   help="output folder (plan.json, report.md + PNGs, ledger.sqlite); an existing ledger "
                        "there is resumed: experiments it holds are reused, not run again, and the time "
                        "its runs spent counts against --budget")
    p.add_argument("--engines", default=None, help="FAST_URL,SLOW_URL of running engines' admin APIs; "
                   "without it both tiers start as local `anneal serve` processes")
    p.add_argument("--report-to", default=None, metavar="NS/NAME", help="CompilationJob to report progress to")
    p.add_argument("--baseline-plan", default=None, metavar="FILE",
                   help="Plan or CompiledPlan both engines apply first: the baseline the search must beat "
                        "(default: what the engines serve, the reference plan for local engines)")
    p.add_argument("--seed-plans", default=None, metavar="FILE[,FILE...]",
                   help="Plan or CompiledPlan files the plan search measures first and then evolves like its own "
                        "finds: a warm start from earlier compiles or hand-set plans")
    p.add_argument("--fast-layers", type=int, default=None, help="layers of the fast-tier engine (default 1)")
    p.add_argument("--slow-tier-memory", type=float, default=None, metavar="SHARE",
                   help="the locally started slow tier's share of GPU memory for weights + KV cache (default: "
                        "the share that leaves room beside its KV cache for the largest second copies of weights a "
                        "candidate may need, folded_norm over bf12 copies, ~20 GB on an 8B: 0.72 on an 80-GB card; "
                        "the engine's 0.85 where that leaves room already); a candidate without room is refused")
    p.add_argument("--device", default=None, help="device of locally started engines (default: cuda if available, else cpu)")
    p.add_argument("--agents", default=None, help=f"comma-separated subset of {','.join(AGENT_NAMES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=None,
                   help=f"scale the traffic's lengths to fit this many tokens (default {CPU_MAX_LEN} "
                        f"on CPU engines, else the engines' max_model_len)")
    p.add_argument("--cross-traffic", default=None,
                   help="also measure baseline and winner on this other traffic shape (the loss is reported)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs per replica the cost model may split the model over (default: the GPUs the "
                        "fast-tier engine sees)")
    p.add_argument("--measure-tp", default="auto", metavar="auto|off|N[,N...]",
                   help="serve the compiled plan at these tensor-parallel degrees after the search (each a "
                        "whole-model engine of its own, the tiers stopped first) and set its decode step beside "
                        "the cost model's prediction in the report; auto (default): degree 1 and the "
                        "recommended one when that is not 1; local engines only")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--fp8-weights", action="store_true",
                   help="let the search run the layers' projections on weight-only fp8 (e4m3) copies: half "
                        "the bytes a decode step reads, lossy, so a winner must still pass the quality check "
                        "against the reference plan (real checkpoints do; random weights do not)")
    p.add_argument("--compile-ahead", action="store_true",
                   help="ask the fast engine to compile each queued candidate's kernels ahead (POST "
                        "/admin/prepare): on an empty Triton cache (a fresh machine or pod) a compile ran "
                        "3595 experiments/h with it against 1946/h without (one H100); off by default, as on a "
                        "warm cache most candidates hit the JIT cache (the H200: 3906/h against 4517/h)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved slow-tier re-measurements of winner and baseline (default 2 on a GPU, "
                        "1 on the CPU); the median decides, so more rounds narrow a noisy replay")
    return p


def _measure_tp_flag(value: str) -> list[int] | None:
    """``--measure-tp``: None for auto, [] for off, else the degrees (1-8)."""
    if value == "auto":
        return None
    if value == "off":
        return []
    try:
        degrees = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        degrees = []
    if not degrees or any(not 1 <= d <= 8 for d in degrees):
        raise ValueError(f"--measure-tp: auto, off or degrees 1-8 separated by commas (got {value!r})")
    return degrees


def budget_spent(ledger: Ledger) -> float:
    """Seconds of budget the ledger's earlier runs spent: for each run whose start is recorded, from
    its start to its last recorded experiment (a killed run's unrecorded last moments are lost)."""
    starts = ledger.get_meta("run_starts", {}) or {}
    last = ledger.last_finished()
    return sum(max(0.0, last[run] - start) for run, start in starts.items() if run in last)


def _options() -> dict[str, Any]:
    """Extra options from the operator (env ANNEAL_COMPILE_OPTIONS, JSON)."""
    raw = os.environ.get("ANNEAL_COMPILE_OPTIONS")
    if not raw:
        return {}
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CompileError(f"ANNEAL_COMPILE_OPTIONS is not JSON: {e}") from None
    return opts if isinstance(opts, dict) else {}


def run_compile(args: argparse.Namespace) -> int:
    """Entry point of `anneal compile`; returns the exit status."""
    opts = _options()
    agents = args.agents.split(",") if args.agents else list(opts.get("agents") or AGENT_NAMES)
    unknown = sorted(set(agents) - set(AGENT_NAMES))
    if unknown:
        print(f"anneal compile: unknown agents {unknown}; known: {', '.join(AGENT_NAMES)}", file=sys.stderr)
        return 2
    engines = None
    if args.engines:
        urls = [u.strip() for u in args.engines.split(",") if u.strip()]
        if len(urls) != 2:
            print("anneal compile: --engines needs FAST_URL,SLOW_URL", file=sys.stderr)
            return 2
        engines = (urls[0], urls[1])
    if args.report_to and args.report_to.count("/") != 1:
        print(f"anneal compile: --report-to must be NAMESPACE/NAME, got {args.report_to!r}", file=sys.stderr)
        return 2
    device = args.device or _default_device()
    try:
        settings = CompileSettings(
            model=args.model, traffic=args.traffic, budget_s=args.budget, out=args.out, engines=engines,
            report_to=args.report_to, fast_layers=args.fast_layers or int(opts.get("fastLayers") or 1),
            seed=args.seed, device=device, baseline_plan=args.baseline_plan, rounds=args.rounds,
            compile_ahead=args.compile_ahead, fp8_weights=args.fp8_weights or bool(opts.get("fp8Weights")),
            seed_plans=[f.strip() for f in (args.seed_plans or "").split(",") if f.strip()],
            measure_tp=_measure_tp_flag(args.measure_tp), slow_tier_memory=args.slow_tier_memory,
        )
    except ValueError as e:  # a flag out of range: name the flag, not the settings field
        if not isinstance(e, ValidationError):
            print(f"anneal compile: {e}", file=sys.stderr)
            return 2
        flags = {"budget_s": "--budget", "fast_layers": "--fast-layers", "slow_tier_memory": "--slow-tier-memory"}
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            print(f"anneal compile: {flags.get(field, '--' + field.replace('_', '-'))}: {err['msg']} "
                  f"(got {err.get('input')!r})", file=sys.stderr)
        return 2
    out_existed = Path(args.out).exists()
    if engines is None:  # the engines start here: a model they cannot load fails now, not after their start
        try:
            _ = preset_config(args.model.split(":", 1)[1]) if is_random(args.model) else config_from_hf(args.model)
        except ModelError as e:
            print(f"anneal compile: --model: {e}", file=sys.stderr)
            return 2
    try:
        compiled = compile_plan(
            settings, agents=agents, max_len=args.max_len, cross_traffic=args.cross_traffic,
            gpus=args.gpus, progress=not args.quiet, verification=opts.get("verification") or {},
            llm_model=(opts.get("llm") or {}).get("model"),
        )
    except (CompileError, EngineError, ValueError) as e:
        print(f"anneal compile: {e}", file=sys.stderr)
        report_progress(args.report_to, phase="Done", message=f"failed: {e}"[:500])
        if not out_existed and Path(args.out).is_dir() and not any(Path(args.out).iterdir()):
            Path(args.out).rmdir()  # a bad input file: leave no empty --out behind
        return EXIT_ENGINES_LOST if isinstance(e, EngineGone) and settings.engines else 1
    gain = next((g for g in compiled.gains if g.metric == "tokens_per_s"), None)
    print(f"plan {compiled.plan.hash} written to {Path(args.out) / 'plan.json'}"
          + (f"; tokens/s x{gain.ratio:.3f} vs baseline" if gain else ""))
    if not compiled.verification.get("passed"):
        failed = [c.get("name") for c in compiled.verification.get("checks", []) if not c.get("passed")]
        print(f"anneal compile: the resulting plan did not pass verification ({', '.join(failed)}); "
              f"do not serve it — see {Path(args.out) / 'report.md'}", file=sys.stderr)
        return 1
    return 0


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


# ---- the loop --------------------------------------------------------------------------------------

def _agents(names: list[str], llm_model: str | None = None):
    out = []
    for n in names:
        if n == "kernel-tuner":
            out.append(KernelTuner())
        elif n == "plan-search":
            out.append(PlanSearch())
        elif n == "graph-buckets":
            out.append(GraphBucketAgent())
        elif n == "scheduler-tuner":
            out.append(SchedulerTuner())
        elif n == "llm-writer":
            w = maybe_writer(**({"model": llm_model} if llm_model else {}))
            if w is not None:
                out.append(w)
    return out


def _fusion_phase(progress, board: Board, phase: Callable[[], list[str]], said: str, spent: str) -> None:
    """One of the fusion phases between the search and promotion: ``phase()`` returns the fusions it
    tried, kept or dropped (said after ``said``); its share of the budget running out ends it with
    ``spent`` in the report's notes, what was read by then decided."""
    try:
        names = phase()
    except BudgetExhausted:
        board.note(spent)
        return
    if names:
        _say(progress, said + ", ".join(names))


def compile_plan(
    settings: CompileSettings, *, agents: list[str] | None = None, max_len: int | None = None,
    cross_traffic: str | None = None, gpus: int | None = None, progress: bool = True,
    verification: dict[str, Any] | None = None, clients: dict[str, EngineClient] | None = None,
    llm_model: str | None = None,
) -> CompiledPlan:
    """One compilation; writes plan.json, report.md (+ PNGs) and ledger.sqlite under ``settings.out``."""
    from anneal.engine.traffic import load_traffic

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    traffic = load_traffic(settings.traffic)
    with exit_on_sigterm():
        return _with_engines(settings, out, traffic, clients, agents, max_len, cross_traffic, gpus, progress,
                             verification, llm_model)


def _with_engines(settings, out, traffic, clients, agents, max_len, cross_traffic, gpus, progress,
                  verification, llm_model) -> CompiledPlan:
    # read before any engine starts: a bad file fails the compile without starting or measuring
    baseline = _read_plan(settings.baseline_plan, "--baseline-plan") if settings.baseline_plan else None
    seeds = [_read_plan(path, "--seed-plans") for path in settings.seed_plans]
    local: LocalEngines | None = None
    if clients is None:
        if settings.engines:
            clients = {"fast": EngineClient(settings.engines[0], name="fast-tier engine"),
                       "slow": EngineClient(settings.engines[1], name="slow-tier engine")}
        else:
            local = LocalEngines(settings.model, out, fast_layers=settings.fast_layers, device=settings.device,
                                 plan=settings.baseline_plan, slow_memory_share=settings.slow_tier_memory)
            _say(progress, f"starting the fast-tier ({settings.fast_layers} layers) and slow-tier engines ...")
            clients = local.start()
    restored = restore_ledger(settings.report_to, out / "ledger.sqlite")
    if restored:
        _say(progress, f"resuming from the ledger an earlier coordinator of {settings.report_to} saved ({restored} bytes)")
    ledger = Ledger(out / "ledger.sqlite")
    checkpoints = LedgerCheckpoints(settings.report_to, ledger) if settings.report_to else None
    t0_wall, t0 = time.time(), time.monotonic()  # the budget starts once the engines answer
    grace_s = ENGINE_STOP_GRACE_S
    try:
        if baseline is not None and local is None:  # local tiers were started on it already
            _apply_baseline(clients, baseline, settings.baseline_plan, progress)
        restarts = 0
        while True:
            try:
                return _compile(settings, clients, ledger, traffic, t0, t0_wall, agents or list(AGENT_NAMES),
                                max_len, cross_traffic, gpus, progress, verification or {}, llm_model, seeds,
                                stop_tiers=local.stop if local is not None else None)
            except (EngineGone, EngineUnavailable, EngineError) as e:
                died = local is not None and any(not eng.alive() for eng in local.engines.values())
                if isinstance(e, EngineError) and not died:
                    raise  # an answer the compile cannot use, from a live engine
                if local is None and settings.report_to:  # the operator restarts them and a new coordinator
                    raise EngineGone(f"{e}; the ledger keeps what was measured for the next coordinator") from e
                if local is None or restarts == ENGINE_RESTARTS:
                    raise EngineGone(f"{e}; the ledger keeps what was measured: rerun with the same --out "
                                     "to resume") from e
                restarts += 1
                _say(progress, f"{e}; restarting the engines and resuming from the ledger ({restarts} of "
                               f"{ENGINE_RESTARTS}; their logs: {out}/engine-*.log)")
                local.stop(timeout_s=INTERRUPTED_STOP_GRACE_S)
                for c in clients.values():
                    c.close()
                clients = local.start()
                t0_wall, t0 = time.time(), time.monotonic()
    except BaseException:
        # Failed or interrupted: what the engines still run is this compile's own measurement,
        # abandoned, so they are not given time to finish it (a SIGTERM'd pod has ~30 s in all).
        grace_s = INTERRUPTED_STOP_GRACE_S
        raise
    finally:
        if local is not None:  # first: an agent's request still in flight then fails at once
            local.stop(timeout_s=grace_s)
        for c in clients.values():
            c.close()
        if checkpoints is not None:
            checkpoints.close()
        ledger.close()


def _compile(settings, clients, ledger, traffic, t0, t0_wall, agent_names, max_len, cross_traffic, gpus,
             progress, verification, llm_model, seeds=(), stop_tiers=None) -> CompiledPlan:
    out = Path(settings.out)
    fast_state, slow_state = clients["fast"].state(), clients["slow"].state()
    if fast_state.model != slow_state.model:
        raise CompileError(f"the tiers serve different models: fast {fast_state.model}, slow {slow_state.model}")
    if settings.model and settings.model not in (fast_state.model, fast_state.model.split("/")[-1]):
        _say(progress, f"note: engines serve {fast_state.model} (asked for {settings.model})")
    run_id = uuid.uuid4().hex[:12]
    ledger.set_meta("runs", [*(ledger.get_meta("runs", []) or []), run_id])
    # A resumed compile spends what its earlier runs left of the budget: a 30-minute compile can
    # then run as several shorter ones (a device's 10-minute calls), each killed one picking up where
    # it stopped, and a finished one rerun reuses everything instead of searching again.
    spent = budget_spent(ledger)
    ledger.set_meta("run_starts", {**(ledger.get_meta("run_starts", {}) or {}), run_id: t0_wall})
    t0 -= spent
    quick = not fast_state.device.startswith("cuda")
    if max_len is None:  # decided by where the engines run, not by this (maybe torch-free) process
        max_len = CPU_MAX_LEN if quick else None
    engine_max = min(int((s.model_extra or {}).get("max_model_len") or 1 << 30) for s in (fast_state, slow_state))
    max_len = min(max_len or engine_max, engine_max)
    setting, traffic = make_setting(fast_state, traffic, seed=settings.seed, max_len=max_len, quick=quick,
                                    fp8_weights=settings.fp8_weights)
    # seeds run at the engines' degree (fixed when they started): an earlier compile's degree-1 plan
    # seeds a degree-2 compile less the fusions a split model refuses
    degree = setting.base.parallelism.tensor_parallel
    setting.seeds = [s if s.parallelism.tensor_parallel == degree else at_degree(s, degree) for s in seeds]
    traffic_json = traffic.model_dump(mode="json", exclude_none=True)
    try:
        cost = CostModel.from_state(fast_state)
    except ValueError as e:
        _say(progress, f"cost model off: {e}")
        cost = None
    board = Board()
    lab = Lab(ledger=ledger, engines=clients, cost_model=cost, run_id=run_id, traffic=traffic_json,
              deadline=t0 + settings.budget_s * SEARCH_SHARE, space=setting.space, on_note=board.note,
              base=setting.base, compile_ahead=settings.compile_ahead)
    baseline = slow_state.plan.model_copy(update={"name": None})
    report_progress(settings.report_to, phase="Searching", experiments=0,
            message=f"searching on {fast_state.model} ({fast_state.num_layers_loaded} layers)")

    agents = _agents(agent_names, llm_model)
    lab.warm_up(setting.decode_spec)
    lab.warm_up(setting.workload_spec(), traffic_json)
    resumed = (f"; resuming from {len(ledger)} ledger rows, {spent:.0f} of the {settings.budget_s:.0f} s budget "
               f"spent by earlier runs" if len(ledger) else "")
    _say(progress, f"search space: {setting.space.size:.3g} plans; agents: "
                   f"{', '.join(a.name for a in agents)}{resumed}")
    results = _search_with_progress(agents, lab, setting, board, settings, progress)
    _say(progress, f"search finished ({summary(results)}); {lab.run} new experiments, {lab.reused} reused")
    gone = [v for v in results.values() if v.startswith("error: EngineUnavailable")]
    if gone:
        raise EngineGone(gone[0].removeprefix("error: EngineUnavailable: "))

    # The kernel tuner's findings, each alone on the decode step, before the composites carry them.
    after_retrials = SEARCH_SHARE + OP_TRIALS_SHARE + FUSION_RETRIALS_SHARE
    if board.best_ops:
        _say(progress, "op trials: each tuned op alone on the base's decode step ...")
        # up to a third of the time between the search's end and promotion's: the slow tier needs the rest
        op_trials(lab, setting, board, deadline=t0 + settings.budget_s * (SEARCH_SHARE + OP_TRIALS_SHARE))
        # the fusions whose GEMVs the tuned projections retile, tried again beside them
        _fusion_phase(progress, board, lambda: fusion_retrials(
            lab, setting, board, deadline=t0 + settings.budget_s * after_retrials), "fusion trials beside the tuned ops: ",
            "fusion trials beside the tuned ops: their share of the budget was spent; what was read by then decided")
    # the fusions the composite lacks, each on it: gains that show only beside the kept ones
    _fusion_phase(progress, board, lambda: fusion_additions(lab, setting, board, deadline=t0 + settings.budget_s * (
        after_retrials + FUSION_ADDITIONS_SHARE)), "fusions tried on the composite: kept ",
        "fusion trials on the composite: their share of the budget was spent; what was read by then decided")
    # the composite's fusions, each against the composite without it: gains that do not compound
    _fusion_phase(progress, board, lambda: fusion_stack_check(lab, setting, board, deadline=t0 + settings.budget_s * (
        after_retrials + FUSION_ADDITIONS_SHARE + FUSION_STACK_SHARE)), "fusions timed together: dropped ",
        "fusions timed together: their share of the budget was spent; the composite's fusions were kept as their "
        "own trials decided")

    # Promotion on the slow tier.
    report_progress(settings.report_to, phase="Verifying", experiments=len(ledger), message="promoting on the slow tier")
    # ranked as the whole model would run them: the fast tier's step is half lm_head on the 8B
    whole = None if cost is None else (lambda ms, plan: cost.whole_model_ms(plan, setting.decode_spec, ms))
    tops = board.top_plans(settings.top_k + EXTRA_PROMOTED, distinct_fusions=True, rank=whole)

    def fast_note(ms: float, plan: Plan) -> str:
        projected = ms if whole is None else whole(ms, plan)
        return f"fast-tier {ms:.3f} ms" + ("" if projected == ms else f", {projected:.3f} ms projected to every layer")

    cands, extra = slow_tier_candidates(board, baseline, tops, settings.top_k, fast_note)
    wspec = setting.workload_spec().model_copy(update={"seed": settings.seed})
    more = f", then up to {len(extra)} more while the budget allows" if extra else ""
    _say(progress, f"promoting {len(cands)} candidates{more} on the slow tier (baseline measured in the same run) ...")
    promo = promote(lab, cands, baseline, wspec, objective=setting.objective,
                    max_spread=settings.max_spread, verify_kwargs=_verify_kwargs(verification),
                    deadline=t0 + settings.budget_s * PROMOTION_SHARE, rounds=settings.rounds or (QUICK_ROUNDS if quick else 2),
                    extra=extra)

    # The tensor-parallel degree is the cost model's recommendation (NVLink all-reduce included),
    # reported, not written into the plan: the gains above were measured at the engines' degree,
    # and a plan only carries what was measured.
    tp_choice = None
    winner = promo.winner
    if gpus is None:
        gpus = max(1, fast_state.hardware.num_gpus or 1)
    if cost is not None:  # with what this run's timings taught the model (its fits), for the winner's ops
        # unfused: several fusions add the residual inside o/down's GEMM, where a split model needs its
        # all-reduce first (bench/tp_probe.py refuses them too)
        tp_choice = cost.whole_model(max(1, gpus)).choose_tp(setting.decode_spec,
                                                             plan=winner.model_copy(update={"fusions": {}}))
        if tp_choice[0] != winner.parallelism.tensor_parallel:
            _say(progress, f"cost model: tensor-parallel degree {tp_choice[0]} predicted best on {gpus} GPU(s) "
                           f"({', '.join(f'tp{k}: {v:.3f} ms' for k, v in tp_choice[1].items())})")

    cross = _cross_measure(lab, cross_traffic, max_len, promo, wspec, quick) if cross_traffic else None
    report = promo.verification
    if report is None:  # the baseline is kept: it is verified like any winner, not assumed good
        report, _ = lab.verify(Candidate(plan=promo.winner, agent="baseline", note="kept baseline"), "slow",
                               **_verify_kwargs(verification))
    verification_doc: dict[str, Any] = {**report.model_dump(), "tier": "slow"}
    if promo.is_baseline:
        verification_doc["note"] = "no candidate beat the baseline and passed every gate; the baseline is kept"
    tp_measured = _measure_tp(settings, cost, winner, setting.decode_spec, tp_choice, stop_tiers, progress,
                              slow_state.config)
    if tp_measured is not None:
        ledger.set_meta("tp_measured", tp_measured)
    compiled = CompiledPlan(
        plan=winner.model_copy(update={"name": f"anneal-{winner.hash[:8]}"}),
        model=fast_state.model, hardware=fast_state.gpu_name or fast_state.device,
        traffic=traffic_json, gains=promo.gains, verification=verification_doc, created_at=now_iso(),
    )
    write_artifact(out, compiled)
    per_op = _per_op(ledger, baseline, promo.winner, cost, setting)
    wall = time.monotonic() - t0
    runs = len(ledger.get_meta("run_starts", {}) or {})
    # a compile can end before its budget (session 26: 1171 of 1800 s), and should say why
    over = f" over {runs} runs in this folder" if runs > 1 else ""
    budget = (f"{wall:.0f} of {settings.budget_s:.0f} s spent{over}; the search stops at {SEARCH_SHARE:.0%} of it, "
              f"promotion once its {len(cands)} candidates{more} are measured or at {PROMOTION_SHARE:.0%}; the "
              f"winner's checks and re-measurements, and the other shape's replays, run past that")
    write_report(
        out, compiled, baseline, ledger.experiments(), t0=t0_wall, wall_s=wall,
        spec_key=setting.decode_spec.key(), per_op=per_op, base_m=promo.baseline_m, win_m=promo.winner_m,
        rejected=promo.rejected, notes=board.notes, calibration=cost.calibrations() if cost else {},
        tp_choice=tp_choice, cross=cross, roofline=_slow_roofline(slow_state), paired=promo.paired,
        ranked_on=promo.ranked_on, budget=budget, tp_measured=tp_measured,
    )
    gain = next((g.ratio for g in promo.gains if g.metric == "tokens_per_s"), None)
    publish_result(settings.report_to, compiled)
    report_progress(settings.report_to, phase="Done", experiments=len(ledger), best_speedup=gain,
            best_plan_hash=compiled.plan.hash, message=f"done in {wall:.0f}s")
    return compiled


def _measure_tp(settings, cost, winner: Plan, spec: BenchSpec, tp_choice, stop_tiers, progress: bool,
                config: dict | None):
    """The winner served at the degrees ``--measure-tp`` names (auto: 1 and the recommended one)
    beside the cost model's predictions (agents/tp_measure.py); None when none are measured. The
    tier engines stop first: the degree-N engines need the GPUs' memory they hold."""
    degrees = degrees_to_measure(settings.measure_tp, tp_choice[0] if tp_choice else None)
    if not degrees or cost is None:
        return None
    if stop_tiers is None:
        _say(progress, "tensor-parallel degrees not measured: the engines were given by URL")
        return None
    stop_tiers()

    def predict(plan: Plan, degree: int) -> float:
        return cost.whole_model(degree).predict(plan, spec, tp=degree).ms

    return measure_degrees(settings.model, settings.device, Path(settings.out), winner, spec, predict, degrees,
                           say=lambda m: _say(progress, m), config=config)


def _slow_roofline(state) -> CostModel | None:
    """The slow tier's cost model (all its layers, its measured bandwidth): the report's headroom."""
    try:
        return CostModel.from_state(state)
    except ValueError:
        return None


def _read_plan(path: str, flag: str) -> Plan:
    """A plan file given with ``flag`` as a Plan, or a CompileError saying what is wrong with it."""
    from anneal.engine.plan import check_parallelism, load_plan

    try:
        plan = load_plan(Path(path).read_text())
        check_parallelism(plan)  # before any engine starts
        return plan
    except OSError as e:
        raise CompileError(f"{flag} {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise CompileError(f"{flag} {path} is not a valid plan: {e}") from None


def _apply_baseline(clients: dict[str, EngineClient], plan: Plan, path: str, progress: bool) -> None:
    """Both tiers serve the baseline before anything is measured: it is the plan to beat."""
    for tier, c in clients.items():
        _say(progress, f"{tier} tier: applying the baseline plan {plan.hash} from {path}")
        c.put_plan(plan)


VERIFY_CHECKS = ("quality", "kv_contamination", "batch_invariance", "prefix_cache", "determinism")


def _verify_kwargs(v: dict[str, Any]) -> dict[str, Any]:
    """The operator's verification tolerances (CRD field names) as /admin/verify request fields."""
    out: dict[str, Any] = {}
    for src, dst in (("logitsRtol", "rel_tol"), ("minGreedyAgreement", "min_greedy_agreement"),
                     ("numPrompts", "num_prompts"), ("steps", "steps")):
        if v.get(src) is not None:
            out[dst] = v[src]
    if v.get("kvContamination") is False:
        out["checks"] = [c for c in VERIFY_CHECKS if c != "kv_contamination"]
    return out


def _per_op(ledger: Ledger, base: Plan, win: Plan, cost: CostModel | None, setting: SearchSetting):
    """Per-op ms before/after: measured per-op timings when the engine reported them, else predicted."""
    def measured(plan: Plan) -> dict[str, float] | None:
        for e in reversed(ledger.experiments(kind="benchmark")):
            if e.plan_hash == plan.hash and e.measurement and e.measurement.per_op_ms:
                return e.measurement.per_op_ms
        return None

    b, w = measured(base), measured(win)
    if b and w:
        return b, w, "measured"
    if cost is None:
        return None
    return (cost.predict(base, setting.decode_spec).per_op_ms, cost.predict(win, setting.decode_spec).per_op_ms,
            "cost model, calibrated")


# Request samples the other shape is replayed on (each by both plans): one sample of agentic moved the
# chat plan's ITL p90 from 6.33 to 11.91 ms (session 23), so one reading says little either way.
CROSS_SAMPLES = 2


def _cross_measure(lab: Lab, spec_name: str, max_len: int | None, promo: Promotion, wspec: BenchSpec,
                   quick: bool):
    """The winner and baseline on another traffic shape: what the plan loses off its own shape,
    with the latencies. The other shape's replay has as many requests as its own compile replays:
    with this shape's count, agentic's 8 requests replayed chat (concurrency 16) at half load, where
    the agentic plan (max_num_seqs 8) read x1.07-1.08 on chat; on chat's own replay it is x0.66.
    ``CROSS_SAMPLES`` fresh samples on a GPU (one on the CPU), both plans on each, the order swapped
    from one to the next so drift favours neither; the medians and each sample's figures are kept."""
    from anneal.engine.traffic import load_traffic

    other = load_traffic(spec_name)
    if max_len:
        other = other.scaled(max_len)  # unchanged when it fits
    tj = other.model_dump(mode="json", exclude_none=True)
    n_req = workload_requests(other, quick)
    samples = []
    for i in range(1 if quick else CROSS_SAMPLES):
        spec = wspec.model_copy(update={"seed": wspec.seed + 100 + i, "num_requests": n_req})
        pair = (("baseline", promo.baseline), ("compiled", promo.winner))
        row: dict[str, Any] = {"seed": spec.seed}
        for label, plan in (pair if i % 2 == 0 else pair[::-1]):
            m = lab.measure(Candidate(plan=plan, agent="cross", note=f"{label} on {spec_name}"), spec, "slow",
                            prune=False, traffic=tj, budgeted=False).measurement
            row[f"{label}_tokens_per_s"] = round(score(m), 3) if m else None
            for k in ("itl_p90_ms", "ttft_p90_ms"):
                v = getattr(m, k) if m else None
                row[f"{label}_{k}"] = round(v, 3) if v is not None else None
        samples.append(row)
    res: dict[str, Any] = {"traffic": other.name or spec_name, "samples": samples}
    for key in samples[0]:
        if key != "seed":
            xs = [r[key] for r in samples if r[key] is not None]
            res[key] = round(statistics.median(xs), 3) if len(xs) == len(samples) else None
    ratios = [r["compiled_tokens_per_s"] / r["baseline_tokens_per_s"] for r in samples
              if r["baseline_tokens_per_s"] and r["compiled_tokens_per_s"]]
    if ratios and len(ratios) == len(samples):
        res["ratio"] = round(statistics.median(ratios), 3)
    return res


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _search_with_progress(agents, lab: Lab, setting: SearchSetting, board: Board, settings, progress: bool):
    if not progress:
        return run_swarm(agents, lab, setting, board)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    total = max(1.0, lab.deadline - time.monotonic())
    with Progress(TextColumn("[bold]search"), BarColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task("", total=total)
        last_report = [0.0]

        def tick() -> None:
            best = board.best_ms
            desc = (f"{lab.run} run, {lab.reused} reused, best {best:.3f} ms"
                    if best < float("inf") else f"{lab.run} run, {lab.reused} reused")
            bar.update(task, completed=min(total, total - max(0.0, lab.time_left())), description=desc)
            if time.monotonic() - last_report[0] > 10.0:
                last_report[0] = time.monotonic()
                report_progress(settings.report_to, phase="Searching", experiments=lab.run + lab.reused, message=desc)

        return run_swarm(agents, lab, setting, board, tick=tick)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m anneal.agents.compile`), same flags as `anneal compile`."""
    p = add_compile_args(argparse.ArgumentParser(prog="anneal compile", description=__doc__))
    return run_compile(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
