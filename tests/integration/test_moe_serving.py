"""A mixture-of-experts model served by the real processes: Qwen2-MoE (routed experts and a
shared expert) under tensor parallelism 2 (each expert's FFN and the shared expert sharded,
the routers replicated) equals transformers batched under a small pool (preemption),
chunked, alone and after a prefix hit, with n-gram drafts verified
(tests/integration/test_tensor_parallel.py's checks),
and /admin/stats and /metrics report each expert's (token, expert) pairs. Every other served
family under tensor parallelism 2 equals transformers alone and batched (gpt-oss by default,
float; the others, and gpt-oss's MXFP4 experts, marked slow); OLMoE is served on one rank
(tests/unit/gpu_worker/models/test_moe_tensor_parallel.py)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.integration.test_tensor_parallel import (
    ADMIN,
    NUM_NEW,
    TOKEN,
    _check_parity_everywhere,
    _gib,
    _prompts,
    _stats,
    _together,
    _tokens,
)
from tests.reference import hf_greedy
from tests.server import running_server
from tests.tiny_moe_models import make_tiny_moe_model, make_tiny_mxfp4_gpt_oss

# per rank: 3 layers, K/V, 16 slots, 1 KV head of 16 (hidden 64 / 4 heads), float32
BLOCK_BYTES = 3 * 2 * 16 * 1 * 16 * 4


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe") / "qwen2_moe", "qwen2_moe")


def test_tp2_qwen2_moe_equals_transformers_and_counts_expert_tokens(qwen2_moe: Path) -> None:
    prompts = _prompts((5, 17, 30, 41, 50, 60))
    expected = [hf_greedy(qwen2_moe, p, NUM_NEW) for p in prompts]
    flags = ["--model", str(qwen2_moe), "--tensor-parallel-size", "2", "--admin-token", TOKEN]
    flags += ["--max-num-batched-tokens", "24", "--kv-cache-memory", _gib(14, BLOCK_BYTES)]
    flags += ["--speculative", "ngram"]  # drafts verified on every rank alike
    with running_server(*flags) as server:
        assert _stats(server)["num_total_blocks"] == 14
        _check_parity_everywhere(server, prompts, expected)
        assert _stats(server)["spec_num_draft_tokens"] > 0
        counts = _stats(server)["moe_expert_tokens"]
        # layer 1 of 3 is sparse (decoder_sparse_step 2): top-4 of 8 experts per token
        assert len(counts) == 8 and sum(counts) % 4 == 0 and sum(counts) > 0
        metrics = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=30).text
        exported = re.findall(r'^shuttle:moe_expert_tokens_total\{.*expert="(\d+)".*\} (\S+)$',
                              metrics, re.M)  # fmt: skip
        assert sorted(int(e) for e, _ in exported) == list(range(8))
        assert sum(float(v) for _, v in exported) >= sum(counts)


TP2_FAMILIES = [
    "gpt_oss",
    pytest.param("qwen3_moe", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("gpt_oss_mxfp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family", TP2_FAMILIES)
def test_tp2_family_equals_transformers_alone_and_batched(family: str, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp(family)
    kv_heads = {"num_key_value_heads": 2}  # gpt-oss's tiny config has one: not splittable
    if family == "gpt_oss_mxfp4":
        folder, reference = make_tiny_mxfp4_gpt_oss(root, **kv_heads)
    else:
        fields = kv_heads if family == "gpt_oss" else {}
        folder = reference = make_tiny_moe_model(root / family, family, **fields)
    prompts = _prompts((3, 17, 30))
    expected = [hf_greedy(reference, p, NUM_NEW) for p in prompts]
    with running_server("--model", str(folder), "--tensor-parallel-size", "2") as server:
        assert _together(server, prompts) == expected
        assert [_tokens(server, p) for p in prompts] == expected


def test_hot_swap_between_a_dense_and_a_moe_model(qwen2_moe: Path, tmp_path_factory) -> None:
    """A drain swap from a dense Llama to the MoE (another KV layout) and back: each serves
    transformers' tokens, and the per-expert counts belong to the MoE while it serves."""
    from tests.integration.test_tensor_parallel import _complete, _swap
    from tests.tiny_models import make_tiny_model

    dense = make_tiny_model(tmp_path_factory.mktemp("dense") / "llama", "llama", seed=1)
    prompt = _prompts((21,), seed=5)[0]
    with running_server("--model", str(dense), "--admin-token", TOKEN) as server:
        assert _stats(server)["moe_expert_tokens"] == []
        for model, version in ((qwen2_moe, "v-moe"), (dense, "v-dense")):
            result = _swap(server, model, version, "drain")
            assert result["ok"] and result["version"] == version, result
            body = _complete(server, prompt)
            assert body["system_fingerprint"] == version
            assert body["choices"][0]["token_ids"] == hf_greedy(model, prompt, NUM_NEW)
            counts = _stats(server)["moe_expert_tokens"]
            assert (sum(counts) > 0) if model == qwen2_moe else counts == []
