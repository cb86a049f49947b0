"""Plans side by side on traffic replays: reference vs hand-set vs compiled, on every shape, one run.

Why: a compiled plan's gain means something only against the alternatives measured in the same
process on the same GPU — the reference plan, the best hand-set plan, and plans compiled for other
traffic shapes (what a plan loses off its own shape). One engine with all layers (the slow tier)
hot-swaps each plan and replays each shape's synthetic workload exactly as `anneal compile`'s
promotion does (closed loop at the shape's concurrency, lengths scaled to the engine's context),
interleaved over rounds so drift in clocks or temperature hits every plan alike. Each round is its own
request sample; a plan's ratio to another is the median over rounds of the ratio on the same sample.

    python bench/plans.py --model random:llama-3.1-8b --traffic chat,agentic \
        --plans reference,bench/plans/triton.json,out-chat/plan.json,out-agentic/plan.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402


def load_plans(specs: list[str]):
    """(label, Plan) for 'reference' or a Plan/CompiledPlan file; the label is the file's folder."""
    from anneal.engine.plan import Plan, load_plan

    out = []
    for s in specs:
        if s == "reference":
            out.append(("reference", Plan()))
            continue
        p = Path(s)
        if not p.is_file():
            raise SystemExit(f"plan file {s} does not exist")
        label = p.stem if p.stem != "plan" else p.parent.name
        out.append((label, load_plan(p.read_text())))
    return out


WARM_SEED = 10_000  # not a round's seed (rounds use 0, 1, ...)


class InProcessEngine:
    """The engine in this process: plans hot-swapped and replays run by direct calls."""

    def __init__(self, model: str, device: str, memory_utilization: float | None = None) -> None:
        from anneal.engine.hardware import measure
        from anneal.engine.llm import Engine, EngineArgs

        sizing = {} if memory_utilization is None else {"gpu_memory_utilization": memory_utilization}
        self.eng = Engine(EngineArgs(model=model, device=device, **sizing))
        self.config = self.eng.config.model_dump()
        self.dtype_bytes = self.eng.dtype.itemsize
        self.max_model_len = self.eng.max_model_len
        self.hw = measure(self.eng.device)  # the roofline each replay's decode steps are placed against

    def apply(self, plan) -> float:
        total_s = self.eng.apply_plan(plan).total_s
        if self.eng.device.type == "cuda":  # what a next plan's weight copies could get, and what the graphs hold
            from anneal.engine.weights import free_memory

            gib, (room, pools) = 2**30, free_memory(self.eng.device)
            print(f"applied {plan.name or plan.hash}: {room / gib:.1f} GiB allocatable, "
                  f"{pools / gib:.2f} GiB cached in graph pools", file=sys.stderr)
        return total_s

    def benchmark(self, req):
        from anneal.engine.benchmark import run_benchmark

        return run_benchmark(self.eng, req)

    def verify(self, plan):
        from anneal.engine.verify import VerifyRequest, verify

        return verify(self.eng, VerifyRequest(plan=plan, num_prompts=6, steps=16))  # the compile's request

    def close(self) -> None:
        pass


