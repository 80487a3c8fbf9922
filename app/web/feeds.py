"""The bridge from the engine thread's step callbacks to asyncio subscribers (the SSE clients).

    engine thread   StepFeed._on_step: append the record to an inbox; wake the loop once
    event loop      StepFeed._deliver: compact the records, hand them to every client
    each client     a bounded buffer of steps + an event; its stream takes everything buffered
                    at most `max_hz` times a second, so fast steps coalesce into few frames

The engine never waits on the loop, and a slow client never holds anyone up: its buffer only
grows until it is full, then its oldest steps are dropped (and counted). The feed follows the
engine only while a client is connected; with no steps, nothing runs (no polling).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.telemetry import STATE_POOL_FIELDS, STEP_COLUMNS, StepRecord, field_name

# The fields of a StepRecord the charts and the kernel-path strip need: its stored single
# values but the scheduler time, the cumulative prefix-cache counters and the state pool (lists
# stay out: only the latest step's batch is shown, and it comes with the live state, as does
# the state pool; preemptions are counted).
_NOT_CHARTED = ("scheduler_time", "prefix_cache_queries", "prefix_cache_hits",
                *STATE_POOL_FIELDS)
STEP_FIELDS = tuple(c for c in STEP_COLUMNS if c == field_name(c) and c not in _NOT_CHARTED)
ACCEPTANCE_STEPS = 50  # steps the rolling acceptance rate covers
RATE_WINDOW_S = 1.0  # seconds the decode rate covers


def decode_tokens(record: StepRecord) -> int:
    """Tokens the step emitted for requests past their prefill: one per decode row, and per
    verify group its accepted drafts plus the target's own token."""
    verified = sum(e.emitted for e in record.entries if e.phase == "verify")
    return record.decode_rows + verified


class RollingRate:
    """Decode tokens per second of wall time over the steps that ended in the last `window_s`."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._steps: deque[tuple[float, float, int]] = deque()  # (start, end, decode tokens)
        self._rows = 0

    def add(self, record: StepRecord) -> float:
        """The rate as the step ends."""
        end = record.started_at + record.wall_time
        tokens = decode_tokens(record)
        self._steps.append((record.started_at, end, tokens))
        self._rows += tokens
        return self.at(end)

    def at(self, now: float) -> float:
        """The rate at `now` (not before the last step added): the steps that ended in the
        window before it, so an engine that stopped stepping decays to 0."""
        while self._steps and self._steps[0][1] <= now - self.window_s:
            self._rows -= self._steps.popleft()[2]
        if not self._steps:
            return 0.0
        span = now - self._steps[0][0]  # from the first step's start: the gaps count too
        return self._rows / span if span > 0 else 0.0


def decode_rate(records: list[StepRecord], now: float, window_s: float = RATE_WINDOW_S) -> float:
    """Decode tokens per second now, over the steps (in step order) that ended in the last
    `window_s`: what the dashboard's summary shows, 0 once no step ran in the window."""
    rate = RollingRate(window_s)
    for record in records:
        if record.started_at + record.wall_time > now - window_s:
            rate.add(record)
    return rate.at(now)


class RollingAcceptance:
    """Accepted over drafted tokens in the last `steps` steps; None while none drafted."""

    def __init__(self, steps: int = ACCEPTANCE_STEPS):
        self._steps: deque[tuple[int, int]] = deque(maxlen=steps)  # (drafted, accepted)

    def add(self, record: StepRecord) -> float | None:
        self._steps.append((record.draft_tokens, record.accepted_tokens))
        drafted = sum(d for d, _ in self._steps)
        return sum(a for _, a in self._steps) / drafted if drafted else None


