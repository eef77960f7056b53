"""gpu_worker/cpu/huge_pages.py: weights and KV cache moved into huge-page mappings keep their
values, their sharing and their model's outputs."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from gpu_worker.cpu import huge_pages
from gpu_worker.kv_cache import KVCache

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages")


def test_zeros_is_a_zero_tensor_that_outlives_its_name() -> None:
    t = huge_pages.zeros((3, 5, 7), torch.bfloat16)
    gc.collect()
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16
    assert not t.any()
    t[1, 2, 3] = 1.5  # writable, and the mapping is still there
    assert t.sum().item() == 1.5


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's LM head is

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.embed(ids))))


@needs_thp
def test_parameters_move_once_with_their_values() -> None:
    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor([1, 7, 49])
    before = model(ids)
    old = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = huge_pages.use_huge_pages(model)
    gc.collect()
    assert moved >= sum(p.numel() * 4 for p in model.parameters())  # the tied one once
    assert moved < 2 * 50 * 16 * 4 + 16 * 16 * 4 + 16 * 4 + 64 * 4  # ... and not twice
    assert model.head.weight is model.embed.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, old[name]), name
        assert isinstance(p, nn.Parameter)
    assert torch.equal(model(ids), before)


def test_kv_cache_in_huge_pages_is_zeroed_like_torchs() -> None:
    def cache(huge_pages: bool) -> KVCache:
        return KVCache(
            num_layers=2,
            num_blocks=4,
            block_size=16,
            num_kv_heads=3,
            head_dim=8,
            dtype=torch.float32,
            device=torch.device("cpu"),
            huge_pages=huge_pages,
        )

    huge, plain = cache(True), cache(False)
    assert huge.tensor.shape == plain.tensor.shape and huge.tensor.is_contiguous()
    assert torch.equal(huge.tensor, plain.tensor)
