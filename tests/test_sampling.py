"""Sampling: the reference `sample` op and sampled requests through the engine.

Greedy is the argmax; a seed fixes the tokens; a request's tokens do not depend on its batch;
top-k=1 and a tiny top-p are greedy; over many seeds the sampled frequencies follow
softmax(logits / temperature) restricted to the top-k / top-p support.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.ops.reference import sample
from anneal.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def call(logits, temperature, top_p=None, top_k=None, seeds=None, steps=None):
    B = logits.shape[0]
    full = lambda v, dt: v if torch.is_tensor(v) else torch.full((B,), v, dtype=dt)  # noqa: E731
    return sample(
        logits,
        full(temperature, torch.float32),
        full(1.0 if top_p is None else top_p, torch.float32),
        full(0 if top_k is None else top_k, torch.int32),
        full(7 if seeds is None else seeds, torch.int64),
        full(3 if steps is None else steps, torch.int64),
    )


def rand_logits(B: int, V: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


def many_seeds(n: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([rng.getrandbits(62) for _ in range(n)], dtype=torch.int64)


# ---- the op --------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = rand_logits(64, 301, seed=1)
    out = call(logits, 0.0, seeds=many_seeds(64, 1))
    assert torch.equal(out, logits.argmax(-1))


def test_same_seed_same_tokens_different_seeds_differ():
    logits = rand_logits(1, 50, seed=2, scale=0.5).expand(256, 50).contiguous()
    seeds = many_seeds(256, 2)
    a = call(logits, 1.0, seeds=seeds)
    b = call(logits, 1.0, seeds=seeds.clone())
    assert torch.equal(a, b)
    assert len(set(a.tolist())) > 20, "different seeds should spread over the vocabulary"
    # The step is part of the counter: the same seed at another step draws afresh.
    c = call(logits, 1.0, seeds=seeds, steps=4)
    assert (a != c).float().mean() > 0.5


def test_a_rows_sample_does_not_depend_on_its_batch():
    V = 200
    row = rand_logits(1, V, seed=3)
    alone = call(row, 0.9, top_p=0.9, top_k=50, seeds=torch.tensor([123456789]), steps=torch.tensor([17]))
    for trial in range(5):
        others = rand_logits(6, V, seed=10 + trial)
        pos = trial % 7
        logits = torch.cat([others[:pos], row, others[pos:]])
        temps = torch.rand(7, generator=torch.Generator().manual_seed(trial)) * 1.5
        temps[pos] = 0.9
        top_p = torch.full((7,), 0.5)
        top_p[pos] = 0.9
        top_k = torch.randint(0, 20, (7,), dtype=torch.int32)
        top_k[pos] = 50
        seeds = many_seeds(7, trial)
        seeds[pos] = 123456789
        steps = torch.randint(1, 100, (7,))
        steps[pos] = 17
        out = call(logits, temps, top_p=top_p, top_k=top_k, seeds=seeds, steps=steps)
        assert out[pos] == alone[0]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = rand_logits(128, 97, seed=4, scale=0.3)  # flat: sampling would often differ
    seeds = many_seeds(128, 4)
    greedy = logits.argmax(-1)
    assert not torch.equal(call(logits, 1.5, seeds=seeds), greedy)
    assert torch.equal(call(logits, 1.5, top_k=1, seeds=seeds), greedy)
    assert torch.equal(call(logits, 1.5, top_p=1e-6, seeds=seeds), greedy)


def test_temperature_zero_in_a_sampled_batch_stays_greedy():
    logits = rand_logits(32, 64, seed=5, scale=0.3)
    temps = torch.full((32,), 1.3)
    zero = [3, 4, 17, 31]
    temps[zero] = 0.0
    out = call(logits, temps, top_k=10, top_p=0.8, seeds=many_seeds(32, 5))
    assert torch.equal(out[zero], logits.argmax(-1)[zero])
    others = [i for i in range(32) if i not in zero]
    assert not torch.equal(out[others], logits.argmax(-1)[others])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep] * n
    stat = (((counts[keep] - expected) ** 2) / expected).sum().item()
    return stat, int(keep.sum()) - 1


def chi2_limit(dof: int) -> float:
    """About the 99.9th percentile of chi-square(dof) (Wilson-Hilferty)."""
    z = 3.1
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def frequencies(logits_row: torch.Tensor, n: int, seed: int, **kw) -> torch.Tensor:
    V = logits_row.shape[0]
    logits = logits_row.expand(n, V).contiguous()
    rng = random.Random(seed)
    steps = torch.tensor([rng.randrange(1, 4000) for _ in range(n)], dtype=torch.int64)
    out = call(logits, kw.pop("temperature"), seeds=many_seeds(n, seed), steps=steps, **kw)
    return torch.bincount(out, minlength=V).double()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_over_temperature(temperature):
    row = rand_logits(1, 12, seed=6, scale=1.0)[0]
    counts = frequencies(row, 30000, seed=int(temperature * 10), temperature=temperature)
    probs = torch.softmax(row.double() / temperature, -1)
    stat, dof = chi_square(counts, probs)
    assert stat < chi2_limit(dof), (stat, dof, counts, probs * counts.sum())
    # ... and not the distribution at another temperature (the test can tell them apart)
    wrong = torch.softmax(row.double() / (temperature * 1.5), -1)
    assert chi_square(counts, wrong)[0] > 3 * chi2_limit(dof)


def test_top_k_restricts_the_support_and_renormalizes():
    row = rand_logits(1, 16, seed=7, scale=1.0)[0]
    k = 5
    counts = frequencies(row, 30000, seed=7, temperature=0.8, top_k=k)
    top = row.topk(k).indices
    outside = torch.ones(16, dtype=torch.bool)
    outside[top] = False
    assert counts[outside].sum() == 0, "sampled outside the top-k"
    probs = torch.zeros(16, dtype=torch.float64)
    probs[top] = torch.softmax(row[top].double() / 0.8, -1)
    stat, dof = chi_square(counts, probs)
    assert stat < chi2_limit(dof), (stat, counts, probs * counts.sum())


def test_top_p_keeps_the_smallest_nucleus_and_renormalizes():
    row = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -1.5, -2.2, -3.0], dtype=torch.float32)
    row = row[torch.randperm(10, generator=torch.Generator().manual_seed(8))]  # any order
    T, p = 1.2, 0.7
    probs_all = torch.softmax(row.double() / T, -1)
    order = probs_all.argsort(descending=True)
    cum = probs_all[order].cumsum(0)
    n_keep = int((cum < p).sum()) + 1  # smallest prefix whose mass reaches p
    nucleus = order[:n_keep]
    assert 2 <= n_keep <= 6  # a meaningful nucleus for this row
    counts = frequencies(row, 30000, seed=8, temperature=T, top_p=p)
    outside = torch.ones(10, dtype=torch.bool)
    outside[nucleus] = False
    assert counts[outside].sum() == 0, "sampled outside the nucleus"
    probs = torch.zeros(10, dtype=torch.float64)
    probs[nucleus] = probs_all[nucleus] / probs_all[nucleus].sum()
    stat, dof = chi_square(counts, probs)
    assert stat < chi2_limit(dof), (stat, counts, probs * counts.sum())


def test_top_k_and_top_p_together():
    row = rand_logits(1, 40, seed=9, scale=1.5)[0]
    counts = frequencies(row, 8000, seed=9, temperature=1.0, top_k=8, top_p=0.6)
    probs = torch.softmax(row.double(), -1)
    top8 = probs.topk(8).indices
    renorm = probs[top8] / probs[top8].sum()
    cum = renorm.cumsum(0)
    nucleus = top8[: int((cum < 0.6).sum()) + 1]
    support = set(torch.nonzero(counts).flatten().tolist())
    assert support <= set(nucleus.tolist())
    assert len(support) == len(nucleus)


# ---- through the engine -----------------------------------------------------------------------


def tiny(seed: int = 0) -> Engine:
    return Engine(EngineArgs(model="random:tiny", device="cpu", block_size=8, num_kv_blocks=128,
                             max_model_len=128, seed=seed))


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def sp(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True, **kw)


def test_engine_seeded_sampling_is_reproducible_and_seeds_differ():
    ps = prompts(10, 1) * 4
    params = [sp(temperature=1.0, seed=s) for s in (11, 11, 12, 13)]
    a = tiny().generate(ps, params)
    eng = tiny()
    eng.generate(prompts(15, 2), sp(temperature=1.0))  # unseeded requests advance the engine's rng
    b = eng.generate(ps, params)  # explicit seeds do not depend on it, nor on the batch's order
    assert a == b
    assert eng.generate(ps[::-1], params[::-1]) == a[::-1]
    assert a[0] == a[1]
    assert a[0] != a[2] and a[2] != a[3]


def test_engine_unseeded_requests_draw_different_seeds():
    ps = prompts(11, 1) * 3
    out = tiny().generate(ps, sp(temperature=1.0))
    assert len({tuple(o) for o in out}) == 3


def test_engine_sampled_request_does_not_depend_on_its_batch():
    target = prompts(12, 1)[0]
    params = sp(temperature=0.9, top_p=0.95, top_k=40, seed=777)
    alone = tiny().generate([target], params)[0]
    crowd = prompts(13, 6)
    crowd_params = [sp(temperature=random.Random(i).uniform(0, 1.5), seed=i) for i in range(6)]
    mixed = tiny().generate(crowd[:3] + [target] + crowd[3:], crowd_params[:3] + [params] + crowd_params[3:])
    assert mixed[3] == alone


def test_engine_top_k_one_tiny_top_p_and_temperature_zero_are_greedy():
    ps = prompts(14, 3)
    greedy = tiny().generate(ps, sp(temperature=0))
    sampled = tiny().generate(ps, sp(temperature=1.5, seed=5))
    assert sampled != greedy, "plain sampling should differ from greedy on a random model"
    assert tiny().generate(ps, sp(temperature=1.5, top_k=1, seed=5)) == greedy
    assert tiny().generate(ps, sp(temperature=1.5, top_p=1e-6, seed=5)) == greedy
    # Greedy requests in the middle of a sampled batch stay greedy.
    mixed_params = [sp(temperature=1.5, seed=1), sp(temperature=0), sp(temperature=1.2, seed=2)]
    mixed = tiny().generate(ps, mixed_params)
    assert mixed[1] == greedy[1]
    assert mixed[0] != greedy[0] or mixed[2] != greedy[2]
