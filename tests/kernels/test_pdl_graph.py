"""A chain of dependent kernels launched with PDL inside a CUDA graph gives the reference's result
(each kernel waits for its predecessor's writes: no race from the early launch). GPU only."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op, get_op
from kernel_testing import assert_close, gen, randn


@pytest.mark.gpu
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows,m1", [(4, "dot"), (1, "fma")])
def test_pdl_chain_in_cuda_graph(device, rows, m1):
    """With m1="fma" each GEMV requests its first weight tile before the PDL wait."""
    H, I = 2048, 8192
    g = gen(77, device)
    x = randn(rows, H, dtype=torch.float32, device=device, g=g)
    res = randn(rows, H, dtype=torch.float32, device=device, g=g)
    wn = randn(H, dtype=torch.float32, device=device, g=g)
    wgu = randn(2 * I, H, dtype=torch.float32, device=device, g=g, scale=H ** -0.5)
    wd = randn(H, I, dtype=torch.float32, device=device, g=g, scale=I ** -0.5)
    norm = build_op("add_rmsnorm", "triton", {"pdl": True})
    gate_up = build_op("gate_up_proj", "triton_gemv_splitk", {"pdl": True, "split_k": 2, "m1": m1})
    act = build_op("silu_and_mul", "triton", {"pdl": True})
    down = build_op("down_proj", "triton_gemv_splitk", {"pdl": True, "split_k": 4, "m1": m1,
                                                                  "reduce": "ticket"})

    def layer(h, r):
        for _ in range(8):  # several layers deep: each kernel reads what the previous one wrote
            n, r = norm(h, r, wn, 1e-5)
            h = down(act(gate_up(n, wgu)), wd)
        return h, r

    def ref_layer(h, r):
        for _ in range(8):
            n, r = ref.add_rmsnorm(h, r, wn, 1e-5)
            h = get_op("down_proj").reference(ref.silu_and_mul(get_op("gate_up_proj").reference(n, wgu)), wd)
        return h, r

    layer(x, res)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_r = layer(x, res)
    graph.replay()
    torch.cuda.synchronize()
    exp, exp_r = ref_layer(x, res)
    assert_close(out_r, exp_r, {torch.float32: (1e-3, 1e-3)})
    assert_close(out, exp, {torch.float32: (1e-3, 1e-3)})
