"""Microbenchmarks the engine runs once: the ceilings the cost model reasons against.

Copy bandwidth counts bytes read plus bytes written; the matmul rate is a square bf16 (GPU) or
fp32 (CPU) product on random data. Sizes are small on the CPU so start-up stays quick.
"""

from __future__ import annotations

import statistics
import time

import torch


def _time(fn, reps: int, sync) -> float:
    for _ in range(2):
        fn()
    sync()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def measure(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    nbytes = (1 << 30) if cuda else (64 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), 10, sync)
    n = 8192 if cuda else 512
    dt = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    mm_s = _time(lambda: a @ b, 5, sync)
    out = {
        "copy_gbps": 2 * nbytes / copy_s / 1e9,
        "matmul_tflops": 2 * n**3 / mm_s / 1e12,
        "matmul_dtype": str(dt).replace("torch.", ""),
        "gpu_name": torch.cuda.get_device_name(device) if cuda else None,
        "num_gpus": torch.cuda.device_count() if cuda else 0,
    }
    if cuda:
        props = torch.cuda.get_device_properties(device)
        out.update(sm_count=props.multi_processor_count, memory_gb=props.total_memory / 1e9)
    return out
