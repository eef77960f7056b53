"""Faults on the real processes: a process killed with SIGKILL mid-load is restarted, the
requests in flight through it end with a retryable error (HTTP 503 with Retry-After, or an
error event mid-stream) instead of hanging, and serving resumes with every block free.
SIGTERM drains: new requests get 503, in-flight ones finish."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import orjson
import pytest

from tests.server import Server, running_server
from tests.waiting import wait_until

TOKEN = "fault-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _pid_of(server: Server, module: str) -> int:
    pid = next((pid for name, pid in server.children() if name == module), None)
    assert pid is not None, f"no {module} child"
    return pid


def _wait_serving(server: Server) -> None:
    wait_until(server.serves, 120, "a completion to succeed", 0.2)


def _idle(server: Server) -> bool:
    stats = _stats(server)
    return stats["num_used_blocks"] == 0 and stats["num_running"] == 0


def _requests_in(server: Server, state: str) -> int:
    rows = httpx.get(server.url + "/admin/requests", headers=ADMIN, timeout=30).json()
    return sum(r["state"] == state for r in rows["requests"])


def _pids_of(server: Server, module: str) -> set[int]:
    return {pid for name, pid in server.children() if name == module}


def _stats(server: Server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30).json()


class _Load:
    """Requests in flight in the background, one streamed; records how each ended."""

    def __init__(self, server: Server, n: int = 6) -> None:
        self.server = server
        self.results: list[tuple[str, str]] = []  # (kind, outcome)
        self.threads = [threading.Thread(target=self._plain, daemon=True) for _ in range(n)]
        self.threads.append(threading.Thread(target=self._streamed, daemon=True))

    def start(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def _body(self, stream: bool) -> dict:
        return {
            "model": self.server.model,
            "prompt": "Write a very long story:",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": stream,
        }

    def _plain(self) -> None:
        r = httpx.post(self.server.url + "/v1/completions", json=self._body(False), timeout=120)
        outcome = f"{r.status_code} retry-after={r.headers.get('retry-after')}"
        if r.status_code == 200:
            outcome += " " + str(r.json()["choices"][0]["finish_reason"])
        self.results.append(("plain", outcome))

    def _streamed(self) -> None:
        outcome = "no end"
        self.tail: list[str] = []
        with httpx.stream(
            "POST", self.server.url + "/v1/completions", json=self._body(True), timeout=120
        ) as r:
            if r.status_code != 200:  # failed before its first byte: a plain HTTP error
                self.results.append(("stream", f"error {r.status_code}"))
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        outcome = f"error {chunk['error']['code']}"
                elif line == "data: [DONE]":
                    break
                self.tail = [*self.tail[-3:], line[:300]]
        self.results.append(("stream", outcome))

    def join(self) -> None:
        for t in self.threads:
            t.join(120)


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    # (resumes off: a request a dead process held fails fast, as tested here; the resumes
    # are tests/integration/test_resume.py's)
    with running_server(
        "--admin-token", TOKEN, "--num-tokenizers", "2", "--resume-timeout", "0"
    ) as s:
        yield s


@pytest.mark.parametrize("module", ["gpu_worker", "services.scheduler", "services.detokenizer"])
def test_killed_process_fails_in_flight_requests_fast_and_recovers(
    server: Server, module: str
) -> None:
    _wait_serving(server)
    load = _Load(server).start()
    wait_until(lambda: _requests_in(server, "decoding") == 7, 120, "7 requests decoding")
    pid = _pid_of(server, module)
    os.kill(pid, signal.SIGKILL)
    # 2000 tokens each: had they waited for the restart, they would end with 200, not 503
    load.join()
    assert len(load.results) == 7
    for kind, outcome in load.results:
        if kind == "plain":
            assert outcome == "503 retry-after=1", load.results
        else:
            assert outcome == "error 503", load.tail
    _wait_serving(server)
    assert _pid_of(server, module) != pid
    wait_until(lambda: _idle(server), 60, "every block free, nothing running")


def test_health_is_down_while_the_worker_restarts(server: Server) -> None:
    _wait_serving(server)
    os.kill(_pid_of(server, "gpu_worker"), signal.SIGKILL)
    seen: list[int] = []

    def down_then_up() -> bool:
        seen.append(httpx.get(server.url + "/health", timeout=10).status_code)
        return 503 in seen and seen[-1] == 200

    wait_until(down_then_up, 120, "/health to answer 503, then 200 again")
    _wait_serving(server)


def test_killed_tokenizer_is_restarted(server: Server) -> None:
    _wait_serving(server)
    before = _pids_of(server, "services.tokenizer")
    pid = min(before)
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: len(_pids_of(server, "services.tokenizer") - before) == 1,
        120,
        "a new tokenizer process",
    )
    _wait_serving(server)
    for _ in range(4):  # both tokenizer processes answer again (round robin)
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"model": server.model, "prompt": "Hi", "max_tokens": 2},
        )
        assert r.status_code == 200


def test_sigterm_drains_then_exits() -> None:
    """A stream in flight when SIGTERM arrives finishes whole; a new request meanwhile gets
    503 + Retry-After; then every process exits cleanly. The stream is long (300 tokens) and
    the signal is sent only once its first token arrived, so it is surely in flight."""
    with running_server("--shutdown-timeout", "60") as server:
        done: dict = {}
        started = threading.Event()

        def long_stream() -> None:
            text, usage = [], None
            with httpx.stream(
                "POST",
                server.url + "/v1/completions",
                timeout=180,
                json={
                    "model": server.model,
                    "prompt": "Count:",
                    "max_tokens": 300,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ) as r:
                done["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["text"])
                        started.set()
            done["usage"] = usage

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(120)
        server.proc.send_signal(signal.SIGTERM)

        def refused() -> httpx.Response | None:  # once the gateway has begun to drain
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=30,
                json={"model": server.model, "prompt": "New", "max_tokens": 2},
            )
            return r if r.status_code == 503 else None

        r = wait_until(refused, 60, "a new request to be refused")
        assert r.headers["retry-after"] == "1"
        t.join(180)
        assert done["status"] == 200
        assert done["usage"]["completion_tokens"] == 300
        assert server.proc.wait(60) == 0
