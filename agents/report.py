"""The compile's outputs: the CompiledPlan artifact, report.md and its PNG plots.

Why: a plan is only worth rolling out with the evidence next to it — the gain against the baseline
measured in the same run, the verification report, how the search progressed, where the time per
op went before and after, and how well the cost model predicted (its error beside each measurement).
Files are written to a temporary name and renamed, so nothing half-written is left behind.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import statistics
from pathlib import Path
from typing import Any

from anneal.engine.plan import CompiledPlan, Plan
from anneal.agents.cost_model import COLLECTIVE_IMPL, PROJECTION_FAMILY, PROJECTIONS, CostModel, replay_headroom
from anneal.agents.types import Experiment, Measurement


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_artifact(out: Path, compiled: CompiledPlan) -> Path:
    path = out / "plan.json"
    _atomic_write(path, (compiled.model_dump_json(indent=2) + "\n").encode())
    return path


def plan_diff(base: Plan, plan: Plan) -> list[str]:
    """What the plan changes against the baseline, one line per change."""
    lines = []
    for op in sorted(set(base.canonical()["ops"])):
        a, b = base.choice(op), plan.choice(op)
        if a != b:
            lines.append(f"`{op}`: {a.impl} {a.params or ''} -> **{b.impl}** {b.params or ''}")
    if base.fusions != plan.fusions:
        lines.append(f"fusions: {base.fusions} -> {plan.fusions}")
    if base.cuda_graph_batch_sizes != plan.cuda_graph_batch_sizes:
        lines.append(f"CUDA-graph batch sizes: {base.cuda_graph_batch_sizes} -> {plan.cuda_graph_batch_sizes}")
    if base.cuda_graph_token_sizes != plan.cuda_graph_token_sizes:
        lines.append(f"CUDA-graph token sizes (prompt steps): {base.cuda_graph_token_sizes} -> "
                     f"{plan.cuda_graph_token_sizes}")
    if base.scheduler != plan.scheduler:
        lines.append(f"scheduler: {base.scheduler.model_dump()} -> {plan.scheduler.model_dump()}")
    if base.parallelism != plan.parallelism:
        lines.append(f"tensor parallel: {base.parallelism.tensor_parallel} -> {plan.parallelism.tensor_parallel}")
    for k in plan.kernels:
        lines.append(f"agent-written kernel `{k.op}/{k.impl}` ({len(k.source)} chars of source)")
    return lines or ["(none: the baseline plan stays)"]


def prediction_error(exps: list[Experiment]) -> tuple[float | None, int]:
    """Median |predicted - measured| / measured over measured experiments with a prediction."""
    errs = [abs(e.prediction.ms - e.measurement.median_ms) / e.measurement.median_ms
            for e in exps if e.prediction and e.measurement and e.measurement.median_ms > 0]
    return (statistics.median(errs), len(errs)) if errs else (None, 0)


# ---- plots ---------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_progress(path: Path, exps: list[Experiment], spec_key: str, t0: float) -> None:
    """Every fast-tier measurement of the plan-level objective over time, and the best so far."""
    plt = _plt()
    pts = sorted((e.finished_at - t0, e.measurement.median_ms) for e in exps
                 if e.tier == "fast" and e.measurement and e.spec and e.spec.key() == spec_key)
    fig, ax = plt.subplots(figsize=(7, 4))
    if pts:
        xs, ys = zip(*pts)
        best, cur = [], math.inf
        for y in ys:
            cur = min(cur, y)
            best.append(cur)
        ax.scatter(xs, ys, s=12, alpha=0.5, label="measured candidates")
        ax.step(xs, best, where="post", color="C3", label="best so far")
        ax.legend()
    ax.set_xlabel("seconds into the compile")
    ax.set_ylabel("decode step (ms, fast tier)")
    ax.set_title("Search progress")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_per_op(path: Path, before: dict[str, float], after: dict[str, float], source: str) -> None:
    plt = _plt()
    ops = sorted(set(before) | set(after), key=lambda o: -before.get(o, after.get(o, 0)))
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(ops))
    ax.bar([i - 0.2 for i in x], [before.get(o, 0) for o in ops], width=0.4, label="baseline")
    ax.bar([i + 0.2 for i in x], [after.get(o, 0) for o in ops], width=0.4, label="compiled")
    ax.set_xticks(list(x), ops, rotation=45, ha="right")
    ax.set_ylabel("ms per step")
    ax.set_title(f"Per-op time ({source})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_tradeoff(path: Path, base: list[Measurement], win: list[Measurement]) -> None:
    """Throughput vs latency of the slow-tier replays, baseline and compiled plan."""
    plt = _plt()
    from anneal.agents.scheduler_tuner import score

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ms, c in (("baseline", base, "C0"), ("compiled", win, "C3")):
        lat = [m.itl_p90_ms if m.itl_p90_ms is not None else m.median_ms for m in ms]
        ax.scatter([score(m) for m in ms], lat, label=label, color=c)
    ax.set_xlabel("tokens/s (slow tier, traffic replay)")
    ax.set_ylabel("p90 ITL (ms)" if any(m.itl_p90_ms is not None for m in base + win) else "median (ms)")
    ax.set_title("Throughput vs latency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- report.md -----------------------------------------------------------------------------------

_SPLIT_ROWS = (
    ("total_ms", "replay wall time", "ms"), ("decode_ms", "decode-only steps", "ms"),
    ("decode_steps", "decode-only steps, count", ""), ("decode_mean_batch", "decode batch, mean", ""),
    ("decode_step_ms", "decode step, mean", "ms"), ("prefill_ms", "steps with prompt tokens", "ms"),
    ("prefill_steps", "steps with prompt tokens, count", ""), ("between_steps_ms", "between steps", "ms"),
    ("drain_ms", "drain (after the last admission)", "ms"),
    # what steady serving sees: until the last admission the traffic's concurrency is in flight
    ("steady_ms", "until the last admission", "ms"), ("steady_tokens_per_s", "tokens/s until then", "tok/s"),
    ("pipelined_steps", "steps launched ahead (overlap scheduling)", ""),
)


def time_split_table(base: list[Measurement], win: list[Measurement]) -> list[str]:
    """Report lines: where the slow tier's replay time went, baseline vs compiled (medians over the
    rounds). Says whether a gain, or its absence, is the decode step's, the prefill's or the
    workload's own drain. Empty when the engines did not report it."""
    def med(ms: list[Measurement], key: str) -> float | None:
        xs = [m.time_split[key] for m in ms if m.time_split and key in m.time_split]
        return statistics.median(xs) if xs else None

    if med(base, "total_ms") is None or med(win, "total_ms") is None:
        return []
    L = ["", "## Where the replay's time went (slow tier, median over rounds)", "",
         "| | baseline | compiled |", "|---|---|---|"]
    one_wave = not med(base, "steady_tokens_per_s")  # every request admitted at once: no steady part
    for key, label, unit in _SPLIT_ROWS:
        b, w = med(base, key), med(win, key)
        if b is not None and w is not None and not (one_wave and key.startswith("steady_")):
            L.append(f"| {label} | {b:.4g} {unit} | {w:.4g} {unit} |".replace("  |", " |"))
    if one_wave and med(base, "steady_ms") is not None:
        L += ["", "Every request was admitted at once (one wave): the whole replay is its drain, with no steady part."]
    return L


