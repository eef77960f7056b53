"""tools/bench's multi-turn workload on the real processes (a tiny Llama): its conversations do
not fit a device pool of 8 blocks, so without lower tiers a conversation's prefix is evicted
by the others before its next turn; with host memory for the working set it comes back. The
hit rates are counts (cached_tokens), never times."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server import running_server
from tests.tiny_models import make_tiny_model
from tools.benchmarks.multi_turn import MultiTurnSpec, run

TOKEN = "multi-turn-admin"
GIB = 1 << 30
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, block size, KV heads, head dim, float32
SPEC = MultiTurnSpec(
    num_conversations=5, num_turns=3, system_words=24, user_words=(8, 12), max_tokens=4
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mt") / "llama", "llama", seed=1)


def _hits(model: Path, host_blocks: int) -> dict:
    flags = ["--model", str(model), "--dtype", "float32", "--admin-token", TOKEN]
    flags += ["--kv-cache-memory", repr(8 * BLOCK_BYTES / GIB)]
    if host_blocks:
        flags += ["--kv-offload-memory", repr(host_blocks * BLOCK_BYTES / GIB)]
    with running_server(*flags) as server:
        return run(server.url, server.model, SPEC, 1, TOKEN)


@pytest.mark.slow  # two servers, ~80 s on 2 cores; the tiers' hits are in test_kv_offload
def test_the_host_tier_raises_the_multi_turn_hit_rate(tiny: Path) -> None:
    without, with_host = _hits(tiny, 0), _hits(tiny, 128)
    for r in (without, with_host):
        assert r["failed"] == 0 and r["turns"] == 15
        assert r["device_pool_blocks"] == 8
        assert r["working_set_blocks"] >= 2 * 8  # the conversations outgrow the pool
        counters = r["server_counters"]
        assert counters["prefix_cache_queries"] == r["prompt_tokens"]
    assert "kv_offload_host_hits" not in without["server_counters"]
    assert with_host["server_counters"]["kv_offload_host_hits"] > 0
    # greedy replies: both runs send the same conversations
    assert with_host["prompt_tokens"] == without["prompt_tokens"]
    assert with_host["cached_tokens"] > without["cached_tokens"]
    assert with_host["later_turns_hit_rate"] > 0.5 > without["later_turns_hit_rate"]
