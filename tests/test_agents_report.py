"""report.md's headroom section: the replay's decode steps placed against the roofline."""

from __future__ import annotations

from anneal.agents.cost_model import CostModel, replay_headroom
from anneal.agents.report import headroom_table
from anneal.agents.types import EngineState, Measurement

H200 = EngineState(model="random:llama-3.1-8b", device="cuda", gpu_name="NVIDIA H200", dtype="bfloat16",
                   num_layers_total=32, num_layers_loaded=32)
SPLIT = {"total_ms": 9745.0, "decode_ms": 8938.0, "decode_steps": 1669, "decode_mean_batch": 10.6,
         "decode_mean_context": 800.0, "prefill_ms": 758.0, "prefill_steps": 47,
         "tokens_in_prefill_steps": 30000, "prefill_mean_rows": 9.0, "prefill_mean_context": 400.0}


def _m(split: dict | None) -> Measurement:
    return Measurement(median_ms=9745.0, tokens_per_s=1900.0, time_split=split)


def test_headroom_table_states_the_most_any_plan_can_gain():
    cm = CostModel.from_state(H200)
    faster = {**SPLIT, "total_ms": 9000.0, "decode_ms": 8200.0}
    lines = headroom_table([_m(SPLIT), _m(SPLIT)], [_m(faster)], cm)
    text = "\n".join(lines)
    base, win = replay_headroom(SPLIT, cm), replay_headroom(faster, cm)
    assert f"x{base['bound']:.3f}" in text and f"x{win['bound']:.3f}" in text
    assert f"{base['of_roofline']:.1%}" in text and base["bound"] > win["bound"] > 1
    assert "can beat the baseline's replay by more than" in text


