"""The console's event feed (services/gateway/http/console/events.py), over the app in
process against the fake engine: a snapshot at once, requests as the engine client takes and
lets go of them (through the observer hook the real client calls), swaps, adapters and
restarts as they change, and nothing sampled while nobody listens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from common.config import ServerConfig
from common.messages import FinishReason, GenerateRequest, ProcessDown, SamplingParams
from services.gateway.engine.client import OutputDelta
from services.gateway.engine.live_requests import LiveRequests
from services.gateway.http.app import create_app
from services.gateway.http.console.events import MAX_QUEUED, ConsoleEvents
from tests.fake_engine import FakeEngine
from tests.waiting import wait_until_async

TOKEN = "console-secret"
STATS = {
    "ready": True,
    "num_running": 1,
    "num_waiting": 2,
    "kv_cache_usage": 0.25,
    "version": "v-test",
    "request_ids": ["r1"],
}
ROWS = {
    "requests": [
        {"id": "r1", "index": 0, "state": "decoding", "version": "v-test", "num_prompt_tokens": 3}
    ]
}


class Feed:
    """GET /admin/events on the ASGI app itself (httpx's transport would wait for the end of
    a body that never ends): the events as they come, and a disconnect at the end."""

    def __init__(self, app: Any, headers: dict[str, str]) -> None:
        self.app = app
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        self.status = 0
        self.events: list[tuple[str, Any]] = []
        self.gone = asyncio.Event()
        self.ended = False  # the server ended the body
        self._buffer = b""

    async def run(self) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": "/admin/events",
            "raw_path": b"/admin/events",
            "query_string": b"",
            "root_path": "",
            "headers": self.headers,
            "client": ("127.0.0.1", 1),
            "server": ("test", 80),
        }
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            elif message["type"] == "http.response.body":
                self._buffer += message.get("body", b"")
                self.ended = not message.get("more_body", False)
                *frames, self._buffer = self._buffer.split(b"\n\n")
                for frame in frames:
                    fields = dict(
                        line.split(b": ", 1) for line in frame.split(b"\n") if b": " in line
                    )
                    if b"event" in fields:
                        self.events.append(
                            (fields[b"event"].decode(), orjson.loads(fields[b"data"]))
                        )

        await self.app(scope, receive, send)

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]

    def last(self, kind: str) -> Any:
        return next(data for k, data in reversed(self.events) if k == kind)


class Engine(FakeEngine):
    """The fake, answering the scheduler's request rows to `what="requests"`."""

    async def stats(self, timeout: float = 5.0, what: str = "stats") -> dict[str, Any]:
        return ROWS if what == "requests" else await super().stats(timeout, what)


def listen(
    test: Callable[[FakeEngine, ConsoleEvents, Feed], Awaitable[None]],
    headers: dict[str, str] | None = None,
) -> Feed:
    """Run `test` while a feed listens to a fresh app; the feed, once it has gone."""
    engine = Engine(stats=STATS)
    engine.lora_enabled = True

    async def go() -> Feed:
        app = create_app(engine, ServerConfig(admin_token=TOKEN))
        console: ConsoleEvents = app.state.console
        console.tick_s = 0.01
        feed = Feed(app, headers if headers is not None else {"Authorization": f"Bearer {TOKEN}"})
        task = asyncio.create_task(feed.run())
        try:
            await test(engine, console, feed)
        finally:
            feed.gone.set()
            await asyncio.wait_for(task, 10)
        return feed

    return asyncio.run(go())


def generate_request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt="hi", sampling=SamplingParams())


def test_a_snapshot_first_then_requests_as_they_start_and_finish() -> None:
    async def test(engine: FakeEngine, console: ConsoleEvents, feed: Feed) -> None:
        await wait_until_async(lambda: "snapshot" in feed.kinds(), 30, "the first snapshot")
        assert engine.observer is not None  # the hook the real engine client calls
        watch = engine.observer(generate_request("r1"))
        watch.delta(OutputDelta("a", [5, 6], FinishReason.NONE, 3, 2, False, version="v-test"))
        await wait_until_async(
            lambda: any(r["id"] == "r1" for r in feed.last("snapshot")["requests"]),
            30,
            "a snapshot listing r1",
        )
        watch.delta(OutputDelta("", [7], FinishReason.STOP, 3, 3, True))
        watch.end()
        await wait_until_async(
            lambda: ("request", "finished") in [(k, d.get("event")) for k, d in feed.events],
            30,
            "r1 finished",
        )

    feed = listen(test)
    assert feed.status == 200
    first = feed.events[0]
    assert first[0] == "snapshot"
    snapshot = first[1]
    assert snapshot["model"] == {
        "name": "test-model",
        "names": ["test-model"],
        "version": "v-test",
        "max_model_len": 256,
        "ready": True,
        "draining": False,
    }
    assert snapshot["stats"]["kv_cache_usage"] == 0.25 and "request_ids" not in snapshot["stats"]
    assert snapshot["lora_enabled"] is True and snapshot["requests"] == []
    started = next(d for k, d in feed.events if k == "request" and d["event"] == "started")
    assert (started["id"], started["model"], started["state"]) == ("r1", "test-model", "queued")
    listed = next(
        r for k, d in feed.events if k == "snapshot" for r in d["requests"] if r["id"] == "r1"
    )
    # the gateway's row, with the scheduler's finer state
    assert (listed["state"], listed["num_output_tokens"], listed["num_prompt_tokens"]) == (
        "decoding",
        2,
        3,
    )
    finished = feed.last("request")
    assert (finished["event"], finished["state"], finished["num_output_tokens"]) == (
        "finished",
        "stop",
        3,
    )
    totals = feed.last("snapshot")["totals"]
    assert (totals["num_finished"], totals["num_output_tokens"]) == (1, 3)


