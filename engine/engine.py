"""The engine: one thread owns all MLX work; other threads submit, cancel and subscribe.

    step = schedule -> run the model -> postprocess (tokens, stops, finishes, step record)

The thread blocks on its inbox when there is nothing to do; it never spins.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import itertools
import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from engine.block_manager import BlockManager, KVCopy
from engine.config import EngineConfig, KernelPath, KernelPolicy
from engine.distributed.launch import DistributedError
from engine.draft import draft_proposer
from engine.errors import RequestError
from engine.events import ErrorEvent, FinishEvent, RequestHandle, TokenEvent, push_all
from engine.kernels import PathTally
from engine.lookahead import Ahead, continues, next_groups, resume
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import StepOutput, state_pool_for
from engine.models import family_for
from engine.output import OutputText
from engine.penalties import penalty_processors
from engine.platform import backend_info
from engine.sampling import SamplingParams
from engine.scheduler import GroupUpdate, Phase, RowGroup, Scheduler, SchedulerOutput
from engine.sequence import FinishReason, LogitsProcessor, Sequence
from engine.speculative import Proposer, propose, proposer_for
from engine.startup import build_runner, log_model, pool_dtype, rank_times, stop_ranks
from engine.structured import MaskClock, grammar_processors
from engine.telemetry import StepEntry, StepLog, StepRecord
from engine.thresholds import ThresholdTable, resolve_threshold
from engine.token_bytes import TokenBytes

log = logging.getLogger("batchscope.engine")


class EngineError(RuntimeError):
    pass


@dataclass
class _Request:
    seq: Sequence
    handle: RequestHandle
    output: OutputText
    first_token_time: float | None = None
    arrival_wall: float = field(default_factory=time.time)
    first_scheduled_wall: float | None = None
    steps: list[int] = field(default_factory=list)
    trace: list[dict] | None = None  # per step, when the request asked to be traced


@dataclass
class Submission:
    """One request of an Engine.submit_many batch (the arguments of Engine.submit)."""

    prompt: str | list[int]
    params: SamplingParams | None = None
    request_id: str | None = None
    trace: bool = False
    logits_processors: tuple[LogitsProcessor, ...] = ()  # see Sequence.logits_processors


class Engine:
    """Continuous-batching engine. `loader` runs on the engine thread and returns a LoadedModel."""

    def __init__(self, config: EngineConfig, loader: Callable[[], object] | None = None,
                 thresholds: ThresholdTable | None = None, proposer: Proposer | None = None,
                 draft_loader: Callable[[str], LoadedModel] | None = None):
        """thresholds: the calibrated kernel thresholds (engine/thresholds.py); none given,
        --kernel-policy auto uses --kernel-threshold or the default. proposer: where drafts
        come from when config.speculative is on (default: the method's own; for "draft",
        made at load, engine/draft.py). draft_loader: builds the draft model config.draft_model
        names (default: the project's loader; a layers:N draft is never loaded)."""
        self.config = config
        self._thresholds = thresholds
        self._loader = loader or self._default_loader
        self.loaded = None  # LoadedModel, set on the engine thread
        self.tokenizer = None
        self._token_bytes = None  # engine.token_bytes.TokenBytes, made on first use
        self.max_model_len = 0
        self.block_manager: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        self.runner = None
        self.pool = None
        self.state_slots = None  # engine.state_slots.StateSlots of a model with recurrent layers
        self.steps = StepLog(config.step_history)
        self.kernel_policy = KernelPolicy(config.kernel_policy, config.kernel_threshold or 1)
        self.speculation = config.speculation
        self.proposer = proposer or proposer_for(self.speculation)
        self._draft_loader = draft_loader
        self._propose_time = 0.0  # seconds the proposer took in the current step
        self.mask_clock = MaskClock()  # grammar masks' rows and time (engine/structured.py)
        self.kernel_threshold_source = "flag" if config.kernel_threshold is not None else "default"
        self.step_count = 0
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._requests: dict[str, _Request] = {}
        # Requests held back by submit_many(after=...): request id -> [(tokens, requests)].
        self._held: dict[str, list[tuple[int, list[_Request]]]] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._stopped = False
        self._lost: str | None = None  # why the engine stopped itself (a tensor-parallel rank)
        self._ids = itertools.count()
        # Events produced inside a step wait here until its StepRecord is published, so a
        # consumer that sees a finish can already see the step that produced it.
        self._outbox: list[tuple[RequestHandle, object]] | None = None
        # Async scheduling (engine/lookahead.py): the step launched behind the one computing,
        # and when the last step's computation ended (perf_counter), where the next began.
        self._ahead: Ahead | None = None
        self._computed_at = 0.0
        # Test hook: called with the scheduled step before the forward (may raise).
        self.before_forward: Callable[[SchedulerOutput], None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float | None = 600) -> Engine:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="batchscope-engine", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # the thread must clear its MLX streams before exit
        if not self._ready.wait(timeout):
            raise EngineError("engine did not finish loading the model in time")
        if self._load_error is not None:
            raise self._load_error
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        atexit.unregister(self.stop)
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)
        self._thread = None

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    # ---- public API (any thread) -------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None, trace: bool = False,
               logits_processors: tuple[LogitsProcessor, ...] = ()) -> RequestHandle:
        """Queue a request. Raises RequestError (a ValueError) on one the engine cannot serve.

        trace=True records, for every step the request takes part in, the kernel path, the
        keys and values it wrote (all layers) and its logits: FinishEvent.trace. Memory-heavy
        (~50 KB per token for the embedded model, plus the vocabulary's logits per sampled
        token): for divergence experiments, not for serving."""
        return self.submit_many([Submission(prompt, params, request_id, trace,
                                            tuple(logits_processors))], loop=loop)[0]

    def submit_many(self, submissions: list[Submission], *,
                    loop: asyncio.AbstractEventLoop | None = None,
                    after: tuple[str, int] | None = None) -> list[RequestHandle]:
        """Queue several requests at once: they reach the scheduler together, before the same
        step (a batch whose make-up does not depend on thread timing: divergence experiments).

        after=(request_id, n) holds them until that request has produced n tokens (or has
        finished), so they join it at a chosen point of its generation. All are validated
        before any is queued: a RequestError queues none."""
        if not self.running:
            raise EngineError(f"engine is not running: {self._lost}" if self._lost
                              else "engine is not running")
        prepared = []
        for sub in submissions:
            params = sub.params or SamplingParams()
            prompt_ids = (self.encode(sub.prompt) if isinstance(sub.prompt, str)
                          else list(sub.prompt))
            self.validate(prompt_ids, params)
            prepared.append((sub, params, prompt_ids, (
                *penalty_processors(params, len(prompt_ids)),
                *grammar_processors(params.structured, len(prompt_ids), self.loaded,
                                    self.mask_clock), *sub.logits_processors)))
        requests = []
        for sub, params, prompt_ids, processors in prepared:
            request_id = sub.request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            handle = RequestHandle(request_id, prompt_ids, self.cancel, loop)
            seq = Sequence(request_id, prompt_ids, params, logits_processors=processors)
            requests.append(_Request(seq, handle,
                                     OutputText(self.tokenizer, params.stop),
                                     trace=[] if sub.trace else None))
        self._inbox.put(("add", requests, after))
        return [r.handle for r in requests]

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestError naming what to change: the prompt or max_tokens."""
        if not prompt_ids:
            raise RequestError("prompt is empty", "prompt")
        vocab = self.loaded.config.get("vocab_size") if self.loaded else None
        if vocab and any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if vocab and any(t >= vocab for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        n = len(prompt_ids)
        # Blame max_tokens only when the prompt alone leaves room for at least one new token.
        total = n + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{total}, more than the context window of {self.max_model_len} tokens",
                "max_tokens" if n < self.max_model_len else "prompt", "context_length_exceeded")
        blocks = -(-total // self.config.block_size)
        if blocks > self.config.num_kv_blocks:
            capacity = self.config.num_kv_blocks * self.config.block_size
            raise RequestError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs {blocks} KV "
                f"blocks of {self.config.block_size} tokens; the pool has "
                f"{self.config.num_kv_blocks}",
                "max_tokens" if n < capacity else "prompt", "context_length_exceeded")

    @property
    def attention(self) -> str:
        """Which attention the step's rows use, in words (logged at start, shown by the CLI)."""
        return self.runner.describe_attention(self.config.attention)

    @property
    def row_kernels(self) -> str:
        """Which kernels a step's linear layers and other per-row math outside attention run
        on, in words (logged at start)."""
        return self.runner.describe_row_kernels(self.config.row_kernels, self.loaded.weights)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, exact even for part of a UTF-8 character (logprobs)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes(token_id)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def subscribe(self, callback: Callable[[StepRecord], None]) -> Callable[[], None]:
        return self.steps.subscribe(callback)

    def generate(self, prompt: str | list[int],
                 params: SamplingParams | None = None) -> FinishEvent:
        """Blocking convenience: submit and wait for the result."""
        return self.submit(prompt, params).result()

    def kv_snapshot(self) -> dict:
        """Block map for the dashboard (read without locking: a best-effort live view)."""
        bm = self.block_manager
        return {"num_blocks": bm.num_blocks, "block_size": bm.block_size,
                "holders": {str(k): v for k, v in bm.holders().items()},
                "cached": bm.cached_block_ids()}

    # ---- engine thread -----------------------------------------------------------------------
    def _default_loader(self):
        return load_model(self.config.model, self.config.weights)

    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as e:  # reported to start()
            self._load_error = e
            stop_ranks(self.runner)
            gc.unfreeze()
            self._ready.set()
            mx.clear_streams()
            return
        self._ready.set()
        try:
            while not self._stopped:
                self._drain_inbox(block=not self._has_work())
                if not self._stopped and self._has_work():
                    self._step()
        finally:
            self._stopped = True
            self._drop_ahead()
            for req in list(self._requests.values()):
                if self._lost:  # a lost rank: the requests' error, as a failed step's
                    self._emit(req, ErrorEvent(req.seq.seq_id, self._lost))
                self._finish(req, FinishReason.ERROR if self._lost else FinishReason.CANCELLED,
                             error=self._lost or "engine stopped")
            stop_ranks(self.runner)
            gc.unfreeze()  # what a stopped engine held is garbage now: collectible again
            # MLX wants each thread to destroy its own streams before it ends; otherwise the
            # process aborts at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _has_work(self) -> bool:
        """Requests to schedule, or a step launched ahead to book (its rows may all be of
        requests that ended meanwhile: it is still a step that ran)."""
        return self.scheduler.has_work() or self._ahead is not None

    def _setup(self) -> None:
        self.loaded = self._loader()
        self.tokenizer = self.loaded.tokenizer
        cfg = self.config
        self.max_model_len = self.loaded.context_limit(cfg.max_model_len,
                                                       cfg.num_kv_blocks * cfg.block_size)
        if not self.loaded.max_context:
            log.info("model %s names no context length (max_position_embeddings): a request "
                     "may reach %d tokens", self.loaded.name, self.max_model_len)
        family = family_for(self.loaded.model, self.loaded.config)
        self.state_slots, states = state_pool_for(family, cfg) or (None, None)
        self.runner = build_runner(cfg, self.loaded, family, states,
                                   self._loader != self._default_loader)
        self.pool = self.runner.pool
        # Rows of a block shared in part are copied in this process's pool: not where ranks
        # hold the pool in shards, nor for recurrent layers (their state resumes only at
        # checkpoints kept at whole blocks).
        self.block_manager = BlockManager(
            cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching,
            copy_partial=states is None and cfg.tensor_parallel_size == 1,
            min_copy_rows=self.pool.min_copy_rows)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, self.state_slots)
        threshold, self.kernel_threshold_source = resolve_threshold(
            cfg, self.loaded.name, self.loaded.weights, backend_info(), self._thresholds)
        self.kernel_policy = KernelPolicy(cfg.kernel_policy, threshold)
        # One throwaway row allocates the KV pool (in the dtype the model produces) and warms
        # the kernels now, not inside the first request's time to first token: the head and
        # the sampler too (a greedy sample), so that the native float32 kernel's packed copy of
        # the head is made here. It writes slot 0 of a free block, which any later owner
        # overwrites before reading.
        t0 = time.perf_counter()
        self.runner.run([RowGroup("warmup", [0], 0, [0], sample=True, params=SamplingParams(),
                                  state_slot=0)])
        log.info("KV pool allocated: %.0f MiB (%s) in %.1f s", self.pool.nbytes() / 2**20,
                 self.pool.dtype, time.perf_counter() - t0)
        gc.freeze()  # setup's objects out of full collections (~25 ms a step); _run unfreezes
        log_model(self, family, states)
        if self.speculation.method == "draft" and self.proposer is None:
            self.proposer = draft_proposer(cfg, self.loaded, self.runner, pool_dtype(cfg.kv_dtype),
                                           self._path_for, self._draft_loader)
        if self.speculation.enabled:
            log.info("speculative decoding: %s", self.speculation.describe())

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "stop":
            self._stopped = True
        elif kind == "add":
            requests: list[_Request] = msg[1]
            for req in requests:
                self._requests[req.seq.seq_id] = req
            after = msg[2]
            target = self._requests.get(after[0]) if after else None
            if target is not None and len(target.seq.output_ids) < after[1]:
                self._held.setdefault(after[0], []).append((after[1], requests))
            else:
                for req in requests:
                    self.scheduler.add(req.seq)
        elif kind == "cancel":
            req = self._requests.get(msg[1])
            if req is not None:
                self._finish(req, FinishReason.CANCELLED)

    def _step(self) -> None:
        started_at = time.time()
        t0 = time.perf_counter()
        self._outbox = []
        try:
            self._run_step(started_at, t0)
        finally:
            outbox, self._outbox = self._outbox, None
            push_all(outbox)

    def _emit(self, req: _Request, event) -> None:
        if self._outbox is not None:
            self._outbox.append((req.handle, event))
        else:
            req.handle.push(event)

    def _run_step(self, started_at: float, t0: float) -> None:
        """schedule (or take the step launched ahead) -> launch -> launch the next one ahead
        where it is known -> wait -> update (the scheduler books the KV kept) -> publish."""
        ahead, self._ahead = self._ahead, None
        discarded = 0
        self.step_count += 1
        if ahead is not None:  # launched during the last step, behind it
            groups, discarded = resume(ahead, set(self._requests))
            plan, path, speculation = SchedulerOutput(groups), ahead.path, ""
            pending, error, self._propose_time = ahead.pending, ahead.error, 0.0
        else:
            drafts, speculation = self._proposals()
            plan = self.scheduler.schedule(drafts)
            copies = self.block_manager.take_copies()
            for g in plan.groups:
                g.trace = self._traced(g.seq_id)
            path = self._path_for(plan.num_rows)
        t1 = time.perf_counter()  # scheduled: the rest until booking is the model's
        if ahead is None:
            pending, error = self._launch(plan, path, self.step_count, copies=copies)
        if pending is not None:
            self._ahead = self._look_ahead(plan, pending)
        if pending is None:
            output = None if error is not None else StepOutput({}, 0.0)
        else:
            output, error = self._wait(pending, self._computed_at if ahead else None)
        t2 = self._computed_at = time.perf_counter()
        if error is not None:
            self._drop_ahead()  # it was built on this step's tokens
        # What the calls took ("native" where every one ran on a native kernel); else planned.
        rows = plan.num_rows + discarded
        taken = output.taken if output is not None and output.taken else PathTally(
            path, rows, self.config.invariant_tile).taken()
        model_time = output.model_time if output is not None else t2 - t1
        bm = self.block_manager
        # KV usage as the step ran, before finished requests give their blocks back.
        kv_used, kv_free, kv_cached = bm.num_used_blocks, bm.num_empty_blocks, bm.num_cached_blocks
        states = self.state_slots.usage() if self.state_slots is not None else {}
        if output is not None:
            updates = self.scheduler.update_from_output(plan, output)
            entries = self._publish(updates, output.traces, plan, taken.path, started_at)
            expert_rows = {str(i): rows for i, rows in output.expert_rows.items()}
        else:
            entries, expert_rows = self._fail(plan, error, started_at), {}
        record = StepRecord(
            step=self.step_count, started_at=started_at, wall_time=0.0, model_time=model_time,
            scheduler_time=0.0, entries=entries, total_rows=rows,
            prefill_rows=sum(g.num_rows for g in plan.groups if g.phase == Phase.PREFILL),
            decode_rows=discarded + sum(g.num_rows for g in plan.groups
                                        if g.phase == Phase.DECODE),
            verify_rows=sum(g.num_rows for g in plan.groups if g.phase == Phase.VERIFY),
            draft_tokens=sum(len(g.drafts) for g in plan.groups),
            accepted_tokens=sum(e.accepted for e in entries), speculation=speculation,
            propose_time=self._propose_time, **self.mask_clock.take(),
            kv_blocks_total=bm.num_blocks, kv_blocks_used=kv_used, kv_blocks_free=kv_free,
            kv_blocks_cached=kv_cached,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            preempted=[s.seq_id for s in plan.preempted], kernel_path=taken.path,
            linear_calls_per_layer=taken.calls_per_layer,
            expert_rows=expert_rows, **self.runner.window_savings(plan.groups),
            **states,
            prefix_cache_queries=bm.stats.queries, prefix_cache_hits=bm.stats.hits, error=error,
            ranks=rank_times(self.runner), overlapped=ahead is not None,
            discarded_rows=discarded)
        t3 = time.perf_counter()
        record.wall_time = t3 - t0
        record.scheduler_time = (t1 - t0 - self._propose_time) + (t3 - t2)
        self.steps.append(record)

    def _launch(self, plan: SchedulerOutput, path: KernelPath, step: int,
                tokens: mx.array | None = None,
                copies: list[KVCopy] | None = None) -> tuple[object | None, str | None]:
        """The plan's forward and sampling, queued (the runner's PendingStep): (pending, None),
        or (None, the error in words) when it failed; (None, None) for an empty plan. step:
        the number its record will have; copies: rows the plan's new prompts matched in blocks
        shared in part, copied first (a failed copy fails the step, as a failed forward)."""
        if not plan.groups:
            return None, None
        plan.step = step
        try:
            if copies:
                self.pool.copy_rows(copies)
            if self.before_forward is not None:
                self.before_forward(plan)
            return self.runner.launch(plan.groups, path, tokens), None
        except Exception as e:
            return None, self._step_error(e, step)

    def _wait(self, pending, since: float | None) -> tuple[StepOutput | None, str | None]:
        """A launched step's output, or (None, the error in words) when it failed."""
        try:
            return pending.result(since), None
        except Exception as e:
            return None, self._step_error(e, self.step_count)

    def _step_error(self, e: Exception, step: int) -> str:
        error = f"{type(e).__name__}: {e}"
        log.error("step %d failed: %s\n%s", step, error, traceback.format_exc())
        if isinstance(e, DistributedError):  # no step can run any more: stop
            self._lost, self._stopped = error, True
        return error

    def _look_ahead(self, plan: SchedulerOutput, pending) -> Ahead | None:
        """The step after this one launched now, behind it, where it is known before this
        step's tokens are (engine/lookahead.py); None where it is not, or not wanted: another
        request is waiting, arriving or held for one of these (submit_many's `after`): it
        joins the step the scheduler plans instead."""
        if (not self.config.async_scheduling or not self.runner.queues_steps
                or self.speculation.enabled or self.state_slots is not None
                or self.scheduler.waiting or not self._inbox.empty()
                or any(g.seq_id in self._held for g in plan.groups)
                or not continues(plan.groups)):
            return None
        found = next_groups(plan.groups, self.block_manager, self.max_model_len)
        if found is None:
            return None
        groups, sources = found
        at = {id(g): i for i, g in enumerate(pending.groups)}
        rows = [at[id(plan.groups[i])] for i in sources]
        tokens = pending.samples.token_ids
        if rows != list(range(tokens.shape[0])):
            tokens = tokens[mx.array(rows)]
        path = self._path_for(len(groups))
        launched, error = self._launch(SchedulerOutput(groups), path, self.step_count + 1,
                                       tokens)
        return Ahead(groups, path, launched, error)

    def _drop_ahead(self) -> None:
        """Wait out and forget a step launched ahead (its tokens are not wanted)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.pending is not None:
            try:
                ahead.pending.result()
            except Exception:  # noqa: BLE001 - built on a failed step: its error is that one's
                pass

    def _publish(self, updates: list[GroupUpdate], traces: dict, plan: SchedulerOutput,
                 path: KernelPath, started_at: float) -> list[StepEntry]:
        """Each group's tokens to its request (until a stop or a finish), its trace, and its
        step entry (the drafts it emitted: those before a stop only)."""
        entries = []
        for u in updates:
            g = u.group
            req = self._requests.get(g.seq_id)
            if req is None:
                continue
            self._scheduled(req, started_at)
            entry = self._entry(g, sampled=g.sample, accepted=u.accepted,
                                emitted=len(u.samples))
            entries.append(entry)
            if req.trace is not None and g.seq_id in traces:
                t = traces[g.seq_id]
                # A verify group: only the rows it keeps (rejected rows' slots are rewritten
                # before anything reads them), and the logits of each token it emits.
                logits = t.logits[:u.accepted + 1] if g.verify else t.logits
                req.trace.append({"step": self.step_count, "path": path,
                                  "step_rows": plan.num_rows, "phase": g.phase,
                                  "start": g.start, "rows": u.kept, "drafted": len(g.drafts),
                                  "accepted": u.accepted, "kv": t.kv[:, :, :, :u.kept],
                                  "logits": logits, **({"state": t.state}
                                                       if t.state is not None else {})})
            for used, sample in enumerate(u.samples, 1):
                self._accept(req, sample, self.step_count)
                if g.seq.is_finished:  # EOS or a stop string: the rest is not emitted
                    entry.accepted, entry.emitted = min(u.accepted, used), used
                    break
        return entries

    def _fail(self, plan: SchedulerOutput, error: str, started_at: float) -> list[StepEntry]:
        """A failed step: every request in it ends with the error."""
        entries = []
        for g in plan.groups:
            req = self._requests.get(g.seq_id)
            if req is None:
                continue
            self._scheduled(req, started_at)
            self._emit(req, ErrorEvent(g.seq_id, error))
            entries.append(self._entry(g, sampled=False))
            self._finish(req, FinishReason.ERROR, error=error)
        if self._lost is None:  # a lost rank's pool may wait on its collectives for ever
            self._recover_pool()
        return entries

    def _scheduled(self, req: _Request, started_at: float) -> None:
        req.steps.append(self.step_count)
        if req.first_scheduled_wall is None:
            req.first_scheduled_wall = started_at

    def _path_for(self, rows: int) -> KernelPath:
        """The kernel path of a forward of this many rows (the draft's too)."""
        if self.config.batch_invariant:
            return KernelPath.TILED
        return self.kernel_policy.path_for(rows)

    def _traced(self, seq_id: str) -> bool:
        req = self._requests.get(seq_id)
        return req is not None and req.trace is not None

    def _entry(self, g, sampled: bool, accepted: int = 0, emitted: int = 0) -> StepEntry:
        return StepEntry(g.seq.seq_id, g.phase, g.num_rows, g.seq.num_computed,
                         len(self.block_manager.block_table(g.seq.seq_id)), sampled,
                         drafted=len(g.drafts), accepted=accepted, emitted=emitted)

    def _proposals(self) -> tuple[dict[str, list[int]], str]:
        """Drafts for the running requests in decode, and the step's speculation state."""
        drafts, state, self._propose_time = propose(
            self.speculation, self.proposer, self.scheduler.running, self.max_model_len)
        return drafts, state

    def _accept(self, req: _Request, sample, step: int) -> None:
        seq = req.seq
        now = time.time()
        if req.first_token_time is None:
            req.first_token_time = now
        eos = sample.token_id in self.tokenizer.eos_token_ids and not seq.params.ignore_eos
        if eos:
            self._finish(req, FinishReason.STOP)
            return
        seq.output_ids.append(sample.token_id)
        self._release_held(seq.seq_id, len(seq.output_ids))
        text, stopped = req.output.add(sample.token_id)
        self._emit(req, TokenEvent(seq.seq_id, len(seq.output_ids) - 1, sample.token_id, text,
                                   sample.logprob, sample.top, now, step, sample.drafted))
        if stopped:
            self._finish(req, FinishReason.STOP)
        elif len(seq.output_ids) >= seq.params.max_tokens:
            self._finish(req, FinishReason.LENGTH)
        elif seq.num_tokens >= self.max_model_len:
            self._finish(req, FinishReason.LENGTH)

    def _release_held(self, request_id: str, produced: int | None) -> None:
        """Hand requests held for `request_id` to the scheduler once it has produced enough
        tokens (produced=None: it finished, release them all)."""
        groups = self._held.get(request_id)
        if not groups:
            return
        keep = []
        for tokens, requests in groups:
            if produced is None or produced >= tokens:
                for req in requests:
                    if req.seq.seq_id in self._requests:  # not cancelled meanwhile
                        self.scheduler.add(req.seq)
            else:
                keep.append((tokens, requests))
        if keep:
            self._held[request_id] = keep
        else:
            del self._held[request_id]

    def _finish(self, req: _Request, reason: FinishReason, error: str | None = None) -> None:
        seq = req.seq
        self._requests.pop(seq.seq_id, None)
        self._release_held(seq.seq_id, None)
        self.scheduler.finish(seq, reason)  # frees the blocks whatever happens next
        # The proposer's own state for it (a draft model's KV blocks). Proposers written
        # before release existed (scripted ones in tests) keep nothing and have none.
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(seq.seq_id)
        # Text held back for a possible stop string is released with the finish.
        tail = req.output.flush() if reason in (FinishReason.LENGTH, FinishReason.STOP) else ""
        self._emit(req, FinishEvent(
            request_id=seq.seq_id, reason=reason, text=req.output.text, text_delta=tail,
            token_ids=list(seq.output_ids), prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids), cached_prompt_tokens=seq.num_cached_prompt,
            preemptions=seq.num_preemptions, arrival_time=req.arrival_wall,
            first_scheduled_time=req.first_scheduled_wall, first_token_time=req.first_token_time,
            finish_time=time.time(), error=error, steps=req.steps, trace=req.trace,
            interrupted=self._lost is not None))

    def _recover_pool(self) -> None:
        """After a failed step, make sure the pool's pending writes can still be evaluated."""
        try:
            mx.eval(self.pool.state())
        except Exception:
            log.exception("KV pool unusable after a failed step: dropping it")
            for req in list(self._requests.values()):
                self._finish(req, FinishReason.ERROR, error="KV cache reset after an engine error")
            self.block_manager = self.block_manager.emptied()
            self.scheduler.bm = self.block_manager
            self.pool.reset()
