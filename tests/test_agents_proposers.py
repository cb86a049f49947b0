"""The proposer agents against a FAKE engine whose numbers have a known optimum (tests/fakes)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from fakes.fake_engine import FakeEngine, serve_in_thread
from anneal.engine.plan import OpChoice, Plan
from anneal.engine.traffic import load_traffic
from anneal.agents.board import Board
from anneal.agents.setting import make_setting
from anneal.agents.cost_model import CostModel
from anneal.agents.engine_client import EngineClient
from anneal.agents.kernel_tuner import KernelTuner
from anneal.agents.lab import Lab
from anneal.agents.ledger import Ledger
from anneal.agents.plan_search import PlanSearch
from anneal.agents.scheduler_tuner import SchedulerTuner
from anneal.agents.swarm import run_swarm
from anneal.agents.types import LatencyObjective


@contextlib.contextmanager
def _lab_on(tmp_path, **fake):
    """A lab whose fast tier is a FakeEngine(``fake``), the chat setting on it, and a board."""
    srv, url = serve_in_thread(FakeEngine(token="tok", **fake))
    client = EngineClient(url, "tok")
    ledger = Ledger(tmp_path / "l.sqlite")
    try:
        state = client.state()
        setting, _ = make_setting(state, load_traffic("chat"), seed=0, max_len=256, num_requests=4)
        yield Lab(ledger=ledger, engines={"fast": client}, cost_model=CostModel.from_state(state)), setting, Board()
    finally:
        ledger.close()
        client.close()
        srv.shutdown()


@pytest.fixture
def env(tmp_path):
    with _lab_on(tmp_path) as lab_setting_board:
        yield lab_setting_board


def _budget_measurements(lab, monkeypatch, limit: int) -> list[str]:
    """The budget runs out after ``limit`` measurements; returns the op each one was for."""
    from anneal.agents.lab import BudgetExhausted

    measure, calls = lab.measure, []

    def budgeted(cand, spec, *a, **kw):
        if len(calls) >= limit:
            raise BudgetExhausted()
        calls.append(cand.note.split("=")[0])
        return measure(cand, spec, *a, **kw)

    monkeypatch.setattr(lab, "measure", budgeted)
    return calls


def test_kernel_tuner_finds_each_ops_best_declared_config(env):
    lab, setting, board = env
    KernelTuner().run(lab, setting, board)
    # The fake's optimum: split_k=4 with block_n=32; triton block=128 for both elementwise ops.
    assert board.best_ops["attention_decode"][0] == OpChoice(impl="splitk", params={"block_n": 32, "split_k": 4})
    assert board.best_ops["rmsnorm"][0] == OpChoice(impl="triton", params={"block": 128})
    assert board.best_ops["silu_and_mul"][0] == OpChoice(impl="triton", params={"block": 128})
    # Every config was timed at every shape bucket.
    buckets = {r.spec.batch_size for r in lab.ledger.experiments()}
    assert buckets == set(setting.buckets) and len(buckets) == 2
    # Decode attention is also tuned at the traffic's long (p90) context; other ops at the typical one.
    ctx = {(r.note.split("=")[0], r.spec.context_len) for r in lab.ledger.experiments()}
    assert setting.long_context_len > setting.context_len
    assert ("attention_decode", setting.long_context_len) in ctx
    assert ("rmsnorm", setting.long_context_len) not in ctx


def test_kernel_tuner_spreads_a_short_budget_over_the_ops_and_keeps_what_it_found(env, monkeypatch):
    """Descending one op to the end before the next spent a whole H200 budget on gate_up: the ops
    take turns, and when the budget runs out each offers the best config it has timed."""
    lab, setting, board = env
    calls = _budget_measurements(lab, monkeypatch, 40)
    tuner = KernelTuner()
    tuner.run(lab, setting, board)
    ops = setting.space.tunable_ops()
    assert len(ops) >= 3 and set(calls) == set(ops)  # every op timed, not the first one's descent
    assert set(board.best_ops) == set(ops)  # each offers its best so far
    assert any("(budget spent)" in n for n in board.notes)
    # The fake's best elementwise config is one step from the defaults: found within the budget by
    # the elementwise op furthest above its roofline (the one given more turns).
    assert lab.cost_model is not None and tuner.gaps["silu_and_mul"] > tuner.gaps["rmsnorm"]
    assert board.best_ops["silu_and_mul"][0] == OpChoice(impl="triton", params={"block": 128})


def test_kernel_tuner_ranks_configs_on_the_ops_own_time(env):
    """The engine times ops one by one only when asked (``per_op``); nothing asked, and the tuner
    ranked configs on whole steps, where one op's change hides in the step's noise."""
    lab, setting, board = env
    KernelTuner().run(lab, setting, board)
    rows = [r for r in lab.ledger.experiments() if r.agent == "kernel-tuner"]
    assert rows and all(r.spec.per_op and r.measurement.per_op_ms for r in rows)
    assert board.best_ms < float("inf")  # its decode-step timings still count as plan measurements


def test_kernel_tuner_gives_the_costliest_ops_their_turns_first(env, monkeypatch):
    """A 290 s H200 budget reached 2-3 configs per op while the norms and argmax took equal turns
    with the projections: ops the cost model puts below ``major_share`` of the step wait."""
    lab, setting, board = env
    ops = setting.space.tunable_ops()
    share = KernelTuner.shares(ops, lab, setting)
    ranked = sorted(ops, key=lambda o: -share[o])
    tuner = KernelTuner(major_share=(share[ranked[0]] + share[ranked[1]]) / 2)  # one major op
    assert tuner.phases(ops, lab, setting) == ([ranked[0]], ranked[1:])
    calls = _budget_measurements(lab, monkeypatch, 12)
    tuner.run(lab, setting, board)
    assert set(calls) == {ranked[0]}  # the budget went to the costliest op's descent
    assert set(board.best_ops) == {ranked[0]}  # the others never started: nothing to offer


def test_kernel_tuner_gives_turns_by_the_gap_to_the_roofline(env, monkeypatch):
    """Turns in proportion to the ops' share of the step gave gate_up (at 96% of its roofline on
    the H200) the most: after each op times its base, the one furthest above its roofline gets
    the most turns, and an op at its roofline still gets some."""
    lab, setting, board = env
    tuner = KernelTuner(major_share=0.0)  # all ops in one phase
    real_floor, computed = tuner.floor_ms, {}

    def floor(op, lab_, setting_):  # attention (the largest share) sits at its roofline
        computed[op] = real_floor(op, lab_, setting_)
        return {"attention_decode": 10.0}.get(op, 0.0)

    monkeypatch.setattr(tuner, "floor_ms", floor)
    calls = _budget_measurements(lab, monkeypatch, 24)
    tuner.run(lab, setting, board)
    per_bucket = len(setting.shape_buckets("rmsnorm"))
    att_bucket = len(setting.shape_buckets("attention_decode"))
    turns = {op: calls.count(op) for op in set(calls)}
    assert set(turns) == set(setting.space.tunable_ops())  # every op timed its base
    # the openings (base, the other impl at its defaults: 16 timings), then turns by the gap: none
    # to attention, 2% of whose time is its gap
    assert turns["attention_decode"] == 2 * att_bucket
    assert turns["rmsnorm"] + turns["silu_and_mul"] == 24 - 2 * att_bucket
    assert turns["rmsnorm"] >= 3 * per_bucket and turns["silu_and_mul"] >= 3 * per_bucket
    assert tuner.gaps["attention_decode"] < tuner.gaps["rmsnorm"]
    assert set(computed) == set(turns) and all(v > 0 for v in computed.values())  # real rooflines
    assert any("gap to the roofline" in n for n in board.notes)


def test_kernel_tuner_measures_an_ops_gap_from_its_least_bytes_implementation(tmp_path):
    """lm_head on cuBLAS ran at ~95% of its bf16 roofline on the 8B and got one turn in session 45's
    chat compile, its bf12 copy (three quarters of the bytes) never timed: the gap is measured from
    the roofline of the implementation of its space that reads the fewest bytes."""
    bf12 = {"qkv_proj": {"reference": {}, "triton_gemv_bf12": {"block_n": [32, 64]}}}
    with _lab_on(tmp_path, extra_variants=bf12) as (lab, setting, _):
        from anneal.agents.kernel_tuner import _shape_weights

        tuner = KernelTuner()

        def roofline(plan, op):  # weighted over the op's buckets as the tuner weighs them
            return sum(w * lab.cost_model.predict(plan, setting.spec_for(op, b, ctx), calibrated=False,
                                                  step_factor=False).per_op_ms[op]
                       for (b, ctx), w in _shape_weights(op, setting).items())

        dense = roofline(setting.base, "qkv_proj")
        copied = roofline(setting.base.with_ops(qkv_proj=OpChoice(impl="triton_gemv_bf12", params={"block_n": 32})),
                          "qkv_proj")
        assert copied < dense
        assert tuner.floor_ms("qkv_proj", lab, setting) == pytest.approx(copied)
        # an op without a smaller copy keeps its own roofline
        assert tuner.floor_ms("rmsnorm", lab, setting) == pytest.approx(roofline(setting.base, "rmsnorm"))


def test_kernel_tuner_times_every_ops_implementations_at_their_defaults_before_turns_by_the_gap(tmp_path, monkeypatch):
    """Session 46's 180-s chat compile gave lm_head one turn (the smallest gap), so its bf12 copy was
    never timed: every op's opening (its base, then each other implementation at its defaults) comes
    before any op's descent, however small its gap."""
    from anneal.agents.kernel_tuner import _Descent

    bf12 = {"qkv_proj": {"reference": {}, "triton_gemv_bf12": {"block_n": [32, 64]}}}
    with _lab_on(tmp_path, extra_variants=bf12) as (lab, setting, board):
        tuner = KernelTuner(major_share=0.0)
        monkeypatch.setattr(tuner, "floor_ms", lambda op, lab_, setting_: {"qkv_proj": 10.0}.get(op, 0.0))
        scored = []
        score = tuner.score
        monkeypatch.setattr(tuner, "score", lambda op, choice, *a: scored.append((op, choice)) or score(op, choice, *a))
        tuner.run(lab, setting, board)
        openings = [(op, ch) for op in setting.space.tunable_ops()
                    for ch in _Descent(op, tuner, lab, setting, board).openings()]
    assert ("qkv_proj", OpChoice(impl="triton_gemv_bf12", params={"block_n": 32})) in openings
    assert sorted(map(repr, scored[:len(openings)])) == sorted(map(repr, openings))
    assert len(scored) > len(openings)  # then the descents
    assert tuner.gaps["qkv_proj"] == min(tuner.gaps.values())  # at its roofline, yet its copy was timed


