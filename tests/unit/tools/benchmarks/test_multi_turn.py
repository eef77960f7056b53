"""The multi-turn workload's generator and figures (tools/benchmarks/multi_turn.py), no server."""

from __future__ import annotations

from collections import Counter

import pytest

from tools.benchmarks.multi_turn import (
    MultiTurnSpec,
    TurnResult,
    summarize_turns,
    working_set_blocks,
)


def _spec(**kw: object) -> MultiTurnSpec:
    base: dict = dict(num_conversations=5, num_turns=3, system_words=8, user_words=(4, 9))
    return MultiTurnSpec(**(base | {"max_tokens": 16} | kw))


def test_text_is_seeded_and_independent_of_the_order() -> None:
    a, b = _spec(), _spec(order="random")
    assert a.system_prompt() == b.system_prompt() and len(a.system_prompt().split()) == 8
    assert a.user_message(3, 2) == b.user_message(3, 2)
    assert a.user_message(3, 2) != a.user_message(2, 3)
    words = a.user_message(0, 0).split()
    assert words[0] == "[0.0]" and 4 <= len(words) - 1 <= 9
    assert _spec(seed=1).system_prompt() != a.system_prompt()
    assert _spec(system_words=0).first_messages(0) == []
    assert a.first_messages(1) == [{"role": "system", "content": a.system_prompt()}]


def test_round_robin_runs_every_other_conversation_between_two_turns_of_one() -> None:
    order = _spec().turn_order()
    assert order == [0, 1, 2, 3, 4] * 3


def test_random_order_is_seeded_and_has_every_turn() -> None:
    order = _spec(order="random").turn_order()
    assert order == _spec(order="random").turn_order()
    assert order != _spec(order="random", seed=5).turn_order()
    assert order != _spec().turn_order()
    assert Counter(order) == {c: 3 for c in range(5)}


@pytest.mark.parametrize(
    "bad",
    [dict(num_conversations=0), dict(num_turns=0), dict(order="lifo"), dict(max_tokens=0)],
)
def test_bad_specs_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        _spec(**bad)


def test_working_set_is_every_conversations_latest_prompt_in_blocks() -> None:
    results = [
        TurnResult(0, 0, prompt_tokens=20),
        TurnResult(1, 0, prompt_tokens=16),
        TurnResult(0, 1, prompt_tokens=40),  # 3 blocks of 16
        TurnResult(1, 1, prompt_tokens=33, error="HTTP 503"),  # failed: 16 stays latest
    ]
    assert working_set_blocks([r for r in results if not r.error], 16) == 3 + 1


def test_summary_counts_hits_and_the_servers_counters_over_the_run() -> None:
    results = [
        TurnResult(0, 0, prompt_tokens=100, cached_tokens=0, ttft=0.1),
        TurnResult(0, 1, prompt_tokens=200, cached_tokens=96, ttft=0.2),
        TurnResult(1, 0, prompt_tokens=100, cached_tokens=32, ttft=0.3),
        TurnResult(1, 1, error="HTTP 500"),
    ]
    before = {"prefix_cache_hits": 10, "kv_offload_host_hits": 1}
    after = {"prefix_cache_hits": 138, "kv_offload_host_hits": 4, "block_size": 16}
    after |= {"num_total_blocks": 12}
    s = summarize_turns(results, 2.0, before, after)
    assert (s["turns"], s["failed"], s["errors"]) == (3, 1, ["HTTP 500"])
    assert (s["prompt_tokens"], s["cached_tokens"]) == (400, 128)
    assert s["hit_rate"] == 128 / 400 and s["later_turns_hit_rate"] == 96 / 200
    assert s["server_counters"] == {"prefix_cache_hits": 128, "kv_offload_host_hits": 3}
    assert (s["device_pool_blocks"], s["working_set_blocks"]) == (12, 13 + 7)
    assert s["ttft_s"]["median"] == 0.2
