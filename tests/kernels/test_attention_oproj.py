"""bench/attention_oproj.py's persistent kernel (decode attention and o_proj in one launch, joined by
per-tile flags) against its fp32 reference: uneven lengths (one empty, one of a single token),
every split and tile size the probe times, two launches on one set of counters (the first must
leave them at zero), and on the GPU the same output from a CUDA graph replay as from the eager
call, bit for bit (no atomics touch the data)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernel_testing import DTYPES, TOL_ACC, assert_close, device_configs, gen, poison_

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from attention_oproj import Workspace, attention_oproj, attention_oproj_reference, make_inputs  # noqa: E402

# (B, lengths, H, Hkv, D, N)
SHAPES_CPU = [(3, [150, 37, 1], 8, 2, 32, 48), (2, [0, 70], 4, 1, 16, 32)]
SHAPES_GPU = [(12, [800] * 11 + [17], 32, 8, 128, 4096), (1, [2048], 32, 8, 128, 4096), (16, [1] + [300] * 15, 32, 8, 128, 4096),
              (5, [0, 64, 65, 999, 4000], 32, 8, 128, 4096)]
CONFIGS_CPU = [{"split_k": 1, "block_o": 16, "lag": 0, "programs": 2, "block_k": 16},
               {"split_k": 2, "block_o": 32, "lag": 1, "programs": 3, "block_k": 32},
               {"split_k": 4, "block_o": 16, "lag": 2, "programs": 1, "block_k": 16}]
CONFIGS_GPU = [{}, {"block_o": 32, "per_sm": 3, "lag": 0}, {"block_o": 128, "lag": 2}, {"per_sm": 1, "num_warps": 8},
               {"split_k": 16, "block_k": 256}, {"split_k": 1, "programs": 7, "lag": 8}, {"order": "first"},
               {"order": "static", "per_sm": 1, "split_k": 1}]


@pytest.mark.parametrize("device, ci, cfg", device_configs(CONFIGS_CPU, CONFIGS_GPU))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_pair_matches_reference(device, ci, cfg, dtype):
    shapes = SHAPES_CPU if device == "cpu" else SHAPES_GPU
    for si, (B, lens, H, Hkv, D, N) in enumerate(shapes):
        q, k, v, bt, ln, w = make_inputs(B, lens, H, Hkv, D, N, device, dtype, gen(5200 + si, device), spare=1)
        want = attention_oproj_reference(q, k, v, bt, ln, D ** -0.5, w).to(dtype)
        ws = Workspace(B, H, Hkv, D, cfg.get("split_k") or 64, N, device, dtype)
        first = attention_oproj(q, k, v, bt, ln, D ** -0.5, w, block_n=16 if device == "cpu" else 64, ws=ws, **cfg)
        assert_close(first, want, TOL_ACC, what=f"{cfg} B={B} {lens} {dtype}")
        assert not ws.counters.any(), f"{cfg}: a launch left counters set: {ws.counters.nonzero().flatten()}"
        again = attention_oproj(q, k, v, bt, ln, D ** -0.5, w, block_n=16 if device == "cpu" else 64, ws=ws, **cfg)
        assert torch.equal(first, again), f"{cfg}: the second launch on the same counters differs"


@pytest.mark.gpu
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_pair_in_a_cuda_graph(device):
    """Four layers (each its own cache and W_o) captured in one graph, outputs poisoned before each of
    three replays: every replay equals the eager calls exactly."""
    B, lens, H, Hkv, D, N = 12, [800] * 12, 32, 8, 128, 4096
    layers = [make_inputs(B, lens, H, Hkv, D, N, device, torch.bfloat16, gen(5300 + i, device)) for i in range(4)]
    ws = Workspace(B, H, Hkv, D, 64, N, device, torch.bfloat16)
    eager = [attention_oproj(*lay[:5], D ** -0.5, lay[5], ws=ws) for lay in layers]
    outs = [torch.empty_like(e) for e in eager]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for lay, o in zip(layers, outs):
            o.copy_(attention_oproj(*lay[:5], D ** -0.5, lay[5], ws=ws))
    for _ in range(3):
        for o in outs:
            poison_(o)
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, e) in enumerate(zip(outs, eager)):
            assert torch.equal(o, e), f"layer {i}: the replay differs from the eager call"
    assert not ws.counters.any()
