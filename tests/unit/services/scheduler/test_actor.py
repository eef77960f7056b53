"""The scheduler actor's handshake with the worker, without processes: a worker that starts
again (a new boot id, even with the same pid, as in a container) resets the block pool and
the prefix cache; the answer to the scheduler's own Reset does not."""

from __future__ import annotations

from common.config import Config
from common.messages import ModelInfo, Ready
from services.scheduler.actor import SchedulerActor


def _info(boot_id: str) -> ModelInfo:
    return ModelInfo(
        model_type="llama",
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        dtype="float32",
        num_blocks=64,
        block_size=4,
        max_model_len=128,
        vocab_size=0,
        weights_version="v1",
        model_name="m",
        pid=1,
        boot_id=boot_id,
        eos_token_ids=[2],
    )


def test_a_restarted_worker_resets_the_pool_even_with_the_same_pid(tmp_path) -> None:  # type: ignore[no-untyped-def]
    actor = SchedulerActor(Config().replace(server={"run_dir": str(tmp_path)}))
    actor._on_ready(Ready(name="worker", info={}, model=_info("a")))
    first = actor.core.policy
    assert first is not None
    first.blocks.allocate("x", 8)  # a leftover: cached KV the old worker held
    first.blocks.free("x")
    actor._on_ready(Ready(name="worker", info={}, model=_info("a")))  # the answer to our Reset
    assert actor.core.policy is first
    actor._on_ready(Ready(name="worker", info={}, model=_info("b")))  # pid 1 again, a new process
    assert actor.core.policy is not first and actor.core.policy.blocks.num_free_blocks == 64


def test_a_restarted_peer_is_told_the_served_model_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from common.messages import ModelChanged, ProcessDown
    from tests.unit.services.scheduler.test_engine_core import Outbox

    actor = SchedulerActor(Config().replace(server={"run_dir": str(tmp_path)}))
    actor.core.outbox = out = Outbox()
    actor._on_ready(Ready(name="worker", info={}, model=_info("a")))
    actor._on_process_down(ProcessDown(name="tokenizer-0", exit_code=1))
    actor._on_process_down(ProcessDown(name="detokenizer", exit_code=1))
    assert [m.version for m in out.of(ModelChanged)] == ["v1", "v1", "v1"]
    actor._on_process_down(ProcessDown(name="worker", exit_code=1))
    assert len(out.of(ModelChanged)) == 3 and not actor.core.is_ready  # the next Ready tells
