"""bench/tp_probe.py's premise on the CPU (gloo, two processes): the engine's decoder on each rank's
shard of the weights, with all-reduces after o_proj and down_proj and a vocabulary-split embedding
and greedy head, computes the whole model's decode step. On a 2-GPU host it then times both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anneal.engine.weights import random_weights, resolve_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tp_probe import shard_config, shard_weights  # noqa: E402


def test_two_ranks_compute_the_whole_step():
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(ROOT / "bench" / "tp_probe.py"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "degree 2 computes degree 1's step: tokens equal True" in r.stderr
    assert "every rank True" in r.stderr


def test_the_shards_partition_every_weight():
    """Each projection's rows (q|k|v, gate|up) or columns (o, down) and the vocabulary, cut in two,
    put back together are the whole: nothing dropped, nothing read twice."""
    cfg = resolve_config("random:tiny")
    w = random_weights(cfg, torch.device("cpu"), torch.float32, 2, seed=1)
    a, b = (shard_weights(w, cfg, 2, r) for r in (0, 1))
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for L, A, B in zip(w.layers, a.layers, b.layers):
        # each rank's qkv rows: its half of q, then of k, then of v
        for part, (whole_lo, whole_hi) in zip(((0, q // 2), (q // 2, q // 2 + kv // 2), (q // 2 + kv // 2, None)),
                                              ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
            lo, hi = part
            assert torch.equal(torch.cat([A.qkv[lo:hi], B.qkv[lo:hi]]), L.qkv[whole_lo:whole_hi])
        assert torch.equal(torch.cat([A.gate_up[:inter // 2], B.gate_up[:inter // 2]]), L.gate_up[:inter])
        assert torch.equal(torch.cat([A.gate_up[inter // 2:], B.gate_up[inter // 2:]]), L.gate_up[inter:])
        assert torch.equal(torch.cat([A.o, B.o], dim=1), L.o)
        assert torch.equal(torch.cat([A.down, B.down], dim=1), L.down)
    assert torch.equal(torch.cat([a.embed, b.embed]), w.embed)
    assert a.lm_head is a.embed  # tied stays tied


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    cfg = resolve_config("random:tiny")  # 2 kv heads
    assert shard_config(cfg, 2).num_key_value_heads == 1
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not split 4 ways"):
        shard_config(cfg, 4)
