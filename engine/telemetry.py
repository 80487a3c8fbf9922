"""What the engine did in each step, recorded as it did it: the only shapes the dashboard reads."""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any


@dataclass
class StepEntry:
    request_id: str
    phase: str  # "prefill", "decode" or "verify" (a decode row with drafted tokens)
    rows: int  # token positions this request contributed to the step
    context_len: int  # tokens with KV in the cache after the step
    blocks_held: int
    sampled: bool  # the step produced a token for this request
    drafted: int = 0  # verify: tokens proposed (rows - 1)
    accepted: int = 0  # verify: of them, kept and emitted
    # Tokens the step gave the request (an EOS included): 1 for a sampled prefill or decode
    # row; accepted + 1 for a verify group, fewer when the request ended on an accepted draft
    # (EOS or a stop string: the rest are not emitted)
    emitted: int = 0


@dataclass
class RankTimes:
    """One rank's share of a tensor-parallel step, in seconds (engine/distributed/)."""

    rank: int
    wall_s: float  # the step after the plan broadcast: forward (its all_sums inside), sampling
    model_s: float  # forward + sampling, evaluated (StepOutput.model_time)
    broadcast_s: float  # in the plan broadcast (ranks > 0: waiting for rank 0's plan included)
    # In the forward's all_sums, waiting for the peers there included; None unless timed
    # (--time-collectives).
    all_sum_s: float | None = None


@dataclass
class StepRecord:
    step: int
    started_at: float  # epoch seconds
    wall_time: float  # seconds, whole step
    # Forward + sampling, evaluated. An overlapped step's began when the step before it had
    # computed, during that step's bookkeeping: it can exceed wall_time (steps tile time).
    model_time: float
    scheduler_time: float  # scheduling + bookkeeping + events (all else but propose_time)
    entries: list[StepEntry]
    total_rows: int
    prefill_rows: int
    decode_rows: int
    kv_blocks_total: int
    kv_blocks_used: int  # held by at least one request
    kv_blocks_free: int  # never used or evicted
    kv_blocks_cached: int  # no holder but kept for prefix reuse (evictable)
    num_running: int
    num_waiting: int
    preempted: list[str] = field(default_factory=list)
    # Speculative decoding: rows of verify groups (each request's last token and its drafts),
    # drafts proposed and accepted in the step, and whether the step speculated: "" when the
    # engine has no speculation, "on", or why it was off ("off: 9 running > 4").
    verify_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    speculation: str = ""
    # Seconds the proposer took to draft for the step (a draft model's forwards; not counted
    # in scheduler_time or model_time, which is the target's forward).
    propose_time: float = 0.0
    # The path the step's matmul calls took (engine/kernels.py, PathTally): "native" where
    # every one ran on a native row kernel (each row computed alone, whatever shares the step);
    # else the policy's, which at least one MLX/BLAS call took: "gemm" one batched call per
    # linear layer, "gemv" one per row, "tiled" (batch-invariant mode) calls of a fixed number
    # of rows. linear_calls_per_layer: the most calls one layer made on that path
    # (docs/kernel-paths.md).
    kernel_path: str = "gemm"
    linear_calls_per_layer: int = 1
    # Mixture-of-experts models: per MoE layer (index as a string, JSON's key type), how many
    # of the step's rows the router sent to each expert; the expert calls follow kernel_path.
    expert_rows: dict[str, list[int]] = field(default_factory=dict)
    # Sliding-window models: KV blocks that every sliding layer has left behind but the pool
    # keeps (the global layers still read them), summed over the step's sequences, and the
    # bytes a per-layer-group allocation (vLLM's hybrid allocator) would free from them.
    window_blocks_behind: int = 0
    window_bytes_reclaimable: int = 0
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0  # cumulative, tokens
    # Models with recurrent layers (Gated DeltaNet): the state pool beside the KV pool, as
    # the step ran (engine/state_slots.py); all 0 for a model without such layers.
    state_slots_total: int = 0  # live-sequence slots (0: the model has no recurrent layers)
    state_slots_used: int = 0  # slots held by sequences
    state_checkpoints: int = 0  # prefix checkpoints held
    state_checkpoint_capacity: int = 0  # checkpoints the memory budget allows
    state_checkpoint_hits: int = 0  # cumulative: admissions that resumed from a checkpoint
    state_slot_bytes: int = 0  # one slot, all recurrent layers: conv + recurrent state
    # Structured outputs (engine/structured.py): the step's rows held to a grammar, and the
    # milliseconds their matchers took to take the new tokens and compute the masks.
    constrained_rows: int = 0
    mask_ms: float = 0.0
    # Tensor parallelism: every rank's times for the step, rank 0 first; empty for one rank
    # and for a step that did not complete on every rank.
    ranks: list[RankTimes] = field(default_factory=list)
    # Async scheduling (engine/lookahead.py): the step was built and queued while the one
    # before it computed; rows it computed for requests that ended on the step before (their
    # tokens are discarded; counted in total_rows and decode_rows, in no entry).
    overlapped: bool = False
    discarded_rows: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# The state pool's fields of a StepRecord, the keys of the engine's usage() dict for them.
