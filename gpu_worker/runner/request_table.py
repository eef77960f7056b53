"""The StepPlan rules every runner shares (the real `ModelRunner` and the compute-free
`SyntheticRunner`; the `Runner` protocol they fill is gpu_worker/runner/base.py's).

Per request a runner keeps what the scheduler told it (common/messages/scheduler_worker.py):
all token ids (prompt + sampled), the sampling parameters, the block table, how many tokens
are in the KV cache and the model version serving it. `RequestTable` is that state and the
rules that change it, written once:

    apply_diffs   finished -> swap out -> preempted reset -> new -> swap in -> copy-on-write
                  (the KV copies are done by the runner's `KVCopier`; a runner without KV
                  passes none and only the tables change)
    schedule      for each request of the batch: check the plan's view against ours, append
                  its new blocks, count its new tokens as computed (drafts count once
                  accepted); a plan that disagrees is refused with a ValueError

    block table of a request, block_size 4, 10 tokens computed:
    [ b7 | b2 | b9 ]   slots: b7*4+0..3, b2*4+0..3, b9*4+0..1 used

A runner then computes what `schedule` returned and samples for each state that
`needs_sample` (all its known tokens computed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Container
from typing import TYPE_CHECKING, Protocol

from common.kv_groups import PLACEHOLDER, reference_group
from common.messages.scheduler_worker import StepPlan
from common.messages.types import SamplingParams

if TYPE_CHECKING:  # the synthetic runner runs without torch ever being imported
    import torch

    from gpu_worker.sample.structured import RowGrammar


class KVCopier(Protocol):
    """The block copies a plan asks for (gpu_worker.kv_cache.KVCache)."""

    def swap_out(self, src: list[int], dst: list[int]) -> None: ...

    def swap_in(self, src: list[int], dst: list[int]) -> None: ...

    def tier_load(self, src: list[int], dst: list[int]) -> None: ...

    def copy_blocks(self, src: list[int], dst: list[int]) -> None: ...


@dataclasses.dataclass
class RequestState:
    """What a runner remembers about one request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + sampled so far
    params: SamplingParams
    num_prompt: int
    version: str  # the model version that serves it, for its whole life
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # what min_tokens masks
    block_table: list[int] = dataclasses.field(default_factory=list)
    # KV layer groups: one table per group (-1 where a sliding group's block went back);
    # block_table is then the reference group's, the same list. None: one dense group
    group_tables: list[list[int]] | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    generator: torch.Generator | None = None  # the model runner's, for sampled requests
    draft_computed: int = 0  # tokens whose K/V are in the draft model's pool (if any)
    # prompt logprobs (params.prompt_logprobs): one entry per prompt token computed so far
    # ([ids], [values] as in StepResult), kept across preemptions, sent with the first
    # sampled token
    prompt_logprob_ids: list[list[int]] = dataclasses.field(default_factory=list)
    prompt_logprob_values: list[list[float]] = dataclasses.field(default_factory=list)
    prompt_logprob_ranks: list[int] = dataclasses.field(default_factory=list)  # 0: none
    prompt_logprobs_sent: bool = False
    grammar: RowGrammar | None = None  # structured outputs: the sequence's own matcher
    # embeddings, mean pooling: the float32 sum of the final-normed hidden states of the
    # prompt positions computed so far ([H]), restarted by a chunk from position 0
    pool_sum: torch.Tensor | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def needs_sample(self) -> bool:
        """Every known token is computed: the next one is sampled (never for an embeddings
        request, which `is_pooled` instead)."""
        return self.num_computed == len(self.token_ids) and not self.params.pooling

    @property
    def is_pooled(self) -> bool:
        """An embeddings request whose prompt is computed: its vector is ready, it is done."""
        return bool(self.params.pooling) and self.num_computed == len(self.token_ids)