def test_kernel_tuner_weighs_prefill_attention_by_how_often_prompt_steps_come(env, monkeypatch):
    """Chat's s12 compile gave prefill attention (1.34 ms above its roofline per prompt step) 10
    turns to decode attention's 4, though a replay runs ~30 decode steps per prompt step."""
    lab, setting, _ = env
    w = setting.prefill_steps_per_decode_step
    assert 0 < w < 1 and setting.steps_weight("attention_prefill") == w and setting.steps_weight("rmsnorm") == 1.0
    tuner = KernelTuner()
    monkeypatch.setattr(tuner, "floor_ms", lambda op, lab_, setting_: 0.0)
    full = lab.cost_model.full_model_factor("attention_prefill")
    assert tuner.gap("attention_prefill", 2.0, lab, setting) == pytest.approx(2.0 * full * w)
    assert tuner.gap("rmsnorm", 2.0, lab, setting) == pytest.approx(2.0)
    # fewer decode steps per request (shorter outputs) make prompt steps weigh more
    short = make_setting(lab.engines["fast"].state(), load_traffic("chat"), seed=0, max_len=64, num_requests=4)[0]
    assert short.prefill_steps_per_decode_step > w


def test_kernel_tuner_weighs_ops_by_the_whole_models_step(env):
    """On the fast tier's 2 of the 8B's 32 layers lm_head was 60% of the step and o_proj fell under
    ``major_share``: a layer op's share counts every layer of the model, lm_head's counts once."""
    lab, setting, _ = env
    cm = lab.cost_model
    assert cm.shape.num_layers > cm.layers  # the fake's fast tier loads fewer layers than its model
    share = KernelTuner.shares(["silu_and_mul", "rmsnorm"], lab, setting)
    per_op = cm.predict(setting.base, setting.decode_spec).per_op_ms
    on_fast_tier = per_op["silu_and_mul"] / per_op["rmsnorm"]
    assert share["silu_and_mul"] / share["rmsnorm"] == pytest.approx(on_fast_tier * cm.shape.num_layers / cm.layers)


def test_prefill_attention_is_tuned_in_mixed_steps_when_the_scheduler_mixes(env):
    """Under mixed prefill the steps with prompt tokens also carry the decode rows, which the prefill
    kernel serves too: it is timed in such a step, else in a lone prompt's."""
    _, setting, _ = env
    typical = setting.decode_spec.batch_size
    assert typical > 1 and setting.base.scheduler.mixed_prefill
    spec = setting.spec_for("attention_prefill", 1)
    assert (spec.mode, spec.batch_size, spec.context_len, spec.prompt_len) == (
        "mixed", typical, setting.context_len, setting.prompt_len)
    plain = dataclasses.replace(setting, base=setting.base.model_copy(
        update={"scheduler": setting.base.scheduler.model_copy(update={"mixed_prefill": False})}))
    assert plain.spec_for("attention_prefill", 1).mode == "prefill"


def test_plan_search_improves_without_enumerating(env):
    lab, setting, board = env
    PlanSearch(max_children=25).run(lab, setting, board)
    rows = lab.ledger.experiments()
    base = next(r for r in rows if r.note == "baseline")
    assert board.best_ms < 0.8 * base.measurement.median_ms
    assert len(rows) < setting.space.size / 10
    assert any("mutate" in r.note or "crossover" in r.note for r in rows)


def test_plan_search_starts_from_seed_plans(env):
    lab, setting, board = env
    good = setting.base.with_ops(attention_decode=OpChoice(impl="splitk", params={"block_n": 32, "split_k": 4}),
                                 rmsnorm=OpChoice(impl="triton", params={"block": 128})).model_copy(
        update={"name": "an earlier compile"})
    seeded = dataclasses.replace(setting, seeds=[good, setting.base])  # the base twice: measured once
    PlanSearch(max_children=3).run(lab, seeded, board)
    rows = lab.ledger.experiments()
    assert [r.note for r in rows[:2]] == ["baseline", "seed an earlier compile"]
    assert rows[1].plan_hash == good.hash and sum(r.plan_hash == setting.base.hash for r in rows) == 1
    base_ms, seed_ms = rows[0].measurement.median_ms, rows[1].measurement.median_ms
    assert seed_ms < base_ms and board.best_ms <= seed_ms  # the search keeps what the seed brought


def test_scheduler_tuner_respects_the_latency_bound(env):
    lab, setting, board = env
    SchedulerTuner(max_settings=40).run(lab, setting, board)
    free = board.scheduler
    assert free is not None
    floor = min(setting.space.max_num_seqs)
    assert any(f"max_num_seqs searched from {floor}" in n for n in board.notes)  # the report says so
    rows = [r for r in lab.ledger.experiments() if r.spec.mode == "workload"]
    best_any = max(rows, key=lambda r: r.measurement.tokens_per_s)
    assert free == best_any.plan.scheduler
    # Bound ITL below what the fastest setting achieves: the tuner must pick a setting within it.
    bound = sorted(r.measurement.itl_p90_ms for r in rows)[len(rows) // 2]
    setting.objective = LatencyObjective(itl_p90_ms=bound)
    board2 = Board()
    SchedulerTuner(max_settings=40).run(lab, setting, board2)
    chosen = next(r for r in rows if r.plan.scheduler == board2.scheduler)
    assert chosen.measurement.itl_p90_ms <= bound


def test_swarm_runs_agents_concurrently_and_stops_at_the_deadline(env):
    import time

    lab, setting, board = env
    lab.deadline = time.monotonic() + 2.0
    t0 = time.monotonic()
    res = run_swarm([KernelTuner(), PlanSearch(), SchedulerTuner()], lab, setting, board)
    assert time.monotonic() - t0 < 10
    assert set(res) == {"kernel-tuner", "plan-search", "scheduler-tuner"}
    assert all(v in ("done", "budget") for v in res.values()), res
    assert {r.agent for r in lab.ledger.experiments()} == set(res)


PREFILL = {"attention_prefill": {"reference": {}, "triton": {}}}  # a token graph needs one that is not the reference


def test_graph_bucket_agent_fits_the_replayed_batches_and_keeps_the_fit_only_when_it_times_better(tmp_path):
    """The fake replays a closed loop of 16 (steady at 16, a drain through 1-15) and prices a
    step by its padded rows. The base's powers of two are already optimal there: kept. A base
    of session 9's kind ([12, 15, ...]) pads the drain's small batches to 12: replaced."""
    from anneal.agents.graph_buckets import GraphBucketAgent

    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", extra_variants=PREFILL))  # FAKE graph padding costs
    try:
        with EngineClient(url, "tok") as client:
            setting, _ = make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256,
                                      num_requests=4)
            setting = dataclasses.replace(setting, base=setting.base.with_ops(attention_prefill=OpChoice(impl="triton")))
            assert setting.space.uses_graphs
            led = Ledger(tmp_path / "l.sqlite")
            lab = Lab(ledger=led, engines={"fast": client})
            board = Board()
            GraphBucketAgent().run(lab, setting, board)
            notes = [r.note for r in led.experiments()]
            assert "baseline replay: its batch sizes" in notes
            assert {n for n in notes if n.startswith("graph b=")} == {f"graph b={g}" for g in (1, 2, 4, 8, 16)}
            fit_note = next(n for n in board.notes if n.startswith("graph buckets"))
            assert board.graph_batch_sizes is None and "kept the base" in fit_note
            assert "from the baseline's replay" in fit_note

            s9 = dataclasses.replace(setting, base=setting.base.model_copy(
                update={"cuda_graph_batch_sizes": [12, 15, 17, 20, 23, 29]}))
            GraphBucketAgent().run(lab, s9, board)
            assert board.graph_batch_sizes is not None and board.graph_batch_sizes[0] == 1
            assert board.graph_batch_sizes[-1] == 16 and set(board.graph_batch_sizes) <= {1, 2, 4, 8, 16}
            assert board.composite(s9.base).cuda_graph_batch_sizes == board.graph_batch_sizes
            # this fake replays no faster with token graphs: none
            assert "token graphs" in notes and board.token_graph_sizes is None
            assert board.composite(s9.base).cuda_graph_token_sizes == []
            led.close()
    finally:
        srv.shutdown()


