"""Control messages any actor may receive: health, readiness, shutdown, abort, stats."""

from __future__ import annotations

from typing import Any

from common.codec import message
from common.messages.types import ModelInfo


@message("ping")
class Ping:
    reply_to: str  # address of the asker's inbox
    nonce: int


@message("pong")
class Pong:
    name: str
    nonce: int


@message("ready")
class Ready:
    """Sent once by an actor when it can serve; `info` holds what it learned at start-up
    for the supervisor (its ports); a worker's `model` describes its model and KV pool."""

    name: str
    info: dict[str, Any]
    model: ModelInfo | None = None


@message("progress")
class Progress:
    """An actor's start-up stage, before its Ready, for the supervisor to print (a worker
    loading weights takes seconds that would otherwise pass in silence)."""

    name: str
    stage: str  # what it is doing now, in words ("loading weights from PATH")


@message("shutdown")
class Shutdown:
    reason: str = ""


@message("abort")
class Abort:
    """End these requests (cancel, client gone, stop string, timeout): one path for all."""

    request_ids: list[str]
    reason: int  # FinishReason
    seq_indices: list[int] | None = None  # [num_reqs] end only this sequence of each request
    # (n > 1: a stop string ends one sequence); None: every sequence of each request


@message("stats_query")
class StatsQuery:
    reply_to: str
    query_id: int
    what: str = "stats"  # "stats": counters; "requests": every live request, one row each


@message("stats")
class Stats:
    name: str
    query_id: int
    data: dict[str, Any]


@message("swap_model")
class SwapModel:
    """gateway -> scheduler: serve another model version (DESIGN §9)."""

    ticket: int
    reply_to: str
    path: str  # a Hugging Face folder, already checked against --model-root
    version: str = ""  # label; "" = a hash of the weight files
    mode: str = "overlap"  # overlap | drain


@message("swap_result")
class SwapResult:
    """scheduler -> gateway: how a swap ended."""

    ticket: int
    ok: bool
    version: str = ""
    previous_version: str = ""
    mode: str = ""
    duration_s: float = 0.0
    error: str = ""


@message("process_down")
class ProcessDown:
    """supervisor -> gateway, scheduler: a process died and is being restarted. Requests
    in flight through it fail with a retryable error (HTTP 503, gRPC UNAVAILABLE)."""

    name: str  # worker | scheduler | detokenizer | tokenizer-<i> | gateway
    exit_code: int


@message("reset")
class Reset:
    """A freshly started scheduler -> worker: drop every request and announce yourself
    (Ready) again, so the new scheduler can size its block pool."""

    reason: str = ""


@message("drain")
class Drain:
    """supervisor -> gateway (SIGTERM): refuse new requests (503), let in-flight ones
    finish for up to `timeout_s`, then answer Drained."""

    reply_to: str
    timeout_s: float


@message("drained")
class Drained:
    num_unfinished: int  # requests still in flight when the time ran out


@message("model_changed")
class ModelChanged:
    """scheduler -> every tokenizer, the detokenizer, the gateway: the model new requests are
    served by. The scheduler owns this fact and pushes it once the worker is ready and after
    every change (hot-swap, worker restart); nobody polls for it. Sent to the gateway before
    a swap's SwapResult, so the gateway names the new version when the swap call returns."""

    name: str  # the served model name (what /v1/models lists)
    version: str  # the weights version new requests start on
    path: str  # the model folder (its tokenizer files)
    tokenizer_fingerprint: str  # tokenizer_fingerprint(path)
    max_model_len: int
    vocab_size: int  # the model's embedding rows: token ids must be below it
    eos_token_ids: list[int]
