"""The triton attention backend against the torch backend, and the worker on each of them.

The worker test drives a ModelRunner on a tiny random Llama through a chunked prefill (a
second chunk whose cached prefix ends mid-block), mixed decode + extend steps and pure
decode steps, and expects the same greedy tokens from both backends.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from common.messages.scheduler_worker import StepPlan  # noqa: E402
from common.messages.types import SamplingParams  # noqa: E402
from gpu_worker.attention import build_metadata, create_backend  # noqa: E402
from gpu_worker.layers.ops_triton import TritonLayerOps  # noqa: E402
from gpu_worker.runner.model_runner import ModelRunner  # noqa: E402
from gpu_worker.runner.options import RunnerOptions  # noqa: E402
from tests.kernels.paged import randn  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def _backend(name: str, device: torch.device, num_heads: int = 6, num_kv_heads: int = 2,
             **variant: float):  # fmt: skip
    return create_backend(name, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                          dtype=torch.float32, device=device, **variant)  # fmt: skip


@pytest.mark.parametrize("window", [0, 3, 6])  # 0: none
@pytest.mark.parametrize("variant", [{}, {"scale": 0.3, "softcap": 2.0}], ids=["plain", "gemma2"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_backend_matches_torch_backend_on_a_mixed_batch(window, variant, with_sinks,
                                                        device) -> None:  # fmt: skip
    # two decodes, then a prefill and an extend whose prefix ends mid-block
    num_computed, num_new = [15, 1, 0, 5], [1, 1, 9, 4]
    tables = [[3, 7, 10, 11], [0], [5, 1, 9], [2, 8, 4]]
    cache = randn(2, 12, 4, 2, 64, seed=0, device=device)
    tokens = sum(num_new)
    q = randn(tokens, 6, 64, seed=1, device=device)
    k, v = randn(tokens, 2, 64, seed=2, device=device), randn(tokens, 2, 64, seed=3, device=device)
    outs, caches = [], []
    sinks = torch.tensor([2.0, -1.0, 5.0, 0.0, 1.0, -4.0], device=device) if with_sinks else None
    for name in ("torch", "triton"):
        backend = _backend(name, device, **variant)
        common = build_metadata(num_computed, num_new, tables, 4, device)
        caches.append(cache.clone())
        meta = backend.build_metadata(common)
        outs.append(backend.forward(q, k, v, caches[-1], meta, window, sinks))
    assert (outs[0] - outs[1]).abs().max().item() <= 2e-3
    assert torch.equal(caches[0], caches[1])


def test_auto_picks_torch_on_cpu_and_triton_rejects_cpu_without_interpreter(monkeypatch):
    import gpu_worker.attention.triton_backend  # noqa: F401  (the attribute patched below)

    assert create_backend("auto", num_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                          device=torch.device("cpu")).name == "torch"  # fmt: skip
    # not the environment variable: triton reads it when a kernel module is first imported
    monkeypatch.setattr("gpu_worker.attention.triton_backend.interpreting", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        _backend("triton", torch.device("cpu"))


def _plan(
    step: int, reqs: list[tuple[str, int, int, list[int]]], new=(), num_groups: int = 0
) -> StepPlan:
    """reqs: (id, num_computed, num_new, new blocks); `new`: (id, prompt) sent this step;
    with KV layer groups (a windowed model) group g takes blocks 8 g + those."""
    groups = [[[b + 8 * g for b in r[3]] for g in range(num_groups)] for r in reqs]
    return StepPlan(
        step,
        new_req_ids=[r for r, _ in new],
        new_prompt_token_ids=[p for _, p in new],
        new_sampling=[GREEDY for _ in new],
        req_ids=[r[0] for r in reqs],
        num_computed_tokens=[r[1] for r in reqs],
        num_new_tokens=[r[2] for r in reqs],
        new_block_ids=[r[3] for r in reqs],
        new_group_block_ids=groups if num_groups else [],
    )


def _greedy_tokens(runner: ModelRunner) -> list[tuple[list[str], list[int]]]:
    a, b = [5, 6, 7, 8, 9, 10, 11], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]
    k = runner.kv_groups.num_groups if runner.kv_groups else 0
    assert k <= 2, "16 blocks: 8 per group"
    plans = [
        _plan(
            0, [("a", 0, 7, [0, 1]), ("b", 0, 6, [2, 3])], new=[("a", a), ("b", b)], num_groups=k
        ),
        # b's prefix of 6 tokens ends mid-block (block_size 4): an extend, beside a decode
        _plan(1, [("a", 7, 1, []), ("b", 6, 7, [4, 5])], num_groups=k),
        _plan(2, [("b", 13, 1, []), ("a", 8, 1, [6])], num_groups=k),
        _plan(3, [("a", 9, 1, []), ("b", 14, 1, [])], num_groups=k),
        _plan(4, [("a", 10, 1, []), ("b", 15, 1, [])], num_groups=k),
    ]
    results = [runner.execute(plan) for plan in plans]
    return [(r.req_ids, r.token_ids) for r in results]


# qwen3: q/k norms, head_dim 32; qwen2-window: a second layer sliding over 8 positions;
# gemma2: soft caps, query_pre_attn_scalar, sandwich norms, GeGLU
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2-window", "gemma2"])
def test_worker_greedy_tokens_match_torch_backend(arch, tiny_model_dir, device) -> None:
    path = str(tiny_model_dir(arch))
    kwargs = dict(device=str(device), num_blocks=16, block_size=4)
    torch_runner = ModelRunner(path, RunnerOptions(attention_backend="torch", **kwargs))
    triton_runner = ModelRunner(path, RunnerOptions(attention_backend="triton", **kwargs))
    assert isinstance(triton_runner.model.model.layers[0].ops, TritonLayerOps)
    expected = _greedy_tokens(torch_runner)
    assert sum(len(ids) for ids, _ in expected) == 9  # a: steps 0-4, b: steps 1-4
    assert _greedy_tokens(triton_runner) == expected