@dataclass
class Rolling:
    """The running figures a stream of compact steps carries (fed in step order)."""

    rate: RollingRate = field(default_factory=RollingRate)
    acceptance: RollingAcceptance = field(default_factory=RollingAcceptance)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def compact_step(record: StepRecord, rolling: Rolling) -> dict[str, Any]:
    """A step as the dashboard charts it (records must be fed to `rolling` in step order)."""
    out = {name: getattr(record, name) for name in STEP_FIELDS}
    out["preemptions"] = len(record.preempted)
    out["tokens_per_s"] = round(rolling.rate.add(record), 2)
    out["verify_groups"] = sum(1 for e in record.entries if e.phase == "verify")
    # Speculation: this step's accepted / drafted (None: it drafted nothing), and the same over
    # the last ACCEPTANCE_STEPS steps.
    out["acceptance"] = _rounded(record.accepted_tokens / record.draft_tokens
                                 if record.draft_tokens else None)
    out["acceptance_rolling"] = _rounded(rolling.acceptance.add(record))
    return out


def compact_steps(records: list[StepRecord],
                  window_s: float = RATE_WINDOW_S) -> list[dict[str, Any]]:
    rolling = Rolling(RollingRate(window_s))
    return [compact_step(r, rolling) for r in records]


class FeedClient:
    """One subscriber's bounded buffer of steps not yet sent."""

    def __init__(self, max_steps: int):
        self._steps: deque[dict[str, Any]] = deque(maxlen=max_steps)
        self._ready = asyncio.Event()
        self.last_step = 0  # the newest step handed to this client
        self.dropped = 0  # steps lost because this client fell too far behind

    def push(self, steps: list[dict[str, Any]]) -> None:
        # A backlog read at connect time may overlap the first live steps: keep each step once.
        steps = [s for s in steps if s["step"] > self.last_step]
        if not steps:
            return
        self.last_step = steps[-1]["step"]
        overflow = len(self._steps) + len(steps) - (self._steps.maxlen or 0)
        if overflow > 0:
            self.dropped += overflow
        self._steps.extend(steps)
        self._ready.set()

    async def wait(self) -> None:
        await self._ready.wait()

    def take(self) -> list[dict[str, Any]]:
        self._ready.clear()
        steps = list(self._steps)
        self._steps.clear()
        return steps


class StepFeed:
    """Fans engine steps out to asyncio clients. Create and use it on the event loop."""

    def __init__(self, engine: Any, *, max_steps: int = 1000, rate_window_s: float = RATE_WINDOW_S):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._max_steps = max_steps
        self._lock = threading.Lock()
        self._inbox: list[StepRecord] = []
        self._wake_pending = False
        self._clients: set[FeedClient] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._rolling = Rolling(RollingRate(rate_window_s))

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    @property
    def following(self) -> bool:
        """Whether the feed is subscribed to the engine (only while it has clients)."""
        return self._unsubscribe is not None

    def connect(self, since: int | None = None) -> FeedClient:
        """A new client, given first the steps after `since` still in the engine's ring buffer
        (read after subscribing, so no step falls in between). Without `since` it starts
        after the newest recorded step."""
        client = FeedClient(self._max_steps)
        self._clients.add(client)
        if self._unsubscribe is None:
            self._unsubscribe = self._engine.subscribe(self._on_step)
        records = self._engine.steps.recent()
        if since is None:
            since = records[-1].step if records else 0
        client.last_step = since
        backlog = [r for r in records if r.step > since]
        client.push(compact_steps(backlog[-self._max_steps:]))
        return client

    def disconnect(self, client: FeedClient) -> None:
        self._clients.discard(client)
        if not self._clients and self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _on_step(self, record: StepRecord) -> None:
        """Engine thread: must be quick. One loop wake-up covers any number of queued steps."""
        with self._lock:
            self._inbox.append(record)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            records, self._inbox = self._inbox, []
            self._wake_pending = False
        steps = [compact_step(r, self._rolling) for r in records]
        for client in list(self._clients):
            client.push(steps)


def feed_for(app_state: Any) -> StepFeed:
    """The app's feed (made by the lifespan, on the event loop: app/web/app.py)."""
    return app_state.step_feed
