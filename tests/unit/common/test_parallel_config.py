"""Data parallelism's config section (common/parallel_config.py) refuses bad settings."""

from __future__ import annotations

from typing import Any

import pytest

from common.config import Config, ConfigError


@pytest.mark.parametrize(
    "bad",
    [
        {"data_parallel_size": 0},
        {"dp_routing": "random"},
        {"dp_load_bound": 0.5},
        {"replica_index": 2, "data_parallel_size": 2},
    ],
)
def test_bad_settings_fail_at_start_up(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Config().replace(data_parallel=bad)


def test_prefill_and_decode_replicas_set_the_replicas_and_their_roles() -> None:
    from common.topology import replica_roles

    config = Config().replace(data_parallel={"prefill_replicas": 1, "decode_replicas": 2})
    dp = config.data_parallel
    assert dp.data_parallel_size == 3 and dp.is_disaggregated
    assert replica_roles(config) == ["prefill", "decode", "decode"]
    assert [dp.role_of(i) for i in range(3)] == replica_roles(config)
    replica = config.replace(data_parallel={"replica_index": 2, "role": "decode"})
    assert replica.data_parallel.own_role == "decode"
    assert replica_roles(Config()) == ["both"]


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"prefill_replicas": 1}, "--prefill-replicas"),
        ({"prefill_replicas": 1, "decode_replicas": 1, "data_parallel_size": 3}, "--data-par"),
        ({"role": "prefill"}, "--role prefill needs --prefill-replicas"),
        (
            {"prefill_replicas": 1, "decode_replicas": 1, "role": "prefill", "replica_index": 1},
            "disagrees with --replica-index 1",
        ),  # fmt: skip
        ({"role": "middle"}, "--role"),
        ({"kv_transfer": "rdma"}, "--kv-transfer"),
    ],
)
def test_bad_role_settings_are_refused_by_name(bad: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Config().replace(data_parallel=bad)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("speculative", {"speculative": "ngram"}),
        ("speculative", {"speculative": "draft", "draft_model": "/m"}),
        ("lora", {"enable_lora": True}),
    ],
)
def test_speculative_decoding_and_lora_go_across_the_split(
    section: str, field: dict[str, Any]
) -> None:
    """The hand-over carries what they need (the decode replica drafts from the tokens it
    received; a sequence's adapter and its weights hash travel with its KV)."""
    split = {"prefill_replicas": 1, "decode_replicas": 1}
    config = Config().replace(data_parallel=split, **{section: field})
    assert config.data_parallel.is_disaggregated
