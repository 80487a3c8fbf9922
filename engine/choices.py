"""Several choices of one prompt (OpenAI's `n` and `best_of`): child requests that share the
prompt's KV blocks.

The first choice is submitted as any request. The others are held (`Engine.submit_many`'s
`after`) until it has sampled its first token: by then its prefill has registered the prompt's
full blocks in the prefix cache, so each further choice is admitted holding those blocks by
reference count (`BlockManager.match_prefix`) and computes only the prompt's tail after the
last full block (at least one token, whose logits it samples from) into a block of its own:
the partial block is copied by recomputing it (or, where the prompt is whole blocks, the last
one's rows but the last are copied from it: BlockManager's copy_partial), never written by two
choices. Each choice then samples on its own (seed + i when the request is seeded), stops on
its own and frees its blocks when it ends; a shared block goes back to the pool (cached for
reuse) when its last holder ends. Cancelling the first choice before its first token releases
the others at once.

Without prefix caching (`--no-prefix-caching`) the choices compute the prompt each; a model
with recurrent layers shares the blocks up to its deepest state checkpoint of the prompt
(engine/state_slots.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

from engine.engine import Engine, Submission
from engine.errors import RequestError
from engine.events import RequestHandle
from engine.sampling import SamplingParams


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: a seeded request gives each choice its own random stream
    (seed + index), so the choices differ and each is reproducible on its own."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def submit_choices(engine: Engine, prompt: str | list[int], params: SamplingParams | None,
                   n: int, *, request_ids: list[str] | None = None,
                   loop: asyncio.AbstractEventLoop | None = None) -> list[RequestHandle]:
    """Queue n choices of one prompt; one handle per choice, in order. n=1 is a plain submit.

    Raises RequestError (naming "n" for a bad n, else as Engine.submit) before queueing any."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestError(f"n must be a positive integer, got {n!r}", "n")
    if request_ids is not None and len(request_ids) != n:
        raise ValueError(f"{len(request_ids)} request ids for {n} choices")
    params = params or SamplingParams()
    ids: list[str | None] = list(request_ids) if request_ids is not None else [None] * n
    prompt_ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    first = engine.submit(prompt_ids, params, request_id=ids[0], loop=loop)
    if n == 1:
        return [first]
    try:
        rest = engine.submit_many(
            [Submission(prompt_ids, choice_params(params, i), ids[i]) for i in range(1, n)],
            loop=loop, after=(first.request_id, 1))
    except BaseException:  # the engine stopped in between: take the first back
        first.cancel()
        raise
    return [first, *rest]