@pytest.mark.parametrize("gain,drift,noise", [(0.1, 0.0, 0.0), (-0.1, 0.0, 0.0), (0.05, 0.03, 0.0),
                                              (-0.05, -0.03, 0.0), (0.04, 0.0, 0.1), (-0.04, 0.0, -0.1)])
def test_graph_bucket_agent_keeps_token_graphs_only_when_the_replay_runs_faster_with_them(tmp_path, gain, drift,
                                                                                       noise):
    """Kept when the traffic's replay is faster with them, also on a fast tier whose replays drift
    over the search (slower, or faster, by 3% a replay): the trial pairs them with the base; and when
    host noise moves the token plan's decode steps more than its prompt steps gain or lose (the
    trial reads the prompt steps, the only ones token graphs change)."""
    from anneal.agents.graph_buckets import GraphBucketAgent
    from anneal.agents.space import TOKEN_GRAPH_SETS

    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", token_graph_gain=gain, extra_variants=PREFILL,
                                          drift=drift, token_plan_decode_noise=noise))
    try:
        with EngineClient(url, "tok") as client:
            setting, _ = make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)
            setting = dataclasses.replace(setting, base=setting.base.with_ops(attention_prefill=OpChoice(impl="triton")))
            led = Ledger(tmp_path / "l.sqlite")
            board = Board()
            GraphBucketAgent().run(Lab(ledger=led, engines={"fast": client}), setting, board)
            trial = [r for r in led.experiments() if r.note == "token graphs"]
            beside = [r for r in led.experiments() if r.note == "token graphs: the base beside them"]
            assert len(trial) == 2 and all(r.plan.cuda_graph_token_sizes == list(TOKEN_GRAPH_SETS[1]) for r in trial)
            assert len(beside) == 2 and {r.spec.seed for r in beside} == {r.spec.seed for r in trial}
            assert all(r.plan.hash == setting.base.hash for r in beside)
            want = list(TOKEN_GRAPH_SETS[1]) if gain > 0 else None
            assert board.token_graph_sizes == want
            assert board.composite(setting.base).cuda_graph_token_sizes == (want or [])
            # a base whose prefill attention cannot be captured is not tried
            ref = dataclasses.replace(setting, base=setting.base.with_ops(attention_prefill=OpChoice()))
            GraphBucketAgent().run(Lab(ledger=led, engines={"fast": client}), ref, Board())
            assert len([r for r in led.experiments() if r.note == "token graphs"]) == 2
            led.close()
    finally:
        srv.shutdown()


@pytest.mark.parametrize("faster", ["folded_norm", "norm_stats"])
def test_of_two_kept_fusions_that_exclude_each_other_the_composite_carries_the_faster(faster):
    """folded_norm and norm_stats cannot run together; both kept, the composite takes the one whose
    trial was faster (not the conflict table's order), beside a fusion that conflicts with neither."""
    from anneal.engine.plan import Plan, fusion_conflicts

    board = Board()
    slower = "norm_stats" if faster == "folded_norm" else "folded_norm"
    assert fusion_conflicts([faster, slower])
    board.keep_fusion(slower, 0.99)
    board.keep_fusion("lm_head_argmax", 0.995)
    board.keep_fusion(faster, 0.95)
    assert board.composite(Plan()).fusions == {faster: True, "lm_head_argmax": True}
    # a faster fusion the tuned ops retile takes nothing from the one they leave as timed (folded_norm's
    # residual add moves from cuBLAS into the GEMV's epilogue: never timed so)
    board.best_ops["o_proj"] = (OpChoice(impl="triton_gemv_splitk"), 0.1)
    assert "folded_norm" not in board.composite(Plan()).fusions
    if faster == "folded_norm":
        assert board.composite(Plan()).fusions == {"norm_stats": True, "lm_head_argmax": True}


def test_the_composite_takes_the_set_of_fusions_whose_gains_compound_most_and_a_second_keeps_them():
    """Session 26's 30-minute chat compile kept four fusions, some of them exclusive, and taking the
    fastest trial first gave a set whose gains compound less than another's (there norm_stats +
    gate_up_silu, x0.966, against rope_attention + folded_norm, x0.964; norm_stats and rope_attention
    could not run together until session 46). Here folded_norm is the fastest alone and excludes two
    whose product beats it (norm_stats and silu_mul_down: gate_up_silu rides with folded_norm since
    session 49). Its tuned projections then moved folded_norm's residual add off cuBLAS (o_proj) and
    retiled norm_stats' and silu_mul_down's fused GEMVs: the composite (x0.95 the baseline on the slow tier)
    ran fusions never timed so. The first composite now drops what the tuned ops rule out or
    retile; a second keeps the best set and leaves those ops at the base, while ops that touch none
    of its fusions stay tuned."""
    from anneal.engine.plan import Plan

    base = Plan().with_ops(attention_decode=OpChoice(impl="triton_splitk"))
    board = Board()
    for name, ratio in (("folded_norm", 0.975), ("norm_stats", 0.98), ("silu_mul_down", 0.985),
                        ("rope_attention", 0.99)):
        board.keep_fusion(name, ratio)
    best = {"norm_stats": True, "silu_mul_down": True, "rope_attention": True}  # x0.956, folded_norm's pair x0.965
    assert board.composite(base).fusions == best
    # at the GEMV's default tiles a Triton projection leaves the fused kernels as they were timed
    board.best_ops["qkv_proj"] = (OpChoice(impl="triton_gemv_splitk"), 0.04)
    assert board.composite(base).fusions == best
    tuned = OpChoice(impl="triton_gemv_splitk", params={"block_m": 16, "block_n": 16, "max_m": 8})
    board.best_ops["o_proj"] = (tuned, 0.03)
    ops_first = board.composite(base)
    assert ops_first.choice("o_proj") == tuned
    # folded_norm's residual add moved into the Triton o_proj, norm_stats retiled by its tiles
    assert ops_first.fusions == {"rope_attention": True, "silu_mul_down": True}
    board.best_ops["down_proj"] = (tuned, 0.1)  # retiles silu_mul_down too
    assert board.composite(base).fusions == {"rope_attention": True}
    fused = board.composite(base, fusions_first=True)
    assert fused.fusions == best
    assert fused.choice("o_proj").impl == fused.choice("down_proj").impl == "reference"
    assert fused.choice("qkv_proj").impl == "triton_gemv_splitk"  # at the default tiles: norm_stats ran those
    # nothing ruled out or retiled: one composite
    del board.best_ops["o_proj"], board.best_ops["down_proj"]
    assert board.composite(base).hash == board.composite(base, fusions_first=True).hash


def test_a_fusion_the_tuned_ops_retile_counts_by_its_trial_beside_them():
    """Session 45's chat compile put every projection on the bf12 GEMV: gate_up_silu, kept on the
    base, was retiled and left out, and the norm fusions were never timed over bf12. A retiled
    fusion now counts by its trial beside the tuned ops (``keep_retried_fusion``), mixed with the
    base's trials of the fusions left as they ran, and only while the ops keep the tiles it ran."""
    from anneal.engine.plan import Plan

    base = Plan().with_ops(attention_decode=OpChoice(impl="triton_splitk"))
    board = Board()
    board.keep_fusion("gate_up_silu", 0.994)
    board.keep_fusion("rope_attention", 0.993)
    bf12 = OpChoice(impl="triton_gemv_bf12")
    for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        board.best_ops[op] = (bf12, 0.1)
    assert board.composite(base).fusions == {"rope_attention": True}  # gate_up_silu retiled, no retrial
    tuned = board.tuned_ops(base)
    assert tuned.fusions == base.fusions and all(tuned.choice(op) == bf12 for op in ("qkv_proj", "down_proj"))
    board.keep_retried_fusion(tuned, "gate_up_silu", 0.99)
    assert board.composite(base).fusions == {"rope_attention": True, "gate_up_silu": True}
    # norm_stats and rope_attention run together (the attention rotates what the qkv GEMV normalised)
    board.keep_retried_fusion(tuned, "norm_stats", 0.97)
    comp = board.composite(base)
    assert comp.fusions == {"norm_stats": True, "gate_up_silu": True, "rope_attention": True}
    assert comp.choice("gate_up_proj") == bf12
    # other tiles than the retrial's: its fused kernels were never timed so, and the base's trial of
    # gate_up_silu ran other ones still
    board.best_ops["gate_up_proj"] = (OpChoice(impl="triton_gemv_bf12", params={"block_n": 128}), 0.1)
    assert board.composite(base).fusions == {"rope_attention": True}
    # lm_head_argmax reads lm_head's copy with its tiles: on the bf16 GEMV it keeps its own kernel
    board.keep_fusion("lm_head_argmax", 0.994)
    board.best_ops["lm_head"] = (OpChoice(impl="triton_gemv_splitk", params={"block_n": 64}), 0.3)
    assert board.composite(base).fusions == {"rope_attention": True, "lm_head_argmax": True}
    board.best_ops["lm_head"] = (bf12, 0.3)
    assert board.composite(base).fusions == {"rope_attention": True}