def headroom_table(base: list[Measurement], win: list[Measurement], model: CostModel | None,
                   plans: tuple[Plan | None, Plan | None] = (None, None)) -> list[str]:
    """Report lines: how far each replay's decode steps are from the bandwidth roofline, and the
    most any plan that keeps the tokens could gain on this workload (``replay_headroom``). Says
    whether a gain target is still open, or only reachable by reading fewer bytes per token.
    ``plans``: the baseline and the winner (the rooflines of their projections on fp8 / bf12 copies count those bytes)."""
    def med(ms: list[Measurement], plan: Plan | None) -> dict[str, float] | None:
        rows = [h for m in ms if (h := replay_headroom(m.time_split or {}, model, m.speculation, plan)) is not None]
        return {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]} if rows else None

    if model is None:
        return []
    b, w = med(base, plans[0]), med(win, plans[1])
    if b is None or w is None:
        return []
    return [
        "", f"## Headroom: the replay at the roofline ({model.hw.mem_gbps:.0f} GB/s copy bandwidth)", "",
        "| | baseline | compiled |", "|---|---|---|",
        f"| decode step at the roofline (its batch and context) | {b['roofline_step_ms']:.3f} ms "
        f"| {w['roofline_step_ms']:.3f} ms |",
        f"| decode step, measured (host time included) | {b['decode_step_ms']:.3f} ms | {w['decode_step_ms']:.3f} ms |",
        f"| share of the roofline | {b['of_roofline']:.1%} | {w['of_roofline']:.1%} |",
        f"| steps with prompt tokens: measured / at the roofline | {b['prefill_ms']:.4g} / "
        f"{b['prefill_roofline_ms']:.4g} ms | {w['prefill_ms']:.4g} / {w['prefill_roofline_ms']:.4g} ms |",
        f"| replay at the bound (every step at the roofline, nothing between steps) | {b['bound_ms']:.4g} ms "
        f"| {w['bound_ms']:.4g} ms |",
        f"| most tokens/s any plan could add to this replay | x{b['bound']:.3f} | x{w['bound']:.3f} |",
        "",
        f"No plan that keeps the tokens and reads and computes as much per token (no quantization, no "
        f"speculative decoding) can beat the baseline's replay by more than x{b['bound']:.3f}.",
    ] + speculation_lines(base, b)