class ServedEngine:
    """An `anneal serve` process measured over its admin API, as `anneal compile` measures its slow
    tier (with ``fast_layers``, beside an idle fast-tier engine on the same GPU, as the compile
    starts them). Why: the compile's own gains for overlap plans read above this script's in-process
    ones (session 16: x1.160 against x1.072); the two differ in the process the replay runs in."""

    def __init__(self, model: str, device: str, out: Path, fast_layers: int | None) -> None:
        from anneal.agents.local_engines import LocalEngines

        self.local = LocalEngines(model, out, fast_layers=fast_layers, device=device)
        clients = self.local.start()
        for tier, c in clients.items():
            if tier != "slow":
                c.close()
        self.client = clients["slow"]
        state = self.client.state()
        self.config = state.config or {}
        self.dtype_bytes = 2 if state.dtype in ("bfloat16", "float16") else 4
        self.max_model_len = int((state.model_extra or {})["max_model_len"])
        self.hw = state.hardware.model_dump()

    def apply(self, plan) -> float:
        return self.client.put_plan(plan)["timings"]["total_s"]

    def benchmark(self, req):
        from anneal.engine.benchmark import BenchmarkResult

        return BenchmarkResult.model_validate(
            self.client.benchmark_answer(req.model_dump(mode="json")))

    def verify(self, plan):
        return self.client.verify(plan)

    def close(self) -> None:
        self.client.close()
        self.local.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--plans", default="reference,bench/plans/triton.json")
    ap.add_argument("--traffic", default="chat,agentic")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved measurements of every (plan, shape)")
    ap.add_argument("--seed", type=int, default=0, help="round r replays request sample seed + r (another GPU "
                    "running the same list with another seed adds independent samples)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-warm-replays", dest="warm_replays", action="store_false",
                    help="skip the untimed replay of each plan (to see what a plan's first replay after its "
                         "apply costs)")
    ap.add_argument("--engine", choices=("in-process", "served", "served-beside-fast-tier"), default="in-process",
                    help="where the replays run: this process, an `anneal serve` process over its admin API, or "
                         "that beside an idle 2-layer fast-tier engine on the same GPU (as `anneal compile` runs)")
    ap.add_argument("--verify", action="store_true",
                    help="run the verification suite on every plan but the reference first (what `anneal "
                         "compile` requires of its winner), and report which pass")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="in-process: the engine's share of GPU memory for weights and KV cache (its default "
                         "0.85); lower leaves room for a plan's second copies of weights, which are made "
                         "beside a KV cache sized once for the first plan (folded_norm on bf12 copies: ~20 GB "
                         "on an 8B)")
    ap.add_argument("--name", default=None, help="result file stem (default plans-<model>)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)

    import torch

    plans = load_plans(args.plans.split(","))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    if args.engine == "in-process":
        eng = InProcessEngine(args.model, device, args.gpu_memory_utilization)
    else:
        logs = Path(args.out or "bench/results") / f"{args.name or 'plans'}-engines"
        eng = ServedEngine(args.model, device, logs, 2 if args.engine == "served-beside-fast-tier" else None)
    try:
        return _measure(args, plans, device, eng, time.perf_counter() - t0)
    finally:
        eng.close()


def _measure(args, plans, device: str, eng, start_s: float) -> int:
    from tqdm import tqdm

    from anneal.agents.cost_model import CostModel, replay_headroom, shape_from_config
    from anneal.agents.setting import workload_requests
    from anneal.agents.types import HardwareSpec
    from anneal.engine.benchmark import BenchmarkRequest
    from anneal.engine.traffic import load_traffic

    hw = eng.hw
    roofline = CostModel(
        shape=shape_from_config(eng.config, eng.dtype_bytes),
        hw=HardwareSpec(name=device, mem_gbps=hw["copy_gbps"], matmul_tflops=hw["matmul_tflops"],
                        memory_gb=hw.get("memory_gb") or 1))
    shapes = []
    for name in args.traffic.split(","):
        t = load_traffic(name).scaled(eng.max_model_len)  # unchanged when it fits
        shapes.append((name, t, workload_requests(t, quick=device != "cuda")))

    # One untimed replay of every plan on every shape first, on a seed of its own (no round's requests
    # are replayed before they are timed): a plan's first replay after its apply pays whatever the
    # apply left, cuBLAS heuristics and allocations for new shapes, and Triton compiles when the
    # engine does not warm prompt steps (engine/prompt_warmup.py). Session 4 warmed the first plan
    # alone (it had read 10% low in round 0); session 13's chat plan, before the engine warmed prompt
    # steps, lost 2.6 s of prompt-step time to JIT in its first timed replay (x0.76 against
    # x1.04-1.06 in the next two). The reference plan is torch ops (no JIT) and replays for minutes:
    # it is warmed only when it is the one plan.
    verified, unapplied = {}, {}
    if args.verify:  # a plan that fails it could not be a compile's winner, however fast it replays
        for label, plan in plans:
            if label != "reference":
                try:
                    rep = eng.verify(plan)
                except Exception as e:  # noqa: BLE001 - e.g. no room for its weight copies: the rest still run
                    verified[label] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
                    print(f"verify {label}: could not run ({verified[label]['error']})", file=sys.stderr, flush=True)
                    continue
                verified[label] = rep.model_dump(mode="json")
                failed = "; ".join(f"{c.name}: {c.detail}" for c in rep.checks if not c.passed)
                print(f"verify {label}: " + ("passed" if rep.passed else f"FAILED ({failed})") + " ("
                      + ", ".join(f"{c.name} {c.metrics.get('max_rel_err', 0):.3g}" for c in rep.checks
                                  if "max_rel_err" in c.metrics)
                      + "".join(f", quality vs the fp32 truth {c.metrics['truth_rel_err']:.3g} (reference plan "
                                f"{c.metrics['reference_truth_rel_err']:.3g})" for c in rep.checks
                                if "truth_rel_err" in c.metrics) + ")",
                      file=sys.stderr, flush=True)
    def applied(label: str, plan) -> float | None:
        """``plan`` applied (its apply seconds), or None when it cannot be: it is left out of every
        later replay and the result says why, and the other plans are measured all the same (sessions
        49-50 lost whole side-by-side runs to one plan's out-of-memory error)."""
        if label in unapplied:
            return None
        try:
            return eng.apply(plan)
        except Exception as e:  # noqa: BLE001
            unapplied[label] = f"{type(e).__name__}: {e}"
            print(f"{label}: could not be applied, left out ({unapplied[label]})", file=sys.stderr, flush=True)
            return None

    warm = ([(label, plan) for label, plan in plans if label != "reference"] or plans) if args.warm_replays else []
    for (label, plan), (sname, shape, n) in tqdm([(p, s) for p in warm for s in shapes], desc="warm-up replays",
                                                 file=sys.stderr):
        if applied(label, plan) is None:
            continue
        eng.benchmark(BenchmarkRequest(mode="workload", traffic=shape.model_dump(mode="json"),
                                       num_requests=n, steps=1, warmup=0, seed=WARM_SEED))
    runs: dict[tuple[str, str], list[dict]] = {}
    # Each round starts one plan later (a rotation): whatever the first slot of a round costs (session
    # 4: an identical plan read 3% lower there in both rounds) lands on every plan in turn.
    jobs = [(r, label, plan, s) for r in range(args.rounds)
            for label, plan in plans[r % len(plans):] + plans[:r % len(plans)] for s in shapes]
    for r, label, plan, (sname, shape, n) in tqdm(jobs, desc="plan x shape x round", file=sys.stderr):
        apply_s = applied(label, plan)
        if apply_s is None:
            continue
        res = eng.benchmark(BenchmarkRequest(mode="workload", traffic=shape.model_dump(mode="json"),
                                             num_requests=n, steps=1, warmup=1, seed=args.seed + r))
        row = {"round": r, "seed": args.seed + r, "tokens_per_s": res.tokens_per_s, "wall_ms": res.median_ms,
               "apply_s": apply_s, **res.extra}
        head = replay_headroom(res.extra["time_split"], roofline, res.extra.get("speculation"), plan)
        if head:
            row["headroom"] = head
        runs.setdefault((label, sname), []).append(row)
        steady = res.extra.get("steady_tokens_per_s")
        print(f"round {r} {label:>24} on {sname:<8} {res.tokens_per_s:9.1f} tok/s "
              f"({f'{steady:.1f}' if steady else 'no steady part'} until the last admission)  itl p90 "
              f"{res.extra['itl_p90_ms']:7.2f} ms  ttft p90 {res.extra['ttft_p90_ms']:8.1f} ms  "
              + "wall split: decode {decode_ms:.0f} ({decode_steps} steps, batch {decode_mean_batch:.1f}), "
                "prefill {prefill_ms:.0f} ({prefill_steps} steps), between {between_steps_ms:.0f}, "
                "drain {drain_ms:.0f} ms, pipelined {pipelined_steps}/{engine_steps} steps, "
                "gc {gc_ms:.0f} ms ({gc_collections} collections, {gc_full_collections} full)".format(
                    **{"pipelined_steps": 0, "engine_steps": 0, **res.extra["time_split"]})
              + (f"; decode steps at {head['of_roofline']:.1%} of the roofline, bound x{head['bound']:.3f}"
                 if head else "")
              + (f"; an n-gram drafter: {head['spec_tokens_per_step']:.3f} tokens a verify step, bound with it "
                 f"x{head['spec_bound']:.3f}" if head and "spec_bound" in head else ""),
              file=sys.stderr, flush=True)

    table = {}
    for (label, sname), rows in runs.items():
        med = lambda k: statistics.median(x[k] for x in rows)  # noqa: E731
        table.setdefault(sname, {})[label] = {
            "plan_hash": dict(plans)[label].hash, "tokens_per_s": med("tokens_per_s"),
            "itl_p90_ms": med("itl_p90_ms"), "ttft_p90_ms": med("ttft_p90_ms"),
            "itl_p50_ms": med("itl_p50_ms"), "rounds": rows,
        }
        if label in verified:
            table[sname][label]["verified"] = verified[label]["passed"]
    def paired(rows: list[dict], ref_rows: list[dict], key: str) -> float | None:
        """Median over rounds of ``key`` against the reference's on the same round: a round's request
        sample moves every plan's figures alike. None when no round has both."""
        ref_by_round = {x["round"]: x.get(key) for x in ref_rows}
        ratios = [x[key] / ref_by_round[x["round"]] for x in rows if x.get(key) and ref_by_round.get(x["round"])]
        return round(statistics.median(ratios), 3) if ratios else None

    for sname, per in table.items():
        first_other = next((label for label, _ in plans if label != "reference" and label not in unapplied), None)
        for ref in {"reference", first_other} - {None}:
            base = per.get(ref)
            for label, m in per.items():
                if base and label != ref:
                    m[f"x_vs_{ref}"] = paired(m["rounds"], base["rounds"], "tokens_per_s")
                    m[f"itl_p90_vs_{ref}"] = round(m["itl_p90_ms"] / base["itl_p90_ms"], 3)
                    # until the last admission: what steady serving would see, without the drain
                    steady = paired(m["rounds"], base["rounds"], "steady_tokens_per_s")
                    if steady is not None:
                        m[f"steady_x_vs_{ref}"] = steady
    print("\nshape     plan                      tok/s   itl p90 ms  ttft p90 ms  ratios", file=sys.stderr)
    for sname, per in table.items():
        for label, m in per.items():
            ratios = ", ".join(f"{k}={v}" for k, v in m.items() if k.startswith(("x_vs_", "steady_x_vs_", "verified")))
            print(f"{sname:<9} {label:<24} {m['tokens_per_s']:8.1f} {m['itl_p90_ms']:11.2f} "
                  f"{m['ttft_p90_ms']:12.1f}  {ratios}", file=sys.stderr)
    path = write_result(args.name or f"plans-{args.model.removeprefix('random:')}", {
        "benchmark": "plans side by side (workload replay, closed loop at the shape's concurrency)",
        "environment": environment(), "model": args.model, "device": device, "engine": args.engine,
        "engine_start_s": start_s,
        "hardware": hw,
        "plans": {label: plan.model_dump(mode="json") for label, plan in plans},
        "shapes": {s: {"traffic": t.model_dump(mode="json"), "num_requests": n} for s, t, n in shapes},
        "results": table,
        "verification": verified,
        "failed": unapplied,
    }, Path(args.out) if args.out else None)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
