"""scheduler -> router (data parallelism): what a replica holds in its prefix cache, its load."""

from __future__ import annotations

import dataclasses

from common.codec import message


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
