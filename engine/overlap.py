"""Overlap scheduling: launch decode step n+1 before the host has read step n's tokens.

Why: between two graph replays the host schedules, reads the tokens, checks stops, builds the next
step's inputs and copies them over: 0.43-0.51 ms of each 5-5.7 ms 8B step at batch 1-16 on the
H200 (session 5), a quarter of a 1B bs=1 step. With this plan knob (``scheduler.overlap``) the
next step is queued on the stream first and the host does the previous step's bookkeeping while
the GPU computes, as SGLang's overlap scheduler does.

How: a launched step's tokens stay on the device; the next step takes them as its input ids
(``ModelRunner.launch_decode``) while each sequence carries a placeholder where its token will go.
When the tokens arrive the placeholders are filled in, stops checked, and full blocks entered in
the prefix cache. A sequence that stopped (EOS, a stop token, its length, an abort) may have one
more step in flight: its row's token is dropped. The KV that step writes is its last real token's,
into blocks it freed; any later user of them (a prefix-cache hit, a new allocation) runs after that
step on the same stream.

It only pipelines what it can do exactly: decode-only steps without log-probs (greedy or sampled:
the sampler is seeded per sequence and position, so the tokens do not depend on when the host
looks), nothing waiting for admission, and a free block for every sequence's next token (no
preemption while a step is in flight).
Anything else completes the step in flight and takes the plain path; the tokens are the same
either way (tests/test_overlap.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from anneal.engine.sequence import RequestOutput, Sequence, Status, positions_attended

PLACEHOLDER = -1  # a token the device has computed and the host has not read yet


@dataclass
class Launched:
    """A decode step queued on the device whose tokens the host has not read."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # on the device, one per row
    host: torch.Tensor  # where they land (pinned on a GPU)
    event: torch.cuda.Event | None  # recorded after the copy to ``host``
    index: list[int] = field(default_factory=list)  # each row's placeholder position


class OverlapStepper:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.inflight: Launched | None = None
        self.pipelined = 0  # launches that took their ids from a step still in flight

    def step(self) -> list[RequestOutput]:
        # Taken before anything can raise: a failed step (the server aborts what was in flight)
        # must not leave a launch that every later step tries to complete again.
        prev, self.inflight = self.inflight, None
        nxt = None
        if self._pipelinable(prev):
            batch = self.engine.scheduler.schedule()  # exactly the running decodes (see _pipelinable)
            nxt = self._launch([s for s, _ in batch.items], prev)
        outputs = self._complete(prev) if prev is not None else []
        if nxt is not None and all(s.status is not Status.RUNNING for s in nxt.seqs):
            self._complete(nxt)  # every row stopped with prev: idle now, not one call later
            nxt = None
        self.inflight = nxt
        if prev is None and nxt is None:
            return self.engine._step_plain()
        return outputs

    def _pipelinable(self, prev: Launched | None) -> bool:
        e = self.engine
        sched = e.scheduler
        if sched.waiting or not sched.running:
            return False
        in_prev = {id(s) for s in prev.seqs} if prev is not None else None
        need = 0
        for s in sched.running:
            p = s.params
            if s.in_prefill or p.logprobs is not None:  # log-probs are read on the host, per step
                return False
            if in_prev is not None and id(s) not in in_prev:
                return False
            # A sequence whose token in flight ends it (by length too) still gets a row in the next
            # step, dropped when the token arrives: cheaper than a step the host cannot overlap.
            need += e.blocks.blocks_needed(len(s)) - len(s.block_table)
        return need <= e.blocks.num_free_blocks

    def _launch(self, seqs: list[Sequence], prev: Launched | None) -> Launched:
        e = self.engine
        rows = None
        if prev is not None:  # every row's last token is one of prev's, still on the device
            row = {id(s): i for i, s in enumerate(prev.seqs)}
            rows = [row[id(s)] for s in seqs]
        tokens = e.runner.launch_decode(seqs, rows)
        self.pipelined += prev is not None
        cuda = tokens.device.type == "cuda"
        host = torch.empty(len(seqs), dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        index = []
        attended = positions_attended([(s, 1) for s in seqs])  # before this step's placeholder
        for s in seqs:
            index.append(len(s.token_ids))
            s.token_ids.append(PLACEHOLDER)
            s.num_computed_tokens += 1
        e._steps += 1
        e._last = (len(seqs), len(seqs), True, attended)
        return Launched(seqs, tokens, host, event, index)

    def _complete(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's tokens (the one host sync) and do its bookkeeping."""
        e = self.engine
        if launched.event is not None:
            launched.event.synchronize()
        outputs = []
        for seq, i, token in zip(launched.seqs, launched.index, launched.host.tolist()):
            if seq.status is not Status.RUNNING:  # aborted, or stopped, while this step ran
                continue
            seq.token_ids[i] = token
            e.blocks.mark_computed(seq)
            reason = e._stop_reason(seq, token, length=i + 1)
            if reason:
                del seq.token_ids[i + 1:]  # a later step's placeholder: its row is dropped
                e._finish(seq, reason)
            outputs.append(RequestOutput(
                request_id=seq.request_id, new_token_ids=[token], finished=reason is not None,
                finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens, num_output_tokens=i + 1 - seq.num_prompt_tokens,
            ))
        return outputs
