"""The ``rope_attention`` fusion's kernel: ``qk_rope_store`` then ``attention_decode`` in one launch,
against the reference's RoPE + store followed by the split kernel on the same decode step (caches and
output bit for bit in bf16 without Qwen3's q/k norm), and against the two kernels run one after the
other."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.kernels import attention_decode as attn
from anneal.engine.kernels import rope
from anneal.engine.kernels._common import KernelInputError
from anneal.engine.ops import reference as ref
from kernel_testing import DEVICES, DTYPES, TOL_ACC, assert_close, gen, randn, rope_table
from paged import paged_cache

CASES_CPU = [  # context_lens (0: a graph's padding row), H, Hkv, D, block_size, qk_norm
    ([1, 37, 0, 70], 6, 2, 24, 5, False),
    ([9, 64, 16], 4, 4, 16, 16, True),
    ([130], 8, 1, 32, 16, False),
]
CASES_GPU = [
    ([1, 1000, 333, 4097, 2048, 17, 0, 0], 32, 8, 128, 16, False),
    ([700, 1, 129, 800], 32, 8, 128, 16, True),
    ([12, 1025, 0], 16, 4, 64, 32, False),
]
PARAMS_CPU = [
    {"split_k": 1, "block_n": 16},
    {"split_k": 4, "block_n": 16},
    {"split_k": 8, "block_n": 16, "merge": "ticket"},
]
PARAMS_GPU = [
    {},
    {"split_k": 1, "block_n": 32},
    {"split_k": 8, "block_n": 32, "pdl": True},
    {"split_k": 16, "merge": "ticket", "pdl": True},
    {"num_stages": 5},  # the loop's K/V double-buffered: tiles requested after the new token's store
    {"split_k": 4, "block_n": 32, "num_stages": 7},
]


def _decode_step(lens, H, Hkv, D, BS, qk_norm, dtype, device, g):
    """A decode step's inputs: each row's own token at position ``len - 1``, stored at that
    position's slot of the block table (``-1`` for padding rows, context 0)."""
    kc, vc, bt, cl = paged_cache(lens, Hkv, D, BS, dtype, device, g)
    B = len(lens)
    qkv = randn(B, (H + 2 * Hkv) * D, dtype=dtype, device=device, g=g, scale=2.0)
    positions = torch.tensor([max(L - 1, 0) for L in lens])
    slots = torch.tensor([int(bt[b, (L - 1) // BS]) * BS + (L - 1) % BS if L else -1 for b, L in enumerate(lens)])
    qn = randn(D, dtype=dtype, device=device, g=g) if qk_norm else None
    kn = randn(D, dtype=dtype, device=device, g=g) if qk_norm else None
    return qkv, positions.to(device), rope_table(max(lens) + 1, D, device), kc, vc, slots.to(device), qn, kn, bt, cl


def _unfused(qkv, positions, cos_sin, kc, vc, slots, H, Hkv, qn, kn, bt, cl, scale, params, stream=None):
    q = rope.qk_rope_store(qkv, positions, cos_sin, kc, vc, slots, H, Hkv, qn, kn, 1e-6, rms_of=stream, rms_eps=1e-5)
    return attn.paged_decode_attention(q, kc, vc, bt, cl, scale, **params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "rms_of"])
def test_rope_attention_equals_rope_then_attention(device, dtype, folded):
    cases = CASES_CPU if device == "cpu" else CASES_GPU
    for pi, params in enumerate(PARAMS_CPU if device == "cpu" else PARAMS_GPU):
        for i, (lens, H, Hkv, D, BS, qk_norm) in enumerate(cases):
            g = gen(2000 + 10 * pi + i, device)
            qkv, pos, cs, kc0, vc0, slots, qn, kn, bt, cl = _decode_step(lens, H, Hkv, D, BS, qk_norm, dtype, device, g)
            stream = randn(len(lens), 3 * D + 5, dtype=dtype, device=device, g=g, scale=6.0) if folded else None
            scale = D ** -0.5
            kc_ref, vc_ref, kc, vc = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
            expected = _unfused(qkv, pos, cs, kc_ref, vc_ref, slots, H, Hkv, qn, kn, bt, cl, scale, params, stream)
            out = attn.rope_decode_attention(qkv, pos, cs, kc, vc, slots, H, Hkv, qn, kn, 1e-6, bt, cl, scale,
                                             rms_of=stream, rms_eps=1e-5, **params)
            what = f"params {params} case {i} {dtype}"
            # The reference's RoPE and store on the same inputs, then the split kernel on its q and caches
            kc_x, vc_x = kc0.clone(), vc0.clone()
            x = ref.rms_scaled(qkv, stream, 1e-5) if folded else qkv
            q_x = ref.qk_rope_store(x, pos, cs, kc_x, vc_x, slots, H, Hkv, qn, kn, 1e-6)
            via_ref = attn.paged_decode_attention(q_x, kc_x, vc_x, bt, cl, scale, **params)
            if dtype != torch.float32 and not qk_norm and not folded and device == "cuda":
                # RoPE rounded as the reference rounds it, so the tiles hold the reference's bits: its
                # output is the split kernel's on them, bit for bit (session 21, NOTES)
                assert torch.equal(kc, kc_x), what + ": k_cache differs from the reference's RoPE"
                assert torch.equal(vc, vc_x), what + ": v_cache differs from the reference's store"
                assert torch.equal(out, via_ref), what + ": output differs from the split kernel's on those caches"
            elif dtype != torch.float32 and not qk_norm and not folded:
                # The interpreter rounds bf16 its own way (not PyTorch's), in both kernels alike: the
                # fused kernel's caches and output are the unfused pair's, bit for bit
                assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), what + ": caches differ from qk_rope_store's"
                assert torch.equal(out, expected), what + ": output differs from the unfused pair's"
            else:  # fp32 products may fuse (FMA); Qwen3's q/k norm and the folded 1/rms sum in another order
                assert_close(kc, kc_x, what=what + " k_cache")
                assert_close(vc, vc_x, what=what + " v_cache")
                assert_close(out, via_ref, TOL_ACC, what=what)
            if dtype == torch.float32:  # and the unfused pair's and the plain reference's outputs
                assert_close(out, expected, TOL_ACC, what=what + " vs the unfused pair")
                assert_close(out, ref.attention_decode(q_x, kc_x, vc_x, bt, cl, scale), TOL_ACC,
                             what=what + " vs reference")


@pytest.mark.parametrize("device", DEVICES)
def test_rope_attention_never_reads_the_slot_it_stores(device):
    """The step's own k / v are stored before anything reads the slot: a stale value left in it (a
    recycled block) changes nothing, as with the unfused pair."""
    g = gen(2100, device)
    lens, H, Hkv, D, BS = [5, 33], 4, 2, 16, 8
    qkv, pos, cs, kc, vc, slots, _, _, bt, cl = _decode_step(lens, H, Hkv, D, BS, False, torch.float32, device, g)
    flat_k, flat_v = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)
    out_a = attn.rope_decode_attention(qkv, pos, cs, kc, vc, slots, H, Hkv, None, None, 1e-6, bt, cl, D ** -0.5,
                                       split_k=4, block_n=16)
    stored_k = flat_k[slots].clone()
    flat_k[slots] = float("nan")
    flat_v[slots] = float("nan")
    out_b = attn.rope_decode_attention(qkv, pos, cs, kc, vc, slots, H, Hkv, None, None, 1e-6, bt, cl, D ** -0.5,
                                       split_k=4, block_n=16)
    assert torch.equal(out_a, out_b)
    assert torch.equal(flat_k[slots], stored_k), "the slot is stored again"


@pytest.mark.parametrize("device", ["cpu"])
def test_rope_attention_rejects_bad_inputs(device):
    g = gen(2200, device)
    lens, H, Hkv, D, BS = [5, 9], 4, 2, 16, 8
    qkv, pos, cs, kc, vc, slots, _, _, bt, cl = _decode_step(lens, H, Hkv, D, BS, False, torch.float32, device, g)
    before = kc.clone()
    with pytest.raises(KernelInputError, match=r"not \[B, \(H \+ 2\*Hkv\) \* D\]"):
        attn.rope_decode_attention(qkv[:, :-D], pos, cs, kc, vc, slots, H, Hkv, None, None, 1e-6, bt, cl, 0.25)
    with pytest.raises(KernelInputError, match="kv heads"):
        attn.rope_decode_attention(qkv, pos, cs, kc, vc, slots, H - 2, Hkv + 1, None, None, 1e-6, bt, cl, 0.25)
    with pytest.raises(KernelInputError, match="positions and slot_mapping"):
        attn.rope_decode_attention(qkv, pos[:1], cs, kc, vc, slots, H, Hkv, None, None, 1e-6, bt, cl, 0.25)
    with pytest.raises(KernelInputError, match="rms_of must be"):
        attn.rope_decode_attention(qkv, pos, cs, kc, vc, slots, H, Hkv, None, None, 1e-6, bt, cl, 0.25,
                                   rms_of=randn(3, 32, dtype=torch.float32, device=device, g=g))
    assert torch.equal(kc, before), "a refused call stored nothing"
