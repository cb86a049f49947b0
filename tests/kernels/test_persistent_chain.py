"""bench/persistent_chain.py's kernel (one launch, grid barriers between GEMV phases) against its
reference: on the CPU one launch per phase (the interpreter runs programs in turn), on the GPU the
barrier itself, in and out of a CUDA graph with PDL."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from anneal.engine.kernels._common import KernelInputError
from kernel_testing import DEVICES, DTYPES, TOL_ACC, assert_close, gen, randn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from persistent_chain import barrier_counter, gemv_chain, gemv_chain_reference  # noqa: E402

# (N, K) per phase; each K at most the previous N (the next input is the first K of the output)
CHAINS_CPU = [[(37, 50)], [(23, 30), (61, 23), (19, 61), (40, 19)], [(9, 130), (70, 9)]]
CHAINS_GPU = [[(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], [(1000, 4000), (4096, 999), (131, 4096)]]
CONFIGS_CPU = [{"rows": 8, "block_k": 16}, {"rows": 4, "block_k": 64}]
CONFIGS_GPU = [{}, {"rows": 16, "block_k": 512, "num_warps": 4}, {"programs_per_sm": 2, "num_warps": 4},
               {"rows": 32, "block_k": 512, "num_warps": 16}]


def _chain(dims, dtype, device, seed):
    g = gen(seed, device)
    x = randn(dims[0][1], dtype=dtype, device=device, g=g)
    return x, [randn(n, k, dtype=dtype, device=device, g=g, scale=k ** -0.5) for n, k in dims]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_chain(device, dtype):
    chains, configs = (CHAINS_CPU, CONFIGS_CPU) if device == "cpu" else (CHAINS_GPU, CONFIGS_GPU)
    for ci, cfg in enumerate(configs):
        for i, dims in enumerate(chains):
            x, ws = _chain(dims, dtype, device, 4100 + 10 * ci + i)
            got = gemv_chain(x, ws, **cfg)
            for p, (a, e) in enumerate(zip(got, gemv_chain_reference(x, ws))):
                assert_close(a, e, TOL_ACC, what=f"{cfg} {dims} phase {p} {dtype}")


@pytest.mark.parametrize("device", ["cpu"])
def test_gemv_chain_refuses_mismatched_widths(device):
    x, ws = _chain([(8, 16), (4, 8)], torch.float32, device, 1)
    with pytest.raises(KernelInputError, match="weight 1 takes K=16 inputs, the previous output has 4"):
        gemv_chain(x, [ws[1], ws[0]])
    with pytest.raises(KernelInputError, match="1 to 4 weights"):
        gemv_chain(x, ws * 3)


@pytest.mark.gpu
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gemv_chain_layers_in_a_cuda_graph_with_pdl(device):
    """Sixteen chains back to back (each layer reading the last one's output), PDL between them,
    replayed from a graph with the outputs poisoned before each replay: every barrier of every
    launch must hold, and the counter must be left as it was found (low bits zero)."""
    dims = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
    layers = [_chain(dims, torch.bfloat16, device, 4200 + i)[1] for i in range(16)]
    x = randn(2048, dtype=torch.bfloat16, device=device, g=gen(4199, device))
    outs = [[torch.empty(n, dtype=torch.bfloat16, device=device) for n, _ in dims] for _ in layers]

    def step():
        v = x
        for ws, o in zip(layers, outs):
            v = gemv_chain(v, ws, outs=o, pdl=True)[-1]
        return v

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        for o in outs:
            for t in o:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # each layer against the reference on the input the graph gave it (its previous layer's
        # output), so a layer's error does not compound through the sixteen
        v = x
        for li, (ws, o) in enumerate(zip(layers, outs)):
            for p, (a, e) in enumerate(zip(o, gemv_chain_reference(v, ws))):
                assert_close(a, e, TOL_ACC, what=f"layer {li} phase {p}")
            v = o[-1]
    assert int(barrier_counter(torch.device(device))[0].item()) & 0x7FFFFFFF == 0  # low bits back at zero