def test_swaps_adapters_and_restarts_are_told_as_they_change() -> None:
    async def test(engine: FakeEngine, console: ConsoleEvents, feed: Feed) -> None:
        await wait_until_async(lambda: "snapshot" in feed.kinds(), 30, "the first snapshot")
        engine.swap_status = {"mode": "drain", "from": "v-test", "to": "v2", "path": "/m"}
        await wait_until_async(lambda: "swap" in feed.kinds(), 30, "the swap event")
        engine.swap_status = None
        engine.system_fingerprint = "v2"
        await wait_until_async(lambda: "model" in feed.kinds(), 30, "the model event")
        engine.lora_adapters = {"sql": "/adapters/sql"}
        await wait_until_async(lambda: "adapters" in feed.kinds(), 30, "the adapters event")
        console.on_process_down(ProcessDown(name="tokenizer-0", exit_code=-9))
        console.on_process_down(ProcessDown(name="tokenizer-0", exit_code=1))
        await wait_until_async(
            lambda: feed.last("snapshot")["processes"], 30, "a snapshot with the restarts"
        )

    feed = listen(test)
    swaps = [d for k, d in feed.events if k == "swap"]
    assert swaps[0] == {"mode": "drain", "from": "v-test", "to": "v2", "path": "/m"}
    assert swaps[-1] is None  # it ended
    assert feed.last("model")["version"] == "v2"
    assert feed.last("adapters") == {"sql": "/adapters/sql"}
    restarts = [d for k, d in feed.events if k == "process"]
    assert [(p["name"], p["restarts"], p["exit_code"]) for p in restarts] == [
        ("tokenizer-0", 1, -9),
        ("tokenizer-0", 2, 1),
    ]
    assert feed.last("snapshot")["processes"][0]["restarts"] == 2


def test_the_sampler_runs_only_while_someone_listens() -> None:
    async def test(engine: FakeEngine, console: ConsoleEvents, feed: Feed) -> None:
        await wait_until_async(lambda: "snapshot" in feed.kinds(), 30, "the first snapshot")
        assert console.listeners and console.is_sampling
        feed.gone.set()
        await wait_until_async(lambda: not console.listeners, 30, "the listener gone")
        assert not console.is_sampling
        console.publish("request", {"event": "started"})  # nobody to tell: no error

    listen(test)


def test_closing_ends_every_stream() -> None:
    async def test(engine: FakeEngine, console: ConsoleEvents, feed: Feed) -> None:
        await wait_until_async(lambda: "snapshot" in feed.kinds(), 30, "the first snapshot")
        console.close()
        await wait_until_async(lambda: feed.ended, 30, "the body's end")
        assert not console.is_sampling

    feed = listen(test)
    assert feed.status == 200


def test_the_feed_without_the_token_is_401() -> None:
    async def test(engine: FakeEngine, console: ConsoleEvents, feed: Feed) -> None:
        await wait_until_async(lambda: feed.status, 30, "an answer")

    feed = listen(test, headers={})
    assert feed.status == 401 and feed.events == []


def test_a_listener_that_falls_behind_is_dropped_not_buffered() -> None:
    async def go() -> tuple[int, bool]:
        engine = Engine(stats=STATS)
        console = ConsoleEvents(engine, LiveRequests(lambda: engine.model_name), tick_s=3600)
        stream = console.stream()
        await anext(stream)  # the snapshot
        for i in range(MAX_QUEUED + 10):  # nobody reads meanwhile
            console.publish("request", {"event": "started", "id": f"r{i}"})
        assert not console.listeners  # let go of at once
        got = [event async for event in stream]  # what was queued, then the end
        return len(got), console.is_sampling

    num_got, sampling = asyncio.run(go())
    assert num_got == MAX_QUEUED - 1 and not sampling