def speculation_lines(base: list[Measurement], b: dict[str, float]) -> list[str]:
    """What speculative decoding could add: an n-gram drafter replayed over the baseline's own greedy
    outputs (engine/ngram_draft.py), and the replay's bound with its verify steps at the roofline."""
    spec = next((m.speculation for m in base if m.speculation and m.speculation.get("verify_steps")), None)
    if spec is None or "spec_bound" not in b:
        return []
    return [
        "", f"Speculative decoding, measured on these outputs: an n-gram drafter (k={spec['k']}, suffixes of "
        f"{spec.get('min_n', 1)}-{spec['max_n']} tokens) over the baseline replay's greedy outputs would accept "
        f"{spec['accepted']} of {spec['drafted']} drafted tokens, **{b['spec_tokens_per_step']:.3f} tokens a verify step**; with every "
        f"verify step at the roofline the replay could gain at most **x{b['spec_bound']:.3f}** (x{b['bound']:.3f} "
        "without). The prompts are synthetic: a real model on real traffic repeats its context more or less "
        "than this one did.",
    ]


_CROSS_ROWS = (("tokens/s", "tokens_per_s", True), ("ITL p90 ms", "itl_p90_ms", False),
               ("TTFT p90 ms", "ttft_p90_ms", False))


STEP_SET_ROWS = 8  # the cost-model table's step rows for fusion sets: the most observed


APPLY_PARTS = ("build_s", "warmup_s", "capture_s", "total_s")  # a benchmark answer's extra.apply (engine/benchmark.py)


# An apply whose warm-up took this long compiled kernels. Session 54's ledgers (8B, H100): plans whose
# kernels were cached warmed up in 0.014 s (median, p90 0.33 s), plans with new kernels in 0.77-15 s.
COMPILING_WARMUP_S = 0.5


