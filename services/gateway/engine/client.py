"""The gateway's view of the engine: submit a request, stream its outputs, abort it; the
served model, the scheduler's counters, a hot-swap.

`ZmqEngineClient` (services/gateway/engine/zmq_client.py) is the real one; the HTTP and gRPC
front ends, the admin routes and /metrics see only this interface (the fake in
tests/fake_engine.py implements all of it too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from common.messages import FinishReason, GenerateRequest, LoraAdapterResult, SwapResult


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's entry: the token, its logprob (None for the prompt's first token, which
    nothing precedes), and the top k (id, text, logprob), best first."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]]
    rank: int | None = None  # the token's rank (1 = most likely), where the engine gave it


def entries(
    ids: list[list[int]],
    values: list[list[float]],
    texts: list[list[str]],
    ranks: list[int] | None = None,
) -> list[TokenLogprob]:
    """Entries from the engine's lists ([token, top 1..k] per token, and each token's rank
    where given: 0 for none); [] where a token has none (its request did not ask)."""
    out = []
    for j, (token_ids, lps, tokens) in enumerate(zip(ids, values, texts, strict=True)):
        if not token_ids:
            return []
        top = list(zip(token_ids[1:], tokens[1:], lps[1:], strict=True))
        rank = ranks[j] or None if ranks else None
        out.append(TokenLogprob(token_ids[0], tokens[0], lps[0] if lps else None, top, rank))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class OutputDelta:
    """What one sequence of a request produced since its previous delta.

    A request with `n` > 1 streams the deltas of its n sequences interleaved, told apart by
    `index`; each sequence finishes once (its own `finish_reason`), and `last` marks the delta
    after which the request has nothing more to say (every sequence finished). For n = 1,
    `last` is simply `finish_reason != NONE`.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason  # NONE while this sequence runs
    num_prompt_tokens: int
    num_output_tokens: int  # of this sequence, so far
    last: bool  # the request's final delta: every sequence has finished
    index: int = 0  # which sequence, 0..n-1
    version: str = ""  # the model version serving it ("" until the scheduler says)
    # one entry per token of `token_ids` when the request asked for logprobs, else []
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    # every prompt token's entry (prompt_logprobs), in the sequence's first delta only
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    # vLLM's stop_reason, with the finish: the stop string or stop token id that ended it
    stop_reason: str | int | None = None
    # an embeddings request's pooled vector (SamplingParams.pooling), with its finish; else []
    embedding: list[float] = dataclasses.field(default_factory=list)
    # prompt tokens the prefix cache served (OpenAI's usage.prompt_tokens_details.cached_tokens):
    # as counted at the sequence's first prefill (a preempted or resumed sequence keeps it)
    num_cached_tokens: int = 0


class RequestFailed(Exception):
    """The engine refused or failed a request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def naming_prompt(self, field: str) -> RequestFailed:
        """This refusal with the prompt named `field`, the endpoint's name for it: the
        tokenizer and the scheduler call any request's prompt `prompt`, but a chat request
        sent `messages`."""
        if self.param != "prompt" or field == "prompt":
            return self
        message = (
            field + self.message[len("prompt") :]
            if self.message.startswith("prompt:")
            else self.message
        )
        return RequestFailed(self.status, message, field)


class RequestObserver(Protocol):
    """Watches one request's deltas (services/gateway/http/metrics.py's RequestTimer)."""

    def delta(self, delta: OutputDelta) -> None: ...

    def failed(self, status: int) -> None: ...

    def end(self) -> None:
        """The engine client is done with the request (after its last delta, a failure, or
        the caller closing the stream early)."""
        ...


class EngineClient(Protocol):
    """Everything the HTTP app, the gRPC servicers, the admin routes and /metrics use."""

    @property
    def model_name(self) -> str:
        """The served model's name (what responses report); "" while nothing is served."""
        ...

    @property
    def model_names(self) -> list[str]:
        """Every name the served model answers to (--served-model-name aliases), with
        `model_name` first; what /v1/models lists. Empty while nothing is served."""
        ...

    @property
    def system_fingerprint(self) -> str:
        """The served weights version."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def lora_enabled(self) -> bool:
        """--enable-lora: adapters may be served, loaded and unloaded."""
        ...

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters served, name -> folder, sorted by name: a request's `model` may
        name one; /v1/models lists them."""
        ...

    async def load_lora(self, name: str, path: str, timeout: float = 600.0) -> LoraAdapterResult:
        """Serve the PEFT adapter folder `path` under `name` (every replica); the outcome."""
        ...

    async def unload_lora(self, name: str, timeout: float = 600.0) -> LoraAdapterResult:
        """Stop serving `name`: refused at once for new requests, gone once the running
        ones finished; the outcome (404: no such adapter)."""
        ...

    @property
    def eos_token_ids(self) -> list[int]:
        """The served model's end-of-sequence ids (beam search ends beams on them)."""
        ...

    @property
    def swap_status(self) -> dict[str, Any] | None:
        """The hot-swap in progress (what /v1/models shows), or None."""
        ...

    # Called with each request on arrival; what it returns watches that request's deltas.
    observer: Callable[[GenerateRequest], RequestObserver] | None
    # shutting down: in-flight requests finish, new ones are refused (503, saying so)
    draining: bool

    def is_ready(self) -> bool:
        """A model is served and new requests are taken (not starting, not draining)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncGenerator[OutputDelta, None]:
        """Stream deltas until the one marked `last`. Raises RequestFailed.

        Closing the generator early (`aclose()`: client gone) aborts the request in the engine.
        """
        ...

    def is_in_flight(self, request_id: str) -> bool: ...

    async def abort(self, request_id: str) -> None:
        """End a request's sequences in the engine; idempotent (an unknown id is no error)."""
        ...

    async def cancel(self, request_id: str) -> bool:
        """End a request by its client's id, whichever gateway process holds it (idempotent):
        whether one held it."""
        ...

    async def peer_requests(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        """The other gateway processes' live requests (services/gateway/engine/live_requests.py
        rows, each with `gateway`: who holds it); none with one gateway process."""
        ...

    async def stats(self, timeout: float = 5.0, what: str = "stats") -> dict[str, Any]:
        """The scheduler's counters (`what="requests"`: its live requests, one row each).
        Raises TimeoutError when it does not answer within `timeout`."""
        ...

    async def swap_model(
        self, path: str, version: str, mode: str, timeout: float = 600.0
    ) -> SwapResult:
        """Serve the model in folder `path` (mode "overlap" or "drain"); the outcome."""
        ...

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
        """The served model's token ids of `prompt` or of chat `messages` (rendered by
        `chat_template`, else the server's, else the model's, with `chat_template_kwargs` and
        `tools`),
        as a tokenizer process makes them (POST /tokenize). Raises RequestFailed when
        refused, TimeoutError when no tokenizer answers."""
        ...

    async def detokenize(self, token_ids: list[int], timeout: float = 10.0) -> str:
        """The text of `token_ids` (POST /detokenize); raises as `tokenize` does."""
        ...
