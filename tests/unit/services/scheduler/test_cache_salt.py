"""vLLM's cache_salt on the real scheduler policy (services/scheduler/policy.py): a salted
request is hashed under H(root, salt), so its prompt blocks are shared only with requests
of the same salt (common/model_facts.salted_root)."""

from __future__ import annotations

from common.messages import SamplingParams
from common.model_facts import salted_root
from services.scheduler.block_manager import BlockManager
from services.scheduler.policy import PolicyConfig, SchedulingPolicy
from services.scheduler.request import Request

PROMPT = list(range(100, 117))  # 4 full blocks of 4, and one token more
ROOT = 12345


def _finish(s: SchedulingPolicy, rid: str, salt: str) -> Request:
    """Run one request of PROMPT with `salt` to its end; return it."""
    req = Request(rid, PROMPT, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=salt)
    s.add(req)
    while not req.is_finished:
        out = s.schedule()
        sampled = [x.request.request_id for x in out.scheduled if x.samples]
        s.update(sampled, [7] * len(sampled))
    return req


def test_only_requests_with_the_same_salt_share_prefix_blocks() -> None:
    s = SchedulingPolicy(BlockManager(64, 4), PolicyConfig(watermark=0.0))
    s.set_version("v1", ROOT)
    assert _finish(s, "a", "").num_cached_tokens == 0
    assert _finish(s, "b", "").num_cached_tokens == 16  # unsalted: shared
    assert _finish(s, "c", "salt-1").num_cached_tokens == 0  # its own chain
    assert _finish(s, "d", "salt-1").num_cached_tokens == 16
    assert _finish(s, "e", "salt-2").num_cached_tokens == 0
    assert _finish(s, "f", "salt-2").cache_root == salted_root(ROOT, "salt-2") != ROOT


def test_salted_root() -> None:
    assert salted_root(ROOT, "") == ROOT
    assert salted_root(ROOT, "x") == salted_root(ROOT, "x") != salted_root(ROOT, "y")
    assert salted_root(ROOT, "x") != salted_root(ROOT + 1, "x")
