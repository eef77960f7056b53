"""Data parallelism at the gateway: the answers of every replica's scheduler, as one.

A stats query, a listing and a swap go to every replica (a fan-out); their answers are
gathered here. Stats add up (gauges and counters summed, KV usage over all blocks) and keep
each replica's own under `replicas`, which /metrics labels `replica="<i>"`; listed requests
are tagged with their replica; a swap succeeds when every replica's did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from common.messages import SwapResult

T = TypeVar("T")

_SUMMED = (
    "num_waiting",
    "num_running",
    "num_swapped",
    "num_total_blocks",
    "num_free_blocks",
    "num_cached_blocks",
    "num_used_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "kv_offload_host_blocks",
    "kv_offload_host_bytes",
    "kv_offload_disk_blocks",
    "kv_offload_disk_bytes",
    "kv_offload_host_hits",
    "kv_offload_disk_hits",
    "kv_offload_fetch_failures",
    "num_preemptions",
    "num_swaps",
    "num_steps",
    "num_computed_tokens",
    "num_steps_in_flight",
    "num_model_swaps",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)
# prefill/decode replicas (services/scheduler/handover.py): summed where replicas have roles
_HANDOVER_SUMMED = (
    "kv_handover_num_handed_over",
    "kv_handover_num_received",
    "kv_handover_num_refused",
    "kv_handover_bytes_sent",
    "kv_handover_bytes_received",
    "kv_handover_blocks_received",
    "kv_handover_blocks_hit",
    "kv_handover_blocks_failed",
    "kv_handover_prefill_queue_s",
    "kv_handover_prefill_s",
    "kv_handover_transfer_s",
    "kv_handover_num_exporting",
    "kv_handover_num_importing",
)


class Replies(Generic[T]):
    """Answers to one query sent to `expected` replicas, keyed by who answered."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.items: dict[str, T] = {}
        self.done = asyncio.Event()

    def add(self, key: str, item: T) -> None:
        self.items[key] = item
        if len(self.items) >= self.expected:
            self.done.set()


class PendingQueries:
    """Queries sent out and the answers coming back, by query id: `ask` sends one and waits
    for its `expected` answers (or `timeout`); `answer` files one that arrived."""

    def __init__(self) -> None:
        self._waiters: dict[int, Replies[dict[str, Any]]] = {}

    async def ask(
        self, qid: int, expected: int, send: Callable[[], None], timeout: float
    ) -> dict[str, dict[str, Any]]:
        """The answers by who gave them, those that came within `timeout`."""
        replies: Replies[dict[str, Any]] = Replies(expected)
        self._waiters[qid] = replies
        try:
            send()
            await asyncio.wait_for(replies.done.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.pop(qid, None)
        return replies.items

    def answer(self, qid: int, name: str, data: dict[str, Any]) -> None:
        replies = self._waiters.get(qid)
        if replies is not None:
            replies.add(name, data)


def replica_index(name: str) -> int:
    """`scheduler-3` -> 3 (`scheduler`, the only one: 0)."""
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0


def merge_stats(replies: dict[str, dict[str, Any]], num_replicas: int) -> dict[str, Any]:
    """One stats answer from every replica's (a replica that did not answer: not ready)."""
    per: list[dict[str, Any]] = [{"ready": False} for _ in range(num_replicas)]
    for name, data in replies.items():
        per[replica_index(name)] = data
    ready = [d for d in per if d.get("ready")]
    merged: dict[str, Any] = {key: sum(d.get(key, 0) for d in ready) for key in _SUMMED}
    if any("role" in d for d in ready):
        merged |= {key: sum(d.get(key, 0) for d in ready) for key in _HANDOVER_SUMMED}
    merged["ready"] = bool(ready)
    merged["kv_cache_usage"] = merged["num_used_blocks"] / max(1, merged["num_total_blocks"])
    drafts = merged["spec_num_draft_tokens"]
    merged["spec_acceptance_rate"] = merged["spec_num_accepted_tokens"] / max(1, drafts)
    merged["spec_mean_accepted_length"] = 1 + merged["spec_num_accepted_tokens"] / max(
        1, merged["spec_num_drafts"]
    )
    merged["request_ids"] = sorted({rid for d in ready for rid in d.get("request_ids", [])})
    if ready:
        first = ready[0]
        merged["version"] = first.get("version")
        merged["model"] = first.get("model")
        merged["kv_cache_dtype"] = first.get("kv_cache_dtype")
        merged["block_size"] = first.get("block_size")
        merged["swap"] = next((d["swap"] for d in ready if d.get("swap")), None)
    merged["lora_adapters"] = _merge_loras(ready)
    merged["replicas"] = [{"replica": i, **d} for i, d in enumerate(per)]
    return merged


def _merge_loras(ready: list[dict[str, Any]]) -> dict[str, Any]:
    """Per LoRA adapter: its counts summed over the replicas, the rest from the first."""
    merged: dict[str, dict[str, Any]] = {}
    for d in ready:
        for name, row in d.get("lora_adapters", {}).items():
            if name not in merged:
                merged[name] = dict(row)
                continue
            for key in ("num_requests", "num_live_requests", "num_cached_blocks"):
                merged[name][key] = merged[name].get(key, 0) + row.get(key, 0)
    return merged


def merge_request_rows(replies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every replica's live requests, each row tagged with its replica, oldest first."""
    rows = [
        {**row, "replica": replica_index(name)}
        for name, data in replies.items()
        for row in data.get("requests", [])
    ]
    rows.sort(key=lambda r: (r.get("arrival_time", 0.0), r["replica"], r.get("index", 0)))
    return {"requests": rows}


def merge_swap_results(results: list[SwapResult], num_replicas: int) -> SwapResult:
    """One swap outcome: ok when every replica swapped."""
    first = results[0]
    errors = [r.error for r in results if not r.ok]
    if len(results) < num_replicas:
        errors.append(f"{num_replicas - len(results)} replica(s) did not answer")
    return SwapResult(
        ticket=first.ticket,
        ok=not errors,
        version=next((r.version for r in results if r.ok), first.version),
        previous_version=first.previous_version,
        mode=first.mode,
        duration_s=max(r.duration_s for r in results),
        error="; ".join(e for e in errors if e),
    )
