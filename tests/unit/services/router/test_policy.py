"""The data-parallel router's decisions (services/router/policy.py), fed notices by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import codec
from common.messages import ReplicaNotice
from common.prefix_hash import prefix_hashes
from services.router.policy import MAX_PENDING_HASHES, Router
from services.scheduler.block_manager import BlockManager

ROOT, BS = 1234, 4


def _notice(replica: int, cached: list[int] = (), **kw: object) -> ReplicaNotice:  # type: ignore[assignment]
    fields = {
        "is_ready": True,
        "cache_root": ROOT,
        "block_size": BS,
        "tokenizer_fingerprint": "tok",
        "cached_hashes": list(cached),
    }
    fields.update(kw)
    return ReplicaNotice(replica=replica, **fields)  # type: ignore[arg-type]


def _router(n: int = 2, routing: str = "prefix", bound: float = 1.25) -> Router:
    router = Router(n, routing, bound)
    for i in range(n):
        router.on_notice(_notice(i))
    return router


SYSTEM = list(range(100, 124))  # 6 full blocks


def test_the_block_managers_hashes_are_the_routers() -> None:
    """A replica's cached blocks, as its block manager hashed them, match the router's chain."""
    blocks = BlockManager(16, BS, track_hash_changes=True)
    prompt = [*SYSTEM, 7, 8]
    blocks.allocate("r", len(prompt))
    blocks.cache_full_blocks("r", ROOT, prompt, len(prompt))
    cached, evicted = blocks.drain_hash_changes()
    assert cached == list(prefix_hashes(ROOT, prompt, BS)) and not evicted
    assert blocks.drain_hash_changes() == ([], [])


def test_eviction_is_reported() -> None:
    blocks = BlockManager(2, BS, track_hash_changes=True)
    blocks.allocate("a", 8)
    blocks.cache_full_blocks("a", ROOT, list(range(8)), 8)
    blocks.free("a")
    first, _ = blocks.drain_hash_changes()
    blocks.allocate("b", 4)  # takes a cached block: one hash goes
    cached, evicted = blocks.drain_hash_changes()
    assert not cached and len(evicted) == 1 and evicted[0] in first


def test_a_shared_prefix_goes_where_it_is_cached() -> None:
    router = _router()
    router.on_notice(_notice(1, list(prefix_hashes(ROOT, SYSTEM + [1], BS))))
    d = router.route("a", [*SYSTEM, 5, 6, 7])
    assert d is not None and d.replica == 1 and d.num_hit_blocks == 6


def test_a_miss_goes_to_the_least_loaded_and_spreads_ties() -> None:
    router = _router()
    picks = [router.route(f"r{i}", [i] * 40) for i in range(4)]
    assert [p.replica for p in picks if p] == [0, 1, 0, 1]
    assert router.num_least_loaded_routed == 4


def test_routed_prompts_are_expected_before_any_notice() -> None:
    """A burst of one system prompt sticks to the replica the first one went to."""
    router = _router(bound=10.0)
    first = router.route("a", [*SYSTEM, 1])
    second = router.route("b", [*SYSTEM, 2])
    assert first is not None and second is not None
    assert second.replica == first.replica and second.num_hit_blocks == 6


def test_affinity_is_bounded_by_load() -> None:
    router = _router(bound=1.25)
    router.on_notice(_notice(0, list(prefix_hashes(ROOT, SYSTEM + [1], BS))))
    replicas = [router.route(f"r{i}", [*SYSTEM, i]) for i in range(12)]
    # affinity until replica 0 would hold more than 1.25x the mean: 2 of 3, then the other
    # replica takes one (and so holds the prefix too: from then on both do)
    assert [d.replica for d in replicas[:3] if d] == [0, 0, 1]
    loads = [r.load for r in router.replicas]
    assert max(loads) <= router.load_bound * sum(loads) / 2 + 1


def test_ended_requests_lower_the_load() -> None:
    router = _router()
    router.route("a", [1] * 9)
    assert router.replicas[0].load == 1
    router.on_notice(_notice(0, ended_request_ids=["a"]))
    assert router.replicas[0].load == 0


def test_a_replica_that_is_not_ready_is_routed_around() -> None:
    router = _router()
    router.on_notice(_notice(0, list(prefix_hashes(ROOT, SYSTEM + [1], BS))))
    router.on_notice(_notice(0, is_ready=False, reset=True))
    assert all(router.route(f"r{i}", [*SYSTEM, i]).replica == 1 for i in range(3))  # type: ignore[union-attr]


def test_a_dead_scheduler_gives_back_its_live_requests() -> None:
    router = _router()
    router.route("a", [1] * 9)
    router.route("b", [2] * 9)
    assert router.on_replica_down(0) == ["a"]
    assert router.replicas[0].load == 0 and not router.replicas[0].is_ready
    assert router.route("c", [3] * 9).replica == 1  # type: ignore[union-attr]


def test_no_replica_ready() -> None:
    router = Router(2)
    assert router.route("a", [1, 2, 3]) is None


def test_eviction_and_reset_forget_blocks() -> None:
    router = _router()
    hashes = list(prefix_hashes(ROOT, SYSTEM + [1], BS))
    router.on_notice(_notice(1, hashes))
    router.on_notice(_notice(1, evicted_hashes=hashes[:1]))
    assert router.replicas[1].num_leading_hits(hashes) == 0
    router.on_notice(_notice(1, hashes))
    router.on_notice(_notice(1, reset=True))
    assert router.replicas[1].num_leading_hits(hashes) == 0


def test_another_version_does_not_match() -> None:
    """Replica 1 serves a new version (another root): the old prefix is no hit there."""
    router = _router()
    router.on_notice(_notice(1, list(prefix_hashes(ROOT, SYSTEM + [1], BS)), cache_root=99))
    d = router.route("a", [*SYSTEM, 1])
    assert d is not None and d.num_hit_blocks == 0


def test_pending_hashes_are_bounded() -> None:
    router = _router(n=1)
    for i in range(MAX_PENDING_HASHES // 10 + 10):
        router.route(f"r{i}", [i] * 45)
    assert len(router.replicas[0].pending) <= MAX_PENDING_HASHES


def test_round_robin_takes_ready_replicas_in_turn() -> None:
    router = _router(3, "round-robin")
    router.on_notice(_notice(1, is_ready=False))
    picks = [router.route(f"r{i}", [*SYSTEM, i]) for i in range(4)]
    assert [p.replica for p in picks if p] == [0, 2, 0, 2]


def test_mid_swap_the_requests_tokenizer_comes_first() -> None:
    router = _router()
    router.on_notice(_notice(1, tokenizer_fingerprint="new"))
    assert router.route("a", [1] * 9, "new").replica == 1  # type: ignore[union-attr]
    assert router.route("b", [1] * 9, "old").replica in (0, 1)  # type: ignore[union-attr]


def test_unknown_routing_is_refused() -> None:
    with pytest.raises(ValueError):
        Router(2, "random")


def test_replica_notice_round_trip() -> None:
    msg = _notice(1, [1, -2], evicted_hashes=[3], ended_request_ids=["x"], reset=True)
    assert codec.decode(codec.encode(msg)) == msg
    big = _notice(0, [2**63 - 1, -(2**63)], cache_root=2**64 - 1)
    assert codec.decode(codec.encode(big)) == big


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["route", "end", "notice"]), st.integers(0, 5), st.integers(0, 3)
        ),
        max_size=60,
    ),
    st.sampled_from([1.0, 1.25, 2.0]),
)
def test_decisions_keep_their_rules(ops: list[tuple[str, int, int]], bound: float) -> None:
    """Whatever the order of requests, ends and notices: a request goes by affinity only to a
    replica within the load cap holding the most of its blocks, else to a least-loaded one;
    the router's load is exactly its live requests."""
    router = _router(3, bound=bound)
    prompts = [[*SYSTEM[: 4 * (k + 1)], k] for k in range(6)]
    live: dict[str, int] = {}
    for n, (op, k, replica) in enumerate(ops):
        if op == "route":
            loads = [r.load for r in router.replicas]
            cap = router.load_cap([r for r in router.replicas if r.is_ready])
            hashes = list(prefix_hashes(ROOT, prompts[k], BS))
            hits = [r.num_leading_hits(hashes) for r in router.replicas]
            d = router.route(f"r{n}", prompts[k])
            assert d is not None and d.num_hit_blocks == hits[d.replica]
            holders = [i for i in range(3) if hits[i] and loads[i] + 1 <= cap]
            if holders:
                assert hits[d.replica] == max(hits[i] for i in holders)
                assert loads[d.replica] + 1 <= cap
            else:
                assert loads[d.replica] == min(loads)
            live[f"r{n}"] = d.replica
        elif op == "end" and live:
            rid = sorted(live)[k % len(live)]
            router.on_notice(_notice(live.pop(rid), ended_request_ids=[rid]))
        elif op == "notice":
            hashes = list(prefix_hashes(ROOT, prompts[k], BS))
            router.on_notice(_notice(replica % 3, hashes[: 1 + k % len(hashes)]))
        assert [r.load for r in router.replicas] == [
            sum(1 for v in live.values() if v == i) for i in range(3)
        ]


