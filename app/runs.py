"""RunService: the one place a validated request becomes an engine submission plus recorder calls.

    route -> RunService.start(RunRequest) -> Run -> `async for event in run.events()`

Each Run has a pump task that reads the engine's events, forwards them to the recorder and
queues them for the consumer. Recording therefore never depends on the consumer: when a client
goes away, the consumer's `finally` cancels the request and the pump still records the
"cancelled" finish the engine sends once it has freed the blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from engine.choices import choice_params, submit_choices
from engine.engine import EngineError
from engine.events import ErrorEvent, Event, FinishEvent, TokenEvent
from engine.sampling import SamplingParams
from engine.telemetry import StepRecord

log = logging.getLogger("batchscope.runs")


class Recorder(Protocol):
    """What the app needs from the recorder (app/db). Every method returns at once."""

    def start_session(self, model: str, weights: str, kernel_policy: str,
                      config: dict) -> int: ...

    def run_started(self, run_id: str, *, session_id: int | None, source: str, endpoint: str,
                    model: str, weights: str, kernel_policy: str, prompt_text: str,
                    messages: list[dict] | None, prompt_token_ids: list[int], params: dict,
                    queued_at: float) -> None: ...

    def token(self, event: TokenEvent) -> None: ...

    def run_finished(self, event: FinishEvent) -> None: ...

    def step(self, session_id: int | None, record: StepRecord) -> None: ...


def kernel_policy(engine: Any) -> str:
    policy = getattr(engine, "kernel_policy", None)
    return policy.describe() if policy is not None else "gemm"


def session_config(engine: Any) -> dict:
    """The engine configuration as run, with the context window resolved."""
    return {**asdict(engine.config), "max_model_len": engine.max_model_len}


class QueueFullError(EngineError):
    """Too many requests are in flight: the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class RunRequest:
    prompt_ids: list[int]
    params: SamplingParams
    endpoint: str  # "/v1/completions", "/v1/chat/completions", "/playground", ...
    source: str = "api"
    prompt_text: str | None = None  # None: decoded from prompt_ids for the record
    messages: list[dict] | None = None
    # Recorded beside the sampling parameters (the playground's tools and their parser).
    record: dict = field(default_factory=dict)


@dataclass
class RunResult:
    tokens: list[TokenEvent]
    finish: FinishEvent
    error: str | None  # set when the engine failed the request


@dataclass
class Run:
    id: str
    request: RunRequest
    created: float  # epoch seconds
    _handle: Any
    _queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    finish: FinishEvent | None = None

    def cancel(self) -> None:
        """Stop the request; the engine frees its blocks before its next step."""
        self._handle.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """Token, error and finish events, ending with the FinishEvent.

        Leaving the loop early (client gone, task cancelled) cancels the request."""
        finished = False
        try:
            while True:
                event = await self._queue.get()
                yield event
                if isinstance(event, FinishEvent):
                    finished = True
                    return
        finally:
            if not finished:
                self.cancel()

    async def collect(self) -> RunResult:
        tokens: list[TokenEvent] = []
        error: str | None = None
        async for event in self.events():
            if isinstance(event, TokenEvent):
                tokens.append(event)
            elif isinstance(event, ErrorEvent):
                error = event.message
        assert self.finish is not None  # events() ends only on the finish
        if self.finish.reason in ("error", "cancelled") and error is None:
            error = self.finish.error or f"request {self.finish.reason}"
        return RunResult(tokens, self.finish, error)


