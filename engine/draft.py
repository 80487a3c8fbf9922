"""The draft-model proposer (--speculative draft): a smaller model guesses the target's next
tokens greedily, on the engine thread, batched across the requests that speculate.

The draft has its own ModelRunner (the same kernels as the target's), its own paged KVPool and
its own BlockManager; its block tables are per request, like the target's. One `propose` call
is at most k forwards of the draft:

    round 1     every request: the tokens the draft has not seen yet (a prefill chunk, one row
                after an ordinary step), sampled greedily at its last row -> d1
    rounds 2..k one row per request (its previous draft) -> d2 .. dk

Rollback needs no hook in the engine: the proposer remembers which tokens its cache holds for
each request, and at the next call keeps the longest common prefix of those and the request's
tokens (the accepted drafts and the target's token follow it), trimming the blocks past it.
A draft with recurrent layers (qwen3_5, qwen3_next) cannot cut its state back, so it keeps
the state after each of its forwards (DraftStates) and resumes after the accepted drafts.
A preempted request keeps its draft cache (its tokens do not change); `release` frees it when
the request finishes, is cancelled or fails. When the draft's pool runs out of blocks, caches
of requests that are not speculating now are dropped (least recently used first); if that is
not enough, the request gets the drafts made so far (none when its catch-up does not fit). A
draft never fails a step: an error inside the draft drops its caches and the step goes on
without drafts.

Greedy drafts are point proposals, so the acceptance rules in engine/sampler.py keep the
target's output exact, greedy or sampled.

Drafts: "layers:N" is the target's own first N decoder layers with its final norm and head
(its weights shared, no memory added but the draft's KV); "embedded" is the embedded model at
its shipped 4-bit weights (a draft for a float32 target); anything else a local mlx-lm folder,
loaded as `--weights auto` loads one. A loaded draft must use the target's vocabulary.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig, KernelPath
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner, pool_for
from engine.models import Family, UnsupportedModelError, family_for
from engine.scheduler import RowGroup
from engine.speculative import common_prefix, draft_layers
from engine.state_pool import StatePool

log = logging.getLogger("batchscope.engine")

# Families whose decoder layers depend on all the others (per-layer inputs sized for every
# layer, keys and values shared from later layers' sources): no layers:N draft.
NOT_TRUNCATABLE = ("gemma4",)


@dataclass
class DraftModel:
    """The model that drafts, as the proposer runs it."""

    model: object  # the mlx-lm model (for layers:N, the target's own)
    family: Family  # its adapter (for layers:N, cut to the first N layers)
    name: str  # for the start-up log and describe()
    weights: str
    max_context: int
    shared: bool  # the target's own weights (layers:N)


def load_draft(spec: str, target: LoadedModel, target_family: Family,
               loader: Callable[[str], LoadedModel] | None = None) -> DraftModel:
    """The draft model `spec` names (--draft-model), checked against the target. loader:
    builds a draft to load (default: the project's loader; "embedded" at its shipped q4)."""
    n = draft_layers(spec)
    if n is not None:
        return truncated(target, target_family, n)
    if loader is not None:
        loaded = loader(spec)
    else:
        loaded = load_model(spec, "q4" if spec == "embedded" else "auto")
    check_vocabulary(target, loaded)
    family = family_for(loaded.model, loaded.config)
    return DraftModel(loaded.model, family, loaded.name, loaded.weights,
                      loaded.max_context or target.max_context, shared=False)


def truncated(target: LoadedModel, target_family: Family, n: int) -> DraftModel:
    """The target's first n decoder layers, its final norm and its head: the same modules, so
    the same weights (the draft adds its own KV pool, nothing else)."""
    total = len(target_family.layers)
    if not 1 <= n < total:
        raise ValueError(f"draft model layers:{n}: the target {target.name} has {total} decoder "
                         f"layers; a layers:N draft takes 1 to {total - 1} of them")
    if target_family.name in NOT_TRUNCATABLE:
        raise UnsupportedModelError(f"draft model layers:{n}: {target_family.name}'s layers "
                                    "read per-layer inputs and shared keys of later layers, so "
                                    "its first layers are not a model of their own")
    family = family_for(target.model, target.config)
    family.layers = family.layers[:n]
    return DraftModel(target.model, family, f"layers:{n} (the first {n} of {total} layers of "
                      f"{target.name})", target.weights, target.max_context, shared=True)


def draft_proposer(cfg: EngineConfig, target: LoadedModel, target_runner: ModelRunner,
                   kv_dtype, path_for: Callable[[int], KernelPath],
                   loader: Callable[[str], LoadedModel] | None = None) -> DraftProposer:
    """The proposer of cfg.draft_model for the target: the draft, its runner over a pool of
    its own (as many blocks as the target's, kv_dtype as the target's) and its block tables;
    refused here, before the engine serves, when it does not fit the target. path_for: the
    engine's kernel path for a forward of that many rows."""
    draft = load_draft(cfg.draft_model, target, target_runner.family, loader)
    pool = pool_for(draft.family, cfg.num_kv_blocks, cfg.block_size, kv_dtype)
    states = None
    if draft.family.recurrent_layers():
        states = DraftStates(cfg.max_num_seqs, cfg.num_speculative_tokens)
        states.pool = StatePool(draft.family.recurrent_layers(), states.total,
                                draft.family.conv_dtype())
    # A draft of the target's own modules shares its stacked q/k/v and gate/up weights (the
    # layers' weights are views of them), so it adds no weight memory.
    runner = ModelRunner(draft.model, pool, cfg.attention, cfg.row_kernels, draft.family,
                         tile=cfg.invariant_tile,
                         stacks=target_runner.stacks if draft.shared else None,
                         states=states.pool if states is not None else None)
    runner.run([RowGroup("warmup", [0], 0, [0], sample=False, state_slot=0)])
    log.info("draft model %s (%s weights%s); its KV pool %.0f MiB (%s)", draft.name,
             draft.weights, ", shared with the target" if draft.shared else "",
             pool.nbytes() / 2**20, pool.dtype)
    return DraftProposer(draft, runner, BlockManager(cfg.num_kv_blocks, cfg.block_size,
                                                     enable_prefix_caching=False),
                         cfg.max_num_batched_tokens, path_for, states)


def vocabulary_rows(loaded: LoadedModel) -> int:
    """Rows of the model's output head: the tokens it scores (its embedding's when tied)."""
    model = loaded.model
    head = getattr(model, "lm_head", None)
    if head is None:
        head = model.model.embed_tokens
    return int(head.weight.shape[0])


def check_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft proposes token ids of the target's vocabulary: refuse one whose embeddings or
    tokenizer (its vocabulary, its end-of-sequence ids) differ, naming both."""
    names = f"draft model {draft.name!r} and target {target.name!r}"
    rows_d, rows_t = vocabulary_rows(draft), vocabulary_rows(target)
    embed_d = int(draft.model.model.embed_tokens.weight.shape[0])
    embed_t = int(target.model.model.embed_tokens.weight.shape[0])
    if (rows_d, embed_d) != (rows_t, embed_t):
        raise ValueError(f"{names} have different vocabularies: the draft scores {rows_d} "
                         f"tokens (embeddings of {embed_d}), the target {rows_t} (embeddings "
                         f"of {embed_t}); a draft must share the target's tokenizer")
    tok_d, tok_t = draft.tokenizer, target.tokenizer
    vocab_d, vocab_t = _tokenizer_vocab(tok_d), _tokenizer_vocab(tok_t)
    if vocab_d != vocab_t:
        size_d = vocab_d if isinstance(vocab_d, int) else len(vocab_d)
        size_t = vocab_t if isinstance(vocab_t, int) else len(vocab_t)
        detail = (f"{size_d} against {size_t} entries" if size_d != size_t
                  else f"both {size_d} entries, but not the same tokens at the same ids")
        raise ValueError(f"{names} have different tokenizers ({detail}); a draft must share "
                         "the target's tokenizer")
    eos_d, eos_t = sorted(tok_d.eos_token_ids), sorted(tok_t.eos_token_ids)
    if eos_d != eos_t:
        raise ValueError(f"{names} end sequences on different tokens: the draft on {eos_d}, "
                         f"the target on {eos_t}")


def _tokenizer_vocab(tokenizer) -> dict | int:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return get_vocab() if get_vocab is not None else int(tokenizer.vocab_size)


class DraftProposer:
    """Drafts from a draft model (see the module docstring). Engine-thread only."""

    def __init__(self, draft: DraftModel, runner: ModelRunner, block_manager: BlockManager,
                 max_rows: int, path_for: Callable[[int], str],
                 states: DraftStates | None = None):
        """runner: a ModelRunner of the draft over its own pool; block_manager: the draft
        pool's tables (no prefix caching: blocks are trimmed back to any length); max_rows:
        rows one catch-up forward may hold (the engine's step budget); path_for: the kernel
        path of a forward of that many rows (the engine's rule for its own steps); states: the
        recurrent states of a draft with recurrent layers."""
        self.draft = draft
        self.states = states
        self.runner = runner
        self.block_manager = block_manager
        self.max_rows = max_rows
        self.path_for = path_for
        # seq_id -> the tokens whose keys and values the draft's cache holds (a prefix of the
        # request's tokens plus drafts), least recently used first.
        self._seen: OrderedDict[str, list[int]] = OrderedDict()
        self.forwards = 0  # draft forwards run so far (at most k per propose call)

    @property
    def cached_requests(self) -> list[str]:
        return list(self._seen)

    def cached_tokens(self, seq_id: str) -> list[int]:
        """The tokens whose keys and values the draft's cache holds for a request."""
        return list(self._seen.get(seq_id, []))

    def release(self, seq_id: str) -> None:
        self._seen.pop(seq_id, None)
        self.block_manager.free(seq_id)
        if self.states is not None:
            self.states.release(seq_id)

    def propose(self, wanted: Seq[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        try:
            return self._propose(wanted)
        except Exception:
            log.exception("draft model failed: no drafts this step; its caches are dropped")
            self._reset()
            return {}

    def _reset(self) -> None:
        bm = self.block_manager
        self.block_manager = BlockManager(bm.num_blocks, bm.block_size, False)
        if self.states is not None:
            for seq_id in list(self._seen):
                self.states.release(seq_id)
        self._seen.clear()
        self.runner.pool.reset()

    def _propose(self, wanted: Seq[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        bm = self.block_manager
        protect = {seq_id for seq_id, _, _ in wanted}
        # Round 1: catch each request's cache up to its tokens; its last row gives d1.
        groups, rooms, budget = [], {}, self.max_rows
        for seq_id, tokens, k in wanted:
            seen = self._seen.pop(seq_id, [])
            keep = min(common_prefix(seen, tokens), len(tokens) - 1)
            if self.states is not None:  # where a recurrent state can go on from
                keep = self.states.resume(seq_id, keep)
            if bm.block_table(seq_id):
                bm.trim(seq_id, keep)
            self._seen[seq_id] = tokens[:keep]  # most recently used now
            if self.draft.max_context:  # 0: the draft's config names no limit
                k = min(k, self.draft.max_context - len(tokens))
            rows = min(len(tokens) - keep, budget)
            if k < 1 or rows < 1 or not self._allocate(seq_id, keep + rows, protect):
                continue
            budget -= rows
            end = keep + rows
            groups.append(RowGroup(seq_id, tokens[keep:end], keep, bm.block_table(seq_id),
                                   sample=end == len(tokens)))
            if self.states is not None and not self.states.plan(groups[-1]):
                groups.pop()  # no state slot free for it: no drafts this step
                continue
            rooms[seq_id] = k
        drafts: dict[str, list[int]] = {}
        while groups:
            out = self.runner.run(groups, self.path_for(sum(g.num_rows for g in groups)))
            self.forwards += 1
            step, groups = groups, []
            for g in step:
                seen = self._seen[g.seq_id]
                seen.extend(g.token_ids)
                if not g.sample:
                    continue  # a catch-up chunk: drafts from a later step
                mine = drafts.setdefault(g.seq_id, [])
                mine.append(out.sampled[g.seq_id].samples[0].token_id)
                # The next round: one row, the draft just made (its KV is not written yet).
                if len(mine) < rooms[g.seq_id] and self._allocate(g.seq_id, len(seen) + 1,
                                                                  protect):
                    groups.append(RowGroup(g.seq_id, [mine[-1]], len(seen),
                                           bm.block_table(g.seq_id), sample=True))
                    if self.states is not None:
                        self.states.plan(groups[-1])
        return drafts

    def _allocate(self, seq_id: str, num_tokens: int, protect: set[str]) -> bool:
        """Grow seq_id's table to num_tokens, dropping the caches of requests not in `protect`
        (least recently used first) when the pool is short; False when it cannot fit."""
        bm = self.block_manager
        needed = bm.blocks_needed(seq_id, num_tokens)
        victims = [s for s in self._seen if s not in protect]
        held = sum(len(bm.block_table(s)) for s in victims)
        if needed > bm.num_free_blocks + held:
            return False
        while not bm.can_allocate(needed):
            self.release(victims.pop(0))
        bm.allocate(seq_id, num_tokens)
        return True


class DraftStates:
    """A draft with recurrent layers: per request a live state slot, and the state after each
    forward of the last propose call. The next call keeps the longest common prefix of the
    draft's tokens and the request's: it goes on from the live state (nothing rejected), from
    the state after the last accepted draft (that slot becomes the live one: nothing is
    copied), or from zero (anything else). Slots come in sets of 1 + k per request; a request
    without a set gets no drafts that step."""

    def __init__(self, requests: int, k: int):
        self.per_request = 1 + k
        self.total = requests * self.per_request
        self.pool: StatePool | None = None
        self._free = [list(range(i * self.per_request, (i + 1) * self.per_request))
                      for i in range(requests - 1, -1, -1)]
        self._slots: dict[str, list[int]] = {}  # seq_id -> [live, snapshot slots...]
        self._len: dict[str, int] = {}  # seq_id -> tokens its live slot's state is after
        self._at: dict[str, dict[int, int]] = {}  # seq_id -> position -> slot holding it

    def resume(self, seq_id: str, keep: int) -> int:
        """How many tokens to keep: `keep` where the state after it is held (made the live
        state), else 0."""
        at = self._at.pop(seq_id, {})
        if keep == self._len.get(seq_id):
            return keep
        if keep not in at:
            return 0
        slots = self._slots[seq_id]
        slots.remove(at[keep])
        slots.insert(0, at[keep])
        self._len[seq_id] = keep
        return keep

    def plan(self, group: RowGroup) -> bool:
        """Give the group its slot and a snapshot after its last row; False when no slot set
        is free."""
        seq_id = group.seq_id
        if seq_id not in self._slots:
            if not self._free:
                return False
            self._slots[seq_id] = self._free.pop()
        slots = self._slots[seq_id]
        at = self._at.setdefault(seq_id, {})
        snapshot = slots[1 + len(at)]
        group.state_slot = slots[0]
        group.snapshots = [(group.num_rows - 1, snapshot)]
        at[group.start + group.num_rows] = snapshot
        self._len[seq_id] = group.start + group.num_rows
        return True

    def release(self, seq_id: str) -> None:
        self._at.pop(seq_id, None)
        self._len.pop(seq_id, None)
        slots = self._slots.pop(seq_id, None)
        if slots is not None:
            self._free.append(slots)
