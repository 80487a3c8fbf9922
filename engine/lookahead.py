"""Async scheduling: the next decode step built and queued while this one computes.

A step of plain decode rows (one row per running request, no drafts, no logits processors,
no recurrent state) has a successor that is known before its tokens are: the same sequences,
one position further, each fed the token this step samples. The engine builds that step's
graph with the sampled tokens still an array being computed (ModelRunner.launch's `tokens`),
and queues it behind this one, so the Python that builds a step (and books the one before)
runs while the other computes, and the CPU stream never waits for Python in between (vLLM's
async scheduling; mlx-lm's generate pipelines the same way with mx.async_eval).

The numbers are those of the step built afterwards: the same groups, tokens, positions and
pool slots, and MLX evaluates the queued step after the one it depends on. A sequence whose
token ends it (EOS, a stop string, a cancel) still had its row computed in the step already
queued: that row is discarded (StepRecord.discarded_rows), and the slot it wrote lies past
the sequence's last token, in a block that is neither cached nor read before a later owner
writes it (blocks are freed on the engine thread, after the queued step was enqueued).
Sequences sure to end on this step's token (max_tokens, the context window) are left out of
the step ahead, and a step that would need a block the pool cannot give is not built ahead:
the scheduler plans it (and preempts) as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import KernelPath
from engine.scheduler import Phase, RowGroup


@dataclass
class Ahead:
    """A step launched behind the one computing: its groups (token_ids placeholders until
    `resume`), its path and its PendingStep, or the error launching it raised."""

    groups: list[RowGroup]
    path: KernelPath
    pending: object | None  # engine.model_runner.PendingStep
    error: str | None = None


def continues(groups: list[RowGroup]) -> bool:
    """Whether a step of these groups has a successor known before its tokens: every group
    one sampled decode row of a scheduled sequence that no processor looks at."""
    return bool(groups) and all(
        g.phase == Phase.DECODE and g.num_rows == 1 and g.sample and not g.trace
        and g.seq is not None and not g.seq.logits_processors and g.state_slot is None
        for g in groups)


def next_groups(groups: list[RowGroup], bm: BlockManager,
                max_model_len: int) -> tuple[list[RowGroup], list[int]] | None:
    """The groups of the step after `groups` (which `continues`), with the index in `groups`
    of the group whose sampled token each one takes; the blocks they write are allocated now.
    Sequences that this step's token ends for sure are left out. None: a sequence needs a block
    the pool does not have free (the scheduler then decides, preempting if it must)."""
    out, sources = [], []
    for i, g in enumerate(groups):
        seq = g.seq
        if (len(seq.output_ids) + 1 >= seq.params.max_tokens
                or seq.num_tokens + 1 >= max_model_len):
            continue  # this step's token is its last
        position = g.start + 1
        if not bm.can_allocate(bm.blocks_needed(seq.seq_id, position + 1)):
            return None
        bm.allocate(seq.seq_id, position + 1)
        out.append(RowGroup(seq.seq_id, [0], position, bm.block_table(seq.seq_id), True,
                            seq.params, g.output_index + 1, phase=Phase.DECODE, seq=seq))
        sources.append(i)
    return (out, sources) if out else None


def resume(ahead: Ahead, running: set[str]) -> tuple[list[RowGroup], int]:
    """The groups of a step launched ahead whose sequences still run (`running`: their ids),
    each given the token its sequence took meanwhile, and how many rows were discarded."""
    kept = [g for g in ahead.groups if g.seq_id in running]
    for g in kept:
        seq = g.seq
        if seq.num_computed != g.start or seq.num_tokens != g.start + 1:
            raise RuntimeError(f"{g.seq_id}: the step built ahead is at position {g.start}, "
                               f"the sequence at {seq.num_computed} of {seq.num_tokens}")
        g.token_ids = seq.tokens(g.start, g.start + 1)
    return kept, len(ahead.groups) - len(kept)
