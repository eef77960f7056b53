"""Data-parallel routing of LoRA requests (services/router/policy.py): a replica that has the
adapter first, then the prefix hashed under the adapter's root, as the replica's scheduler
hashes it (services/scheduler/replica_notices.py tells the router its adapters)."""

from __future__ import annotations

from common.messages import ReplicaNotice
from common.model_facts import lora_root
from common.prefix_hash import prefix_hashes
from services.router.policy import Router

ROOT, BS = 1234, 4
PROMPT = list(range(100, 117))  # 4 matchable full blocks


def _notice(replica: int, **kw: object) -> ReplicaNotice:
    fields: dict[str, object] = {
        "is_ready": True,
        "cache_root": ROOT,
        "block_size": BS,
        "tokenizer_fingerprint": "tok",
    }
    return ReplicaNotice(replica=replica, **(fields | kw))  # type: ignore[arg-type]


def _router() -> Router:
    router = Router(3, "prefix", 10.0)
    for i in range(3):
        router.on_notice(_notice(i))
    return router


def test_the_replica_with_the_adapter_is_preferred() -> None:
    router = _router()
    router.on_notice(_notice(2, lora_names=["sql"], lora_hashes=["h"]))
    for i in range(3):  # even when it is the most loaded
        d = router.route(f"r{i}", PROMPT, "tok", "sql")
        assert d is not None and d.replica == 2
    d = router.route("base", PROMPT, "tok")
    assert d is not None and d.replica != 2


def test_prefix_affinity_uses_the_adapters_root() -> None:
    router = _router()
    for i in (0, 1):
        router.on_notice(_notice(i, lora_names=["sql"], lora_hashes=["h"]))
    base_chain = list(prefix_hashes(ROOT, PROMPT, BS))
    router.on_notice(_notice(0, cached_hashes=base_chain))  # base blocks: no help to sql
    lora_chain = list(prefix_hashes(lora_root(ROOT, "sql", "h"), PROMPT, BS))
    router.on_notice(_notice(1, cached_hashes=lora_chain))
    d = router.route("a", PROMPT, "tok", "sql")
    assert d is not None and (d.replica, d.num_hit_blocks) == (1, 4)


def test_an_adapter_nobody_has_goes_anywhere_ready() -> None:
    router = _router()
    d = router.route("a", PROMPT, "tok", "missing")  # (its scheduler answers 404)
    assert d is not None


def test_a_notice_without_adapters_leaves_them_unchanged() -> None:
    router = _router()
    router.on_notice(_notice(1, lora_names=["sql"], lora_hashes=["h"]))
    router.on_notice(_notice(1))
    assert router.replicas[1].loras == {"sql": "h"}
    router.on_notice(_notice(1, lora_names=[], lora_hashes=[]))
    assert router.replicas[1].loras == {}
