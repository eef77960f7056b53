"""Two gateway processes on one port (--gateway-processes 2, services/gateway/listen.py): a
SIGKILLed one loses only its own connections. Streams run on both processes (the console's
live list, which every process answers for the whole server, says which holds which); one
process is killed; the other's streams complete, whole; new connections are served while
the dead one restarts; the restarted one serves; a cancel by the client's id ends a stream
that another gateway process holds; /metrics counts every process's requests once."""

from __future__ import annotations

import os
import re
import signal
import threading
from typing import Any

import httpx
import orjson
import pytest

from tests.server import Server, running_server
from tests.waiting import wait_until

TOKEN = "gwproc-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MAX_TOKENS = 48
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with running_server(
        "--admin-token", TOKEN, "--gateway-processes", "2", "--max-num-seqs", "32"
    ) as s:
        yield s


def _snapshot(server: Server) -> dict[str, Any]:
    """The console feed's first event: the whole server's live requests, among others."""
    with httpx.stream("GET", server.url + "/admin/events", headers=ADMIN, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                return orjson.loads(line[6:])
    raise AssertionError("the feed ended without a snapshot")


def _holders(server: Server) -> dict[str, str]:
    """Request id -> the gateway process holding it."""
    return {row["id"]: row["gateway"] for row in _snapshot(server)["requests"]}


def _holding(server: Server, ids: set[str]) -> dict[str, str] | None:
    """The holders, once every one of `ids` is in the live list."""
    holders = _holders(server)
    return holders if ids <= set(holders) else None


class _Stream:
    """One streamed completion on its own connection, in a thread."""

    def __init__(self, server: Server, request_id: str, max_tokens: int = MAX_TOKENS) -> None:
        self.request_id = request_id
        self.num_chunks = 0
        self.finish: str | None = None
        self.num_tokens: int | None = None  # the usage at the end
        self.broken: str | None = None  # the connection died under it
        body = {
            "model": server.model,
            "prompt": f"Story {request_id}: once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        headers = {"X-Request-Id": request_id}
        self.thread = threading.Thread(target=self._run, args=(server, body, headers))
        self.thread.daemon = True
        self.thread.start()

    def _run(self, server: Server, body: dict[str, Any], headers: dict[str, str]) -> None:
        url = server.url + "/v1/completions"
        try:
            with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    if chunk.get("usage"):
                        self.num_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", ()):
                        self.num_chunks += 1
                        self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as e:
            self.broken = repr(e)

    def join(self) -> None:
        self.thread.join(300)
        assert not self.thread.is_alive(), f"{self.request_id} hangs"


def _streams_on_both(server: Server, prefix: str, max_tokens: int) -> dict[str, list[_Stream]]:
    """Streams, each on a new connection, until both gateway processes hold some (the
    kernel gives a connection to whichever process accepts first); by holder."""
    streams: list[_Stream] = []
    for i in range(40):
        streams.append(_Stream(server, f"{prefix}-{i}", max_tokens))
        ids = {s.request_id for s in streams}
        holders = wait_until(
            lambda ids=ids: _holding(server, ids), DEADLINE_S, "every stream in the live list"
        )
        by: dict[str, list[_Stream]] = {}
        for s in streams:
            by.setdefault(holders[s.request_id], []).append(s)
        if len(by) == 2:
            return by
    raise AssertionError("40 connections, all taken by one gateway process")


def _success_total(text: str) -> float:
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^shuttle:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    )


def test_a_killed_gateway_process_loses_only_its_own_streams(server: Server) -> None:
    pids = server.gateway_pids()
    assert sorted(pids) == [0, 1]
    by = _streams_on_both(server, "k", 100)  # long enough to outlive the kill
    victim, survivor = sorted(by)  # gateway-0, gateway-1
    wait_until(lambda: all(s.num_chunks for ss in by.values() for s in ss), DEADLINE_S, "tokens")
    index = int(victim.rpartition("-")[2])
    os.kill(pids[index], signal.SIGKILL)
    # new connections are served meanwhile (by the survivor, or queued for the new one)
    for i in range(3):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": server.model, "prompt": f"Hi {i}", "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    for s in [*by[victim], *by[survivor]]:
        s.join()
    for s in by[survivor]:
        assert s.broken is None and s.finish == "length", (s.request_id, s.broken, s.finish)
        assert s.num_tokens == 100
    for s in by[victim]:  # its connections went with it
        assert s.finish is None, (s.request_id, s.finish)
    # the supervisor restarted it: a new process with the same index, which serves
    wait_until(
        lambda: server.gateway_pids().get(index) not in (None, pids[index]),
        DEADLINE_S,
        "the restarted gateway process",
    )
    restarted = wait_until(
        lambda: _streams_on_both(server, "after", 200), DEADLINE_S, "both processes serving"
    )
    for streams in restarted.values():
        for s in streams:
            s.join()
            assert s.broken is None and s.finish == "length"
    # the scheduler cancelled the dead process's requests: nothing left running
    wait_until(lambda: not _holders(server), DEADLINE_S, "no live request left")


def test_a_cancel_reaches_the_process_holding_the_request(server: Server) -> None:
    by = _streams_on_both(server, "c", 2000)
    targets = [streams[0] for streams in by.values()]  # one on each process
    # one connection for both cancels: it reaches one process, so one cancel is the other's
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=60) as client:
        for s in targets:
            r = client.post(f"/admin/cancel/{s.request_id}")
            assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
    for s in targets:
        s.join()
        assert s.finish == "cancelled", (s.request_id, s.finish, s.broken)
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=60) as client:
        for streams in by.values():
            for s in streams[1:]:
                client.post(f"/admin/cancel/{s.request_id}")
    for streams in by.values():
        for s in streams:
            s.join()


def test_metrics_count_every_process_once(server: Server) -> None:
    wait_until(lambda: not _holders(server), DEADLINE_S, "no live request left")
    before = _success_total(httpx.get(server.url + "/metrics", timeout=30).text)
    by = _streams_on_both(server, "m", 64)
    num = sum(len(s) for s in by.values())
    for streams in by.values():
        for s in streams:
            s.join()
            assert s.finish == "length"
    # whichever process answers a scrape, it counts the requests of both, once
    for _ in range(4):
        text = httpx.get(server.url + "/metrics", timeout=30).text
        assert _success_total(text) == before + num


def test_a_stored_response_is_found_by_every_process(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/responses",
        json={"model": server.model, "input": "Hello", "max_output_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    response_id = r.json()["id"]
    # each on a new connection: whichever process takes it reads the same store
    for _ in range(6):
        got = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=30)
        assert got.status_code == 200 and got.json()["id"] == response_id
