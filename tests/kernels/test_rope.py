"""qk_rope_store against the reference: q output, k/v written to the right cache slots, -1 skipped."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op
from kernel_testing import DEVICES, DTYPES, assert_close, gen, randn, rope_table


def _inputs(T, H, Hkv, D, NB, BS, qk_norm, dtype, device, g):
    """qkv, positions, cos/sin, distinct random slots (some tokens padding, -1), q/k norms, caches."""
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype, device=device, g=g, scale=2.0)
    positions = torch.randint(0, 500, (T,), generator=g).to(device)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    slots[torch.rand(T, generator=g) < 0.25] = -1
    qn = randn(D, dtype=dtype, device=device, g=g) if qk_norm else None
    kn = randn(D, dtype=dtype, device=device, g=g) if qk_norm else None
    kc0 = randn(NB, BS, Hkv, D, dtype=dtype, device=device, g=g)
    vc0 = randn(NB, BS, Hkv, D, dtype=dtype, device=device, g=g)
    return qkv, positions, rope_table(512, D, device), slots.to(device), qn, kn, kc0, vc0


CASES_CPU = [  # T, H, Hkv, D, num_blocks, block_size, qk_norm
    (5, 4, 2, 16, 6, 4, False),
    (3, 6, 2, 24, 4, 3, True),
    (1, 3, 3, 8, 2, 16, True),
]
CASES_GPU = [
    (1, 32, 8, 64, 64, 16, False),
    (77, 32, 8, 128, 128, 16, True),
    (300, 40, 8, 128, 64, 32, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_rope_store(device, dtype):
    fn = build_op("qk_rope_store", "triton", {"num_warps": 2, "pdl": device == "cuda"})
    cases = CASES_CPU if device == "cpu" else CASES_GPU
    for i, (T, H, Hkv, D, NB, BS, qk_norm) in enumerate(cases):
        g = gen(400 + i, device)
        qkv, positions, cos_sin, slots, qn, kn, kc0, vc0 = _inputs(T, H, Hkv, D, NB, BS, qk_norm, dtype, device, g)
        kc_ref, vc_ref = kc0.clone(), vc0.clone()
        kc, vc = kc0.clone(), vc0.clone()
        q_ref = ref.qk_rope_store(qkv, positions, cos_sin, kc_ref, vc_ref, slots, H, Hkv, qn, kn, 1e-6)
        q = fn(qkv, positions, cos_sin, kc, vc, slots, H, Hkv, qn, kn, 1e-6)
        what = f"case {i} {dtype}"
        assert_close(q, q_ref, what=what + " q")
        assert_close(kc, kc_ref, what=what + " k_cache")
        assert torch.equal(vc, vc_ref), what + " v_cache must be a plain copy"
        if device == "cuda" and not qk_norm:  # compiled without FMA contraction (rope.QK_ROPE_STORE_OPTIONS):
            # every product and sum rounded as the reference's elementwise ops round them (the
            # interpreter rounds bf16 its own way, so only the GPU build is held to the bits)
            assert torch.equal(q, q_ref) and torch.equal(kc, kc_ref), what + ": RoPE rounds otherwise than the reference"
        # slots not written keep their old contents exactly
        untouched = torch.ones(NB * BS, dtype=torch.bool)
        untouched[slots[slots >= 0].cpu()] = False
        assert torch.equal(kc.view(NB * BS, Hkv, D)[untouched.to(device)], kc0.view(NB * BS, Hkv, D)[untouched.to(device)])


@pytest.mark.parametrize("device", DEVICES)
def test_qk_rope_store_rejects_bad_shapes(device):
    fn = build_op("qk_rope_store", "triton")
    qkv = torch.ones(2, 40, device=device)
    cache = torch.ones(2, 4, 1, 8, device=device)
    with pytest.raises(ValueError, match="not \\[T, \\(H \\+ 2\\*Hkv\\) \\* D\\]"):
        fn(qkv, torch.zeros(2, dtype=torch.long, device=device), rope_table(8, 8, device), cache, cache.clone(),
           torch.zeros(2, dtype=torch.long, device=device), 4, 1, None, None, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_reference_store_skips_padding_rows_even_beside_slot_0(device):
    """A padding row (slot -1) in the same call as a real token stored in slot 0 writes nothing:
    the reference once sent padding rows to slot 0 with its old contents, and index_copy_ with a
    duplicate index let the stale row win (always on the CPU, at random on CUDA)."""
    g = gen(61, device)
    kc = randn(2, 4, 2, 8, dtype=torch.float32, device=device, g=g)
    vc = randn(2, 4, 2, 8, dtype=torch.float32, device=device, g=g)
    k = randn(3, 2, 8, dtype=torch.float32, device=device, g=g)
    v = randn(3, 2, 8, dtype=torch.float32, device=device, g=g)
    before_k = kc.clone()
    slots = torch.tensor([5, 0, -1], device=device)
    ref.store_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(8, 2, 8), vc.view(8, 2, 8)
    assert torch.equal(flat_k[0], k[1]) and torch.equal(flat_v[0], v[1])
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[5], v[0])
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert torch.equal(flat_k[untouched], before_k.view(8, 2, 8)[untouched])
    ref.store_kv(k, v, kc, vc, torch.tensor([-1, -1, -1], device=device))  # nothing valid: nothing changes
    assert torch.equal(flat_k[0], k[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_rope_store_scaled_by_the_stream_rms(device, dtype):
    """``folded_norm``'s RoPE + store: q, k and v of each token scaled by its residual row's 1/rms
    first, as ``reference.rms_scaled`` then the reference op do (Qwen3's q/k norm included)."""
    from anneal.engine.kernels import rope

    cases = CASES_CPU if device == "cpu" else CASES_GPU
    for i, (T, H, Hkv, D, NB, BS, qk_norm) in enumerate(cases):
        g = gen(450 + i, device)
        qkv, positions, cos_sin, slots, qn, kn, kc0, vc0 = _inputs(T, H, Hkv, D, NB, BS, qk_norm, dtype, device, g)
        stream = randn(T, 3 * D + 5, dtype=dtype, device=device, g=g, scale=6.0)  # any width: not the qkv row
        stream[-1] *= 30.0
        kc_ref, vc_ref, kc, vc = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
        q_ref = ref.qk_rope_store(ref.rms_scaled(qkv, stream, 1e-5), positions, cos_sin, kc_ref, vc_ref, slots,
                                  H, Hkv, qn, kn, 1e-6)
        q = rope.qk_rope_store(qkv, positions, cos_sin, kc, vc, slots, H, Hkv, qn, kn, 1e-6, num_warps=2,
                               pdl=device == "cuda", rms_of=stream, rms_eps=1e-5)
        what = f"case {i} {dtype}"
        assert_close(q, q_ref, what=what + " q")
        assert_close(kc, kc_ref, what=what + " k_cache")
        assert_close(vc, vc_ref, what=what + " v_cache")


@pytest.mark.parametrize("device", ["cpu"])
def test_qk_rope_store_rejects_a_stream_of_other_tokens(device):
    from anneal.engine.kernels import rope
    from anneal.engine.kernels._common import KernelInputError

    g = gen(470, device)
    T, H, Hkv, D = 3, 4, 2, 8
    kc = randn(4, 4, Hkv, D, dtype=torch.float32, device=device, g=g)
    with pytest.raises(KernelInputError, match="rms_of must be"):
        rope.qk_rope_store(randn(T, (H + 2 * Hkv) * D, dtype=torch.float32, device=device, g=g),
                           torch.zeros(T, dtype=torch.int64), rope_table(16, D, device), kc, kc.clone(),
                           torch.arange(T), H, Hkv, None, None, 1e-6,
                           rms_of=randn(T + 1, 32, dtype=torch.float32, device=device, g=g))