def test_promotion_takes_the_fastest_plan_of_each_fusion_set_among_the_tied_ones():
    """Session 26 promoted three plans with one fusion set, 0.551-0.554 ms apart on the fast tier.
    Among the plans within 3% of the fastest, each fusion set's fastest goes first; a plan further
    behind is not promoted for its structure alone."""
    from anneal.engine.plan import Plan

    def plan(fusions, warps):
        return Plan().with_ops(rmsnorm=OpChoice(impl="triton", params={"num_warps": warps})).model_copy(
            update={"fusions": dict.fromkeys(fusions, True)})

    board = Board()
    a, b, c = plan(["norm_stats"], 1), plan(["norm_stats"], 2), plan(["norm_stats"], 4)
    d, far = plan(["folded_norm", "rope_attention"], 1), plan(["gate_up_silu"], 1)
    for ms, p in ((0.551, a), (0.552, b), (0.553, c), (0.560, d), (0.600, far)):
        board.offer_plan(ms, p, "plan-search")
    assert [p.hash for _, p, _ in board.top_plans(3)] == [a.hash, b.hash, c.hash]
    assert [p.hash for _, p, _ in board.top_plans(3, distinct_fusions=True)] == [a.hash, d.hash, b.hash]


def test_plan_search_times_both_composites_when_a_tuned_op_rules_out_a_kept_fusion(tmp_path):
    """A kept folded_norm and a tuned Triton o_proj (which rules it out): the search times the
    tuned composite and the fusions-first one, so the population can breed from either."""
    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", noise=0.0, fusion_gains={"folded_norm": 0.03},
                                          extra_variants={"o_proj": {"reference": {}, "triton_gemv_splitk": {"max_m": [8, 64]}}}))
    try:
        with EngineClient(url, "tok") as client:
            setting, _ = make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)
            led = Ledger(tmp_path / "l.sqlite")
            board = Board()
            board.best_ops["o_proj"] = (OpChoice(impl="triton_gemv_splitk", params={"max_m": 8}), 0.01)
            PlanSearch(max_children=1).run(Lab(ledger=led, engines={"fast": client}), setting, board)
            rows = {r.note: r.plan for r in led.experiments()}
            led.close()
    finally:
        srv.shutdown()
    assert board.fusions and "folded_norm" in board.fusions
    tuned = rows["kernel-tuner findings"]
    assert tuned.choice("o_proj").impl == "triton_gemv_splitk" and not tuned.fusions.get("folded_norm")
    fused = rows["kept fusions + kernel-tuner findings they allow"]
    assert fused.choice("o_proj").impl == "reference" and fused.fusions.get("folded_norm")


@pytest.mark.parametrize("drift", [0.0, 0.01, -0.01])
def test_plan_search_tries_each_fusion_beside_the_base_and_the_composite_keeps_the_winner(tmp_path, drift):
    """One fusion makes every step 3% faster, one 2% slower, the rest change nothing; the fast
    tier's decode steps drift by 1% a benchmark. Each fusion is timed between two base steps, so
    only the 3% one is kept, and the composite carries it."""
    from anneal.engine.plan import FUSIONS, fusion_blockers

    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", noise=0.0, decode_drift=drift,
                                          fusion_gains={"folded_norm": 0.03, "norm_stats": -0.02}))
    try:
        with EngineClient(url, "tok") as client:
            setting, _ = make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)
            led = Ledger(tmp_path / "l.sqlite")
            board = Board()
            PlanSearch(max_children=0).run(Lab(ledger=led, engines={"fast": client}), setting, board)
            rows = led.experiments()
            trials: dict[str, list] = {}
            for r in rows:
                if r.note.startswith("fusion trial: "):
                    trials.setdefault(r.note.removeprefix("fusion trial: "), []).append(r)
            bases = [r for r in rows if r.note == "fusion trials: the base"]
            # every fusion the base's ops allow (rope_attention needs the split-K attention it lacks)
            everything = setting.base.model_copy(update={"fusions": dict.fromkeys(FUSIONS, True)})
            assert set(trials) == set(FUSIONS) - set(fusion_blockers(everything))
            # the ones that change nothing read x1.000, within FUSION_REREAD_BAND of the bar: read twice
            assert {f: len(r) for f, r in trials.items()} == {f: 1 if f in ("folded_norm", "norm_stats") else 2
                                                               for f in trials}
            n_readings = sum(len(r) for r in trials.values())
            assert len(bases) == n_readings + 1 and all(r.plan.hash == setting.base.hash for r in bases)
            seeds = [r.spec.seed for rs in trials.values() for r in rs]
            assert set(seeds) <= {r.spec.seed for r in bases} and len(set(seeds)) == n_readings  # fresh each
            assert list(board.fusions) == ["folded_norm"] and board.fusions["folded_norm"] < 0.99, board.notes
            assert board.composite(setting.base).fusions == {"folded_norm": True}
            assert any(n.startswith("fusion norm_stats:") and n.endswith("not kept") for n in board.notes)
            assert any("(readings x1.000, x1.000: the mean)" in n for n in board.notes), board.notes
            led.close()
    finally:
        srv.shutdown()


def test_fusion_retrials_try_the_retiled_fusions_beside_the_tuned_ops_and_the_composite_keeps_a_winner(tmp_path):
    """A tuned bf12 gate_up retiles gate_up_silu, norm_linear and norm_stats; each is timed between
    two steps of the base with the tuned ops (fresh seeds of their own), the one that makes every step 3%
    faster is kept as a retrial, the others not, and the composite carries it on the bf12 gate_up."""
    from anneal.agents.plan_search import FUSION_RETRIAL_SEED, fusion_retrials
    from anneal.engine.plan import retiled_fusions

    bf12 = OpChoice(impl="triton_gemv_bf12")
    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", noise=0.0, fusion_gains={"gate_up_silu": 0.03},
                                          extra_variants={"gate_up_proj": {"reference": {}, "triton_gemv_bf12": {}}}))
    try:
        with EngineClient(url, "tok") as client:
            setting, _ = make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)
            led = Ledger(tmp_path / "l.sqlite")
            board = Board()
            assert fusion_retrials(Lab(ledger=led, engines={"fast": client}), setting, board) == []  # no tuned op
            board.best_ops["gate_up_proj"] = (bf12, 0.1)
            tuned = board.tuned_ops(setting.base)
            retiled = [f for f in retiled_fusions(tuned, setting.base) if f in setting.space.fusions]
            assert {"gate_up_silu", "norm_stats"} <= set(retiled)
            tried = fusion_retrials(Lab(ledger=led, engines={"fast": client}), setting, board)
            rows = led.experiments()
            led.close()
    finally:
        srv.shutdown()
    assert tried == retiled
    trials = [r for r in rows if r.note.startswith("fusion trial beside the tuned ops: ")]
    bases = [r for r in rows if r.note == "fusion trials beside the tuned ops: the base"]
    assert {r.note.rsplit(": ", 1)[1] for r in trials} == set(retiled)
    assert all(r.plan.choice("gate_up_proj") == bf12 for r in trials + bases)
    assert {r.plan.hash for r in bases} == {tuned.hash} and min(r.spec.seed for r in bases) == FUSION_RETRIAL_SEED
    assert not board.fusions and set(board.retried_fusions) == {"gate_up_silu"}, board.notes
    assert board.retried_fusions["gate_up_silu"] < 0.99
    comp = board.composite(setting.base)
    assert comp.fusions.get("gate_up_silu") and comp.choice("gate_up_proj") == bf12
    assert any(n.startswith("fusion norm_stats beside the tuned ops:") and n.endswith("not kept") for n in board.notes)


def test_fusion_retrials_run_best_on_the_base_first_so_a_short_budget_reads_those(tmp_path):
    """Session 48: the H200's 150-s chat compile retried silu_mul_down (never read on the base),
    linear_norm (x1.186 there), gate_up_silu (x0.964) and norm_linear (x1.170), in the dict's order,
    and ran out of budget before norm_stats (x1.002 there; session 46's winner at x0.980). The
    retrials now go by their ratio on the base, best first, those never read there last; the trials
    on the base record every ratio, kept or not."""
    from types import SimpleNamespace

    from anneal.agents.lab import BudgetExhausted
    from anneal.agents.plan_search import fusion_retrials, fusion_trials

    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", noise=0.0,
                                          extra_variants={"gate_up_proj": {"reference": {}, "triton_gemv_bf12": {}},
                                                          "down_proj": {"reference": {}, "triton_gemv_bf12": {}}}))
    try:
        with EngineClient(url, "tok") as client:
            setting, _ = make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)
    finally:
        srv.shutdown()
    ratios = {"linear_norm": 1.186, "gate_up_silu": 0.964, "norm_stats": 1.002}
    tried: list[str] = []

    class StubLab:
        cost_model = None

        def __init__(self, steps: int):
            self.steps = steps

        def measure(self, cand, spec, prune=True, grace_s=0.0, **kw):
            if not grace_s and len(tried) >= self.steps:
                raise BudgetExhausted("budget spent")
            f = None if cand.note.endswith(": the base") else cand.note.rsplit(": ", 1)[1]
            tried.append(f or "base")
            ms = ratios.get(f, 1.0) if f else 1.0
            return SimpleNamespace(measurement=SimpleNamespace(median_ms=ms), verdict=SimpleNamespace(reason=""))

    board = Board()
    on_base = dataclasses.replace(setting, space=dataclasses.replace(setting.space, fusions=tuple(ratios)))
    fusion_trials(StubLab(100), on_base, board, "plan-search", 0.005)
    assert board.fusion_ratios == pytest.approx(ratios)  # lost ones too
    assert set(board.fusions) == {"gate_up_silu"}

    bf12 = OpChoice(impl="triton_gemv_bf12")
    board.best_ops.update({"gate_up_proj": (bf12, 0.1), "down_proj": (bf12, 0.1)})
    retrial = dataclasses.replace(setting, space=dataclasses.replace(
        setting.space, fusions=("linear_norm", "silu_mul_down", "norm_stats", "gate_up_silu")))
    tried.clear()
    with pytest.raises(BudgetExhausted):  # room for the first base and two readings
        fusion_retrials(StubLab(4), retrial, board)
    assert [f for f in tried if f != "base"] == ["gate_up_silu", "norm_stats"]
    assert board.fusion_ratios == pytest.approx(ratios)  # the retrials do not overwrite the base's

    tried.clear()
    assert fusion_retrials(StubLab(100), retrial, Board(best_ops=dict(board.best_ops), fusion_ratios=dict(ratios))) == [
        "gate_up_silu", "norm_stats", "linear_norm", "silu_mul_down"]  # never read on the base: last


def test_a_fusion_that_loses_on_the_tuned_tiles_is_retried_on_the_common_ones_and_the_composite_takes_them(tmp_path):
    """Session 47: on gate_up's own bf12 tiles (64 wide, 8 warps) norm_stats read x1.010 beside the
    tuned ops and was dropped; on the common ones (session 46) x0.980. A retiled fusion that loses
    narrowly is tried once more with its projections on the common tiles, read against the tuned
    ops; if it wins there the composite moves those projections back for it. One that loses by far
    (gate_up_silu) gets no second trial, one that still loses (norm_linear) is not kept."""
    from anneal.agents.plan_search import FUSION_COMMON_TILES_SEED, common_tiles, fusion_retrials

    def gain(f: str, plan) -> float:
        common = plan.choice("gate_up_proj").params.get("block_n") == 32
        return {"norm_stats": 0.03 if common else -0.01, "gate_up_silu": -0.2}.get(f, 0.0)

    own = OpChoice(impl="triton_gemv_bf12", params={"block_n": 64, "num_warps": 8})
    gemvs = {"reference": {}, "triton_gemv_splitk": {"num_warps": [4, 8], "block_n": [64, 32]},
             "triton_gemv_bf12": {"num_warps": [8, 4], "block_n": [64, 32]}}
    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", noise=0.0, fusion_gain_of=gain,
                                          extra_variants={"gate_up_proj": gemvs}))
    try:
        with EngineClient(url, "tok") as client:
            setting, _ = make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)
            led = Ledger(tmp_path / "l.sqlite")
            board = Board()
            board.best_ops["gate_up_proj"] = (own, 0.1)
            tuned = board.tuned_ops(setting.base)
            assert common_tiles(setting.space, "gate_up_proj", own) == OpChoice(
                impl="triton_gemv_bf12", params={"block_n": 32, "num_warps": 4})
            assert common_tiles(setting.space, "qkv_proj", own) == own  # no per-projection defaults there
            fusion_retrials(Lab(ledger=led, engines={"fast": client}), setting, board)
            rows = led.experiments()
            led.close()
    finally:
        srv.shutdown()
    second = [r for r in rows if r.note.startswith("fusion trial on the common tiles, beside the tuned ops: ")]
    assert {r.note.rsplit(": ", 1)[1] for r in second} == {"norm_stats", "norm_linear"}, board.notes
    assert all(r.plan.choice("gate_up_proj").params["block_n"] == 32 for r in second)
    bases = [r for r in rows if r.note == "fusion trials on the common tiles, beside the tuned ops: the base"]
    assert {r.plan.hash for r in bases} == {tuned.hash} and min(r.spec.seed for r in bases) == FUSION_COMMON_TILES_SEED
    assert set(board.retried_fusions) == {"norm_stats"} and board.retried_fusions["norm_stats"] < 0.99, board.notes
    comp = board.composite(setting.base)
    assert comp.fusions.get("norm_stats")
    assert comp.choice("gate_up_proj") == OpChoice(impl="triton_gemv_bf12", params={"block_n": 32, "num_warps": 4})


def test_the_composite_moves_projections_to_a_retrial_s_tiles_only_where_that_goes_further():
    """A fusion retried on the common tiles counts, with those tiles, where its set of fusions beats
    the tuned tiles' set, and only while the tuned ops are the ones its ratio was read against."""
    from anneal.engine.plan import Plan

    base = Plan().with_ops(attention_decode=OpChoice(impl="triton_splitk"))
    own = OpChoice(impl="triton_gemv_bf12", params={"block_n": 64, "num_warps": 8})
    common = OpChoice(impl="triton_gemv_bf12", params={"block_n": 32, "num_warps": 4})
    board = Board()
    for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        board.best_ops[op] = (own if op == "gate_up_proj" else OpChoice(impl="triton_gemv_bf12"), 0.1)
    tuned = board.tuned_ops(base)
    board.keep_fusion("rope_attention", 0.993)
    board.keep_retried_fusion(tuned, "gate_up_silu", 0.992)  # on the tuned tiles
    board.keep_retried_fusion(tuned.with_ops(gate_up_proj=common), "norm_stats", 0.98, against=tuned)
    comp = board.composite(base)  # norm_stats + rope_attention (x0.973) beats gate_up_silu + rope_attention
    assert comp.fusions == {"norm_stats": True, "rope_attention": True} and comp.choice("gate_up_proj") == common
    assert comp.choice("down_proj") == tuned.choice("down_proj")
    board.retried_fusions["norm_stats"] = 0.995  # now x0.988 against x0.985 on the tuned tiles
    comp = board.composite(base)
    assert comp.fusions == {"gate_up_silu": True, "rope_attention": True} and comp.choice("gate_up_proj") == own
    board.retried_fusions["norm_stats"] = 0.98
    board.best_ops["gate_up_proj"] = (OpChoice(impl="triton_gemv_bf12", params={"block_n": 128}), 0.1)
    comp = board.composite(base)  # the tuned ops moved since the retrial: its ratio says nothing of them
    assert not comp.fusions.get("norm_stats") and comp.choice("gate_up_proj").params == {"block_n": 128}


def test_the_token_graph_trial_reads_session_22s_pairs_by_their_prompt_steps():
    """The chat compile's trial on the H200 (session 22): whole replays x0.937 and x1.056, prompt
    steps 226 -> 104 and 184 -> 110 ms over the same prompt tokens. By the prompt steps both pairs
    say faster; a time split without prompt tokens falls back to the whole replays."""
    from anneal.agents.graph_buckets import prompt_step_ratio
    from anneal.agents.types import Measurement

    def m(total, prefill, tokens):
        return Measurement(median_ms=total, time_split={"total_ms": total, "prefill_ms": prefill,
                                                        "tokens_in_prefill_steps": tokens})

    pairs = [(m(1814.0, 226.3, 19714), m(1700.2, 104.2, 19714)), (m(1539.5, 183.9, 20789), m(1625.4, 110.0, 20789))]
    ratios = [prompt_step_ratio(b, p) for b, p in pairs]
    assert ratios == pytest.approx([0.9321, 0.9520], abs=1e-3)
    assert prompt_step_ratio(m(100.0, 0.0, 0), m(90.0, 0.0, 0)) == pytest.approx(0.9)
    assert prompt_step_ratio(Measurement(median_ms=100.0), Measurement(median_ms=103.0)) == pytest.approx(1.03)


