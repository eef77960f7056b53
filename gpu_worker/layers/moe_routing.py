"""A mixture-of-experts layer's routing (steps 1, 2 and 4 of gpu_worker/layers/fused_moe.py):
each token's top-k experts and weights from the router's logits, as the family defines them;
the step's (token, slot) pairs grouped by expert; and each token's weighted sum of its experts'
outputs in transformers' order. Every function here works per token: a row's result depends on
that row alone."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

SCORINGS = ("softmax", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a family turns router logits [T, E] into each token's experts and weights.

    scoring       "softmax": softmax over every expert (float32), then the top k;
                  "topk_softmax": the top k logits, then a softmax over those k (gpt-oss)
    renormalize   divide the top-k probabilities by their sum (Mixtral always;
                  `norm_topk_prob` for Qwen-MoE and OLMoE)
    weights_in_logits_dtype  cast the weights back to the logits' dtype (Qwen-MoE, OLMoE);
                  Mixtral keeps them float32
    """

    top_k: int
    renormalize: bool
    scoring: str = "softmax"
    weights_in_logits_dtype: bool = True

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.top_k < 1:
            raise ValueError(f"num_experts_per_tok must be >= 1, got {self.top_k}")


def select_experts(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k] int64) from router logits [T, E], per token (each
    row's result depends on that row alone)."""
    if routing.scoring == "topk_softmax":
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return F.softmax(top, dim=1, dtype=top.dtype), ids
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    if routing.weights_in_logits_dtype:
        top = top.to(logits.dtype)
    return top, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs of ids [T, k], flattened (pair p = token p // k, slot p % k),
    ordered by expert, ties in token order (a stable counting sort), and each expert's count."""
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.sort(flat, stable=True).indices
    return order, counts.tolist()


def combine(
    out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """sum over each token's slots of out [T, k, H] * weights [T, k], in increasing expert id
    order from zero, each term cast to `dtype` before it is added (transformers' index_add_
    over the experts in order)."""
    perm = torch.argsort(ids, dim=1)  # a token's expert ids are distinct: no ties
    out = torch.gather(out, 1, perm[:, :, None].expand_as(out))
    weights = torch.gather(weights, 1, perm)
    acc = torch.zeros(out.shape[0], out.shape[2], dtype=dtype, device=out.device)
    for j in range(out.shape[1]):
        acc = acc + (out[:, j] * weights[:, j, None]).to(dtype)
    return acc
