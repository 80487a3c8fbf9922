"""Prometheus exposition at /metrics, with vLLM's metric names under the `batchscope:` prefix.

Each app gets its own registry (never prometheus-client's global one), so tests and two apps in
one process do not collide. Three sources fill it:

    live state, read at scrape time   requests running / waiting, KV usage, the state pool
                                      (models with recurrent layers; 0 for the others)
    step records (engine thread)      tokens, preemptions, prefix cache, state checkpoint
                                      hits, steps by kernel path,
                                      rows per step, inter-token latency (from step end times,
                                      as vLLM measures it: per engine iteration), speculative
                                      decoding's drafts and accepted tokens (verify entries),
                                      structured outputs' constrained rows and mask time
    finished requests (event loop)    finish reasons, TTFT, end-to-end, queue time, TPOT

Step callbacks only bump counters (prometheus-client is thread-safe), so they stay cheap.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.config import KernelPath
from engine.events import FinishEvent
from engine.sequence import FinishReason
from engine.telemetry import StepEntry, StepRecord

log = logging.getLogger("batchscope.metrics")

PREFIX = "batchscope:"
FINISH_REASONS = tuple(r.value for r in FinishReason)
KERNEL_PATHS = tuple(p.value for p in KernelPath)  # the paths a step can take
# A CPU engine: first tokens in tens of milliseconds to a minute, tokens every few ms to seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MAX_TRACKED_REQUESTS = 10_000  # last-token times kept for ITL (least recently active dropped)


class EngineMetrics:
    """The app's registry and the code that fills it."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.registry = r = CollectorRegistry()

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(PREFIX + name, doc, registry=r).set_function(read)

        gauge("num_requests_running", "Requests in the running batch.",
              lambda: len(self._scheduler().running) if self._scheduler() else 0)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.",
              lambda: len(self._scheduler().waiting) if self._scheduler() else 0)
        gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0 to 1; cached "
              "prefix blocks nobody holds count as free).", self._kv_usage)
        # Models with recurrent layers (Gated DeltaNet) keep a state per sequence in a pool
        # beside the KV pool; present at 0 for the others, as the speculation counters are.
        gauge("state_slots_used", "Recurrent-state slots held by running sequences (0: the "
              "model has no recurrent layers).", lambda: self._state_pool("state_slots_used"))
        gauge("state_slots_total", "Recurrent-state slots for running sequences (0: the "
              "model has no recurrent layers).", lambda: self._state_pool("state_slots_total"))
        gauge("state_checkpoints", "Prefix checkpoints of the recurrent state held.",
              lambda: self._state_pool("state_checkpoints"))
        gauge("state_checkpoint_capacity", "Prefix checkpoints of the recurrent state the "
              "memory budget allows.", lambda: self._state_pool("state_checkpoint_capacity"))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted when "
                                     "a request's prefill completes; cached tokens included).")
        self.generation_tokens = counter("generation_tokens", "Tokens sampled (an "
                                         "end-of-sequence token included).")
        self.request_success = counter("request_success", "Requests finished, by reason.",
                                       ("finished_reason",))
        self.preemptions = counter("num_preemptions", "Requests preempted (by recompute).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix "
                                   "cache.")
        self.state_hits = counter("state_checkpoint_hits", "Admissions that resumed from a "
                                  "prefix checkpoint of the recurrent state.")
        self.steps = counter("steps", "Engine steps, by the kernel path their matmul calls "
                             "took (native: every one on the native kernels, each row "
                             "alone).", ("kernel_path",))
        # Speculative decoding, as vLLM counts it: one draft per verify group (a request's
        # drafts checked in one step), its tokens, those the target kept, and per draft
        # position i the groups that kept more than i drafts (the acceptance curve).
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft proposals verified (one "
                                   "per request per step that brought drafted tokens).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens "
                                         "verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted "
                                            "tokens the target model accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft proposals whose draft at this position "
                                             "(0: the first) was accepted.", ("position",))
        # Structured outputs (and forced tool calls): rows held to a grammar, and the time
        # their matchers took to take the new tokens and compute the masks.
        self.constrained_rows = counter("constrained_rows", "Rows sampled under a grammar "
                                        "(structured outputs, forced tool calls).")
        self.mask_seconds = counter("grammar_mask_seconds", "Time the grammar matchers took "
                                    "to take the steps' tokens and compute the masks.")
        for reason in FINISH_REASONS:  # present at zero, so rates work from the start
            self.request_success.labels(reason)
        for path in KERNEL_PATHS:
            self.steps.labels(path)
        speculation = getattr(engine, "speculation", None)
        if speculation is not None and speculation.enabled:
            for position in range(speculation.num_tokens):
                self.spec_accepted_per_pos.labels(str(position))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two consecutive "
                             "tokens of a request (engine step end times).", TOKEN_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Per request: decode "
                              "time over its output tokens after the first.", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first "
                                    "scheduled.", REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Rows (token positions) "
                                          "per engine step.", ROW_BUCKETS)
        # Tensor parallelism (--tensor-parallel-size): each rank's share of every step.
        self.rank_step = Histogram(PREFIX + "rank_step_seconds", "A step's time on each rank "
                                   "after the plan broadcast: the forward (its all_sums "
                                   "inside) and sampling.", ("rank",), buckets=TOKEN_BUCKETS,
                                   registry=r)
        self.rank_broadcast = counter("rank_plan_broadcast_seconds", "Time each rank spent in "
                                      "the steps' plan broadcasts (ranks > 0: waiting for "
                                      "rank 0's plan included).", ("rank",))
        self.rank_all_sum = counter("rank_all_sum_seconds", "Time each rank spent in the "
                                    "forwards' all_sums (waiting for its peers there "
                                    "included).", ("rank",))

        self._lock = threading.Lock()  # steps arrive on the engine thread, backfill on the loop
        self._last_step = 0
        self._prefix_seen = (0, 0)  # cumulative (queries, hits) at the last step
        self._state_hits_seen = 0  # cumulative checkpoint hits at the last step
        self._last_token: OrderedDict[str, float] = OrderedDict()  # request -> last token time
        self._unsubscribe: list[Callable[[], None]] = []

    # ---- live state ----------------------------------------------------------------------
    def _scheduler(self) -> Any:
        return getattr(self.engine, "scheduler", None)

    def _kv_usage(self) -> float:
        bm = getattr(self.engine, "block_manager", None)
        return bm.num_used_blocks / bm.num_blocks if bm is not None else 0.0

    def _state_pool(self, name: str) -> int:
        slots = getattr(self.engine, "state_slots", None)  # None: no recurrent layers
        return slots.usage()[name] if slots is not None else 0

    # ---- following the engine and the runs -----------------------------------------------
    def follow(self, runs: Any | None = None) -> None:
        """Subscribe to steps (and to finishes through `runs`), catching up on the steps still
        in the engine's ring buffer. Call once, on the event loop."""
        with self._lock:  # steps arriving meanwhile wait, then skip what the backfill covered
            self._unsubscribe.append(self.engine.subscribe(self.observe_step))
            for record in self.engine.steps.recent():
                self._observe_step(record)
        if runs is not None:
            self._unsubscribe.append(follow_finishes(runs, self.observe_finish))

    def close(self) -> None:
        while self._unsubscribe:
            self._unsubscribe.pop()()

    def observe_step(self, record: StepRecord) -> None:
        with self._lock:
            self._observe_step(record)

    def _observe_step(self, record: StepRecord) -> None:
        if record.step <= self._last_step:
            return  # already counted by the backfill
        self._last_step = record.step
        self.steps.labels(record.kernel_path).inc()
        self.iteration_tokens.observe(record.total_rows)
        for t in record.ranks:
            self.rank_step.labels(str(t.rank)).observe(t.wall_s)
            self.rank_broadcast.labels(str(t.rank)).inc(t.broadcast_s)
            if t.all_sum_s is not None:  # timed (--time-collectives)
                self.rank_all_sum.labels(str(t.rank)).inc(t.all_sum_s)
        if record.preempted:
            self.preemptions.inc(len(record.preempted))
        if record.constrained_rows:
            self.constrained_rows.inc(record.constrained_rows)
            self.mask_seconds.inc(record.mask_ms / 1000)
        queries, hits = record.prefix_cache_queries, record.prefix_cache_hits
        seen_q, seen_h = self._prefix_seen
        # The totals are cumulative; they restart from zero if the engine rebuilds its pool.
        self.prefix_queries.inc(queries - seen_q if queries >= seen_q else queries)
        self.prefix_hits.inc(hits - seen_h if hits >= seen_h else hits)
        self._prefix_seen = (queries, hits)
        state_hits, seen = record.state_checkpoint_hits, self._state_hits_seen
        self.state_hits.inc(state_hits - seen if state_hits >= seen else state_hits)
        self._state_hits_seen = state_hits
        token_time = record.started_at + record.wall_time
        for entry in record.entries:
            if not entry.sampled:
                continue
            if entry.phase == "verify":
                self._observe_verify(entry)
            # A verify entry emits its accepted drafts and the target's own token.
            self.generation_tokens.inc(entry.emitted)
            last = self._last_token.pop(entry.request_id, None)
            if last is None:  # the request's first token: its prompt is all in the cache now
                self.prompt_tokens.inc(entry.context_len)
            else:
                self.itl.observe(token_time - last)
            self._last_token[entry.request_id] = token_time
        while len(self._last_token) > MAX_TRACKED_REQUESTS:
            self._last_token.popitem(last=False)

    def _observe_verify(self, entry: StepEntry) -> None:
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(entry.drafted)
        self.spec_accepted_tokens.inc(entry.accepted)
        for position in range(entry.accepted):
            self.spec_accepted_per_pos.labels(str(position)).inc()

    def observe_finish(self, event: FinishEvent) -> None:
        self.request_success.labels(event.reason).inc()
        # A cancelled or failed request's timings say when it ended, not how fast we serve.
        if event.reason not in ("stop", "length"):
            return
        self.e2e.observe(event.finish_time - event.arrival_time)
        if event.first_scheduled_time is not None:
            self.queue_time.observe(event.first_scheduled_time - event.arrival_time)
        if event.first_token_time is not None:
            self.ttft.observe(event.first_token_time - event.arrival_time)
            if event.completion_tokens > 1:
                self.tpot.observe((event.finish_time - event.first_token_time)
                                  / (event.completion_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def follow_finishes(runs: Any, callback: Callable[[FinishEvent], None]) -> Callable[[], None]:
    """Call `callback` with every FinishEvent of the runs; returns the unsubscribe function."""
    runs.on_finish.append(callback)
    return lambda: runs.on_finish.remove(callback) if callback in runs.on_finish else None


def install(app_state: Any) -> EngineMetrics:
    """The app's metrics, created and following the engine on first call (idempotent).
    The lifespan calls it as soon as the RunService exists."""
    metrics = getattr(app_state, "metrics", None)
    if metrics is None:
        metrics = app_state.metrics = EngineMetrics(app_state.engine)
        metrics.follow(getattr(app_state, "runs", None))
    return metrics


async def metrics_endpoint(request: Request) -> Response:
    metrics = request.app.state.metrics
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics_endpoint, methods=["GET"])]