def test_a_fusion_near_the_keep_bar_is_read_again_and_the_mean_of_its_readings_decides(env):
    """Session 21-22's rope_attention read x0.987-1.000 across trials. A fusion whose first reading
    lands within FUSION_REREAD_BAND of the bar is timed again on a fresh seed: a lucky first reading
    (x0.990, then x1.004) is not kept, an unlucky one (x0.999, then x0.985) is; clear ones are read once."""
    from types import SimpleNamespace

    from anneal.agents.plan_search import FUSION_TRIAL_SEED, fusion_trials

    lab, setting, board = env
    readings = {"folded_norm": [0.990, 1.004], "norm_stats": [0.999, 0.985], "qkv_rope": [0.950], "linear_norm": [1.05]}
    calls: list[tuple[str, int]] = []

    class StubLab:
        cost_model = None  # the measured ratio is the whole model's

        def measure(self, cand, spec, prune=True, **kw):
            f = cand.note.removeprefix("fusion trial: ") if cand.note.startswith("fusion trial: ") else None
            calls.append((f or "base", spec.seed))
            ms = 1.0 if f is None else readings[f][sum(1 for c in calls if c[0] == f) - 1]
            return SimpleNamespace(measurement=SimpleNamespace(median_ms=ms), verdict=SimpleNamespace(reason=""))

    space = dataclasses.replace(setting.space, fusions=tuple(readings))
    fusion_trials(StubLab(), dataclasses.replace(setting, space=space), board, "plan-search", 0.005)
    assert {f: sum(1 for c in calls if c[0] == f) for f in readings} == {f: len(r) for f, r in readings.items()}
    assert len({s for f, s in calls if f != "base"}) == 6 and calls[0] == ("base", FUSION_TRIAL_SEED)
    assert set(board.fusions) == {"norm_stats", "qkv_rope"}
    assert board.fusions["norm_stats"] == pytest.approx(0.992)
    note = next(n for n in board.notes if n.startswith("fusion folded_norm:"))
    assert "(readings x0.990, x1.004: the mean)" in note and note.endswith("not kept")

    # the budget ends during the second readings: what was read by then is still decided on
    from anneal.agents.lab import BudgetExhausted

    class ShortLab(StubLab):
        def measure(self, cand, spec, prune=True, **kw):
            if len(calls) >= 9 + 2:  # the first readings (1 + 4 x 2), then one more fusion step and its base
                raise BudgetExhausted("budget spent")
            return super().measure(cand, spec, prune)

    calls.clear()
    short = Board()
    with pytest.raises(BudgetExhausted):
        fusion_trials(ShortLab(), dataclasses.replace(setting, space=space), short, "plan-search", 0.005)
    assert set(short.fusions) == {"qkv_rope"} and short.fusions["qkv_rope"] == pytest.approx(0.950)
    assert any("(readings x0.990, x1.004: the mean)" in n for n in short.notes)  # its re-read finished
    assert any(n.startswith("fusion norm_stats:") and "x0.999" in n and n.endswith("not kept") for n in short.notes)


def test_a_fusion_read_clear_of_its_base_steps_is_kept_on_a_small_whole_model_gain(env):
    """Session 51: lm_head_argmax ran the composite's 2-layer step 2.6% under both base steps beside it
    (0.605 against 0.621, 0.622 ms) and projected to x0.997 on the whole model, under the 0.5% bar, so it
    was dropped. A fusion whose every fused step is FUSION_CLEAR_GAIN under both base steps is kept on
    any whole-model gain; one as small in the projection but within the bases' spread is not, nor one
    clear on the fast tier that the projection says loses."""
    from types import SimpleNamespace

    from anneal.agents.plan_search import FUSION_CLEAR_GAIN, fusion_trials

    lab, setting, board = env
    # fast-tier step of each fusion, and the base steps: steady except around norm_stats
    fused = {"lm_head_argmax": 0.974, "norm_stats": 0.985, "silu_mul_down": 0.996, "gate_up_silu": 0.97}
    shrink = {"lm_head_argmax": 8.0, "norm_stats": 8.0, "silu_mul_down": 8.0, "gate_up_silu": -1.0}
    calls: list[str] = []

    class Projection:  # the once-a-step share of a 32-layer step, as the cost model would scale it
        def whole_model_ratio(self, base, spec, base_ms, fused_ms, per_layer=True):
            f = calls[-1]
            return 1 - (1 - fused_ms / base_ms) / shrink[f]

    class StubLab:
        cost_model = Projection()

        def measure(self, cand, spec, prune=True, **kw):
            f = cand.note.removeprefix("fusion trial: ") if cand.note.startswith("fusion trial: ") else None
            if f is None:  # the base steps bracketing norm_stats spread 2%: its gain is within them
                ms = 0.98 if calls and calls[-1] == "norm_stats" else 1.0
            else:
                ms = fused[f]
                calls.append(f)
            return SimpleNamespace(measurement=SimpleNamespace(median_ms=ms), verdict=SimpleNamespace(reason=""))

    space = dataclasses.replace(setting.space, fusions=tuple(fused))
    fusion_trials(StubLab(), dataclasses.replace(setting, space=space), board, "plan-search", 0.005)
    assert FUSION_CLEAR_GAIN == pytest.approx(0.01)
    assert set(board.fusions) == {"lm_head_argmax"}
    assert board.fusions["lm_head_argmax"] == pytest.approx(1 - 0.026 / 8)
    note = next(n for n in board.notes if n.startswith("fusion lm_head_argmax:"))
    assert "x0.997 on the whole model" in note and "kept: every fused step 1% or more under" in note
    for f in ("norm_stats", "silu_mul_down", "gate_up_silu"):
        assert next(n for n in board.notes if n.startswith(f"fusion {f}:")).endswith("not kept")


def test_a_fused_step_the_deadline_fell_inside_is_still_bracketed_and_decided(env):
    """Session 48: the H200's chat compile timed rope_attention, the last fusion of its trials, and
    the search's deadline passed while it ran, so the base step after it was refused and the reading
    thrown away. The closing base may start up to CLOSING_BASE_GRACE_S late; no other step may
    (qkv_rope stands for the late fusion here: the fake engine's base keeps rope_attention out)."""
    from types import SimpleNamespace

    from anneal.agents.lab import BudgetExhausted
    from anneal.agents.plan_search import CLOSING_BASE_GRACE_S, fusion_trials

    lab, setting, _ = env
    calls: list[tuple[str, float]] = []  # (what, grace it was asked with)
    past_deadline = 4  # the base, then folded_norm and its base, then qkv_rope: the deadline passes

    class DeadlineLab:
        cost_model = None

        def measure(self, cand, spec, prune=True, grace_s=0.0, **kw):
            what = cand.note.removeprefix("fusion trial: ") if cand.note.startswith("fusion trial: ") else "base"
            if len(calls) >= past_deadline and grace_s < 1.0:  # a second past the deadline
                raise BudgetExhausted("budget spent")
            calls.append((what, grace_s))
            ms = {"base": 1.0, "folded_norm": 1.02, "qkv_rope": 0.97}.get(what, 0.9)
            return SimpleNamespace(measurement=SimpleNamespace(median_ms=ms), verdict=SimpleNamespace(reason=""))

    board = Board()
    space = dataclasses.replace(setting.space, fusions=("folded_norm", "qkv_rope", "linear_norm"))
    with pytest.raises(BudgetExhausted):
        fusion_trials(DeadlineLab(), dataclasses.replace(setting, space=space), board, "plan-search", 0.005)
    assert [w for w, _ in calls] == ["base", "folded_norm", "base", "qkv_rope", "base"]
    assert [g for w, g in calls if w != "base"] == [0.0, 0.0]  # fused steps get no grace
    assert calls[2][1] == calls[4][1] == CLOSING_BASE_GRACE_S and calls[0][1] == 0.0
    assert set(board.fusions) == {"qkv_rope"} and board.fusions["qkv_rope"] == pytest.approx(0.97)
    assert not any(n.startswith("fusion linear_norm") for n in board.notes)  # never started past the deadline

    # a fused step that could not be timed gets no late base
    calls.clear()

    class FailingLab(DeadlineLab):
        def measure(self, cand, spec, prune=True, grace_s=0.0, **kw):
            if cand.note == "fusion trial: qkv_rope":
                calls.append(("qkv_rope", grace_s))
                return SimpleNamespace(measurement=None, verdict=SimpleNamespace(reason="kernel failed"))
            return super().measure(cand, spec, prune, grace_s=grace_s)

    failing = Board()
    with pytest.raises(BudgetExhausted):
        fusion_trials(FailingLab(), dataclasses.replace(setting, space=space), failing, "plan-search", 0.005)
    assert [w for w, _ in calls] == ["base", "folded_norm", "base", "qkv_rope"]
    assert "qkv_rope" not in failing.fusions


