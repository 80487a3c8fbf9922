"""A request as the scheduler sees it: its tokens, how many have KV in the cache, its status."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import ValueEnum
from engine.sampling import SamplingParams

# mlx-lm's convention: processor(tokens, logits) -> logits, with tokens (n,) the sequence so
# far and logits (1, vocab) the next token's, both mx.array (engine/sampler.py applies them).
LogitsProcessor = Callable[[Any, Any], Any]


class FinishReason(ValueEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens, or the context window
    CANCELLED = "cancelled"
    ERROR = "error"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    # Tokens whose keys and values are in the KV cache (prompt first, then outputs).
    num_computed: int = 0
    # Tokens of the prompt found in the prefix cache at the last admission.
    num_cached_prompt: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Applied in order to each of its sampled rows' logits before the log-softmax.
    logits_processors: tuple[LogitsProcessor, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        """Prompt and outputs as one new list: O(length), so not for every step."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] (0 <= start <= stop) without building the whole list: a
        step's rows take a token or a few from sequences of thousands."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p:stop - p]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_decode(self) -> bool:
        """Only the last sampled token lacks KV: one row per step."""
        return bool(self.output_ids) and self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
