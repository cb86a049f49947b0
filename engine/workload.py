"""Synthetic workloads from a TrafficShape: token ids, output lengths, arrivals (torch-free, seeded).

The engine replays a workload while the compiler measures a candidate plan, so a workload must be
reproducible (same shape + seed -> same requests) and must exercise the prefix cache the way the
real traffic does: requests that share a prefix start with *identical* leading token ids.

Token ids are drawn uniformly from ``[low, vocab_size)`` minus ``reserved``. ``low`` defaults to
``RESERVED_LOW`` (16) because most vocabularies keep pad/bos/eos/unk and other control tokens at
the lowest ids; vocabularies that put special tokens at the top (Llama 3: 128000-128255) should
pass the base vocabulary size (128000) as ``vocab_size`` or list the ids in ``reserved``.
"""

from __future__ import annotations

import bisect
import random
from typing import Collection, Literal

from pydantic import BaseModel, ConfigDict, Field

from anneal.engine.traffic import TrafficShape

RESERVED_LOW = 16


class SyntheticRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int]
    max_tokens: int = Field(ge=1)
    arrival_s: float = Field(ge=0, description="offset from the start of the replay")
    prefix_group: int | None = Field(None, description="the shared prefix it starts with, if any")
    shared_len: int = Field(0, ge=0, description="leading tokens copied from that shared prefix")


class Workload(BaseModel):
    """Requests to replay; ``arrival`` says whether ``arrival_s`` or ``concurrency`` paces them."""

    model_config = ConfigDict(extra="forbid")

    shape_name: str | None
    seed: int
    vocab_size: int
    arrival: Literal["poisson", "closed_loop"]
    concurrency: int | None = Field(None, description="requests kept in flight (closed loop)")
    requests: list[SyntheticRequest]

    def prompt_lens(self) -> list[int]:
        return [len(r.prompt_token_ids) for r in self.requests]

    def output_lens(self) -> list[int]:
        return [r.max_tokens for r in self.requests]

    def prefix_hit_ratio(self, block_size: int = 1) -> float:
        """Fraction of prompt tokens an unbounded prefix cache would serve, in arrival order.

        Each request hits the longest common prefix it has with any earlier request (rounded down
        to whole ``block_size`` blocks, as a paged cache would), measured on the token ids alone.
        """
        order = sorted(range(len(self.requests)), key=lambda i: (self.requests[i].arrival_s, i))
        seen: list[list[int]] = []  # earlier prompts, sorted: the best match is a neighbour
        hit = total = 0
        for i in order:
            ids = self.requests[i].prompt_token_ids
            pos = bisect.bisect_left(seen, ids)
            best = 0
            for j in (pos - 1, pos):
                if 0 <= j < len(seen):
                    best = max(best, _common_prefix(ids, seen[j]))
            hit += best - best % block_size
            total += len(ids)
            seen.insert(pos, ids)
        return hit / total if total else 0.0


def _common_prefix(a: list[int], b: list[int]) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slice equality: C-speed comparisons
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _shared_lengths(
    prompt_lens: list[int], groups: list[int], target_ratio: float
) -> list[int]:
    """Per-request shared-prefix lengths ``min(round(c * len), len - 1)`` with ``c`` chosen by
    bisection so that the realized hit fraction (first request of a group misses; a later one hits
    ``min(its shared length, the longest shared length seen in its group so far)``) meets the target."""
    total = sum(prompt_lens)

    def lengths(c: float) -> list[int]:
        return [min(round(c * n), n - 1) for n in prompt_lens]

    def hits(shared: list[int]) -> int:
        best: dict[int, int] = {}
        h = 0
        for g, s in zip(groups, shared):
            seen = best.get(g)
            if seen is not None:
                h += min(s, seen)
            best[g] = max(s, seen or 0)
        return h

    target = target_ratio * total
    lo, hi = 0.0, 1.0
    if hits(lengths(hi)) <= target:
        return lengths(hi)  # the most this many requests/groups can share
    for _ in range(50):
        mid = (lo + hi) / 2
        if hits(lengths(mid)) < target:
            lo = mid
        else:
            hi = mid
    lo_len, hi_len = lengths(lo), lengths(hi)
    return lo_len if target - hits(lo_len) <= hits(hi_len) - target else hi_len


