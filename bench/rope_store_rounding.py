"""The k that the `qk_rope_store` kernel, the `rope_attention` kernel and the reference ops store for
one decode step, compared element by element (GPU only).

Why: on the H200 the fused kernel's output differed from the unfused pair's (session 21). This showed
which one left the reference's rounding: in bf16 the fused kernel stored the reference's k bit for
bit and `qk_rope_store` was an ulp off in ~17% of it (bench/results/rope-attention-diff-s21-call4.log):
its FMA-contracted rotation, since compiled without contraction (`rope.QK_ROPE_STORE_OPTIONS`; not yet
re-run on the GPU). Every count should now read 0 in bf16.

    python bench/rope_store_rounding.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "kernels"))


def main() -> int:
    import torch

    from anneal.engine.kernels import attention_decode as attn
    from anneal.engine.kernels import rope
    from anneal.engine.ops import reference as ref
    from kernel_testing import gen, randn, rope_table
    from paged import paged_cache

    if not torch.cuda.is_available():
        raise SystemExit("rope_store_rounding: needs a CUDA GPU (the interpreter rounds bf16 its own way)")
    H, Hkv, D, BS = 32, 8, 128, 16
    for dtype in (torch.bfloat16, torch.float32):
        for lens in ([1, 1000, 333, 4097, 2048, 17, 0, 0], [5]):
            g = gen(2000, "cuda")
            kc0, vc0, bt, cl = paged_cache(lens, Hkv, D, BS, dtype, "cuda", g)
            qkv = randn(len(lens), (H + 2 * Hkv) * D, dtype=dtype, device="cuda", g=g, scale=2.0)
            pos = torch.tensor([max(L - 1, 0) for L in lens]).cuda()
            slots = torch.tensor([int(bt[b, (L - 1) // BS]) * BS + (L - 1) % BS if L else -1
                                  for b, L in enumerate(lens)]).cuda()
            cs = rope_table(max(lens) + 1, D, "cuda")
            k_store, v_store, k_fused, v_fused, k_ref, v_ref = (t.clone() for t in (kc0, vc0) * 3)
            q = rope.qk_rope_store(qkv, pos, cs, k_store, v_store, slots, H, Hkv, None, None, 1e-6)
            attn.rope_decode_attention(qkv, pos, cs, k_fused, v_fused, slots, H, Hkv, None, None, 1e-6, bt, cl,
                                       D ** -0.5)
            q_ref = ref.qk_rope_store(qkv, pos, cs, k_ref, v_ref, slots, H, Hkv, None, None, 1e-6)
            torch.cuda.synchronize()
            s = slots[slots >= 0]
            fk, sk, rk = (t.view(-1, Hkv, D)[s].float() for t in (k_fused, k_store, k_ref))
            bad = ((fk - sk) != 0).nonzero()
            print(f"{dtype} lens={lens}: k fused vs qk_rope_store max|d|={(fk - sk).abs().max().item():.3g} "
                  f"n={len(bad)}/{fk.numel()} columns={sorted(set(bad[:, 2].tolist()))[:20]} | fused vs reference "
                  f"n={int(((fk - rk) != 0).sum())} | qk_rope_store vs reference n={int(((sk - rk) != 0).sum())} | "
                  f"q: qk_rope_store vs reference n={int((q != q_ref).sum())}/{q.numel()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