def engine_time_table(exps: list[Experiment]) -> list[str]:
    """Where each tier engine's time went: applying plans (build; warm-up, where Triton compiles a
    plan's kernels; capture) and timing them, from the benchmark answers the ledger keeps. Why: the
    experiments/hour is the search's speed, and it is set by kernel compiles: the same compile ran
    1965/h on an empty Triton cache and 2952/h on a warm one (session 54), the empty one's fast tier
    spending 171 of its 227 engine seconds in 42 of 184 applies. Experiments from engines that do not
    report it are left out."""
    L: list[str] = []
    notes: list[str] = []
    for tier in ("fast", "slow"):
        timed = applied = compiling = 0
        total = dict.fromkeys((*APPLY_PARTS, "benchmark_s"), 0.0)
        compiling_s = 0.0
        for e in exps:
            extra = ((e.measurement.model_extra or {}).get("extra") or {}) if e.measurement else {}
            if e.tier != tier or e.kind != "benchmark" or not isinstance(extra.get("benchmark_s"), (int, float)):
                continue
            timed += 1
            total["benchmark_s"] += extra["benchmark_s"]
            apply = extra.get("apply") or {}
            applied += bool(apply)
            for k in APPLY_PARTS:
                total[k] += float(apply.get(k) or 0.0)
            warmup = float(apply.get("warmup_s") or 0.0)
            if warmup >= COMPILING_WARMUP_S:
                compiling, compiling_s = compiling + 1, compiling_s + warmup
        if timed:
            busy = total["total_s"] + total["benchmark_s"]
            share = f"{total['total_s'] / busy:.0%}" if busy > 0 else "-"
            L.append(f"| {tier} | {timed} | {applied} | " + " | ".join(
                f"{total[k]:.1f}" for k in ("total_s", "build_s", "warmup_s", "capture_s", "benchmark_s"))
                + f" | {compiling} ({compiling_s:.1f} s) | {share} |")
            if busy > 0 and compiling_s / busy >= 0.25:
                notes.append(f"The {tier} tier spent {compiling_s / busy:.0%} of its time in the warm-ups of "
                             f"{compiling} applies that compiled kernels. Triton keeps what it compiles: a "
                             "compile on the same cache (in a cluster, the deployment's spec.kernelCache) skips "
                             "it for every plan tried before; new plans compile theirs (`--compile-ahead` builds "
                             "queued candidates' kernels in other processes meanwhile).")
    if not L:
        return []
    return ["", "## Where the engines' time went", "",
            "Seconds summed over the measured experiments. Apply: build (the plan's ops and kernel sources), warm-up "
            "(first runs: where Triton compiles the plan's kernels, unless a warm cache or compile-ahead has them) and "
            "CUDA-graph capture; timing: the benchmark itself, its warm-up steps included. Compiling applies: those "
            f"whose warm-up took {COMPILING_WARMUP_S} s or more (a plan with cached kernels warms up in ~0.01-0.3 s).",
            "", "| tier | experiments | plans applied | apply s | build s | warm-up s | capture s | timing s "
            "| compiling applies | apply share |",
            "|---|---|---|---|---|---|---|---|---|---|", *L, *(["", *notes] if notes else [])]


def _calibration_label(key: str) -> str:
    """``step/decode|a,b`` (the cost model's whole-step fit per fusion set), ``projections/<impl>``
    (the projections' shared line, ``cost_model.PROJECTION_FAMILY``) and ``<collective>/link`` as words."""
    if key.startswith(PROJECTION_FAMILY + "/"):
        return f"{key}: one line over {', '.join(PROJECTIONS)} (how a tensor-parallel rank's share scales)"
    if key.endswith("/" + COLLECTIVE_IMPL):
        return (f"{key}: the split engine's collective as timed (fixed: its latency a call; roofline: its bytes "
                f"over the data sheet's link)")
    if not key.startswith("step/"):
        return key
    mode, sep, fusions = key.partition("|")
    if not sep:
        return f"{mode}, every plan"
    return f"{mode}, fusions {fusions.replace(',', ', ')}" if fusions else f"{mode}, no fusions"


