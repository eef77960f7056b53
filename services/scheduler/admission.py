"""Admission: the blocks a waiting request starts with when the policy starts it.

A new request takes its prefix-cache hits and needs room for its whole prompt beside the
watermark; a swapped-out one copies its blocks back in; a fork (`n > 1`) shares its
leader's prompt blocks once the leader has computed them. Each answers the tokens the
request computes this step, or 0 when it cannot start now (policy.py stops there).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.model_facts import lora_root, salted_root
from common.prefix_hash import block_hash, num_matchable_blocks
from services.scheduler.grouped_blocks import NO_HITS, GroupedBlockManager
from services.scheduler.kv_tiers import DISK, FETCHING, HOST
from services.scheduler.request import Request, Status
from services.scheduler.step_output import SchedulerOutput

if TYPE_CHECKING:
    from services.scheduler.policy import SchedulingPolicy


def admit(policy: SchedulingPolicy, req: Request, budget: int, out: SchedulerOutput) -> int:
    """Give req the blocks it starts with (prefix hits, a fork, swapped-in copies);
    return the tokens it computes this step, or 0 if it cannot start now."""
    if req.fork_of is not None:
        return _admit_fork(policy, req, budget)
    if req.is_swapped:
        return _admit_swapped(policy, req, budget, out)
    bm, rid = policy.blocks, req.request_id
    # a request that starts now runs on the version served now, hashed under its root
    root = req.cache_root if req.version is not None or policy.root is None else policy.root
    if req.version is None and policy.root is not None:  # (vLLM's cache_salt, the adapter)
        root = lora_root(salted_root(root, req.cache_salt), req.lora_name, req.lora_hash)
    # prompt logprobs need the logits of every prompt position, mean pooling (embeddings)
    # its hidden state: no prefix hits (vLLM disables prefix caching for such requests)
    every_position = req.sampling.prompt_logprobs is not None or req.sampling.pooling == "mean"
    if isinstance(bm, GroupedBlockManager):
        return _admit_grouped(policy, bm, req, root, every_position, budget)
    hits = [] if every_position else bm.match_prefix(root, req.all_token_ids)
    loaded = [] if every_position else _tier_hits(policy, req, root, hits)
    if loaded is None:
        return 0  # its prefix is being read up from disk: planned once it is in memory
    cached = (len(hits) + len(loaded)) * bm.block_size
    # a handed-over sequence's partial last prompt block, imported (handover.py): it ends
    # the table when the hits end where it starts, else it goes and its tokens are computed
    tail = bm.tail_of(rid)
    if tail is not None and cached + tail[1] != req.num_prompt_tokens:
        bm.free_tail(rid)
        tail = None
    held = len(hits) + (tail is not None)  # (blocks it starts with that are not new)
    cached += tail[1] if tail is not None else 0
    take = bm.num_hit_blocks_to_take(hits)
    n = min(req.num_tokens - cached, budget)
    whole = bm.num_blocks_for(req.num_tokens) - held + take
    chunk = bm.num_blocks_for(cached + n) - held + take
    if n <= 0 or not _fits(policy, whole, chunk):
        return 0
    if req.version is None:
        req.version, req.cache_root = policy.version, root
        req.started_at = time.time()
    bm.take_prefix(rid, req.cache_root, hits, req.num_prompt_tokens)
    if loaded:
        assert policy.tiers is not None
        for (key, _), block in zip(loaded, bm.take_loaded(rid, loaded), strict=True):
            policy.tiers.load(key, block)
    if tail is not None:
        bm.take_tail(rid)
    req.num_computed_tokens = req.num_cached_tokens = cached
    return n


def _admit_grouped(
    policy: SchedulingPolicy,
    bm: GroupedBlockManager,
    req: Request,
    root: int,
    every_position: bool,
    budget: int,
) -> int:
    """admit() with layer groups (no lower tiers: refused for them): the prefix hit every
    group serves; a sliding group needs blocks for its window only, so the whole prompt
    counts what its last chunk reads."""
    hits = NO_HITS if every_position else bm.match_prefix(root, req.all_token_ids)
    cached = bm.hit_tokens(hits)
    n = min(req.num_tokens - cached, budget)
    whole = bm.start_need(hits, max(cached, req.num_tokens - n), req.num_tokens)
    chunk = bm.start_need(hits, cached, cached + n)
    if n <= 0 or not _fits(policy, whole, chunk):
        return 0
    if req.version is None:
        req.version, req.cache_root = policy.version, root
    bm.take_prefix(req.request_id, req.cache_root, hits, req.num_prompt_tokens)
    req.num_computed_tokens = req.num_cached_tokens = cached
    return n


def _tier_hits(
    policy: SchedulingPolicy, req: Request, root: int, hits: list[int]
) -> list[tuple[int, tuple[int, ...]]] | None:
    """The prefix blocks after the device's hits that host memory holds ((key, tokens) each,
    in order), or None when the request must wait: its prefix goes on on disk and is read
    up now (once per request: what a failed or crowded-out read leaves is recomputed)."""
    tiers, bm = policy.tiers, policy.blocks
    if tiers is None or not tiers.enabled or isinstance(bm, GroupedBlockManager):
        return []
    tokens, bs = req.all_token_ids, bm.block_size
    parent, run = bm.hash_after(root, hits), []
    for i in range(len(hits), num_matchable_blocks(len(tokens), bs)):
        block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
        parent = block_hash(parent, block_tokens)
        where = tiers.where(parent, block_tokens)
        if where is None:
            break
        run.append((parent, block_tokens, where))
    if any(where == FETCHING for _, _, where in run):
        return None
    if not req.tier_read_up and any(where == DISK for _, _, where in run):
        req.tier_read_up = True
        for key, _, _ in reversed(run):  # (the head newest)
            tiers.pin(key)
        fetched = 0
        for key, block_tokens, where in run:
            if where == DISK:
                if tiers.where(key, block_tokens) != DISK or not tiers.fetch(key, block_tokens):
                    break  # (no room left for it: what is read so far serves)
                fetched += 1
        if fetched:
            return None
    loaded = []
    for key, block_tokens, where in run:
        if where != HOST:
            break
        loaded.append((key, block_tokens))
    return loaded


def _admit_swapped(
    policy: SchedulingPolicy, req: Request, budget: int, out: SchedulerOutput
) -> int:
    n = min(req.num_tokens - req.num_computed_tokens, budget)
    bm = policy.blocks
    if isinstance(bm, GroupedBlockManager):  # each group's blocks where they were
        assert req.host_layout is not None and req.host_blocks is not None
        start = req.num_computed_tokens
        want = bm.num_blocks_for(start + n)
        need = len(req.host_blocks) + sum(max(0, want - len(t)) for t in req.host_layout)
        if n <= 0 or not _fits(policy, need, need):
            return 0
        gpu = bm.allocate_layout(req.request_id, req.host_layout)
        req.host_layout = None
    else:
        need = bm.num_blocks_for(req.num_computed_tokens + n)
        if n <= 0 or not _fits(policy, need, need):
            return 0
        gpu = bm.allocate(req.request_id, req.num_computed_tokens)
    assert req.host_blocks is not None and len(gpu) == len(req.host_blocks)
    out.swap_in.extend(zip(req.host_blocks, gpu, strict=True))
    policy.host_pool.free(req.host_blocks)
    req.host_blocks = None
    return n


def _fits(policy: SchedulingPolicy, whole: int, chunk: int) -> bool:
    """Admit when the whole prompt fits beside the watermark; on an idle server, when
    the first chunk fits (so a prompt as large as the pool is never stuck)."""
    return policy.blocks.can_allocate(whole, reserve=policy.num_watermark_blocks) or (
        not policy.running and policy.blocks.can_allocate(chunk)
    )


def _admit_fork(policy: SchedulingPolicy, req: Request, budget: int) -> int:
    """n > 1: share the leader's prompt blocks once it has computed all but the last
    prompt token; each sequence computes that token itself and samples its own."""
    leader, bm = req.fork_of, policy.blocks
    assert leader is not None
    k = req.num_prompt_tokens - 1
    if leader.is_finished or leader.is_swapped or leader.status == Status.WAITING or k == 0:
        req.fork_of = None  # the leader cannot share now (never waits behind it): alone
        return admit(policy, req, budget, SchedulerOutput())
    # KV copies run before a step computes, so only KV of earlier steps may be shared
    ready = (
        leader.computed_before_step
        if leader.scheduled_in == policy.num_schedules
        else leader.num_computed_tokens
    )
    if leader.status != Status.RUNNING or ready < k:
        return 0  # wait for the leader's prefill
    if isinstance(bm, GroupedBlockManager) and not bm.can_fork(leader.request_id, k):
        req.fork_of = None  # a sliding group let go of blocks the fork reads: alone
        return admit(policy, req, budget, SchedulerOutput())
    need = bm.fork_need(k, req.num_tokens)
    if not _fits(policy, need, need):
        return 0
    bm.fork(leader.request_id, req.request_id, k)
    req.version, req.cache_root = leader.version, leader.cache_root
    req.num_computed_tokens = req.num_cached_tokens = k
    req.fork_of = None
    return min(req.num_tokens - k, budget)
