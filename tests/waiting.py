"""Wait for an event, never for a duration: the one polling helper of the tests.

    stats = wait_until(lambda: idle_stats(server), 60, "every block free")
    await wait_until_async(lambda: engine.aborted == ["c1"], 30, "the abort")

The predicate is polled until it returns something truthy, which is returned; at the
deadline the test fails with `what` and the predicate's last value. Deadlines are generous
(a busy machine only makes a test slower, never wrong); the interval only bounds how late
the event is noticed. `wait_until_async` is the same loop for a predicate that needs the
running event loop (it may be a coroutine function); elsewhere in async code,
`await asyncio.to_thread(wait_until, ...)` keeps the loop free.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until it is truthy (returned) or `timeout` seconds pass (a failure)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_late(what, timeout, value))
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]], timeout: float, what: str, interval: float = 0.01
) -> T:
    """wait_until inside an event loop: the loop runs between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_late(what, timeout, value))
        await asyncio.sleep(interval)


def _late(what: str, timeout: float, last: object) -> str:
    return f"waited {timeout:g} s for {what}; the last check gave {last!r}"
