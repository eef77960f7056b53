"""scheduler -> router (data parallelism): what a replica holds in its prefix cache, its load."""

from __future__ import annotations

import dataclasses

from common.codec import message
from common.messages.types import SamplingParams


@message("replica_notice")
class ReplicaNotice:
    """Sent by a replica's scheduler after a step that changed what it tells (and when it
    becomes ready or loses its worker). Hashes are deltas since the previous notice unless
    `reset` is set: then the router forgets everything this replica told it before (a new
    block pool: a worker restart, a swap that rebuilt the pool, a new scheduler)."""

    replica: int  # the replica's index
    is_ready: bool  # has a worker and serves; False: route around it
    cache_root: int  # root of the hash chain new requests start on (the served version)
    block_size: int
    tokenizer_fingerprint: str  # of the served model: requests tokenised by it start at once
    cached_hashes: list[int] = dataclasses.field(default_factory=list)  # [*] blocks cached
    evicted_hashes: list[int] = dataclasses.field(default_factory=list)  # [*] blocks evicted
    ended_request_ids: list[str] = dataclasses.field(default_factory=list)  # [*] requests it
    # no longer holds (finished, failed, rejected or sent back to be tokenised again)
    reset: bool = False
    # the LoRA adapters it serves now, all of them, with their weights hashes (they enter
    # the adapter's cache root); None when unchanged since the previous notice
    lora_names: list[str] | None = None  # [num_adapters]
    lora_hashes: list[str] | None = None  # [num_adapters]


@message("kv_handover")
class KvHandover:
    """prefill scheduler -> router -> decode scheduler: one sequence whose prompt a prefill
    replica computed and whose first token it sampled (and streamed), to be continued by a
    decode replica the router picks by load. Its full blocks travel as the prefix cache's
    files (gpu_worker/kv_handover.py): in `transfer_dir` (shm) or in `block_data` (tcp); the
    decode side imports those whose key its own chain gives, registers them in its prefix
    cache, and runs the sequence as a resumed one (its outputs known, the tail recomputed)."""

    request_id: str  # the wire id (the detokenizer and gateway know it already)
    seq_index: int
    prompt_token_ids: list[int]  # [num_prompt]
    output_token_ids: list[int]  # [num_out] sampled so far (streamed already)
    sampling: SamplingParams  # the sequence's own (its seed offset), prompt logprobs done
    eos_token_ids: list[int]
    arrival_time: float
    priority: int
    timeout: float | None
    tokenizer_fingerprint: str
    cache_salt: str
    version: str  # the model version whose weights computed the KV
    cache_root: int  # the chain's root (version, salt, adapter): the decode side's must be equal
    block_keys: list[int]  # [num_blocks] chain hash of each full block, in order
    block_tokens: list[list[int]]  # [num_blocks][block_size]
    # the LoRA adapter that computed the KV ("": the base model) and its weights hash: the
    # decode replica continues it only with the same adapter, of the same weights
    lora_name: str = ""
    lora_hash: str = ""
    transfer_dir: str = ""  # shm: the folder holding the blocks' files
    block_data: list[str] = dataclasses.field(default_factory=list)  # [num_blocks] tcp: base64
    num_bytes: int = 0  # the blocks' bytes, as moved
    prefill_queue_s: float = 0.0  # TTFT's parts on the prefill replica: waiting to start,
    prefill_s: float = 0.0  # computing the prompt and sampling the first token,
    export_s: float = 0.0  # and writing the blocks out
    sent_at: float = 0.0  # wall clock when the prefill scheduler sent it