class RequestTable:
    """Every request's state on the worker, and the StepPlan rules that change it."""

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        # (params, version, num_drawn): a request's generator, past the draws of the outputs it
        # already sampled (a resumed request)
        new_generator: Callable[[SamplingParams, str, int], torch.Generator | None] | None = None,
        on_drop: Callable[[RequestState], None] | None = None,
        new_grammar: Callable[[SamplingParams, str], RowGrammar | None] | None = None,
        loras: Container[str] | None = None,
        group_windows: tuple[int, ...] = (),
    ) -> None:
        self.block_size = block_size
        # KV layer groups (common/kv_groups.py): each group's window; empty: one dense group
        self.group_windows = group_windows
        self.ref_group = reference_group(group_windows) if group_windows else 0
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self._new_generator = new_generator
        self._on_drop = on_drop  # frees what the runner keeps beside a state (token counts)
        self._new_grammar = new_grammar  # (params, version) -> the sequence's matcher
        self.loras = loras  # the adapters loaded (None: LoRA off), a live view
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    def drop(self, req_id: str) -> None:
        state = self._states.pop(req_id, None)  # idempotent: a repeat or unknown id is fine
        if state is not None and self._on_drop is not None:
            self._on_drop(state)

    def clear(self) -> None:
        for req_id in list(self._states):
            self.drop(req_id)

    def num_serving(self, version: str) -> int:
        """How many requests run on `version`."""
        return sum(state.version == version for state in self._states.values())

    def relabel(self, old: str, new: str) -> None:
        for state in self._states.values():
            if state.version == old:
                state.version = new

    # the diffs ---------------------------------------------------------------------------
    def apply_diffs(
        self,
        plan: StepPlan,
        default_version: str,
        versions: Collection[str],
        kv: KVCopier | None = None,
    ) -> None:
        """The plan's diffs and KV copies, in the documented order."""
        for req_id in plan.finished_req_ids:
            self.drop(req_id)
        if kv is not None and plan.swap_out_src:  # before anything overwrites the blocks saved
            kv.swap_out(plan.swap_out_src, plan.swap_out_dst)
        if kv is not None and plan.tier_load_src:  # prefix hits in host memory (after the
            kv.tier_load(plan.tier_load_src, plan.tier_load_dst)  # swap-outs: blocks reused)
        for req_id in plan.preempted_req_ids:
            state = self._states[req_id]
            self._reset_tables(state)
            state.num_computed = 0
            state.draft_computed = 0  # swaps and recomputes restore only the target's KV
        self._add_new(plan, default_version, versions)
        if kv is not None and plan.swap_in_src:
            kv.swap_in(plan.swap_in_src, plan.swap_in_dst)
        self._copy_on_write(plan, kv)

    def _add_new(self, plan: StepPlan, default_version: str, versions: Collection[str]) -> None:
        new_versions = plan.new_versions or [""] * len(plan.new_req_ids)
        new_stops = plan.new_stop_token_ids or [[] for _ in plan.new_req_ids]
        new_loras = plan.new_loras or [""] * len(plan.new_req_ids)
        new_outputs = plan.new_num_output_tokens or [0] * len(plan.new_req_ids)
        new = zip(
            plan.new_req_ids,
            plan.new_prompt_token_ids,
            plan.new_sampling,
            new_versions,
            new_stops,
            new_loras,
            new_outputs,
            strict=True,
        )
        for req_id, prompt, params, version, stops, lora, num_outputs in new:
            if req_id in self._states:
                raise ValueError(f"request {req_id} is already running on the worker")
            if len(prompt) <= num_outputs:
                raise ValueError(f"request {req_id} has an empty prompt")
            version = version or default_version
            if version not in versions:
                raise ValueError(
                    f"request {req_id} wants model version {version!r}, loaded: {sorted(versions)}"
                )
            if lora and (self.loras is None or lora not in self.loras):
                off = " (LoRA is not enabled)" if self.loras is None else ""
                raise ValueError(f"request {req_id} wants LoRA adapter {lora!r}, not loaded{off}")
            generator = (
                self._new_generator(params, version, num_outputs) if self._new_generator else None
            )
            state = RequestState(
                req_id,
                list(prompt),
                params,
                len(prompt) - num_outputs,
                version,
                lora_name=lora,
                stop_token_ids=list(stops),
                generator=generator,
            )
            self._reset_tables(state)
            if params.is_structured:
                if self._new_grammar is None:
                    raise ValueError(f"request {req_id}: this runner has no structured outputs")
                state.grammar = self._new_grammar(params, version)
            if params.prompt_logprobs is not None:  # the first token: nothing precedes it
                state.prompt_logprob_ids.append([prompt[0]])
                state.prompt_logprob_values.append([])
                state.prompt_logprob_ranks.append(0)
            self._states[req_id] = state

    def _reset_tables(self, state: RequestState) -> None:
        """An empty table (per group with layer groups)."""
        if self.group_windows:
            state.group_tables = [[] for _ in self.group_windows]
            state.block_table = state.group_tables[self.ref_group]
        else:
            state.block_table = []

    def _copy_on_write(self, plan: StepPlan, kv: KVCopier | None) -> None:
        copies = list(zip(plan.copy_req_ids, plan.copy_index, plan.copy_dst, strict=True))
        unknown = [req_id for req_id, _, _ in copies if req_id not in self._states]
        if unknown:
            raise ValueError(f"copy-on-write for unknown request {unknown[0]}")
        groups = plan.copy_groups or [self.ref_group] * len(copies)
        if len(groups) != len(copies) or (self.group_windows and not plan.copy_groups and copies):
            raise ValueError(f"step {plan.step_id}: copy-on-write without its layer groups")
        if kv is not None and plan.copy_src:
            kv.copy_blocks(plan.copy_src, plan.copy_dst)
        for (req_id, index, dst), group in zip(copies, groups, strict=True):
            state = self._states[req_id]
            table = state.group_tables[group] if state.group_tables else state.block_table
            if index < len(table):  # else the table arrives whole, this step
                table[index] = dst
            # the copy is the target's KV only: the draft pool restarts before the block
            state.draft_computed = min(state.draft_computed, index * self.block_size)

    # the batch ---------------------------------------------------------------------------
    def schedule(self, plan: StepPlan) -> list[RequestState]:
        """Check the batch against our state, append each request's new blocks and count its
        new tokens as computed; returns the states in plan order."""
        num_reqs = len(plan.req_ids)
        slots = plan.num_spec_tokens or [0] * num_reqs
        lengths = {
            len(plan.num_computed_tokens),
            len(plan.num_new_tokens),
            len(plan.new_block_ids),
            len(slots),
        }
        if self.group_windows:
            lengths.add(len(plan.new_group_block_ids))
        if lengths != {num_reqs}:
            raise ValueError(f"step {plan.step_id}: batch fields differ in length")
        if len(set(plan.req_ids)) != num_reqs:
            raise ValueError(f"step {plan.step_id}: a request is scheduled twice")
        return [self._schedule(plan, i, slots[i]) for i in range(num_reqs)]

    def _schedule(self, plan: StepPlan, i: int, num_spec: int) -> RequestState:
        """Check the plan's view of request i against ours; append its new blocks."""
        req_id = plan.req_ids[i]
        state = self._states.get(req_id)
        if state is None:
            raise ValueError(f"step {plan.step_id}: unknown request {req_id}")
        num_computed, num_new = plan.num_computed_tokens[i], plan.num_new_tokens[i]
        if not state.block_table and num_computed <= len(state.token_ids):
            # new or preempted: KV it starts with comes from prefix hits, a fork or a swap-in
            state.num_computed = num_computed
        if num_computed != state.num_computed:
            raise ValueError(
                f"request {req_id}: plan says {num_computed} tokens computed, worker has "
                f"{state.num_computed}"
            )
        end = num_computed + num_new
        if num_new < 1 or end > len(state.token_ids) or end > self.max_model_len:
            raise ValueError(
                f"request {req_id}: cannot compute tokens [{num_computed}, {end}) of "
                f"{len(state.token_ids)} known (max_model_len {self.max_model_len})"
            )
        if state.group_tables is not None:
            self._extend_groups(req_id, state.group_tables, plan.new_group_block_ids[i])
        else:
            bad = [b for b in plan.new_block_ids[i] if not 0 <= b < self.num_blocks]
            if bad:
                raise ValueError(
                    f"request {req_id}: block ids {bad} outside [0, {self.num_blocks})"
                )
            state.block_table.extend(plan.new_block_ids[i])
        if len(state.block_table) * self.block_size < end:
            raise ValueError(
                f"request {req_id}: {len(state.block_table)} blocks cannot hold {end} tokens"
            )
        if num_spec:
            self._check_draft_slots(req_id, state, end, num_spec)
        state.num_computed = end
        return state

    def _extend_groups(self, req_id: str, tables: list[list[int]], new: list[list[int]]) -> None:
        if len(new) != len(tables):
            raise ValueError(f"request {req_id}: {len(new)} block tables for {len(tables)} groups")
        for table, ids in zip(tables, new, strict=True):
            bad = [b for b in ids if not (0 <= b < self.num_blocks or b == PLACEHOLDER)]
            if bad:
                raise ValueError(
                    f"request {req_id}: block ids {bad} outside [0, {self.num_blocks})"
                )
            table.extend(ids)

    def _check_draft_slots(self, req_id: str, state: RequestState, end: int, num_spec: int) -> None:
        """Draft slots follow a request's last token, inside its blocks and max_model_len,
        for requests without logits controls (drafts are verified without them) and without
        logprobs (reported for sampled rows only)."""
        params = state.params
        if params.has_controls or params.wants_logprobs or params.is_structured:
            raise ValueError(
                f"request {req_id}: draft slots for a request with logits controls, logprobs "
                "or a grammar"
            )
        if end != len(state.token_ids):
            raise ValueError(
                f"request {req_id}: draft slots on a step that does not reach its last token"
            )
        if (
            end + num_spec > self.max_model_len
            or len(state.block_table) * self.block_size < end + num_spec
        ):
            raise ValueError(
                f"request {req_id}: {num_spec} draft slots after token {end} do "
                f"not fit its {len(state.block_table)} blocks or max_model_len"
            )