def tp_measured_table(rows: list[dict[str, Any]]) -> list[str]:
    """The compiled plan served at each tensor-parallel degree (agents/tp_measure.py): its decode
    step predicted and measured, and as ratios to degree 1's, so the model's error shows."""
    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    L = ["", "### Tensor-parallel degrees, measured", "",
         "The compiled plan (less the fusions a split model refuses) served whole at each degree by an engine "
         "of its own, its decode step on this compile's spec beside the cost model's prediction (none where "
         "the hardware has no interconnect figures).", "",
         "| degree | predicted ms | measured ms | predicted x | measured x | error (x) |",
         "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            L.append(f"| {r['degree']} | {cell(r, 'predicted_ms', '.3f')} | not run: {r['error']} | - | - | - |")
            continue
        L.append(f"| {r['degree']} | {cell(r, 'predicted_ms', '.3f')} | {cell(r, 'measured_ms', '.3f')} | "
                 f"{cell(r, 'predicted_ratio', '.3f')} | {cell(r, 'measured_ratio', '.3f')} | "
                 f"{cell(r, 'ratio_error', '+.3f')} |")
    return L


def calibration_table(calibration: dict[str, Any]) -> list[str]:
    """The cost model's fits (``CostModel.calibrations``): per op/impl, then the whole-step factors,
    the fusion sets' only for the ``STEP_SET_ROWS`` most observed."""
    L = ["", "Each op's time a call: `fixed µs + slope x its roofline` once shapes with different rooflines "
         "were timed, else `correction x its roofline`. The `step` rows: what a measured step leaves after "
         "its once-a-step ops (lm_head, embedding, final norm), over its layers' ops' predictions (the median "
         "over plans with that set of fusions, which the per-op timings of a fused plan cannot place), the "
         "last factor on every step's layers.", "",
         "| op/impl | correction | fixed µs a call | slope | observations |", "|---|---|---|---|---|"]
    rows = [(k, v) for k, v in calibration.items() if k.count("/") == 1]
    sets = sorted((kv for kv in rows if "|" in kv[0] and not kv[0].endswith("|")), key=lambda kv: -kv[1]["n"])
    hidden = {k for k, _ in sets[STEP_SET_ROWS:]}  # a 30-minute compile fits ~30 fusion sets
    L += [f"| {_calibration_label(k)} | {v['factor']:.3f} | " + (f"{v['fixed_us']:.2f} | {v['slope']:.3f}" if "fixed_us" in v else "- | -")
          + f" | {v['n']} |" for k, v in rows if k not in hidden]
    if hidden:
        L.append(f"\n{len(hidden)} more fusion sets' step rows, each observed {max(calibration[k]['n'] for k in hidden)} "
                 f"times or fewer, are left out.")
    return L


def cross_shape_table(cross: dict[str, Any], tolerance: float = 0.02) -> list[str]:
    """Report lines: the compiled plan and the baseline replayed on another traffic shape, and what
    the plan loses there. Why a verdict line: session 11's chat plan read x1.015 tokens/s on
    agentic while its ITL p90 went from 6.7 to 28.8 ms, a loss a list of numbers hid. With several
    request samples the table holds each metric's median over them, and the verdict judges the
    median of the per-sample ratios (both plans replayed the same requests) and names a sample
    that lost on its own when the median did not."""
    name = cross.get("traffic", "another shape")
    samples = cross.get("samples") or [cross]
    n = len(samples)
    said = ("once (one request sample: a few percent is noise)" if n == 1 else
            f"on {n} request samples, both on each (the table: medians; ratios: median of the samples')")
    L = ["", "## Measured on another traffic shape", "", f"Both plans replayed `{name}` {said}.", "",
         "| metric | baseline | compiled | ratio |" + (" per sample |" if n > 1 else ""),
         "|---|---|---|---|" + ("---|" if n > 1 else "")]
    losses, sample_losses = [], []
    for label, key, higher_is_better in _CROSS_ROWS:
        b, c = cross.get(f"baseline_{key}"), cross.get(f"compiled_{key}")
        per = [r[f"compiled_{key}"] / r[f"baseline_{key}"] for r in samples
               if r.get(f"baseline_{key}") and r.get(f"compiled_{key}") is not None]
        ratio = statistics.median(per) if per and len(per) == n else None
        L.append(f"| {label} | {_num(b)} | {_num(c)} | {'-' if ratio is None else f'{ratio:.3f}'} |"
                 + (f" {', '.join(f'{x:.3f}' for x in per) or '-'} |" if n > 1 else ""))

        def lost(x: float) -> bool:
            return x < 1 - tolerance if higher_is_better else x > 1 + tolerance

        if ratio is not None and lost(ratio):
            losses.append(f"{label} x{ratio:.2f}")
        elif n > 1 and any(lost(x) for x in per):
            worst = min(per) if higher_is_better else max(per)
            sample_losses.append(f"{label} x{worst:.2f} on one sample")
    also = ", ".join(sample_losses)
    L += ["", f"On `{name}` the plan loses: {', '.join(losses)}" + (f"; and {also}." if also else ".") if losses else
          f"On `{name}` the plan loses nothing beyond {tolerance:.0%} in tokens/s, ITL p90 or TTFT p90"
          + (f" (median of the samples; {also})." if also else ".")]
    return L


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def write_report(
    out: Path, compiled: CompiledPlan, baseline: Plan, exps: list[Experiment], *, t0: float,
    wall_s: float, spec_key: str, per_op: tuple[dict[str, float], dict[str, float], str] | None,
    base_m: list[Measurement], win_m: list[Measurement], rejected: list[tuple[str, str]],
    notes: list[str], calibration: dict[str, Any], tp_choice: tuple[int, dict[int, float]] | None,
    cross: dict[str, Any] | None = None, roofline: CostModel | None = None, paired: list[float] | None = None,
    ranked_on: float | None = None, budget: str | None = None, tp_measured: list[dict[str, Any]] | None = None,
) -> Path:
    plot_progress(out / "search_progress.png", exps, spec_key, t0)
    if per_op:
        plot_per_op(out / "per_op.png", *per_op)
    plot_tradeoff(out / "throughput_latency.png", base_m, win_m)

    ran = [e for e in exps if e.verdict.status != "pruned" and e.kind == "benchmark"]
    by_status: dict[str, int] = {}
    for e in exps:
        by_status[e.verdict.status] = by_status.get(e.verdict.status, 0) + 1
    per_hour = len(ran) / wall_s * 3600 if wall_s > 0 else 0.0
    err, n_err = prediction_error(exps)
    L: list[str] = [
        f"# Anneal compile: {compiled.model} on {compiled.hardware}",
        "",
        f"- traffic: `{compiled.traffic.get('name') or 'custom'}`; created {compiled.created_at}",
        f"- plan hash `{compiled.plan.hash}` (baseline `{baseline.hash}`)",
        f"- {len(exps)} experiments in {wall_s:.0f} s ({per_hour:.0f} measured experiments/hour); "
        + ", ".join(f"{k}: {v}" for k, v in sorted(by_status.items())),
        *([f"- budget: {budget}"] if budget else []),
        "",
        "## Gain against the baseline (slow tier, traffic replay, same run)",
        "",
        "| metric | baseline (median) | compiled (median) | ratio (median of per-sample ratios) |",
        "|---|---|---|---|",
    ]
    for g in compiled.gains:
        L.append(f"| {g.metric} | {g.baseline:.4g} {g.unit} | {g.candidate:.4g} {g.unit} | {g.ratio:.3f} |")
    if paired:
        L += ["", "tokens/s against the baseline on each fresh request sample (both replayed the same requests): "
              + ", ".join(f"x{r:.3f}" for r in paired) + f"; median x{statistics.median(paired):.3f}"
              + (f". On the sample the candidates were ranked on: x{ranked_on:.3f}, not counted (the best "
                 "of several readings there is biased up)" if ranked_on is not None else "")]
    if compiled.plan.hash == baseline.hash:
        L += ["", "No candidate beat the baseline and passed every gate: the baseline plan is kept."]
    L += time_split_table(base_m, win_m)
    L += headroom_table(base_m, win_m, roofline, (baseline, compiled.plan))
    L += ["", "## What changed", ""] + [f"- {line}" for line in plan_diff(baseline, compiled.plan)]
    L += ["", "## Verification", ""]
    checks = compiled.verification.get("checks", [])
    if checks:
        L += ["| check | passed | detail |", "|---|---|---|"]
        L += [f"| {c['name']} | {'yes' if c['passed'] else 'NO'} | {c.get('detail', '')} |" for c in checks]
    else:
        L.append(compiled.verification.get("note", "not run"))
    if rejected:
        L += ["", "## Rejected at promotion", ""] + [f"- `{h[:12]}`: {why}" for h, why in rejected]
    bad = [e for e in exps if e.verdict.status in ("rejected", "failed")]
    if bad:
        L += ["", "## Rejected or failed experiments", ""]
        L += [f"- #{e.id} {e.kind} by {e.agent} ({e.note}): {e.verdict.status}: {e.verdict.reason[:300]}"
              for e in bad[:40]]
    top = sorted((e for e in exps if e.tier == "fast" and e.measurement and e.spec
                  and e.spec.key() == spec_key and e.verdict.status == "measured"),
                 key=lambda e: e.measurement.median_ms)[:10]
    if top:
        L += ["", "## Best fast-tier candidates (plan-level objective: one decode step)", "",
              "| plan | agent | what | predicted ms | measured ms | spread |", "|---|---|---|---|---|---|"]
        for e in top:
            pred = f"{e.prediction.ms:.3f}" if e.prediction else "-"
            L.append(f"| `{e.plan_hash[:10]}` | {e.agent} | {e.note[:60]} | {pred} | "
                     f"{e.measurement.median_ms:.3f} | {e.measurement.spread:.2f} |")
    L += engine_time_table(exps)
    L += ["", "## Cost model", ""]
    L.append(f"Median prediction error: {err:.1%} over {n_err} measurements" if err is not None
             else "No predictions to compare.")
    if tp_choice:
        tp, table = tp_choice
        degree = compiled.plan.parallelism.tensor_parallel
        L.append(f"\nTensor-parallel degree recommended: {tp} (predicted decode-step ms of the winner's ops, "
                 "unfused, by degree: " + ", ".join(f"{k}: {v:.3f}" for k, v in table.items())
                 + "; the kernels' fitted fixed cost a call included, the collectives at the link's figures: the "
                 "GPU's data sheet, gloo's measured cost on the CPU). A prediction: the search ran at degree "
                 f"{degree} and the plan keeps it; serve another degree with `anneal serve --tensor-parallel-size` "
                 "(less the fusions that add the residual inside o/down: `folded_norm`, `linear_norm`, "
                 "`norm_stats`).")
        if degree > 1:
            L.append(f"At degree {degree} the measured o_proj, down_proj and lm_head times hold their collectives; "
                     "the fit takes out the link figures' estimate of them, so the predictions for other degrees "
                     "are as good as those figures.")
    if tp_measured:
        L += tp_measured_table(tp_measured)
    if calibration:
        L += calibration_table(calibration)
    if cross:
        L += cross_shape_table(cross)
    if notes:
        L += ["", "## Agent notes", ""] + [f"- {n}" for n in notes]
    L += ["", "## Plots", "", "![search progress](search_progress.png)", ""]
    if per_op:
        L += ["![per-op time](per_op.png)", ""]
    L += ["![throughput vs latency](throughput_latency.png)", ""]
    path = out / "report.md"
    _atomic_write(path, "\n".join(L).encode())
    return path


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

