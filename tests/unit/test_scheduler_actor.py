"""The scheduler actor's handshake with the worker, without processes: a worker that starts
again (a new boot id, even with the same pid, as in a container) resets the block pool and
the prefix cache; the answer to the scheduler's own Reset does not."""

from __future__ import annotations

from common.config import Config
from common.messages import Ready
from services.scheduler.actor import SchedulerActor


def _info(boot_id: str) -> dict:
    return {"num_blocks": 64, "block_size": 4, "max_model_len": 128, "weights_version": "v1",
            "model_name": "m", "pid": 1, "boot_id": boot_id, "eos_token_ids": [2]}


def test_a_restarted_worker_resets_the_pool_even_with_the_same_pid(tmp_path) -> None:  # type: ignore[no-untyped-def]
    actor = SchedulerActor(Config().replace(server={"run_dir": str(tmp_path)}))
    actor._on_ready(Ready(name="worker", info=_info("a")))
    first = actor.core.policy
    assert first is not None
    first.blocks.allocate("x", 8)  # a leftover: cached KV the old worker held
    first.blocks.free("x")
    actor._on_ready(Ready(name="worker", info=_info("a")))  # the answer to our Reset
    assert actor.core.policy is first
    actor._on_ready(Ready(name="worker", info=_info("b")))  # pid 1 again, a new process
    assert actor.core.policy is not first and actor.core.policy.blocks.num_free_blocks == 64
