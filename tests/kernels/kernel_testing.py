"""Shared test helpers: tolerances, fresh random inputs that are never zero, poisoned outputs."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def device_configs(cpu: list[dict], gpu: list[dict]) -> list:
    """``(device, index, config)`` cases, one test each. Why not one test looping over its configs:
    on the GPU each config's kernels compile on first use, and one test compiling seven configs
    (the prefill attention's) took 338 s of the 385-s GPU kernel suite on one xdist worker while
    the other eleven had finished (session 33); one test a config spreads the compiles."""
    return ([pytest.param("cpu", i, c, id=f"cpu-c{i}") for i, c in enumerate(cpu)]
            + [pytest.param("cuda", i, c, marks=pytest.mark.gpu, id=f"cuda-c{i}") for i, c in enumerate(gpu)])
DTYPES = [torch.float32, torch.bfloat16]

# (atol, rtol) per dtype, for comparing a variant with the reference on the same inputs.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
# Attention and GEMMs sum long rows in a different order: a little more room.
TOL_ACC = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (3e-3, 3e-3)}


def gen(seed: int, device: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(*shape, dtype, device, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Normal values with no exact zeros (a zero input hides indexing bugs)."""
    x = torch.randn(*shape, generator=g) * scale
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    return x.to(dtype=dtype, device=device)


def rope_table(max_pos: int, D: int, device) -> torch.Tensor:
    """``[max_pos, D]`` float32 RoPE table (cos | sin halves, theta 10000), as the model builds it."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or a huge value (ints) so unwritten outputs cannot pass."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)
    return t


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol=TOL, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    atol, rtol = tol[expected.dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
