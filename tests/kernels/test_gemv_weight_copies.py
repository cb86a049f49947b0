"""Projections on a second copy of their weight (weight-only fp8, bf12): the quantizer and the packer,
the GEMV over each copy against its plain-PyTorch reference, the fused GEMVs reading it, and a whole
model on such a plan against the reference plan run on the same (rounded) weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anneal.engine import bf12_weights as b12
from anneal.engine import fp8_weights as f8
from anneal.engine import weight_copies
from anneal.engine.kernels import gemv
from anneal.engine.kernels._common import KernelInputError
from anneal.engine.ops.registry import build_op
from anneal.engine.plan import BF12_WEIGHT_IMPL, FP8_WEIGHT_IMPL
from kernel_testing import DEVICES, DTYPES, TOL_ACC, assert_close, device_configs, gen, randn

SHAPES_CPU = [(1, 70, 130), (3, 33, 200), (17, 50, 64), (70, 20, 38)]  # M, N, K; 70 rows: above max_m
SHAPES_GPU = [(1, 6144, 4096), (8, 4096, 4096), (16, 28672, 4096), (1, 4096, 14336), (200, 1000, 2048), (3, 1023, 4000)]
# format -> (variant, the copy of w, the dense weight it stands for in dtype, the GEMV's reference)
FORMATS = {
    "fp8": (FP8_WEIGHT_IMPL, f8.fp8_of, lambda q, dt: f8.dequantized(q, dt), f8.reference_linear),
    "bf12": (BF12_WEIGHT_IMPL, b12.bf12_of, lambda q, dt: b12.unpacked(q).to(dt), b12.reference_linear),
}
FORMAT_DTYPES = [("fp8", torch.float32), ("fp8", torch.bfloat16), ("bf12", torch.bfloat16)]  # bf12 packs bf16
PARAMS_CPU = [
    {"split_k": 1, "block_n": 16, "block_k": 64, "m1": "fma"},
    {"split_k": 4, "block_n": 32, "block_k": 64, "block_m": 16},
    {"split_k": 4, "block_n": 16, "block_k": 64, "reduce": "ticket", "m1": "fma", "ahead": 2},
    {"split_k": 2, "block_n": 32, "block_k": 64, "max_m": 0, "reduce": "ticket", "block_m": 16},
]
PARAMS_GPU = [
    {},
    {"split_k": 8, "block_n": 32, "block_k": 256, "num_warps": 8, "m1": "fma"},
    {"split_k": 4, "block_k": 256, "reduce": "ticket", "pdl": True},
    {"block_n": 128, "block_k": 256, "max_m": 0, "num_stages": 4},
]


def test_quantize_rows_scaled_to_e4m3_range():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 300, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    w[5] = 0.0
    q = f8.quantize(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.data.shape == w.shape and q.scale.shape == (40,)
    amax = q.data.float().abs().amax(dim=1)
    assert torch.equal(amax[torch.arange(40) != 5], torch.full((39,), 448.0))  # each row uses the whole range
    assert q.scale[5] == 1 and not q.data[5].float().any()
    back = f8.dequantized(q, torch.float32)
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself; tiny ones within half a subnormal step
    err = (back - w).abs()
    assert bool((err <= w.abs() * 2 ** -4 + q.scale[:, None] * 2 ** -10).all())
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        f8.quantize(torch.zeros(3))


def test_the_copy_is_kept_on_the_weight_and_dropped():
    from anneal.engine import weight_copies

    w = torch.randn(8, 16)
    q = f8.fp8_of(w)
    assert f8.fp8_of(w) is q and weight_copies.has_copy(w, "fp8")
    assert weight_copies.drop([w, torch.randn(2, 2)], "fp8") == f8.fp8_bytes(w) == 8 * 16 + 4 * 8
    assert not weight_copies.has_copy(w, "fp8") and f8.fp8_of(w) is not q


def test_bf12_keeps_every_weight_in_its_row_s_window():
    """bf12 stores a bf16 weight exactly when its exponent is within the 16 under its row's largest
    power of two; the rest (zeros too, unless the row's window reaches down to them) become the
    window's smallest value with their sign, within ``max|row| * 2^-15``, and are counted."""
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(48, 512, generator=g) * torch.logspace(-30, 3, 48)[:, None]).bfloat16()
    w[3:5] = 0.0
    w[4, :7] = torch.tensor([0.0, -0.0, 1e-39, -3e-40, 2.0 ** -20, -1.25 * 2.0 ** -15, 1.5 * 2.0 ** -14]).bfloat16()
    w[4, 7] = 1.0  # row 4's window: exponents -15 .. 0
    q = b12.pack(w)
    assert q.lo.dtype == q.codes.dtype == torch.uint8 and q.base.dtype == torch.int32
    assert q.lo.shape == (48, 512) and q.codes.shape == (48, 256) and q.base.shape == (48,)
    back = b12.unpacked(q)
    assert back.dtype == torch.bfloat16 and not torch.equal(back, w)  # a Gaussian row has a few below the window
    exact = back.view(torch.int16) == w.view(torch.int16)  # bit for bit, signs of zeros too
    rowmax = w.float().abs().amax(dim=1, keepdim=True)
    assert bool(((back.float() - w.float()).abs() <= rowmax * 2.0 ** -15).all())
    assert int((~exact).sum()) == q.flushed
    assert 0 < int((~exact[5:]).sum()) < w[5:].numel() * 1e-3  # the Gaussian rows: a few in ten thousand
    assert bool(exact[w.float().abs() >= rowmax * 2.0 ** -14].all())
    assert bool(exact[3].all())  # an all-zero row: its window reaches zero
    # row 4: zeros, subnormals and 2^-20 under the window: its smallest value 2^-15, signed; -1.25 * 2^-15
    # and 1.5 * 2^-14 in it
    small = 2.0 ** -15
    assert back[4, :7].float().tolist() == [small, -small, small, -small, small, -1.25 * small, 1.5 * 2.0 ** -14]
    assert b12.bf12_bytes(w) == 48 * 512 * 3 // 2 + 4 * 48
    for bad in (torch.zeros(4, 6), torch.zeros(4, 5, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="bf16 \\[N, K\\] matrix with K even"):
            b12.pack(bad)


@pytest.mark.parametrize("block", [512 * 5, 512 * 48, 1])
def test_copies_are_made_a_block_of_rows_at_a_time_as_in_one(monkeypatch, block):
    """The makers convert blocks of rows (their temporaries stay small beside lm_head's 0.5 G
    weights): any block size, one that does not divide the rows included, gives the same copy."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(37, 512, generator=g) * torch.logspace(-20, 2, 37)[:, None]).bfloat16()
    w[6] = 0.0
    whole = (b12.pack(w), f8.quantize(w))
    monkeypatch.setattr(weight_copies, "ROW_BLOCK_ELEMENTS", block)
    seen: list[slice] = []
    row_blocks = weight_copies.row_blocks
    monkeypatch.setattr(weight_copies, "row_blocks", lambda t: [seen.append(r) or r for r in row_blocks(t)])
    blocks = (b12.pack(w), f8.quantize(w))
    rows = max(1, block // 512)
    assert len(seen) == 2 * -(-37 // rows) and all(r.stop - r.start <= rows for r in seen)  # both makers, by blocks
    def bits(t: torch.Tensor) -> torch.Tensor:  # e4m3 compared by its bytes
        return t.view(torch.uint8) if t.dtype == f8.FP8 else t

    for a, b in zip(whole[0][:3] + tuple(whole[1]), blocks[0][:3] + tuple(blocks[1])):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    assert blocks[0].flushed == whole[0].flushed > 0
    assert float(blocks[1].scale[6]) == 1.0  # an all-zero row keeps scale 1
    empty = torch.zeros(0, 8, dtype=torch.bfloat16)
    assert b12.pack(empty).lo.shape == (0, 8) and b12.pack(empty).codes.shape == (0, 4)
    assert f8.quantize(empty).data.shape == (0, 8) and f8.quantize(empty).scale.shape == (0,)


@pytest.mark.parametrize("device, pi, params", device_configs(PARAMS_CPU, PARAMS_GPU))
@pytest.mark.parametrize("fmt, dtype", FORMAT_DTYPES)
@pytest.mark.parametrize("op", ["qkv_proj", "down_proj"])
def test_copy_gemv_matches_its_reference(device, pi, params, fmt, dtype, op):
    impl, copy_of, _, reference = FORMATS[fmt]
    shapes = SHAPES_CPU if device == "cpu" else SHAPES_GPU
    if impl == BF12_WEIGHT_IMPL:  # the dot path only: no M == 1 register-FMA knobs
        params = {k: v for k, v in params.items() if k not in ("m1", "ahead")}
    fn = build_op(op, impl, params)
    for i, (M, N, K) in enumerate(shapes):
        g = gen(5000 + 10 * pi + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        w = randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        max_m = params.get("max_m", 64)
        prompt_rows = bool(max_m) and M > max_m  # above max_m (0: never): the bf16 weight through torch's GEMM
        expected = F.linear(x, w) if prompt_rows else reference(x, copy_of(w))
        assert_close(fn(x, w), expected, TOL_ACC, what=f"{fmt} {params} {M}x{N}x{K} {dtype}")
        if not prompt_rows:  # and it is the copy that is read: W changed after it was made does not count
            w.mul_(2)
            assert_close(fn(x, w), expected, TOL_ACC, what=f"{fmt} {params} {M}x{N}x{K} {dtype}, W changed")


def test_bf12_gemv_refuses_what_it_cannot_pack():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(KernelInputError, match="bf12 weights pack bf16 weights"):
        build_op("o_proj", BF12_WEIGHT_IMPL, {"max_m": 0})(x, w)
    with pytest.raises(KernelInputError, match="weights must be 'bf16', 'fp8' or 'bf12'"):
        gemv.small_m_gemm(x, w, weights="int4")
    with pytest.raises(KernelInputError, match="unpack must be one of"):
        gemv.small_m_gemm(x.bfloat16(), w.bfloat16(), weights="bf12", unpack="lut")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt, dtype", FORMAT_DTYPES)
def test_fused_gemvs_read_the_copy(device, fmt, dtype):
    """Each GEMV fusion with ``weights=fmt`` equals the same fusion over the dense weight the copy
    stands for (fp8 in fp32: the same weights; in bf16 they differ by W's rounding to bf16)."""
    _, copy_of, dense, _ = FORMATS[fmt]
    kw = {"block_k": 64, "split_k": 2, "reduce": "ticket", "block_n": 32} if device == "cpu" else {"reduce": "ticket"}
    for i, (M, N, K) in enumerate([(1, 64, 96), (5, 96, 64)] if device == "cpu" else [(1, 4096, 4096), (12, 4096, 4096)]):
        g = gen(5100 + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        r = randn(M, K, dtype=dtype, device=device, g=g)
        nw = randn(K, dtype=dtype, device=device, g=g, scale=0.1) + 1
        w = randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        wd = dense(copy_of(w), dtype)
        gu = randn(M, 2 * K, dtype=dtype, device=device, g=g)
        wn = randn(K, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)  # o / down: [hidden, hidden]
        wnd = dense(copy_of(wn), dtype)
        cases = {
            "gate_up_silu": (gemv.gate_up_silu(x, w, weights=fmt, **kw), gemv.gate_up_silu(x, wd, **kw)),
            "silu_mul_down_proj": (gemv.silu_mul_down_proj(gu, w, weights=fmt, **kw),
                                   gemv.silu_mul_down_proj(gu, wd, **kw)),
            "add_rmsnorm_linear": (gemv.add_rmsnorm_linear(x, r, nw, 1e-6, w, weights=fmt, **kw)[0],
                                   gemv.add_rmsnorm_linear(x, r, nw, 1e-6, wd, **kw)[0]),
            "linear_add_rmsnorm": (gemv.linear_add_rmsnorm(x, wn, r, nw, 1e-6, weights=fmt, **kw)[0],
                                   gemv.linear_add_rmsnorm(x, wnd, r, nw, 1e-6, **kw)[0]),
            "linear_residual_": (gemv.linear_residual_(x, wn, r.clone(), weights=fmt, **kw),
                                 gemv.linear_residual_(x, wnd, r.clone(), **kw)),  # folded_norm's o / down
        }
        for name, (got, want) in cases.items():
            assert_close(got, want, TOL_ACC, what=f"{fmt} {name} {M}x{N}x{K} {dtype}")
        # lm_head on a copy (session 45): the greedy tokens of the same numbers, tile for tile
        tiles = {k: v for k, v in kw.items() if k in ("block_n", "block_k")}
        got, want = gemv.lm_head_argmax(x, w, weights=fmt, **tiles), gemv.lm_head_argmax(x, wd, **tiles)
        assert torch.equal(got, want), (fmt, M, N, K, got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["fp8", "bf12"])
def test_copy_plan_generates_as_the_reference_on_the_same_weights(device, fmt, monkeypatch):
    """A Llama on a fused plan whose four projections read fp8 (bf12) copies generates what the
    reference plan generates on the weights they stand for (rounded through e4m3 or bf12 first, so
    both runs use the same numbers); the copies exist while the plan serves and go with the next
    plan."""
    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.plan import OpChoice
    from anneal.engine.sampling_params import SamplingParams
    from anneal.engine import weight_copies
    from test_fused_plan import fused_plan

    impl, _, dense, _ = FORMATS[fmt]
    make = f8.quantize if fmt == "fp8" else b12.pack
    eng = Engine(EngineArgs(model="random:tiny", device=device, dtype="float32" if fmt == "fp8" else "bfloat16",
                            num_kv_blocks=128, max_model_len=256))
    projections = [(L, name) for L in eng.weights.layers for name in ("qkv", "o", "gate_up", "down")]
    projections.append((eng.weights, "lm_head"))  # lm_head reads its copy too, unfused and fused with argmax
    for L, name in projections:
        w = getattr(L, name)
        w.copy_(dense(make(w), w.dtype))
        assert not weight_copies.has_copy(w, fmt)
    params = SamplingParams(max_tokens=10 if device == "cpu" else 48, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist() for n in (6, 30)]
    ref = eng.generate(prompts, params)
    plan = fused_plan(device, ("norm_stats", "qkv_rope", "gate_up_silu", "lm_head_argmax"))
    dot_only = ("m1", "ahead") if fmt == "bf12" else ()  # bf12: the dot path only
    plan = plan.model_copy(update={"ops": {**plan.ops, **{
        op: OpChoice(impl=impl, params={k: v for k, v in plan.choice(op).params.items() if k not in dot_only})
        for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")}}})
    read = set()  # (kernel, format, rows of W) of every GEMV the plan launches, its graphs' captures included
    copy_of_w = gemv._weight_copy
    monkeypatch.setattr(gemv, "_weight_copy", lambda name, w, weights, unpack: (
        read.add((name, weights, w.shape[0])), copy_of_w(name, w, weights, unpack))[1])
    eng.apply_plan(plan)
    assert all(weight_copies.has_copy(getattr(L, name), fmt) for L, name in projections)
    got = eng.generate(prompts, params)
    # lm_head reads its copy: fused with the argmax in the GPU's decode graphs (captured by the apply:
    # session 46's first GPU run patched after it and saw only the prompt steps), as the op on the CPU
    head = "lm_head_argmax" if device == "cuda" else "linear"
    assert (head, fmt, eng.config.vocab_size) in read and (head, "bf16", eng.config.vocab_size) not in read, read
    agree = sum(a == b for r, o in zip(ref, got) for a, b in zip(r, o)) / sum(len(r) for r in ref)
    assert agree > 0.98, (agree, ref, got)
    # the next plan's second copies are made only once this one's are gone (an 8B on an H100 has
    # room for one of them beside its KV cache: session 43)
    import anneal.engine.llm as llm_mod
    from test_fused_plan import folded_plan

    fold = llm_mod.fold_norms
    held = []
    llm_mod.fold_norms = lambda w: held.append(any(weight_copies.has_copy(getattr(L, n), fmt) for L, n in projections)) or fold(w)
    try:
        eng.apply_plan(folded_plan(device))
    finally:
        llm_mod.fold_norms = fold
    assert held == [False]
    assert not any(weight_copies.has_copy(getattr(L, name), fmt) for L, name in projections)
    assert eng.weights.folded is not None


def test_a_projection_keeps_only_the_copy_its_plan_reads():
    """Switching a projection from fp8 to bf12 drops its e4m3 copy before the bf12 one is made (an
    8B holds room for one set beside its KV cache); a name or format it does not know changes nothing."""
    from anneal.engine import weight_copies
    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.weights import set_weight_copies

    eng = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="bfloat16", num_kv_blocks=16, max_model_len=64))
    qkv = [L.qkv for L in eng.weights.layers]
    assert set_weight_copies(eng.weights, {"qkv": "fp8", "o": "bf12"}) == 0
    assert all(weight_copies.has_copy(t, "fp8") and not weight_copies.has_copy(t, "bf12") for t in qkv)
    freed = set_weight_copies(eng.weights, {"qkv": "bf12"})
    assert freed == sum(f8.fp8_bytes(t) + b12.bf12_bytes(L.o) for t, L in zip(qkv, eng.weights.layers))
    assert all(weight_copies.has_copy(t, "bf12") and not weight_copies.has_copy(t, "fp8") for t in qkv)
    assert not any(weight_copies.has_copy(L.o, "bf12") for L in eng.weights.layers)
    assert set_weight_copies(eng.weights, {"qkv": "bf12", "lm_head": "bf12"}) == 0  # lm_head: one tensor
    assert weight_copies.has_copy(eng.weights.lm_head, "bf12")
    assert set_weight_copies(eng.weights, {"qkv": "bf12"}) == b12.bf12_bytes(eng.weights.lm_head)
    for bad in ({"embed": "bf12"}, {"qkv": "int4"}):
        with pytest.raises(ValueError, match="weight copies: unknown"):
            set_weight_copies(eng.weights, bad)
    assert all(weight_copies.has_copy(t, "bf12") for t in qkv)
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        weight_copies.copy_of(qkv[0], "int4")


def _run_ptx(asm: str, regs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``asm`` (the few b32 instructions ``gemv._BF12_ASM`` uses) on int64 tensors of uint32
    values, lane by lane: the interpreter cannot run inline PTX, so this checks its arithmetic."""
    regs = dict(regs)
    mask = 0xFFFFFFFF

    def val(a: str) -> torch.Tensor | int:
        return regs[a] if a in regs else int(a, 0)

    def lop3(a, b, c, lut: int):
        out = 0
        for bit in range(8):  # lut bit i is f(a, b, c) for a = i>>2 & 1, b = i>>1 & 1, c = i & 1
            if lut >> bit & 1:
                ta = a if bit & 4 else ~a & mask
                tb = b if bit & 2 else ~b & mask
                tc = c if bit & 1 else ~c & mask
                out = out | (ta & tb & tc)
        return out & mask

    def prmt(a, b, sel: int):
        out = 0
        for i in range(4):
            s = sel >> (4 * i) & 7
            byte = ((a if s < 4 else b) >> (8 * (s % 4))) & 0xFF
            out = out | (byte << (8 * i))
        return out

    ops = {"shr.u32": lambda a, b: a >> b, "shl.b32": lambda a, b: (a << b) & mask, "and.b32": lambda a, b: a & b,
           "add.u32": lambda a, b: (a + b) & mask, "lop3.b32": lop3, "prmt.b32": prmt}
    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *srcs = [a.strip() for a in args.split(",")]
        regs[dst] = ops[op](*(val(s) for s in srcs))
    return regs


def test_the_ptx_unpack_rebuilds_what_unpacked_does():
    """``gemv._BF12_ASM`` (the GPU's bf12 unpack, four pairs of weights an instance) gives the bf16
    bits ``b12.unpacked`` does, for every code, sign and base, emulated instruction by instruction."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(64, 256, generator=g) * torch.logspace(-35, 30, 64)[:, None]).bfloat16()
    w[0, :8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3e38, -3e38, 1e-40, -2.0 ** -133]).bfloat16()
    q = b12.pack(w)
    assert int(q.base.max()) > 100 and int(q.base.min()) == 0  # the window's whole range of bases
    want = b12.unpacked(q).view(torch.int16).to(torch.int64) & 0xFFFF  # [N, K]
    lo = q.lo.to(torch.int64).view(64, -1, 8)  # eight weights (four pairs) an instance
    codes = q.codes.to(torch.int64).view(64, -1, 4)  # their four code bytes
    as_word = lambda b: b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24  # noqa: E731
    regs = {"$4": as_word(lo[..., :4]), "$5": as_word(lo[..., 4:]),  # pairs 0-1 and 2-3, 16 bits each
            "$6": as_word(codes), "$7": (q.base.to(torch.int64) * 0x01010101)[:, None].expand(lo.shape[:2])}
    out = _run_ptx(str(gemv._BF12_ASM.value), regs)
    halves = lambda r: (out[r] & 0xFFFF, out[r] >> 16)  # noqa: E731
    even = torch.stack((*halves("$0"), *halves("$1")), -1)  # weights 0, 2, 4, 6 of the eight
    odd = torch.stack((*halves("$2"), *halves("$3")), -1)  # 1, 3, 5, 7
    got = torch.stack((even, odd), -1).view(64, -1)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("params", [{}, {"block_n": 32, "block_k": 256, "reduce": "ticket"},
                                    {"block_n": 16, "block_k": 512, "split_k": 1, "num_warps": 8},
                                    {"block_n": 128, "block_k": 128, "block_m": 32, "num_stages": 4}])
def test_the_ptx_unpack_gives_the_integer_unpack_s_bits(params):
    """On the GPU the bf12 GEMV's two unpacks (PTX and Triton integer ops) feed the same bf16 tile to
    the same dot: their outputs are equal bit for bit, plain and fused, at the shapes of the 8B."""
    for i, (M, N, K) in enumerate(SHAPES_GPU[:5]):
        g = gen(7000 + i, "cuda")
        x = randn(M, K, dtype=torch.bfloat16, device="cuda", g=g)
        w = randn(N, K, dtype=torch.bfloat16, device="cuda", g=g, scale=K ** -0.5)
        asm, ints = (gemv.small_m_gemm(x, w, weights="bf12", unpack=u, **params) for u in ("asm", "int"))
        assert torch.equal(asm, ints), (params, M, N, K)
    x = randn(5, 4096, dtype=torch.bfloat16, device="cuda", g=g)
    gu = randn(2 * 1024, 4096, dtype=torch.bfloat16, device="cuda", g=g, scale=4096 ** -0.5)
    asm, ints = (gemv.gate_up_silu(x, gu, weights="bf12", unpack=u, **params) for u in ("asm", "int"))
    assert torch.equal(asm, ints), params
