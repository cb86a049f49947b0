"""Continuous batching: which sequences run this step, and how many tokens each computes.

Pure Python. One step is either *decode-only* (every item computes exactly its last token: the
CUDA-graph path) or *mixed* (prefill chunks, with running decodes piggybacking, in one varlen
pass). Order of service: running decodes first (inter-token latency), then running prefills'
next chunks, then new requests while the token budget and the blocks last. With
``mixed_prefill=False`` a step holds decodes or prefill work, never both: the decodes keep the
CUDA-graph path (a mixed step runs them eager), and the two kinds of step alternate while both have
work, so neither starves. When a decode needs a
block and none is free, the most recently admitted sequence is preempted (its blocks freed, to be
recomputed later), so the oldest requests always make progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from anneal.engine.block_manager import BlockManager
from anneal.engine.plan import SchedulerKnobs
from anneal.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 and len(s) - s.num_computed_tokens == 1 for s, n in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __len__(self) -> int:
        return len(self.items)


class Scheduler:
    def __init__(self, knobs: SchedulerKnobs, blocks: BlockManager, max_model_len: int):
        self.check_knobs(knobs, max_model_len)
        self.knobs = knobs
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0
        self._last_step_prefill = False  # mixed_prefill=False: which kind of step ran last

    @staticmethod
    def check_knobs(knobs: SchedulerKnobs, max_model_len: int) -> None:
        """Knobs that could leave a request waiting forever are refused."""
        if not knobs.chunked_prefill and knobs.max_num_batched_tokens < max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({knobs.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})"
            )
        if knobs.speculative_tokens and knobs.overlap:
            raise ValueError("speculative_tokens and overlap cannot be combined: an overlapped step is launched "
                             "before the last one's tokens, which its drafts need, are known")

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                return self._finish(seq, "abort")
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return self._finish(seq, "abort")
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> Sequence:
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        if self.knobs.mixed_prefill:
            return self._schedule(decodes=True, prefills=True)
        has_decodes = any(s.status is Status.RUNNING and not s.in_prefill for s in self.running)
        if has_decodes and self._last_step_prefill:
            batch = self._schedule(decodes=True, prefills=False)
        else:
            batch = self._schedule(decodes=False, prefills=True)
            if not batch.items:  # no prefill work could be scheduled: decode instead
                batch = self._schedule(decodes=True, prefills=False)
        self._last_step_prefill = bool(batch.items) and not batch.decode_only
        return batch

    def _schedule(self, decodes: bool, prefills: bool) -> ScheduledBatch:
        k = self.knobs
        budget = k.max_num_batched_tokens
        batch = ScheduledBatch()
        scheduled: set[int] = set()

        # 1. Running decodes, oldest first; preempt the newest when blocks run out.
        for seq in list(self.running) if decodes else ():
            if seq.status is not Status.RUNNING or seq.in_prefill:
                continue
            while not self.blocks.append_slots(seq):
                victim = self.running[-1]
                if id(victim) in scheduled:
                    batch.items = [(s, n) for s, n in batch.items if s is not victim]
                    budget += 1
                    scheduled.discard(id(victim))
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.items.append((seq, 1))
                scheduled.add(id(seq))
                budget -= 1

        if not prefills:
            return batch

        # 2. Running prefills: their next chunk.
        for seq in self.running:
            if budget <= 0:
                break
            if seq.in_prefill and id(seq) not in scheduled:
                n = min(len(seq) - seq.num_computed_tokens, budget)
                batch.items.append((seq, n))
                scheduled.add(id(seq))
                budget -= n

        # 3. Admit waiting requests while sequences, tokens and blocks last.
        while self.waiting and budget > 0 and len(self.running) < k.max_num_seqs:
            seq = self.waiting[0]
            # Without chunking the whole rest must fit; check before allocating, so a waiting
            # prompt neither re-counts its prefix query nor evicts cached blocks every step.
            if not k.chunked_prefill and len(seq) - self.blocks.num_cached_tokens(seq) > budget:
                break
            if not self.blocks.allocate(seq):
                break
            remaining = len(seq) - seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(remaining, budget)
            batch.items.append((seq, n))
            budget -= n
        return batch
