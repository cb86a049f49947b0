"""A request inside the engine: its tokens, its blocks, how far it has been computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from anneal.engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float = 0.0
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, taken from the prefix cache at admission
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_hashed_blocks: int = 0  # leading full blocks already entered in the prefix cache
    last_block_hash: int | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token still to compute (decode computes exactly the last one)."""
        return len(self.token_ids) - self.num_computed_tokens > 1


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprobs] | None = None


def positions_attended(items: list[tuple[Sequence, int]]) -> int:
    """KV positions the step's tokens attend, summed (its attention's reads): a chunk of ``n`` new
    tokens after ``c`` computed attends ``c+1 ... c+n``; a decode row its whole sequence."""
    return sum(n * s.num_computed_tokens + n * (n + 1) // 2 for s, n in items)
