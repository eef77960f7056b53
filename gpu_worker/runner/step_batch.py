"""One step's model inputs, packed from the plan and the request states (one model version),
and the tokens its logits give.

    propose        draft tokens for the requests the plan gave draft slots (n-gram lookup in
                   their own tokens, or the draft model's passes)
    prepare_batch  decodes first (the attention backend runs them as one batch), then the
                   other chunks; each request's new tokens, then its drafts:

        input_ids       [ d0 | d1 | p0 p0 p0 p0 | p1 p1 ... ]   d: decode, p: prefill chunk
        logits_indices  the last known token of each sampling request (and its drafts'
                        rows), then the prompt positions of requests asking prompt logprobs

    accept         each sampling request's tokens from its logits rows: one sampled (after
                   its grammar's mask), or its drafts verified plus one

The sampling rows keep the plan's order (results go back in it); `StepBatch` says which
request each logits row belongs to.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from common.messages.scheduler_worker import StepPlan
from gpu_worker.attention import AttentionBackend, AttentionMetadata, build_metadata
from gpu_worker.attention.metadata import group_metadata
from gpu_worker.runner.request_table import RequestState
from gpu_worker.sample.logits_controls import History, TokenCounts
from gpu_worker.sample.logprobs import prompt_positions
from gpu_worker.sample.pooling import PoolBatch, pool_batch
from gpu_worker.sample.sampling import sample
from gpu_worker.sample.speculative import DraftModel, ngram_propose, verify
from gpu_worker.sample.structured import apply_grammars


@dataclasses.dataclass
class StepBatch:
    """One step's model inputs (decodes first) and who samples, in plan order."""

    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [L] packed indices whose logits are needed
    sampling_req_ids: list[str]  # [S]
    sampling_states: list[RequestState]  # [S]
    drafts: list[list[int]]  # [S] proposed tokens ([] without speculation); request j's
    # logits rows follow those of requests < j, 1 + len(drafts[j]) of them
    draft_probs: list[torch.Tensor | None]  # [S] the draft model's q rows, sampled requests
    spec_slots: list[int]  # [S] draft slots the plan gave it (0: not speculating)
    draft_computed: list[int]  # [S] the draft pool's count after proposing
    # prompt logprobs: the logits rows after the sampling ones are these requests' prompt
    # positions, request after request
    prompt_rows: list[tuple[RequestState, range]] = dataclasses.field(default_factory=list)
    pool: PoolBatch | None = None  # embeddings requests' rows (gpu_worker/sample/pooling.py)
    # [R] (plan index, tokens) of each request in packed order (LoRA: each token's adapter)
    packed: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_sampling_rows(self) -> int:
        return len(self.sampling_states) + sum(len(d) for d in self.drafts)


@dataclasses.dataclass
class Drafts:
    """The proposals for a step's requests, by their index in the plan."""

    tokens: dict[int, list[int]]  # [] for a request without draft slots
    probs: dict[int, torch.Tensor | None]  # the draft model's q rows (None: n-gram, none)
    computed: dict[int, int]  # the draft pool's count after proposing


def spec_slots(plan: StepPlan) -> list[int]:
    """Draft slots per scheduled request (0: not speculating)."""
    return plan.num_spec_tokens or [0] * len(plan.req_ids)


def propose(
    plan: StepPlan,
    indices: list[int],
    states: list[RequestState],
    *,
    method: str,
    drafter: DraftModel | None,
    prompt_lookup: tuple[int, int],
) -> Drafts:
    """Draft tokens for the requests `indices` given draft slots (decodes of their last
    token), by `method` ('': none, ngram, or draft with `drafter`)."""
    slots = spec_slots(plan)
    drafts = Drafts(
        tokens={i: [] for i in indices},
        probs={i: None for i in indices},
        computed={i: states[i].draft_computed for i in indices},
    )
    spec = [i for i in indices if slots[i]]
    if not spec or not method:
        return drafts
    if drafter is None:  # n-gram lookup in the request's own tokens
        for i in spec:
            drafts.tokens[i] = ngram_propose(states[i].token_ids, slots[i], *prompt_lookup)
        return drafts
    got, q, after = drafter.propose(
        [states[i].token_ids for i in spec],
        [states[i].draft_computed for i in spec],
        [states[i].block_table for i in spec],
        [slots[i] for i in spec],
        [states[i].params for i in spec],
        [states[i].generator for i in spec],
    )
    for j, i in enumerate(spec):
        drafts.tokens[i], drafts.probs[i], drafts.computed[i] = got[j], q[j], after[j]
    return drafts