def test_roles_new_requests_go_to_prefill_replicas_and_hand_overs_to_decode_ones() -> None:
    router = Router(4, "prefix", 1.25, ["prefill", "prefill", "decode", "decode"])
    for i in range(4):
        router.on_notice(_notice(i))
    tokens = list(range(40))
    placed = {router.route(f"r{i}", tokens).replica for i in range(6)}  # type: ignore[union-attr]
    assert placed <= {0, 1}
    router.on_notice(_notice(2, ended_request_ids=[]))
    first = router.route_handover("a", "tok")
    second = router.route_handover("b", "tok")
    assert first is not None and second is not None
    assert {first.index, second.index} == {2, 3}  # by load: one each
    router.on_notice(_notice(first.index, ended_request_ids=["a"]))
    third = router.route_handover("c", "tok")
    assert third is not None and third.index == first.index  # the less loaded one
    assert router.stats()["num_handovers_routed"] == 3
    router.on_notice(_notice(2, is_ready=False))
    router.on_notice(_notice(3, is_ready=False))
    assert router.route_handover("d") is None  # no decode replica ready: the caller fails it


def test_an_adapters_hand_over_goes_to_a_decode_replica_serving_that_adapter() -> None:
    """First one serving the adapter with the same weights (the others would refuse it),
    even if busier; none does: the least loaded (it refuses it, retryably)."""
    router = Router(4, "prefix", 1.25, ["prefill", "decode", "decode", "decode"])
    router.on_notice(_notice(0))
    router.on_notice(_notice(1, lora_names=["a"], lora_hashes=["h2"]))  # other weights
    router.on_notice(_notice(2, lora_names=["a"], lora_hashes=["h1"]))
    router.on_notice(_notice(3))
    for i in range(3):
        chosen = router.route_handover(f"r{i}", "tok", ("a", "h1"))
        assert chosen is not None and chosen.index == 2
    other = router.route_handover("b", "tok", ("b", "h1"))
    assert other is not None and other.index in (1, 3)