def test_a_step_may_start_within_its_grace_past_the_deadline_but_never_once_the_run_is_stopped(env):
    import time

    from anneal.agents.lab import BudgetExhausted
    from anneal.agents.types import Candidate

    lab, setting, _ = env
    lab.deadline = time.monotonic() - 1.0
    spec = setting.decode_spec.model_copy(update={"per_op": False})
    with pytest.raises(BudgetExhausted):
        lab.measure(Candidate(plan=setting.base, agent="t", note="late"), spec)
    exp = lab.measure(Candidate(plan=setting.base, agent="t", note="late, with grace"), spec, grace_s=60.0)
    assert exp.verdict.status == "measured" and exp.measurement.median_ms > 0
    lab.stop()
    with pytest.raises(BudgetExhausted):
        lab.measure(Candidate(plan=setting.base, agent="t", note="stopped"), spec.model_copy(update={"seed": 9}),
                    grace_s=1e9)


def test_fusion_trials_skip_a_fusion_that_runs_nothing_on_the_model_and_say_why(env):
    """Session 23: on the 8B the qkv_rope trial timed noise (x0.989, kept): its fused GEMV cannot
    hold the 128-wide heads at the base's tiles, so the engine ran the unfused ops. With the model's
    config in the setting such a fusion is not tried; on the 1B's 64-wide heads it is."""
    from types import SimpleNamespace

    from anneal.agents.plan_search import fusion_trials
    from anneal.engine.presets import PRESETS

    lab, setting, _ = env
    tried: list[str] = []

    class StubLab:
        cost_model = None

        def measure(self, cand, spec, prune=True, **kw):
            tried.append(cand.note)
            ms = 0.95 if cand.note.startswith("fusion trial: ") else 1.0
            return SimpleNamespace(measurement=SimpleNamespace(median_ms=ms), verdict=SimpleNamespace(reason=""))

    space = dataclasses.replace(setting.space, fusions=("qkv_rope", "norm_stats"))
    for preset, skipped in (("llama-3.1-8b", True), ("qwen3-8b", True), ("llama-3.2-1b", False)):
        tried.clear()
        board = Board()
        fusion_trials(StubLab(), dataclasses.replace(setting, space=space, model_config=PRESETS[preset]), board,
                      "plan-search", 0.005)
        assert ("fusion trial: qkv_rope" in tried) is not skipped, preset
        assert "fusion trial: norm_stats" in tried and "norm_stats" in board.fusions
        assert ("qkv_rope" in board.fusions) is not skipped
        if skipped:
            note = next(n for n in board.notes if n.startswith("fusion qkv_rope:"))
            assert note.startswith("fusion qkv_rope: not tried, it runs nothing on this model"), note


def test_top_plans_rank_by_the_given_projection_and_tie_on_it():
    """The board keeps fast-tier ms; promotion ranks them as the whole model would run them."""
    board = Board()
    head, layers = Plan(name="head"), Plan(name="layers", fusions={"folded_norm": True})
    board.offer_plan(0.570, head, "t")
    board.offer_plan(0.575, layers, "t")
    assert [p.name for _, p, _ in board.top_plans(2)] == ["head", "layers"]
    whole = {"head": 9.0, "layers": 8.5}
    ranked = board.top_plans(2, rank=lambda ms, plan: whole[plan.name])
    assert [(ms, p.name) for ms, p, _ in ranked] == [(0.575, "layers"), (0.570, "head")]  # ms kept raw
    assert [p.name for _, p, _ in board.top_plans(1, distinct_fusions=True, rank=lambda ms, p: whole[p.name])] == ["layers"]


def test_op_trials_drop_a_tuned_op_whose_own_time_wins_and_whose_step_loses(tmp_path):
    """Session 27: the tuner's decode attention (ticket merge) was faster alone and made the whole
    model's decode steps 2-3% slower. Each tuned op runs alone on the base, its decode step between
    two of the base's at the typical batch and in the drain below it; the composite keeps the ones
    whose steps win."""
    from anneal.agents.op_trials import OP_TRIAL_SEED, op_trials, trial_batches

    with _lab_on(tmp_path, step_penalties={("attention_decode", "splitk"): 1.5}) as (lab, setting, board):
        setting.prefill_steps_per_decode_step = 0.0  # decode steps alone here; the prompt step's test follows
        ledger = lab.ledger
        KernelTuner().run(lab, setting, board)
        assert board.best_ops["attention_decode"][0].impl == "splitk"  # its own time: half the reference's
        tuned = {op for op, (ch, _) in board.best_ops.items() if ch != setting.base.choice(op)}
        tuned_choices = {op: ch for op, (ch, _) in board.best_ops.items()}
        assert {"attention_decode", "rmsnorm", "silu_and_mul"} <= tuned
        batches = trial_batches(setting)
        typical = setting.decode_spec.batch_size
        assert batches[typical] == pytest.approx(2 / 3) and 1 in batches and sum(batches.values()) == pytest.approx(1)
        lab.deadline = 0.0  # the search is over: the trials run past its deadline
        op_trials(lab, setting, board)
        assert "attention_decode" not in board.best_ops and {"rmsnorm", "silu_and_mul"} <= set(board.best_ops)
        assert "splitk" not in board.composite(setting.base).choice("attention_decode").impl
        note = next(n for n in board.notes if n.startswith("op trial attention_decode:"))
        assert note.endswith("left at the base's choice") and f"b={typical} x1." in note
        rms = next(n for n in board.notes if n.startswith("op trial rmsnorm:"))
        assert rms.endswith("kept") and ": the mean" in rms  # x0.990 at first: within the band, read again
        trials = [e for e in ledger.experiments() if e.agent == "kernel-tuner" and e.note.startswith("op tria")]
        again = sum("again" in n for n in board.notes if n.startswith("op trial"))  # near-ties read twice
        assert len(trials) == (len(tuned) + again) * 2 * len(batches) + len(batches)  # B T B, the B before shared
        assert min(e.spec.seed for e in trials) == OP_TRIAL_SEED
        # a resumed compile reuses every trial
        again = Board()
        again.best_ops = {op: v for op, v in board.best_ops.items()}
        again.offer_op("attention_decode", OpChoice(impl="splitk", params={"block_n": 32, "split_k": 4}), 0.1)
        run = lab.run
        op_trials(lab, setting, again)
        assert lab.run == run and "attention_decode" not in again.best_ops
        # past the trials' deadline: what the ledger holds is reused, an op never tried is left out
        late = Board()
        for op in ("attention_decode", "rmsnorm"):
            late.offer_op(op, tuned_choices[op], 0.1)
        late.offer_op("silu_and_mul", OpChoice(impl="triton", params={"block": 256}), 0.1)
        op_trials(lab, setting, late, deadline=0.0)
        assert lab.run == run and set(late.best_ops) == {"rmsnorm"}
        assert any(n.startswith("op trial silu_and_mul:") and "not tried" in n for n in late.notes)


def test_op_trials_drop_a_tuned_op_whose_decode_step_wins_and_whose_prompt_steps_lose(tmp_path):
    """Session 56: gate_up at max_m 0 (the GEMV at every row count) read x0.928 on the decode step
    and doubled the slow tier's prompt steps; every promoted candidate carried it. The trials now
    time a prompt step too, weighed by its share of a replay."""
    from anneal.agents.op_trials import op_trials, trial_batches

    with _lab_on(tmp_path, prompt_penalties={("silu_and_mul", "triton"): 5.0}) as (lab, setting, board):
        KernelTuner().run(lab, setting, board)
        assert board.best_ops["silu_and_mul"][0].impl == "triton"  # its own time, on decode steps, wins
        assert board.best_ops["rmsnorm"][0].impl == "triton"
        lab.deadline = 0.0
        op_trials(lab, setting, board)
        assert "silu_and_mul" not in board.best_ops and "rmsnorm" in board.best_ops
        tuned = [n for n in board.notes if n.startswith("op trial ")]
        trials = [e for e in lab.ledger.experiments() if e.note.startswith("op trial")]
        again = sum("again" in n for n in tuned)
        # B T B at each decode batch and on a prompt step, the B before each shared
        assert len(trials) == (len(tuned) + again) * 2 * (len(trial_batches(setting)) + 1) + len(trial_batches(setting)) + 1
        note = next(n for n in board.notes if n.startswith("op trial silu_and_mul:"))
        assert note.endswith("left at the base's choice") and "prompt step x" in note and "of a replay" in note
        kept = next(n for n in board.notes if n.startswith("op trial rmsnorm:"))
        assert kept.endswith("kept") and "prompt step x" in kept
        prompts = [e for e in lab.ledger.experiments() if "prompt step" in e.note]
        assert prompts and {e.spec.mode for e in prompts} <= {"prefill", "mixed"}