def prepare_batch(
    plan: StepPlan,
    indices: list[int],
    states: list[RequestState],
    drafts: Drafts,
    *,
    block_size: int,
    backend: AttentionBackend,
    device: torch.device,
) -> StepBatch:
    """The packed inputs of the scheduled requests `indices` (one model version), whose
    states `RequestTable.schedule` has checked and advanced, with their `drafts`."""
    num_new = {i: plan.num_new_tokens[i] + len(drafts.tokens[i]) for i in indices}
    order = sorted(indices, key=lambda i: num_new[i] != 1)  # decodes first (stable)
    input_ids: list[int] = []
    first_row: dict[int, int] = {}  # packed index of the request's last known token
    for i in order:
        num_computed = plan.num_computed_tokens[i]
        input_ids.extend(states[i].token_ids[num_computed : num_computed + plan.num_new_tokens[i]])
        first_row[i] = len(input_ids) - 1
        input_ids.extend(drafts.tokens[i])
    grouped = states[order[0]].group_tables is not None if order else False
    meta = build_metadata(
        [plan.num_computed_tokens[i] for i in order],
        [num_new[i] for i in order],
        # (a sliding reference group's -1 entries, never read, as block 0)
        [
            [max(b, 0) for b in states[i].block_table] if grouped else states[i].block_table
            for i in order
        ],  # fmt: skip
        block_size,
        device,
    )
    sampling = [i for i in indices if states[i].needs_sample]
    logits_indices = [
        k for i in sampling for k in range(first_row[i], first_row[i] + 1 + len(drafts.tokens[i]))
    ]
    # prompt logprobs: the asking requests' prompt positions of this chunk, after those
    prompt_rows = []
    for i in indices:
        num_computed, chunk = plan.num_computed_tokens[i], plan.num_new_tokens[i]
        positions = prompt_positions(states[i], num_computed, chunk)
        if positions:
            chunk_start = first_row[i] + 1 - chunk  # packed index of num_computed
            logits_indices += [chunk_start + p - num_computed for p in positions]
            prompt_rows.append((states[i], positions))
    slots = spec_slots(plan)
    built = backend.build_metadata(meta)
    if grouped:  # each layer group attends through its own tables (common/kv_groups.py)
        num_groups = len(states[order[0]].group_tables or ())
        built = dataclasses.replace(
            built,
            group_metas=tuple(
                backend.build_metadata(
                    group_metadata(
                        meta, [(states[i].group_tables or [])[g] for i in order], block_size, device
                    )
                )
                for g in range(num_groups)
            ),
        )
    return StepBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
        meta=built,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sampling_req_ids=[plan.req_ids[i] for i in sampling],
        sampling_states=[states[i] for i in sampling],
        drafts=[drafts.tokens[i] for i in sampling],
        draft_probs=[drafts.probs[i] for i in sampling],
        spec_slots=[slots[i] for i in sampling],
        draft_computed=[drafts.computed[i] for i in sampling],
        prompt_rows=prompt_rows,
        pool=pool_batch(
            states, indices, plan.num_computed_tokens, plan.num_new_tokens, first_row, device
        ),
        packed=[(i, num_new[i]) for i in order],
    )


def accept(
    logits: torch.Tensor, batch: StepBatch, counts: TokenCounts, block_size: int
) -> list[list[int]]:
    """Each sampling request's tokens from its `logits` rows (the batch's first
    `num_sampling_rows`; `counts`: its version's, for penalties): one sampled, or its verified
    drafts plus one, appended to its tokens.
    A verified request's accepted drafts count as computed; the blocks past them (only
    rejected drafts' slots) leave its table, as they leave the scheduler's."""
    states = batch.sampling_states
    first = list(itertools.accumulate((1 + len(d) for d in batch.drafts), initial=0))
    grammars = [(first[j], s.grammar, s.output_ids) for j, s in enumerate(states) if s.grammar]
    if grammars:  # masked on a copy: logprobs come from the raw logits
        logits = logits.clone()
        apply_grammars(logits, grammars)
    if not any(batch.spec_slots):  # no speculation: one logits row each, sampled at once
        tokens = sample(
            logits,
            [s.params for s in states],
            [s.generator for s in states],
            History(states, counts),
        )
        for state, token in zip(states, tokens, strict=True):
            state.token_ids.append(token)
        return [[t] for t in tokens]
    plain = [j for j, slots in enumerate(batch.spec_slots) if not slots]
    out: list[list[int]] = [[] for _ in states]
    if plain:
        tokens = sample(
            logits[[first[j] for j in plain]],
            [states[j].params for j in plain],
            [states[j].generator for j in plain],
            History([states[j] for j in plain], counts),
        )
        for j, token in zip(plain, tokens, strict=True):
            out[j] = [token]
    for j, state in enumerate(states):
        if batch.spec_slots[j]:
            verdict = verify(
                logits[first[j] : first[j + 1]],
                batch.drafts[j],
                state.params,
                state.generator,
                batch.draft_probs[j],
            )
            out[j] = verdict.tokens
            state.num_computed += verdict.num_accepted
            del state.block_table[-(-state.num_computed // block_size) :]
            for table in state.group_tables or ():
                del table[-(-state.num_computed // block_size) :]
            state.draft_computed = min(batch.draft_computed[j], state.num_computed)
        state.token_ids.extend(out[j])
    return out
