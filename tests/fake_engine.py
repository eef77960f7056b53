"""One scripted engine for the gateway's unit tests (HTTP, gRPC, admin routes, /metrics): the
whole `EngineClient` protocol (services/gateway/engine/client.py) in process, no sockets.

mypy (`make lint`) checks this file, so the fake cannot drift from the protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from common.messages import FinishReason, GenerateRequest, LoraAdapterResult, SwapResult
from services.gateway.engine.client import OutputDelta, RequestObserver
from services.gateway.openai.logprobs import TokenLogprob

if TYPE_CHECKING:
    from services.gateway.engine.client import EngineClient

MODEL = "test-model"
HANG = "hang"  # script step: wait until cancelled


def delta(
    text: str,
    finish: FinishReason = FinishReason.NONE,
    n: int = 1,
    index: int = 0,
    last: bool | None = None,
) -> OutputDelta:
    """Sequence `index`'s delta, its n-th token; `last` defaults to n = 1's rule (finished)."""
    last = finish != FinishReason.NONE if last is None else last
    return OutputDelta(text, [7] * n, finish, 5, n, last=last, index=index)


def pooled_delta(request: GenerateRequest) -> OutputDelta:
    """An embeddings request's answer: [number of prompt words or ids, 3, 4, 0] (norm 5 + ...)
    with the prompt counted as that many tokens."""
    num = len((request.prompt or "").split()) or len(request.prompt_token_ids or [])
    return OutputDelta(
        "", [], FinishReason.STOP, num, 0, last=True, embedding=[float(num), 3.0, 4.0, 0.0]
    )


class FakeEngine:
    """`generate` yields a script of deltas (default: the prompt's words echoed back, then
    STOP), or the request id's own script in `scripts`; a script step may be an exception to
    raise, HANG, or a float to sleep. `stats`
    answers `stats_answer` (None: it times out, as a silent scheduler does); `swap_model`
    answers `swap_result`, or a successful swap to its version.

    `observer` is held, never called: the request timers are tested on their own
    (test_metrics.py) and inside the real client (test_zmq_client.py)."""

    def __init__(
        self,
        script: list[Any] | None = None,
        *,
        stats: dict[str, Any] | None = None,
        swap_result: SwapResult | None = None,
    ) -> None:
        self.script = script
        self.scripts: dict[str, list[Any]] = {}  # request id -> its own script (a batch's)
        self.model_name = MODEL
        self.aliases: list[str] = []  # more names the model answers to
        self.system_fingerprint = "v-test"
        self.max_model_len = 256
        self.eos_token_ids = [0]
        self.swap_status: dict[str, Any] | None = None
        self.observer: Callable[[GenerateRequest], RequestObserver] | None = None
        self.ready = True
        self.draining = False  # (is_ready answers `ready` alone: set both to drain)
        self.stats_answer = stats
        self.swap_result = swap_result
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.swaps: list[tuple[str, str, str]] = []  # (path, version, mode) asked for
        # tokenize() calls: (prompt, messages, add_special_tokens, add_generation_prompt)
        self.tokenized: list[tuple[Any, ...]] = []
        # and the chat_template, chat_template_kwargs of each
        self.tokenize_templates: list[tuple[str | None, dict[str, Any] | None]] = []
        self.tokenize_failure: Exception | None = None  # raised by (de)tokenize when set
        self.started = asyncio.Event()
        self._in_flight: set[str] = set()
        # LoRA: adapters served (name -> folder); load_lora answers `lora_refusal` when set
        self.lora_enabled = False
        self.lora_adapters: dict[str, str] = {}
        self.lora_refusal: LoraAdapterResult | None = None

    @property
    def model_names(self) -> list[str]:
        return [self.model_name, *self.aliases] if self.model_name else []

    def is_ready(self) -> bool:
        return self.ready

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[OutputDelta, None]:
        self.requests.append(request)
        self._in_flight.add(request.request_id)
        self.started.set()
        finished = False
        try:
            script = self.scripts.get(request.request_id, self.script)
            for step in script if script is not None else self._echo(request):
                if isinstance(step, Exception):
                    raise step
                if step == HANG:
                    await asyncio.Event().wait()
                elif isinstance(step, float):
                    await asyncio.sleep(step)  # a scripted quiet spell: under test
                else:
                    finished = step.last
                    yield step
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:  # closed before the end: the real client sends an Abort
                self.aborted.append(request.request_id)
            raise
        finally:
            self._in_flight.discard(request.request_id)

    def _echo(self, request: GenerateRequest) -> list[OutputDelta]:
        if request.sampling.pooling:  # embeddings: one final delta with the vector
            return [pooled_delta(request)]
        if request.messages:
            words = request.messages[-1]["content"].split()
        else:
            words = (request.prompt or "").split() or list(map(str, request.prompt_token_ids or []))
        steps = [delta(" " + w, n=i + 1) for i, w in enumerate(words)]
        steps = [*steps[:-1], delta(steps[-1].text, FinishReason.STOP, len(words))]
        k = request.sampling.logprobs
        if k is None:
            return steps
        # asked for logprobs: each token's top k are ids 100, 101, ... at -1, -2, ...
        top = [(100 + j, f"<{100 + j}>", -1.0 - j) for j in range(k)]
        return [
            dataclasses.replace(s, logprobs=[TokenLogprob(7, " ", -1.0, top) for _ in s.token_ids])
            for s in steps
        ]

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._in_flight

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def cancel(self, request_id: str) -> bool:
        held = self.is_in_flight(request_id)
        await self.abort(request_id)
        return held

    async def peer_requests(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        return []

    async def stats(self, timeout: float = 5.0, what: str = "stats") -> dict[str, Any]:
        if self.stats_answer is None:
            raise TimeoutError
        return self.stats_answer

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        timeout: float = 10.0,
    ) -> list[int]:
        """Characters as token ids: the prompt's, or the messages' contents joined by
        newlines; special tokens and the generation prompt as ids 1 and 2."""
        self.tokenized.append((prompt, messages, add_special_tokens, add_generation_prompt))
        self.tokenize_templates.append((chat_template, chat_template_kwargs))
        if self.tokenize_failure is not None:
            raise self.tokenize_failure
        text = prompt if messages is None else "\n".join(m["content"] for m in messages)
        ids = [ord(c) for c in text or ""]
        if messages is not None and add_generation_prompt:
            ids.append(2)
        return [1, *ids] if add_special_tokens else ids

    async def detokenize(self, token_ids: list[int], timeout: float = 10.0) -> str:
        if self.tokenize_failure is not None:
            raise self.tokenize_failure
        return "".join(chr(t) for t in token_ids)

    async def swap_model(
        self, path: str, version: str, mode: str, timeout: float = 600.0
    ) -> SwapResult:
        self.swaps.append((path, version, mode))
        if self.swap_result is not None:
            return self.swap_result
        previous, self.system_fingerprint = self.system_fingerprint, version or "v-swapped"
        return SwapResult(
            ticket=len(self.swaps),
            ok=True,
            version=self.system_fingerprint,
            previous_version=previous,
            mode=mode,
            duration_s=0.01,
        )

    async def load_lora(self, name: str, path: str, timeout: float = 600.0) -> LoraAdapterResult:
        if self.lora_refusal is not None:
            return self.lora_refusal
        if name in self.lora_adapters:
            return LoraAdapterResult(0, name, 400, f"lora_name: '{name}' has already been loaded")
        self.lora_adapters[name] = path
        return LoraAdapterResult(0, name, 200, weights_hash="h", rank=8)

    async def unload_lora(self, name: str, timeout: float = 600.0) -> LoraAdapterResult:
        if self.lora_adapters.pop(name, None) is None:
            return LoraAdapterResult(0, name, 404, f"lora_name: '{name}' cannot be found")
        return LoraAdapterResult(0, name, 200)


if TYPE_CHECKING:  # the check `make lint` runs: the fake is a whole EngineClient
    _conforms: type[EngineClient] = FakeEngine
