"""tools/benchmarks/bursts.py: the hand-over figures from /admin/stats counters."""

from __future__ import annotations

import pytest

from tools.benchmarks.bursts import BurstSpec, handover_figures


def test_handover_figures_are_the_counters_change_per_1k_tokens() -> None:
    before = {"kv_handover_transfer_s": 1.0, "kv_handover_blocks_received": 10}
    after = {
        "block_size": 16,
        "kv_handover_transfer_s": 1.5,
        "kv_handover_blocks_received": 135,  # 125 blocks of 16: 2000 tokens moved
        "kv_handover_prefill_s": 4.0,
    }
    h = handover_figures(before, after, prompt_tokens=4000)
    assert h["tokens_moved"] == 2000 and h["blocks_received"] == 125
    assert h["transfer_ms_per_1k_tokens"] == pytest.approx(250.0)
    assert h["prefill_ms_per_1k_prompt_tokens"] == pytest.approx(1000.0)


def test_a_both_replica_has_no_handover_figures() -> None:
    assert handover_figures({}, {"block_size": 16, "num_running": 0}, 100) == {}


def test_bad_specs_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--streams"):
        BurstSpec(streams=0)
    with pytest.raises(ValueError, match="--quiet-s"):
        BurstSpec(quiet_s=0)
