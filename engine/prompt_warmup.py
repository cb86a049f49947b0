"""The synthetic steps that compile, when a plan is applied, what its prompt steps will launch.

Why: applying a plan warms and captures its decode graphs, so it compiles what they launch and
nothing more. Prompt and mixed steps (and decode steps above the largest graph) run eagerly, at
whatever row count and block-table width the traffic brings, and Triton compiles a binary per
class of each integer argument (1, a multiple of 16, or neither) and per row tile of a fused GEMV
(16 to 128 rows). Session 13: a compiled chat plan whose fused GEMVs run in prompt steps of up to
64 rows lost 2.6 s of prompt-step time to those compiles in its first replay after the apply
(x0.76 against x1.04-1.06 warm); a live deployment stalls its first requests after a hot swap the
same way, and the compiler ranks such a plan on its first replay.

So each layout below is a step the runner runs on a two-layer view of the model with a KV cache of
its own (``ModelRunner.ahead_passes`` and ``capture``): row counts on a ladder that has a member of
every class up to 257 rows (past it only the 1 / multiple-of-16 classes change, and 256 / 257 hold
both), as one prompt (one sequence, the sampled-row count 1) and as that many one-token rows (the
decode rows of a mixed step, sampled-row count = rows), with block-table widths of 1, 2-3 and
16-17 blocks; and a decode step of every batch size above the largest graph (none when the
graphs reach max_num_seqs, as ``graph_sizes`` keeps them; one short pass per batch otherwise).
"""

from __future__ import annotations

from typing import NamedTuple

# Row counts whose classes cover every specialization a step of up to 257 rows can reach: for each
# power-of-two row tile (16 .. 256) one count that is a multiple of 16 and one that is not, and 1, 2.
ROW_LADDER = (1, 2, 16, 17, 32, 33, 48, 64, 65, 80, 128, 129, 256, 257)
# Context of a one-token row, cycled over the ladder: block tables of 1, 3 and 16 blocks (block size 16).
ROW_CONTEXTS = (16, 40, 256)


class Layout(NamedTuple):
    """One synthetic eager step: ``rows`` is ``(new tokens, context after them)`` per sequence."""

    decode_only: bool
    rows: tuple[tuple[int, int], ...]


def prompt_step_layouts(max_len: int, max_seqs: int, largest_graph: int) -> list[Layout]:
    """The eager steps to warm for an engine of ``max_len`` tokens per sequence whose plan runs at
    most ``max_seqs`` sequences a step and captures decode graphs up to ``largest_graph`` rows
    (0: none, every decode step eager)."""
    out: list[Layout] = []
    for i, m in enumerate(ROW_LADDER):
        if m <= max_len:
            out.append(Layout(False, ((m, m),)))  # one prompt of m tokens: widths 1 .. 17 over the ladder
        if 1 < m <= max_seqs:  # m one-token rows (a mixed step's decode rows; one row is the prompt of 1)
            out.append(Layout(False, ((1, _row_context(i, max_len)),) * m))
    # Decode steps no graph holds, every batch size: the decode attention's split count follows the
    # batch (its block table is a graph's width, ModelRunner._varlen_logits), not only its classes.
    for m in range(largest_graph + 1, max_seqs + 1):
        out.append(Layout(True, ((1, _row_context(m, max_len)),) * m))
    return out


def _row_context(i: int, max_len: int) -> int:
    return min(ROW_CONTEXTS[i % len(ROW_CONTEXTS)], max_len)