class RunService:
    """Starts runs. At most `engine.config.max_num_seqs + max_waiting` are in flight (started and
    not finished) at once: the engine runs up to max_num_seqs together, so what is beyond them is
    waiting in its queue; one more is refused with QueueFullError (None: no bound)."""

    def __init__(self, engine: Any, recorder: Recorder | None = None,
                 session_id: int | None = None, max_waiting: int | None = None):
        self.engine = engine
        self.recorder = recorder
        self.session_id = session_id
        self.max_waiting = max_waiting
        self.in_flight = 0  # runs started and not yet finished (event loop only: no lock)
        self._pumps: set[asyncio.Task] = set()  # strong references until each run ends
        # Called on the event loop with each run's FinishEvent (metrics); must not block.
        self.on_finish: list[Callable[[FinishEvent], None]] = []
        self._token_text: dict[int, str] = {}

    # ---- what the served model is ------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.loaded.name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def max_context_tokens(self) -> int:
        """Most tokens (prompt + output) one request may hold: the context window or the pool."""
        config = self.engine.config
        return min(self.engine.max_model_len, config.num_kv_blocks * config.block_size)

    def encode(self, prompt: str) -> list[int]:
        return self.engine.encode(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(list(token_ids))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Messages with plain-string content, rendered with the model's chat template."""
        return self.engine.encode_chat(messages)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, for some tokens)."""
        return self.engine.token_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprobs); a partial UTF-8 character shows as U+FFFD."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.token_bytes(token_id).decode(
                "utf-8", errors="replace")
        return text

    @property
    def capacity(self) -> int | None:
        """Most runs in flight at once (running plus waiting), or None for no bound."""
        if self.max_waiting is None:
            return None
        return self.engine.config.max_num_seqs + self.max_waiting

    # ---- runs ------------------------------------------------------------------------------
    def start(self, request: RunRequest, *, id_prefix: str = "run") -> Run:
        """Submit to the engine (call on the event loop).

        Raises engine.errors.RequestError (a ValueError) when the engine cannot serve the prompt
        (empty, token ids out of range, prompt plus max_tokens beyond the context window),
        QueueFullError when the queue is full, EngineError when the engine is not running."""
        return self.start_choices(request, 1, id_prefix=id_prefix)[0]

    def start_choices(self, request: RunRequest, n: int, *, id_prefix: str = "run") -> list[Run]:
        """n choices of one prompt (engine/choices.py: they share its KV blocks), each a run of
        its own, recorded with the parameters it ran with (a seeded request's choice i has
        seed + i). Choice 0's id is the prefix and a random part; choice i's adds "-i".
        Raises as start, before submitting any."""
        capacity = self.capacity
        if capacity is not None and self.in_flight + n > capacity:
            raise QueueFullError(
                f"the server is busy: {self.in_flight} requests are running or waiting "
                f"(at most {self.engine.config.max_num_seqs} run at once and "
                f"{self.max_waiting} wait)"
                + (f"; {n} choices need {n} places" if n > 1 else "") + "; retry shortly")
        loop = asyncio.get_running_loop()
        base = f"{id_prefix}-{uuid.uuid4().hex[:24]}"
        ids = [base] + [f"{base}-{i}" for i in range(1, n)]
        queued_at = time.time()
        handles = submit_choices(self.engine, request.prompt_ids, request.params, n,
                                 request_ids=ids, loop=loop)
        prompt_text = self._prompt_text(request)
        runs = []
        for i, (run_id, handle) in enumerate(zip(ids, handles, strict=True)):
            run = Run(run_id, request, queued_at, handle)
            self.in_flight += 1
            self._record("run_started", run_id, session_id=self.session_id,
                         source=request.source, endpoint=request.endpoint,
                         model=self.model_name, weights=self.engine.loaded.weights,
                         kernel_policy=kernel_policy(self.engine), prompt_text=prompt_text,
                         messages=request.messages, prompt_token_ids=list(request.prompt_ids),
                         params=params_dict(choice_params(request.params, i))
                         | request.record,
                         queued_at=queued_at)
            task = loop.create_task(self._pump(run, handle), name=f"pump-{run_id}")
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)
            runs.append(run)
        return runs

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait for the runs in flight to record their finish (at shutdown, after engine.stop)."""
        if self._pumps:
            await asyncio.wait(set(self._pumps), timeout=timeout)

    async def _pump(self, run: Run, handle: Any) -> None:
        counted = True
        try:
            async for event in handle:
                if isinstance(event, TokenEvent):
                    self._record("token", event)
                elif isinstance(event, FinishEvent):
                    run.finish = event
                    self.in_flight -= 1  # before the consumer can start another run
                    counted = False
                    self._record("run_finished", event)
                    for callback in list(self.on_finish):
                        try:
                            callback(event)
                        except Exception:
                            log.exception("on_finish callback failed")
                run._queue.put_nowait(event)
        finally:
            if counted:  # the pump itself was cancelled (loop shutting down)
                self.in_flight -= 1

    def _prompt_text(self, request: RunRequest) -> str:
        if request.prompt_text is not None:
            return request.prompt_text
        try:
            return self.engine.tokenizer.decode(list(request.prompt_ids))
        except Exception:  # a display nicety only: never fail a run over it
            return ""

    def _record(self, method: str, *args: Any, **kwargs: Any) -> None:
        if self.recorder is None:
            return
        try:
            getattr(self.recorder, method)(*args, **kwargs)
        except Exception:  # a broken recorder must not break serving
            log.exception("recorder.%s failed", method)


def params_dict(params: SamplingParams) -> dict:
    """Sampling parameters as JSON: the runs table's params and the playground's panels."""
    d = asdict(params)
    d["stop"] = list(params.stop)
    d["logit_bias"] = [list(pair) for pair in params.logit_bias]
    return d