STATE_POOL_FIELDS = ("state_slots_total", "state_slots_used", "state_checkpoints",
                     "state_checkpoint_capacity", "state_checkpoint_hits", "state_slot_bytes")


# ---- a step as flat rows ----------------------------------------------------------------------
# A step is stored as one row of its fields, lists and dicts as JSON under "<field>_json", and
# one row per entry, its request_id under "run_id"; what a reader shows of a step takes the
# field's name again (field_name). Fields kept only in memory (/metrics and the live dashboard
# read them from the record itself) are left out.
_STEP_UNSTORED = ("entries", "propose_time", "window_blocks_behind", "window_bytes_reclaimable")
_ENTRY_UNSTORED = ("emitted",)
_JSON_SUFFIX = "_json"


def _is_nested(f: Field) -> bool:
    return str(f.type).startswith(("list", "dict"))


def _step_column(f: Field) -> str:
    return f.name + _JSON_SUFFIX if _is_nested(f) else f.name


def _entry_column(f: Field) -> str:
    return "run_id" if f.name == "request_id" else f.name


def field_name(column: str) -> str:
    """The StepRecord field a steps column holds."""
    return column.removesuffix(_JSON_SUFFIX)


_STEP_STORED = tuple(f for f in fields(StepRecord) if f.name not in _STEP_UNSTORED)
_ENTRY_STORED = tuple(f for f in fields(StepEntry) if f.name not in _ENTRY_UNSTORED)
STEP_COLUMNS: tuple[str, ...] = tuple(_step_column(f) for f in _STEP_STORED)
ENTRY_COLUMNS: tuple[str, ...] = tuple(_entry_column(f) for f in _ENTRY_STORED)
# A live record's stored values in one call, in column order (the runs writer converts every
# step and entry while the engine computes on the same cores).
_STEP_VALUES = operator.attrgetter(*(f.name for f in _STEP_STORED))
_ENTRY_VALUES = operator.attrgetter(*(f.name for f in _ENTRY_STORED))


def _stored(obj: Any, stored: tuple[Field, ...], values: Callable[[Any], tuple]) -> tuple:
    """The stored fields' values in column order, of a dataclass instance or of its asdict()
    saved by an older version (a field missing there takes its default)."""
    if not isinstance(obj, dict):
        return values(obj)
    out = []
    for f in stored:
        if f.name in obj:
            out.append(obj[f.name])
        elif f.default is not MISSING:
            out.append(f.default)
        elif f.default_factory is not MISSING:
            out.append(f.default_factory())
        else:
            raise KeyError(f.name)
    return tuple(out)


def step_row(record: StepRecord | dict) -> dict[str, Any]:
    """A step's stored fields by column (a StepRecord or its to_dict())."""
    row = dict(zip(STEP_COLUMNS, _stored(record, _STEP_STORED, _STEP_VALUES), strict=True))
    # Older records may hold None for these; a dense model's expert rows are NULL.
    row["preempted_json"] = list(row["preempted_json"] or [])
    row["expert_rows_json"] = row["expert_rows_json"] or None
    row["ranks_json"] = [t if isinstance(t, dict) else asdict(t)
                         for t in row["ranks_json"]] or None  # one rank: NULL
    row["speculation"] = row["speculation"] or ""
    return row


def entry_rows(record: StepRecord | dict) -> list[dict[str, Any]]:
    """One row per entry of a step (a StepRecord or its to_dict())."""
    entries = record["entries"] if isinstance(record, dict) else record.entries
    rows = []
    for entry in entries:
        row = dict(zip(ENTRY_COLUMNS, _stored(entry, _ENTRY_STORED, _ENTRY_VALUES),
                       strict=True))
        row["sampled"] = bool(row["sampled"])
        rows.append(row)
    return rows


class StepLog:
    """A ring buffer of recent steps plus live subscribers (called on the engine thread)."""

    def __init__(self, capacity: int):
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._subscribers: list[Callable[[StepRecord], None]] = []
        self._lock = threading.Lock()

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(record)
            except Exception:  # a broken subscriber must never stop the engine
                pass

    def recent(self, n: int | None = None) -> list[StepRecord]:
        with self._lock:
            records = list(self._records)
        return records if n is None else records[-n:]

    def subscribe(self, callback: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Follow steps live; returns a function that unsubscribes. Callbacks must be quick."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe
