"""Embeddings: the pooled final-normed hidden states of an embeddings request's prompt
(SamplingParams.pooling), as vLLM's poolers compute them.

    last   the hidden state of the prompt's last token (the last chunk's last row); such a
           request may take prefix-cache hits, since the scheduler always recomputes the
           prompt's last token
    mean   the mean over every prompt position; each chunk adds its rows to a float32 sum on
           the request's state (RequestState.pool_sum), restarted by a chunk that starts at
           position 0 (a recompute after preemption). Such a request takes no prefix-cache
           hits (the scheduler's rule, as vLLM disables prefix caching for it), so every
           position passes through the model.

An embeddings request samples nothing: the step that computes its prompt's last chunk
answers its vector (StepResult.embeddings), and the request is done. The vector leaves full
size and unnormalised; the gateway truncates it (`dimensions`) and normalises it, the order
of vLLM's pooler head.

    packed rows of a step:  [ decodes | A's chunk (mean) ..... | B's last chunk (last) ]
    PoolBatch.indices:                  a0 a1 a2 ... ak          b_end
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpu_worker.runner.request_table import RequestState


@dataclasses.dataclass(frozen=True)
class PoolRows:
    """One embeddings request's rows of a step's hidden states."""

    state: RequestState
    num_rows: int  # its rows of PoolBatch.indices, in order
    restarts: bool  # mean: the chunk starts at position 0, so the sum starts afresh


@dataclasses.dataclass(frozen=True)
class PoolBatch:
    """The hidden-state rows a step's embeddings requests need, request after request."""

    rows: list[PoolRows]
    indices: torch.Tensor  # [P] packed token indices whose final-normed hidden states pool

    def accumulate(self, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Pool `hidden` ([P, H], the rows of `indices`) into each request's state; return
        the float32 vectors of the requests whose prompt is now computed, by request id."""
        vectors: dict[str, list[float]] = {}
        start = 0
        for rows in self.rows:
            block = hidden[start : start + rows.num_rows].float()
            start += rows.num_rows
            state = rows.state
            if state.params.pooling == "last":
                vectors[state.req_id] = block[-1].tolist()
                continue
            total = block.sum(dim=0)
            if not rows.restarts and state.pool_sum is not None:
                total += state.pool_sum
            state.pool_sum = total
            if state.is_pooled:
                vectors[state.req_id] = (total / state.num_prompt).tolist()
        return vectors


def pool_batch(
    states: list[RequestState],
    indices: list[int],
    num_computed: list[int],
    num_new: list[int],
    last_rows: dict[int, int],
    device: torch.device,
) -> PoolBatch | None:
    """The pooled rows of the scheduled requests `indices` (states already advanced by the
    step): `num_computed[i]` and `num_new[i]` are request i's plan, `last_rows[i]` the packed
    index of its chunk's last token. None when no embeddings request computes this step."""
    rows: list[PoolRows] = []
    packed: list[int] = []
    for i in indices:
        state, end = states[i], last_rows[i]
        if state.params.pooling == "mean":
            if num_computed[i] > 0 and state.pool_sum is None:
                raise ValueError(
                    f"request {state.req_id}: mean pooling needs every prompt position, but "
                    f"its first chunk starts at {num_computed[i]} (prefix-cache hits?)"
                )
            packed.extend(range(end - num_new[i] + 1, end + 1))
            rows.append(PoolRows(state, num_new[i], num_computed[i] == 0))
        elif state.params.pooling and state.is_pooled:
            packed.append(end)
            rows.append(PoolRows(state, 1, False))
    if not rows:
        return None
    return PoolBatch(rows, torch.tensor(packed, dtype=torch.int64, device=device))


def pooled_fields(order: list[str], vectors: dict[str, list[float]]) -> dict[str, Any]:
    """StepResult's embeddings fields: the pooled requests in plan order (none: nothing)."""
    if not vectors:
        return {}
    pooled = [rid for rid in order if rid in vectors]
    return {"pooled_req_ids": pooled, "embeddings": [vectors[rid] for rid in pooled]}
