"""Where a captured decode step spends its time: every kernel of one graph replay, with the gaps.

Profiles CUDA-graph replays of one decode step under ``torch.profiler`` (CUPTI traces the kernels
inside a graph) and reports, per plan: kernels per step, the sum of kernel durations, the span from
the first kernel's start to the last one's end (span - sum = idle gaps between kernels), and a table
of kernels by name (calls per step, mean and total µs). That is the split between "kernels too
slow" and "too many kernels / gaps", which decides what to fuse.

    python bench/profile_step.py --shape llama-3.2-1b --batch-size 1 --context 1024 --plans triton
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, environment, write_result  # noqa: E402
from decode import bench_plans, decode_items, plan_key  # noqa: E402

from anneal.engine.llm import Engine, EngineArgs  # noqa: E402
from anneal.engine.sampling_params import SamplingParams  # noqa: E402
from anneal.engine.sequence import Sequence  # noqa: E402


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every GPU kernel in the trace, in start order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            out.append((e.name, float(e.time_range.start), float(e.time_range.elapsed_us())))
    return sorted(out, key=lambda k: k[1])


def split_replays(kernels, per_step: int):
    return [kernels[i:i + per_step] for i in range(0, len(kernels) - per_step + 1, per_step)]


def advances(step: list[tuple[str, float, float]]) -> list[float]:
    """How far each kernel pushes the step's end: its end minus the latest end before it (0 when it
    ends earlier). They sum to the span. With programmatic dependent launch a kernel starts early
    and waits, so its duration overstates its cost; its advance is its share of the critical path."""
    out, last = [], step[0][1] if step else 0.0
    for _, start, dur in step:
        out.append(max(0.0, start + dur - last))
        last = max(last, start + dur)
    return out


def kernel_table(steps: list[list[tuple[str, float, float]]]) -> list[dict]:
    """The steps' kernels by name, largest advance first: calls, µs and advance (share of the span)
    per step, mean µs per call."""
    by_name: dict[str, list[float]] = defaultdict(list)
    adv_by_name: dict[str, float] = defaultdict(float)
    for s in steps:
        for (name, _, dur), adv in zip(s, advances(s)):
            by_name[name].append(dur)
            adv_by_name[name] += adv
    return sorted(
        ({"kernel": n[:120], "calls_per_step": len(d) / len(steps), "mean_us": statistics.mean(d),
          "total_us_per_step": sum(d) / len(steps), "advance_us_per_step": adv_by_name[n] / len(steps)}
         for n, d in by_name.items()),
        key=lambda r: -r["advance_us_per_step"])


def print_kernels(table: list[dict], n: int = 25) -> None:
    print(f"  {'advance':>8}     {'total':>8}     calls x mean")
    for k in table[:n]:
        print(f"  {k['advance_us_per_step']:8.1f} µs  {k['total_us_per_step']:8.1f} µs  {k['calls_per_step']:5.1f} x "
              f"{k['mean_us']:7.2f}  {k['kernel']}")


def profile_plan(engine: Engine, bs: int, context: int, replays: int) -> dict:
    items = decode_items(engine, bs, context, seed=bs)
    engine.runner.run(items, decode_only=True)  # fills the graph's inputs for this batch
    g = engine.runner.graphs[bs][0]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    # kernels per replay, counted from one profiled replay
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p1:
        g.replay()
        torch.cuda.synchronize()
    per_step = len(kernel_events(p1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    steps = split_replays(kernel_events(prof), per_step)
    spans = [s[-1][1] + s[-1][2] - s[0][1] for s in steps]
    busy = [sum(k[2] for k in s) for s in steps]
    table = kernel_table(steps)
    # One layer in the middle of the step, kernel by kernel (median over the replays): which of a
    # layer's GEMVs and small kernels the critical path waits on. A layer of a graph step repeats
    # every (kernels - the head/tail ones) / layers kernels; ``window`` kernels from the middle show it.
    adv = [advances(s) for s in steps]
    mid = per_step // 2
    window = [{"index": i, "kernel": steps[0][i][0][:60],
               "advance_us": statistics.median(a[i] for a in adv),
               "duration_us": statistics.median(s[i][2] for s in steps)}
              for i in range(max(0, mid - 10), min(per_step, mid + 10))]
    gaps = [s[i + 1][1] - (s[i][1] + s[i][2]) for s in steps for i in range(len(s) - 1)]
    for s, _ in items:
        engine.blocks.free(s)
    return {"kernels_per_step": per_step, "replays": len(steps),
            "span_us_median": statistics.median(spans), "kernel_sum_us_median": statistics.median(busy),
            "gap_us_median": statistics.median(gaps) if gaps else 0.0,
            "gap_us_sum_median": statistics.median(sp - b for sp, b in zip(spans, busy)),
            "kernels": table, "middle_kernels": window}


def profile_mixed(engine: Engine, bs: int, context: int, prompt: int, reps: int, profile: bool = True) -> dict:
    """One step of a ``prompt``-token prefill chunk with ``bs`` decode rows riding along (the
    replay's steps with prompt tokens; eager, or a token graph's replay when the plan has one that
    holds it): its wall time (host included) and, with ``profile``, the host functions, the kernels'
    sum and span, and the kernels by name. Wall far above the span says the step is host-bound."""
    items = decode_items(engine, bs, context, seed=bs)
    V = engine.config.vocab_size
    g = torch.Generator().manual_seed(prompt)
    chunk = Sequence("prefill", torch.randint(0, V, (prompt,), generator=g).tolist(), SamplingParams(temperature=0),
                     seed=bs)
    assert engine.blocks.allocate(chunk), "KV cache too small for the benchmark"
    batch = items + [(chunk, prompt)]  # as the scheduler orders them: decodes first
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        engine.runner.run(batch, decode_only=False)
    sync()
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        engine.runner.run(batch, decode_only=False)  # ends in the step's one host sync
        walls.append((time.perf_counter() - t0) * 1e6)
    out = {"prompt_tokens": prompt, "decode_rows": bs, "token_graph": engine.runner.token_bucket(batch),
           "wall_us_median": statistics.median(walls)}
    if profile:
        host = host_profile(lambda: engine.runner.run(batch, decode_only=False), reps)
        ks = []
        if cuda:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                engine.runner.run(batch, decode_only=False)
                sync()
            ks = kernel_events(prof)
        out.update(kernels_per_step=len(ks), span_us=ks[-1][1] + ks[-1][2] - ks[0][1] if ks else 0.0,
                   kernel_sum_us=sum(k[2] for k in ks), kernels=kernel_table([ks]) if ks else [],
                   host_functions=host)
    for s, _ in batch:
        engine.blocks.free(s)
    return out


def host_profile(step, reps: int, top: int = 25) -> list[dict]:
    """Where a host-bound step's Python time goes: cProfile over ``reps`` steps, the functions with
    the most time of their own (µs per step), so a launch path that costs more than its kernels shows."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": calls / reps,
             "own_us_per_step": tt / reps * 1e6, "cum_us_per_step": ct / reps * 1e6}
            for (f, line, name), (_, calls, tt, ct, _) in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--plans", default="triton")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="profile-step")
    ap.add_argument("--mixed", type=int, default=0, metavar="PROMPT_TOKENS",
                    help="profile an eager step of a prefill chunk of this many tokens with --batch-size decode "
                         "rows riding along (the replay's steps with prompt tokens) instead of a graph replay")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/profile_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    bs, ctx = args.batch_size, args.context
    wanted = args.plans.split(",")
    plans = bench_plans([bs], [w for w in wanted if w.endswith(".json")])
    if args.mixed:  # the step's bs decode rows and its chunk: bs + 1 sequences
        plans = {k: p.model_copy(update={"scheduler": p.scheduler.model_copy(update={"max_num_seqs": bs + 1})})
                 for k, p in plans.items()}
    engine = Engine(EngineArgs(model=f"random:{args.shape}", device="cuda", dtype="bfloat16",
                               max_model_len=max(ctx, args.mixed) + 64,
                               num_kv_blocks=(bs + 1) * (-(-(max(ctx, args.mixed) + 64) // 16)) + 32,
                               plan=plans["reference"]))
    bw = copy_bandwidth_gbps()
    roof_us = engine.weights.nbytes() / (bw * 1e9) * 1e6
    result = {"env": environment(), "copy_gbps": bw, "shape": args.shape, "batch_size": bs, "context": ctx,
              "roofline_weights_us": roof_us, "plans": {}}
    walls: dict[str, float | str] = {}  # plan -> wall µs, or why its wall pass failed
    # Every plan's wall before any profiler runs: session 14 and session 15's call 1 read the same eager
    # step 2x slower after another plan's profile (calls 2 and 4, walls first: within 0-11% after it).
    if args.mixed:
        for name in map(plan_key, wanted):
            try:
                engine.apply_plan(plans[name])
                walls[name] = profile_mixed(engine, bs, ctx, args.mixed, args.replays, profile=False)["wall_us_median"]
            except Exception as e:  # noqa: BLE001 - the plan's entry below reports it
                walls[name] = f"{type(e).__name__}: {e}"
    for name in map(plan_key, wanted):
        try:
            engine.apply_plan(plans[name])
            if args.mixed:
                r = profile_mixed(engine, bs, ctx, args.mixed, args.replays)
                if isinstance(walls[name], str):
                    raise RuntimeError(f"the wall pass failed: {walls[name]}")
                r["wall_us_median_after_profiling"], r["wall_us_median"] = r["wall_us_median"], walls[name]
                result["plans"][name] = r
                print(f"== {args.shape} {name} prefill {args.mixed} + {bs} decode rows (ctx {ctx}, token graph "
                      f"{r['token_graph']}): {r['kernels_per_step']} kernels, wall {r['wall_us_median']:.0f} µs "
                      f"({r['wall_us_median_after_profiling']:.0f} after profiling), span {r['span_us']:.0f} µs, "
                      f"kernels {r['kernel_sum_us']:.0f} µs", flush=True)
                print_kernels(r["kernels"])
                print("  host: functions by their own time (µs per step, calls per step, cumulative µs)")
                for h in r["host_functions"]:
                    print(f"    {h['own_us_per_step']:9.1f} {h['calls_per_step']:8.1f} {h['cum_us_per_step']:9.1f}  {h['function']}")
                continue
            r = profile_plan(engine, bs, ctx, args.replays)
        except Exception as e:  # a plan that fails is a result
            result["plans"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {e}", flush=True)
            continue
        result["plans"][name] = r
        print(f"== {args.shape} {name} bs={bs} ctx={ctx}: {r['kernels_per_step']} kernels, span "
              f"{r['span_us_median']:.1f} µs, kernels {r['kernel_sum_us_median']:.1f} µs, gaps "
              f"{r['gap_us_sum_median']:.1f} µs (median gap {r['gap_us_median']:.2f}); roofline {roof_us:.1f} µs")
        print_kernels(r["kernels"])
        print("  the middle of the step, kernel by kernel (advance / duration µs):")
        for k in r["middle_kernels"]:
            print(f"    {k['index']:4d} {k['advance_us']:7.2f} {k['duration_us']:7.2f}  {k['kernel']}")
    print(json.dumps({"wrote": str(write_result(args.name, result, Path(args.out) if args.out else None))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