def make_workload(
    shape: TrafficShape,
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 32000,
    max_model_len: int | None = None,
    low: int = RESERVED_LOW,
    reserved: Collection[int] = (),
) -> Workload:
    """Draw ``num_requests`` requests from ``shape``; the same arguments give the same workload.

    Lengths come from the shape's histograms (clamped to ``max_model_len`` when given; use
    ``shape.scaled(max_model_len)`` first to keep the relative shape instead). Requests are
    spread over ``shape.prefix.num_prefixes`` shared prefixes so that the fraction of prompt
    tokens an ideal prefix cache serves matches ``shape.prefix.ratio`` (as far as the first, cold
    request of each prefix allows: see ``Workload.prefix_hit_ratio``). With an ``arrival_rate``
    requests arrive as a Poisson process; otherwise they all start at 0 and the replayer keeps
    ``concurrency`` of them in flight.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    reserved_set = {int(t) for t in reserved}
    allowed = [t for t in range(max(0, low), vocab_size) if t not in reserved_set]
    if len(allowed) < 2:
        raise ValueError(f"no token ids left to draw from [{low}, {vocab_size}) minus {len(reserved_set)} reserved")
    if max_model_len is not None:
        shape = shape.clamped(max_model_len)
    rng = random.Random(seed)

    prompt_lens = [shape.prompt_len.sample(rng) for _ in range(num_requests)]
    output_lens = [shape.output_len.sample(rng) for _ in range(num_requests)]
    if max_model_len is not None:
        output_lens = [max(1, min(o, max_model_len - p)) for p, o in zip(prompt_lens, output_lens)]

    if shape.arrival_rate is not None:
        t, arrivals = 0.0, []
        for _ in range(num_requests):
            arrivals.append(t)
            t += rng.expovariate(shape.arrival_rate)
        arrival, concurrency = "poisson", None
    else:
        arrivals = [0.0] * num_requests
        arrival, concurrency = "closed_loop", max(1, round(shape.concurrency or 1))

    sharing = shape.prefix.ratio > 0
    groups = [rng.randrange(shape.prefix.num_prefixes) for _ in range(num_requests)]
    shared = _shared_lengths(prompt_lens, groups, shape.prefix.ratio) if sharing else [0] * num_requests

    # One token sequence per prefix group, each starting with a distinct token so that two groups
    # never share a leading token by chance.
    group_len: dict[int, int] = {}
    for g, s in zip(groups, shared):
        group_len[g] = max(group_len.get(g, 0), s)
    firsts = rng.sample(allowed, min(len(allowed), len(group_len))) if sharing else []
    group_seq: dict[int, list[int]] = {}
    for k, g in enumerate(sorted(group_len)):
        n = group_len[g]
        if n > 0:
            group_seq[g] = [firsts[k % len(firsts)]] + rng.choices(allowed, k=n - 1)

    requests = []
    for p, o, t, g, s in zip(prompt_lens, output_lens, arrivals, groups, shared):
        head = group_seq[g][:s] if s else []
        tail = rng.choices(allowed, k=p - s)
        seq = group_seq.get(g)
        if seq is not None and s < len(seq):
            while tail[0] == seq[s]:  # diverge from the group right where the shared part ends
                tail[0] = rng.choice(allowed)
        requests.append(
            SyntheticRequest(
                prompt_token_ids=head + tail,
                max_tokens=o,
                arrival_s=t,
                prefix_group=g if s else None,
                shared_len=s,
            )
        )
    return Workload(
        shape_name=shape.name,
        seed=seed,
        vocab_size=vocab_size,
        arrival=arrival,
        concurrency=concurrency,
        requests=requests,
    )
