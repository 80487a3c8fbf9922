"""OpenAI's sampling adjustments as per-request logits processors (engine/sampler.py applies
them to each of the request's sampled rows, before the log-softmax, in mlx-lm's
`processor(tokens, logits) -> logits` convention):

- logit_bias: a fixed bias added to chosen tokens' logits (-100 bans a token, 100 forces it);
- frequency_penalty and presence_penalty, over the tokens generated so far (not the prompt),
  as OpenAI defines them: logit[t] -= count[t] * frequency_penalty + (count[t] > 0) *
  presence_penalty;
- repetition_penalty (vLLM's and Hugging Face's), over the prompt and the output: a seen
  token's logit divided by it where positive, multiplied where negative.

Each row sees only its own request's tokens, so a request's adjustments never depend on what
shares its step; a verify row counts the drafts before it, as a decode row at that position
would count the tokens generated before it.
"""

from __future__ import annotations

import mlx.core as mx

from engine.sampling import SamplingParams
from engine.sequence import LogitsProcessor


def penalty_processors(params: SamplingParams, prompt_len: int) -> tuple[LogitsProcessor, ...]:
    """The processors a request's parameters ask for (none for the defaults). prompt_len: the
    tokens before the first generated one."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        ids = mx.array([t for t, _ in params.logit_bias])
        bias = mx.array([b for _, b in params.logit_bias], dtype=mx.float32)

        def logit_bias(tokens: mx.array, logits: mx.array) -> mx.array:
            return logits.at[..., ids].add(bias.astype(logits.dtype))

        out.append(logit_bias)
    frequency, presence = params.frequency_penalty, params.presence_penalty
    if frequency or presence:
        def penalties(tokens: mx.array, logits: mx.array) -> mx.array:
            generated = tokens[prompt_len:]
            if generated.size == 0:
                return logits
            counts = mx.zeros((logits.shape[-1],), dtype=mx.float32).at[generated].add(1.0)
            penalty = counts * frequency + (counts > 0).astype(mx.float32) * presence
            return logits - penalty.astype(logits.dtype)

        out.append(penalties)
    repetition = params.repetition_penalty
    if repetition != 1.0:
        def repetition_penalty(tokens: mx.array, logits: mx.array) -> mx.array:
            seen = mx.zeros((logits.shape[-1],), dtype=mx.float32).at[tokens].add(1.0) > 0
            scaled = mx.where(logits > 0, logits / repetition, logits * repetition)
            return mx.where(seen, scaled, logits)

        out.append(repetition_penalty)
    return tuple(out)
