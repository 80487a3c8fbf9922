"""What a request's consumer receives, and the handle that delivers it across threads.

The engine thread pushes events; a consumer reads them either from asyncio (the handle was
created with a loop: events arrive through call_soon_threadsafe, never blocking the loop) or
from a plain thread (a blocking queue).
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class TokenEvent:
    request_id: str
    index: int  # position in the output
    token_id: int
    text: str  # new text released with this token (may be empty while a stop string may follow)
    logprob: float
    top_logprobs: list[tuple[int, float]]
    time: float  # epoch seconds
    step: int  # engine step that produced it
    drafted: bool = False  # proposed by speculation and accepted by the target


@dataclass
class FinishEvent:
    request_id: str
    reason: str  # an engine.sequence.FinishReason: "stop", "length", "cancelled", "error"
    text: str  # the whole output
    text_delta: str  # text released only now (held back while a stop string could follow)
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    preemptions: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    error: str | None = None
    steps: list[int] = field(default_factory=list)
    # With submit(trace=True): per step {step, path, step_rows, phase, start, rows, drafted,
    # accepted, kv, logits} (see engine/model_runner.py's StepTrace; a verify step's rows are
    # those it kept and its logits one row per emitted token); None otherwise.
    trace: list[dict] | None = None
    # The engine lost part of itself under the request (a tensor-parallel rank): it could not
    # finish, as a server that died under it could not (its run is recorded "interrupted").
    interrupted: bool = False


@dataclass
class ErrorEvent:
    request_id: str
    message: str


Event = TokenEvent | FinishEvent | ErrorEvent


class RequestHandle:
    def __init__(self, request_id: str, prompt_ids: list[int], cancel: Callable[[str], None],
                 loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self._cancel = cancel
        self._loop = loop
        self._async_queue: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None
        self._sync_queue: queue.Queue[Event] | None = None if loop else queue.Queue()
        self.finish: FinishEvent | None = None
        self._consumed = False  # the finish has been read: iterating again yields nothing

    def push(self, event: Event) -> None:
        """Called on the engine thread."""
        push_all([(self, event)])

    def cancel(self) -> None:
        """Stop the request; takes effect before the engine's next step. Safe from any thread."""
        self._cancel(self.request_id)

    def __iter__(self) -> Iterator[Event]:
        if self._sync_queue is None:
            raise RuntimeError("this handle delivers events to asyncio: use `async for`")
        while not self._consumed:
            event = self._sync_queue.get()
            self._consumed = isinstance(event, FinishEvent)
            yield event

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._async_queue is None:
            raise RuntimeError("this handle delivers events to a thread: use `for`")
        while not self._consumed:
            event = await self._async_queue.get()
            self._consumed = isinstance(event, FinishEvent)
            yield event

    def result(self) -> FinishEvent:
        """Block until the request ends (thread consumers); again later, the same finish."""
        for _ in self:
            pass
        return self.finish


def push_all(pairs: list[tuple[RequestHandle, Event]]) -> None:
    """Hand events to their consumers, in order (called on the engine thread). Those bound for
    an asyncio loop go in one call_soon_threadsafe a loop, not one an event: each call writes
    to the loop's wake-up pipe and wakes it, and a step of 8 streams has 8 tokens."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
    for handle, event in pairs:
        if isinstance(event, FinishEvent):
            handle.finish = event
        if handle._async_queue is None:
            handle._sync_queue.put(event)
        else:
            batches.setdefault(handle._loop, []).append((handle._async_queue, event))
    for loop, items in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for target, event in items:
        target.put_nowait(event)