def test_an_fp8_plan_is_held_to_the_roofline_of_the_bytes_it_reads():
    """A replay of a plan on fp8 projections: its decode steps' roofline counts their W at one byte
    a weight, so the share of the roofline stays under 1 where bf16 bytes read ~117% (session 43)."""
    from anneal.engine.plan import OpChoice, Plan

    cm = CostModel.from_state(H200)
    fp8 = Plan(ops={op: OpChoice(impl="triton_gemv_fp8") for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")})
    as_bf16, as_fp8 = replay_headroom(SPLIT, cm), replay_headroom(SPLIT, cm, plan=fp8)
    assert replay_headroom(SPLIT, cm, plan=Plan()) == as_bf16
    assert 0.5 < as_fp8["roofline_step_ms"] / as_bf16["roofline_step_ms"] < 0.6  # weights dominate at batch 10
    assert as_fp8["prefill_roofline_ms"] == as_bf16["prefill_roofline_ms"]  # prompt steps run the bf16 W
    lines = "\n".join(headroom_table([_m(SPLIT)], [_m(SPLIT)], cm, (Plan(), fp8)))
    assert f"{as_fp8['of_roofline']:.1%}" in lines and f"{as_bf16['of_roofline']:.1%}" in lines


def test_no_headroom_section_without_the_numbers():
    cm = CostModel.from_state(H200)
    old = {k: v for k, v in SPLIT.items() if k != "decode_mean_context"}  # an engine from before
    assert headroom_table([_m(old)], [_m(old)], cm) == []
    assert headroom_table([_m(SPLIT)], [_m(SPLIT)], None) == []
    assert headroom_table([_m(None)], [_m(SPLIT)], cm) == []


def test_time_split_table_shows_the_steady_part_or_says_there_is_none():
    from anneal.agents.report import time_split_table

    steady = {**SPLIT, "drain_ms": 3500.0, "steady_ms": 6000.0, "steady_output_tokens": 12000.0,
              "steady_tokens_per_s": 2000.0}
    text = "\n".join(time_split_table([_m(steady)], [_m({**steady, "steady_tokens_per_s": 2200.0})]))
    assert "| tokens/s until then | 2000 tok/s | 2200 tok/s |" in text and "one wave" not in text
    wave = {**steady, "steady_ms": 0.09, "steady_output_tokens": 0.0, "steady_tokens_per_s": 0.0}
    text = "\n".join(time_split_table([_m(wave)], [_m(wave)]))
    assert "until the last admission" not in text and "one wave" in text
    assert "one wave" not in "\n".join(time_split_table([_m(SPLIT)], [_m(SPLIT)]))  # an engine from before


def test_the_cross_shape_table_names_what_the_plan_loses_there():
    """Session 11: chat's plan on agentic read x1.015 tokens/s with ITL p90 6.69 -> 28.8 ms."""
    from anneal.agents.report import cross_shape_table

    lines = cross_shape_table({"traffic": "agentic", "baseline_tokens_per_s": 661.7, "compiled_tokens_per_s": 671.7,
                               "baseline_itl_p90_ms": 6.69, "compiled_itl_p90_ms": 28.83,
                               "baseline_ttft_p90_ms": 661.9, "compiled_ttft_p90_ms": 577.1, "ratio": 1.015})
    text = "\n".join(lines)
    assert "| ITL p90 ms | 6.69 | 28.83 | 4.309 |" in text
    assert "On `agentic` the plan loses: ITL p90 ms x4.31." in text
    fine = cross_shape_table({"traffic": "chat", "baseline_tokens_per_s": 100.0, "compiled_tokens_per_s": 99.0,
                              "baseline_itl_p90_ms": 5.0, "compiled_itl_p90_ms": None})
    assert "| ITL p90 ms | 5 | - | - |" in "\n".join(fine) and "loses nothing beyond 2%" in fine[-1]


def test_the_cross_shape_table_over_two_samples_judges_their_median_and_names_a_sample_that_lost():
    """Session 23's two agentic samples of the chat plan: ITL p90 x1.654 on one, x0.924 on the other."""
    from anneal.agents.report import cross_shape_table

    samples = [{"seed": 100, "baseline_tokens_per_s": 495.3, "compiled_tokens_per_s": 553.2,
                "baseline_itl_p90_ms": 7.20, "compiled_itl_p90_ms": 11.91,
                "baseline_ttft_p90_ms": 808.4, "compiled_ttft_p90_ms": 691.8},
               {"seed": 101, "baseline_tokens_per_s": 683.2, "compiled_tokens_per_s": 744.8,
                "baseline_itl_p90_ms": 6.85, "compiled_itl_p90_ms": 6.33,
                "baseline_ttft_p90_ms": 635.1, "compiled_ttft_p90_ms": 558.4}]
    cross = {"traffic": "agentic", "samples": samples, "baseline_itl_p90_ms": 7.025, "compiled_itl_p90_ms": 9.12,
             "baseline_tokens_per_s": 589.25, "compiled_tokens_per_s": 649.0,
             "baseline_ttft_p90_ms": 721.75, "compiled_ttft_p90_ms": 625.1}
    text = "\n".join(cross_shape_table(cross))
    assert "on 2 request samples" in text
    assert "| ITL p90 ms | 7.025 | 9.12 | 1.289 | 1.654, 0.924 |" in text
    assert "On `agentic` the plan loses: ITL p90 ms x1.29." in text
    calm = [dict(samples[0], compiled_itl_p90_ms=7.6), dict(samples[1], compiled_itl_p90_ms=6.5)]  # x1.056, x0.949
    text = "\n".join(cross_shape_table({**cross, "samples": calm}))
    assert "loses nothing beyond 2% in tokens/s, ITL p90 or TTFT p90 (median of the samples; ITL p90 ms x1.06 " \
           "on one sample)." in text
    slower = [dict(c, compiled_tokens_per_s=c["baseline_tokens_per_s"] * 0.9) for c in calm]
    text = "\n".join(cross_shape_table({**cross, "samples": slower}))
    assert "On `agentic` the plan loses: tokens/s x0.90; and ITL p90 ms x1.06 on one sample." in text


def test_the_cost_model_table_names_the_step_rows_and_keeps_the_most_observed_fusion_sets():
    from anneal.agents.report import STEP_SET_ROWS, calibration_table

    sets = {f"step/decode|f{i:02d},lm_head_argmax": {"factor": 0.9, "n": 100 - i} for i in range(STEP_SET_ROWS + 3)}
    cal = {"attention_decode/triton_splitk": {"factor": 2.2, "n": 41, "fixed_us": 11.83, "slope": 1.093},
           "attention_decode/triton_splitk/{\"prefetch\": 16}": {"factor": 2.0, "n": 3},
           "step/decode": {"factor": 0.96, "n": 795}, "step/decode|": {"factor": 0.962, "n": 523}, **sets}
    text = "\n".join(calibration_table(cal))
    assert "| attention_decode/triton_splitk | 2.200 | 11.83 | 1.093 | 41 |" in text
    assert "prefetch" not in text  # per-params fits stay out of the table
    assert "| step/decode, every plan | 0.960 | - | - | 795 |" in text
    assert "| step/decode, no fusions | 0.962 | - | - | 523 |" in text
    assert "| step/decode, fusions f00, lm_head_argmax | 0.900 |" in text
    assert f"f{STEP_SET_ROWS - 1:02d}," in text and f"f{STEP_SET_ROWS:02d}," not in text
    assert f"3 more fusion sets' step rows, each observed {100 - STEP_SET_ROWS} times or fewer" in text
    shared = calibration_table({"projections/reference": {"factor": 1.25, "n": 378, "fixed_us": 8.32, "slope": 0.968}})
    assert ("| projections/reference: one line over qkv_proj, o_proj, gate_up_proj, down_proj, lm_head (how a "
            "tensor-parallel rank's share scales) | 1.250 | 8.32 | 0.968 | 378 |") in "\n".join(shared)
    link = "\n".join(calibration_table({"all_reduce/link": {"factor": 2.1, "n": 12, "fixed_us": 17.5, "slope": 1.4}}))
    assert "| all_reduce/link: the split engine's collective as timed (fixed: its latency a call;" in link
    assert "| 2.100 | 17.50 | 1.400 | 12 |" in link


def test_headroom_table_says_what_speculative_decoding_could_add():
    cm = CostModel.from_state(H200)
    spec = {"drafter": "ngram", "k": 4, "max_n": 3, "verify_steps": 17000, "tokens": 17690, "drafted": 3000,
            "accepted": 690, "tokens_per_step": 17690 / 17000, "drafted_per_step": 3000 / 17000}
    base = Measurement(median_ms=9745.0, tokens_per_s=1900.0, time_split=SPLIT, speculation=spec)
    text = "\n".join(headroom_table([base], [_m(SPLIT)], cm))
    head = replay_headroom(SPLIT, cm, spec)
    assert "accept 690 of 3000 drafted tokens, **1.041 tokens a verify step**" in text
    assert f"at most **x{head['spec_bound']:.3f}** (x{head['bound']:.3f} without)" in text
    assert "Speculative decoding" not in "\n".join(headroom_table([_m(SPLIT)], [_m(SPLIT)], cm))


def test_engine_time_table_sums_each_tiers_apply_parts_and_timing():
    """The ledger keeps each benchmark answer's apply breakdown (engine/benchmark.py); the report sums
    them per tier, so a compile whose experiments/hour fell shows whether kernel compiles took it."""
    from anneal.agents.report import engine_time_table
    from anneal.agents.types import BenchSpec, Experiment, Verdict
    from anneal.engine.plan import Plan

    def exp(tier: str, benchmark_s: float | None, apply: dict | None) -> Experiment:
        extra = {} if benchmark_s is None else {"benchmark_s": benchmark_s, **({"apply": apply} if apply else {})}
        return Experiment(run_id="r", key=f"k{tier}{benchmark_s}{apply}", plan=Plan(), plan_hash="h", tier=tier,
                          kind="benchmark", agent="a", spec=BenchSpec(), verdict=Verdict(status="measured"),
                          measurement=Measurement(median_ms=1.0, extra=extra), started_at=0.0, finished_at=1.0)

    a = {"build_s": 0.1, "warmup_s": 2.0, "capture_s": 0.4, "total_s": 2.5}
    exps = [exp("fast", 0.5, a), exp("fast", 0.5, a), exp("fast", 0.2, None), exp("slow", 10.0, a),
            exp("fast", None, None)]  # an engine from before: not counted
    text = "\n".join(engine_time_table(exps))
    assert "| fast | 3 | 2 | 5.0 | 0.2 | 4.0 | 0.8 | 1.2 | 2 (4.0 s) | 81% |" in text, text
    assert "| slow | 1 | 1 | 2.5 | 0.1 | 2.0 | 0.4 | 10.0 | 1 (2.0 s) | 20% |" in text, text
    # the fast tier's compiles took 4.0 of its 6.2 s: named with the remedy; the slow tier's 16% is not
    assert "The fast tier spent 65% of its time in the warm-ups of 2 applies that compiled kernels" in text, text
    assert "The slow tier" not in text
    cached = {"build_s": 0.1, "warmup_s": 0.02, "capture_s": 0.4, "total_s": 0.52}
    text = "\n".join(engine_time_table([exp("fast", 0.5, cached)]))
    assert "| 0 (0.0 s) |" in text and "compiled kernels:" not in text, text
    assert engine_time_table([exp("fast", None, None)]) == []
