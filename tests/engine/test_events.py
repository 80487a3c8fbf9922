"""engine/events.py: a step's events reach asyncio consumers with one wake-up of their loop."""

from __future__ import annotations

import asyncio

from engine.events import FinishEvent, RequestHandle, TokenEvent, push_all


def token(request_id: str, index: int) -> TokenEvent:
    return TokenEvent(request_id, index, 7, "x", -0.5, [], 0.0, step=1)


def finish(request_id: str) -> FinishEvent:
    return FinishEvent(request_id, "length", "xx", "", [7, 7], 3, 2, 0, 0, 0.0, 0.0, 0.0, 0.0)


def test_a_steps_events_wake_each_loop_once_and_arrive_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakeups.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counted
        handles = [RequestHandle(f"r{i}", [1], lambda _: None, loop) for i in range(3)]
        plain = RequestHandle("sync", [1], lambda _: None)  # a thread's blocking queue
        step = [(h, token(h.request_id, 0)) for h in handles] + [(plain, token("sync", 0))]
        step += [(handles[0], token("r0", 1)), (handles[0], finish("r0"))]
        push_all(step)
        assert len(wakeups) == 1  # 6 events, one loop: one wake-up
        assert handles[0].finish is not None and handles[1].finish is None
        seen = []
        async for event in handles[0]:
            seen.append(event)
        assert [type(e).__name__ for e in seen] == ["TokenEvent", "TokenEvent", "FinishEvent"]
        assert [e.index for e in seen[:2]] == [0, 1]
        assert handles[1]._async_queue.qsize() == 1
        assert plain._sync_queue.get_nowait().request_id == "sync"

    asyncio.run(main())


def test_a_closed_loop_is_skipped():
    loop = asyncio.new_event_loop()
    handle = RequestHandle("r", [1], lambda _: None, loop)
    loop.close()
    push_all([(handle, finish("r"))])  # nobody listens any more: no error
    assert handle.finish is not None
