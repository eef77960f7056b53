"""What the admin API shows of an EngineCore: one row per live sequence, and its counters
(GET /admin/requests, GET /admin/stats; /metrics reads the counters)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from services.scheduler.engine_core import EngineCore
from services.scheduler.grouped_blocks import GroupedBlockManager
from services.scheduler.request import Request, Status


def request_rows(core: EngineCore) -> dict[str, Any]:
    """GET /admin/requests: id, state, tokens so far, age of every live sequence."""
    if core.policy is None:
        return {"requests": []}
    now = time.time()
    rows = [
        {
            "id": r.group_id,
            "index": r.seq_index,
            "state": _state_name(r),
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": len(r.output_token_ids),
            "num_computed_tokens": r.num_computed_tokens,
            "num_cached_tokens": r.num_cached_tokens,
            "num_blocks": len(core.policy.blocks.block_tables.get(r.request_id, ())),
            "priority": r.priority,
            "age_s": round(now - r.arrival_time, 3),
            "arrival_time": r.arrival_time,
            "version": r.version or "",
            "lora_name": r.lora_name,
        }
        for r in sorted(core.policy.requests.values(), key=lambda r: r.arrival_seq)
    ]
    return {"requests": rows}


def stats(core: EngineCore) -> dict[str, Any]:
    p = core.policy
    if p is None or core.served is None:
        return {"ready": False}
    b = p.blocks
    return {
        "ready": True,
        "num_waiting": p.num_waiting,
        "num_running": p.num_running,
        "num_swapped": sum(1 for r in p.waiting if r.is_swapped),
        "num_total_blocks": b.num_blocks,
        "block_size": b.block_size,
        "kv_cache_dtype": core.served.info.kv_cache_dtype,
        "num_free_blocks": b.num_free_blocks,
        "num_cached_blocks": b.num_cached_blocks,
        "num_used_blocks": b.num_used_blocks,
        "kv_cache_usage": b.usage,
        "prefix_cache_queries": b.num_cached_queries,
        "prefix_cache_hits": b.num_cached_hits,
        # KV layer groups (sliding windows): per group its window and blocks; [] if dense
        "kv_groups": b.num_blocks_by_group() if isinstance(b, GroupedBlockManager) else [],
        "kv_released_blocks": b.num_released if isinstance(b, GroupedBlockManager) else 0,
        # the prefix cache's lower tiers (kv_offload_*: blocks, bytes and hits per tier)
        **_tier_stats(core),
        # prefill/decode replicas: this replica's part and its hand-overs (kv_handover_*)
        **_handover_stats(core),
        "num_preemptions": p.num_preemptions,
        "num_swaps": p.num_swaps,
        "num_steps": core.window.num_steps,
        "num_computed_tokens": p.num_computed_tokens_total,
        "mean_step_s": core.window.step_time_s / max(1, core.window.num_steps),
        "mean_worker_s": core.window.worker_time_s / max(1, core.window.num_steps),
        "num_steps_in_flight": len(core.window.in_flight),
        "version": p.version,
        "swap": core.swaps.status(),
        "num_model_swaps": core.swaps.num_swaps,
        "mean_step_interval_s": core.window.interval_s / max(1, core.window.num_intervals),
        "mean_step_forward_s": core.window.interval_forward_s / max(1, core.window.num_intervals),
        "spec_num_drafts": p.num_spec_rounds,
        "spec_num_draft_tokens": p.num_draft_tokens,
        "spec_num_accepted_tokens": p.num_accepted_tokens,
        "spec_acceptance_rate": p.num_accepted_tokens / max(1, p.num_draft_tokens),
        # tokens per verification round: the accepted drafts plus the token every step
        # yields (vLLM's "mean acceptance length")
        "spec_mean_accepted_length": 1 + p.num_accepted_tokens / max(1, p.num_spec_rounds),
        "model_weight_bytes": core.served.info.weight_bytes,
        # a mixture of experts: (token, expert) pairs each expert has computed, summed over
        # its layers (routing skew); [] for a dense model
        "moe_expert_tokens": list(core.window.expert_tokens),
        "request_ids": sorted(core.groups),
        "model": {**dataclasses.asdict(core.served.info), "model_name": core.served.name},
        # per LoRA adapter: state, rank, hash, requests accepted and live, cached blocks
        "lora_adapters": core.loras.stats(core.num_live_by_lora(), b.num_hashed_by_owner()),
    }


def _tier_stats(core: EngineCore) -> dict[str, int]:
    tiers, served = core.policy.tiers if core.policy else None, core.served
    if tiers is None or served is None:
        return {}
    return {f"kv_offload_{k}": v for k, v in tiers.stats(served.info.tier_block_bytes).items()}


def _state_name(r: Request) -> str:
    """waiting | prefill | decoding | preempted | swapped"""
    if r.is_swapped:
        return "swapped"
    if r.status == Status.WAITING:
        return "preempted" if r.num_preemptions else "waiting"
    return "prefill" if r.num_computed_tokens < r.num_prompt_tokens else "decoding"


def _handover_stats(core: EngineCore) -> dict[str, Any]:
    """The hand-over's counters (services/scheduler/handover.py); none on a `both` replica."""
    h = core.handover
    if h is None:
        return {}
    counters = {f"kv_handover_{k}": v for k, v in dataclasses.asdict(h.stats).items()}
    in_flight = {
        "kv_handover_num_exporting": h.num_exporting,
        "kv_handover_num_importing": h.num_importing,
    }
    return {"role": h.role} | counters | in_flight
