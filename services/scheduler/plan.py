"""SchedulerOutput -> StepPlan: the diff the worker applies (pure, no sockets)."""

from __future__ import annotations

from common.messages import StepPlan
from services.scheduler.handover import Moves
from services.scheduler.step_output import SchedulerOutput

_NO_MOVES = Moves()


def to_plan(step_id: int, out: SchedulerOutput, moves: Moves | None = None) -> StepPlan:
    t, h = out.tiers, moves or _NO_MOVES
    return StepPlan(
        step_id=step_id,
        new_req_ids=[r.request_id for r in out.new_requests],
        # (a resumed request's outputs so far come along: the worker recomputes them)
        new_prompt_token_ids=[r.all_token_ids for r in out.new_requests],
        new_sampling=[r.sampling for r in out.new_requests],
        new_versions=[r.version or "" for r in out.new_requests],
        new_loras=(
            [r.lora_name for r in out.new_requests]
            if any(r.lora_name for r in out.new_requests)
            else []
        ),
        new_stop_token_ids=(
            [r.stop_token_ids if r.sampling.min_tokens else [] for r in out.new_requests]
            if any(r.sampling.min_tokens for r in out.new_requests)
            else []
        ),
        new_num_output_tokens=(
            [len(r.output_token_ids) for r in out.new_requests]
            if any(r.output_token_ids for r in out.new_requests)
            else []
        ),
        finished_req_ids=out.finished_req_ids,
        preempted_req_ids=out.preempted_req_ids,
        req_ids=[s.request.request_id for s in out.scheduled],
        num_computed_tokens=[s.num_computed_tokens for s in out.scheduled],
        num_new_tokens=[s.num_new_tokens for s in out.scheduled],
        new_block_ids=[s.new_block_ids for s in out.scheduled],
        new_group_block_ids=[
            s.new_group_block_ids for s in out.scheduled if s.new_group_block_ids is not None
        ],
        num_spec_tokens=(
            [s.num_spec_tokens for s in out.scheduled]
            if any(s.num_spec_tokens for s in out.scheduled)
            else []
        ),
        swap_out_src=[g for g, _ in out.swap_out],
        swap_out_dst=[h for _, h in out.swap_out],
        swap_in_src=[h for h, _ in out.swap_in],
        swap_in_dst=[g for _, g in out.swap_in],
        copy_req_ids=[c[0] for c in out.copies],
        copy_index=[c[1] for c in out.copies],
        copy_src=[c[2] for c in out.copies],
        copy_dst=[c[3] for c in out.copies],
        copy_groups=out.copy_groups,
        tier_drop_keys=t.drops,
        tier_spill_slots=[s for s, _, _ in t.spills],
        tier_spill_keys=[k for _, k, _ in t.spills],
        tier_spill_tokens=[list(toks) for _, _, toks in t.spills],
        tier_fetch_keys=[k for k, _, _ in t.fetches],
        tier_fetch_tokens=[list(toks) for _, toks, _ in t.fetches],
        tier_fetch_slots=[s for _, _, s in t.fetches],
        tier_save_src=[b for b, _ in t.saves],
        tier_save_dst=[s for _, s in t.saves],
        tier_load_src=[s for s, _ in t.loads],
        tier_load_dst=[b for _, b in t.loads],
        kv_export_src=[e[0] for e in h.exports],
        kv_export_keys=[e[1] for e in h.exports],
        kv_export_tokens=[e[2] for e in h.exports],
        kv_export_versions=[e[3] for e in h.exports],
        kv_export_paths=[e[4] for e in h.exports],
        kv_import_dst=[i[0] for i in h.imports],
        kv_import_keys=[i[1] for i in h.imports],
        kv_import_tokens=[i[2] for i in h.imports],
        kv_import_versions=[i[3] for i in h.imports],
        kv_import_paths=[i[4] for i in h.imports],
        kv_import_data=[i[5] for i in h.imports] if any(i[5] for i in h.imports) else [],
    )