def test_a_fast_tier_plan_goes_to_the_slow_tier_with_the_chosen_serving_knobs():
    """The plan search never moves the scheduler or the token graphs (they do not change a decode
    step), so its winners replayed on the base's scheduler and lost to the composite by overlap
    alone (session 27). Promotion replays them with the board's choices; a plan that chose its own
    (a seed's) keeps them."""
    from anneal.engine.plan import SchedulerKnobs

    base = Plan().with_ops(attention_prefill=OpChoice(impl="triton"))  # token graphs need it
    board = Board()
    fast = base.model_copy(update={"fusions": {"folded_norm": True}})
    assert board.serving(fast, base) is fast  # nothing chosen: the plan as timed
    board.set(scheduler=SchedulerKnobs(overlap=True, max_num_seqs=32), token_graph_sizes=[64, 128])
    served = board.serving(fast, base)
    assert served.scheduler.overlap and served.scheduler.max_num_seqs == 32
    assert served.cuda_graph_token_sizes == [64, 128] and served.fusions == fast.fusions
    own = fast.model_copy(update={"scheduler": SchedulerKnobs(max_num_seqs=128), "cuda_graph_token_sizes": [256]})
    assert board.serving(own, base) == own


@pytest.mark.parametrize("per_step, tried", [(1.0, False), (2.5, True)])
def test_scheduler_tuner_tries_speculation_only_where_the_replay_promises_it(tmp_path, per_step, tried):
    """The base's replay says what an n-gram drafter would emit a verify step: at 1.0 (the 8B's
    random weights) speculation is noted and not measured; at 2.5 it is probed, wins, and every
    grid setting after the probes speculates too (with overlap off: the two do not combine)."""
    with _lab_on(tmp_path, drafted_tokens_per_step=per_step) as (lab, setting, board):
        SchedulerTuner(max_settings=8).run(lab, setting, board)
        knobs = [r.plan.scheduler for r in lab.ledger.experiments()]
        assert len(knobs) == 8 and not knobs[0].speculative_tokens
        speculating = [k for k in knobs if k.speculative_tokens]
        if tried:
            assert knobs[2].speculative_tokens == 4 and not knobs[2].overlap
            assert all(k.speculative_tokens == 4 and not k.overlap for k in knobs[3:])
            assert board.scheduler.speculative_tokens == 4
        else:
            assert not speculating and board.scheduler.speculative_tokens == 0
            assert any("speculative decoding not tried" in n and "1.000 tokens" in n for n in board.notes)


def _fake_chat_setting():
    """The chat search setting of a fake GPU engine (its base plan and candidate space)."""
    srv, url = serve_in_thread(FakeEngine(token="tok", device="cuda", noise=0.0))
    try:
        with EngineClient(url, "tok") as client:
            return make_setting(client.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)[0]
    finally:
        srv.shutdown()


def _fusion_step_lab(ms_of, read: list):
    """A lab whose decode step takes ``ms_of(the plan's enabled fusions)``; each reading is appended
    to ``read`` as (note, fusions, seed)."""
    from types import SimpleNamespace

    class StubLab:
        cost_model = None

        def measure(self, cand, spec, prune=True, grace_s=0.0, **kw):
            on = frozenset(f for f, v in cand.plan.fusions.items() if v)
            read.append((cand.note, on, spec.seed))
            return SimpleNamespace(measurement=SimpleNamespace(median_ms=ms_of(on)), verdict=SimpleNamespace(reason=""))

    return StubLab


@pytest.mark.parametrize("together_ms, dropped", [(1.02, ["gate_up_silu"]), (0.95, [])])
def test_fusion_stack_check_drops_a_fusion_that_gains_nothing_beside_the_others(tmp_path, together_ms, dropped):
    """Session 50: folded_norm and gate_up_silu each won a trial alone (x0.97, x0.98 here), and the
    composite carried both, never timed together, though under folded_norm the gate_up_silu GEMV is
    another kernel. The check reads each fusion against the composite without it: where the pair is
    slower than either alone, the one that gains least leaves the board (one a round: dropping both
    would lose folded_norm's own gain), and the composite keeps the other; where the gains compound,
    nothing is dropped."""
    from anneal.agents.plan_search import FUSION_STACK_SEED, fusion_stack_check

    setting = _fake_chat_setting()
    alone = {frozenset(): 1.0, frozenset({"folded_norm"}): 0.97, frozenset({"gate_up_silu"}): 0.98,
             frozenset({"folded_norm", "gate_up_silu"}): together_ms}
    read: list[tuple[str, frozenset, int]] = []
    StubLab = _fusion_step_lab(alone.__getitem__, read)
    board = Board()
    board.keep_fusion("folded_norm", 0.97)
    board.keep_fusion("gate_up_silu", 0.98)
    assert set(board.composite(setting.base).fusions) == {"folded_norm", "gate_up_silu"}
    assert fusion_stack_check(StubLab(), setting, board) == dropped
    # C W C W C: the composite brackets each fusion's absence, a fresh seed each step
    both = frozenset({"folded_norm", "gate_up_silu"})
    assert [on for _, on, _ in read[:5]] == [both, frozenset({"gate_up_silu"}), both, frozenset({"folded_norm"}), both]
    assert [s for _, _, s in read] == list(range(FUSION_STACK_SEED, FUSION_STACK_SEED + len(read)))
    assert len(read) == 5  # after a drop one fusion is left: nothing more to time together
    kept = {"folded_norm"} if dropped else {"folded_norm", "gate_up_silu"}
    assert set(board.fusions) == kept and set(board.composite(setting.base).fusions) == kept
    note = next(n for n in board.notes if n.startswith("fusions folded_norm+gate_up_silu together"))
    assert note.endswith("; gate_up_silu dropped" if dropped else "; all kept"), note


def test_fusion_additions_try_the_fusions_the_composite_lacks_on_it_and_keep_one_that_pays_there(tmp_path):
    """Session 50: rope_attention read x0.996 on the base and was left out; beside folded_norm it
    also applies the 1/rms, and the hand-set plan carrying both ran the bs-12 step 1.7% faster than the
    compile's plan without it. Each fusion the composite lacks is read on the composite (C F C), best
    on the base first: rope_attention (x0.979 there) is kept and the composite carries it;
    lm_head_argmax (x1.010 on top) is not; linear_norm, x1.159 on the base, is not tried at all."""
    from anneal.agents.plan_search import FUSION_ADDITION_SEED, fusion_additions

    setting = _fake_chat_setting()
    fusions = ("folded_norm", "rope_attention", "lm_head_argmax", "linear_norm")
    setting = dataclasses.replace(setting, base=setting.base.with_ops(attention_decode=OpChoice(impl="triton_splitk")),
                                  space=dataclasses.replace(setting.space, fusions=fusions))

    def ms(on: frozenset) -> float:
        m = 0.97 if "folded_norm" in on else 1.0
        if "rope_attention" in on:
            m *= 0.95 / 0.97 if "folded_norm" in on else 0.996
        return m * (1.0105 if "lm_head_argmax" in on else 1.0) * (1.159 if "linear_norm" in on else 1.0)

    read: list[tuple[str, frozenset, int]] = []
    StubLab = _fusion_step_lab(ms, read)
    board = Board()
    board.keep_fusion("folded_norm", 0.97)
    for f, r in (("folded_norm", 0.97), ("rope_attention", 0.996), ("lm_head_argmax", 1.0), ("linear_norm", 1.159)):
        board.record_fusion_ratio(f, r)
    assert board.composite(setting.base).fusions == {"folded_norm": True}
    assert fusion_additions(StubLab(), setting, board) == ["rope_attention"]
    trials = [(n.rsplit(": ", 1)[1], on) for n, on, _ in read if n.startswith("fusion trial on the composite: ")]
    assert trials == [("rope_attention", frozenset({"folded_norm", "rope_attention"})),
                      ("lm_head_argmax", frozenset({"folded_norm", "rope_attention", "lm_head_argmax"}))]
    bases = [on for n, on, _ in read if n == "fusion trials on the composite: the base"]
    assert bases == [frozenset({"folded_norm"})] * 2 + [frozenset({"folded_norm", "rope_attention"})] * 2
    # each fusion's readings on seeds of its own (the fused step and the base step after it share one)
    seeds = [s for _, _, s in read]
    assert seeds[:3] == [seeds[0], seeds[1], seeds[1]] and seeds[3:] == [seeds[3], seeds[4], seeds[4]]
    assert not set(seeds[:3]) & set(seeds[3:]) and min(seeds) > FUSION_ADDITION_SEED
    assert board.composite(setting.base).fusions == {"folded_norm": True, "rope_attention": True}
    assert any(n.startswith("fusion lm_head_argmax on the composite:") and n.endswith("not kept") for n in board.notes)
