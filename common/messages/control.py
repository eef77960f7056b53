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
    """gateway -> scheduler: serve another model version (hot swap)."""

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
    """supervisor -> gateway, scheduler (the router, the detokenizer: see
    services/launch.py's _told_of_death): a process died and is being restarted. Requests in
    flight through it are resumed once it is back (services/gateway/engine/resume.py), or
    fail with a retryable error (HTTP 503, gRPC UNAVAILABLE)."""

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
    name: str = ""  # the gateway process that drained (gateway-1)


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


@message("load_lora_adapter")
class LoadLoraAdapter:
    """gateway -> scheduler: serve the PEFT adapter in `path` under `name` (POST
    /v1/load_lora_adapter); answered by LoraAdapterResult."""

    ticket: int
    reply_to: str
    name: str
    path: str  # already checked against --model-root
    base_model_name: str = ""  # "": any served model; else refused when it is not this one


@message("unload_lora_adapter")
class UnloadLoraAdapter:
    """gateway -> scheduler: stop serving adapter `name` (POST /v1/unload_lora_adapter).
    New requests for it are refused at once (404); running ones finish first."""

    ticket: int
    reply_to: str
    name: str


@message("lora_adapter_result")
class LoraAdapterResult:
    """scheduler -> gateway: how a load or an unload ended. `status` is the HTTP status the
    gateway answers with (200; 400 a refused adapter, naming its file and field; 404 an
    unknown name; 409 a name already loaded or being loaded)."""

    ticket: int
    name: str
    status: int
    error: str = ""
    weights_hash: str = ""
    rank: int = 0


@message("loras_changed")
class LorasChanged:
    """scheduler -> gateway: the adapters this replica serves now (after a load, an unload,
    a hot swap that dropped some, a worker restart). The scheduler owns the fact."""

    replica: int  # the sender's replica index (data parallelism; 0 alone)
    names: list[str]  # [num_adapters]
    paths: list[str]  # [num_adapters] each adapter's folder (/v1/models' `root`)
