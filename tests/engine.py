"""The engine the scheduler process runs, driven in this process (no sockets): the same
EngineCore, plans and step loop as the real processes, for parity tests."""

from __future__ import annotations

from common.config import Config
from services.scheduler.in_process import InProcessEngine, StepRunner
from services.scheduler.policy import PolicyConfig


def LocalEngine(
    runner: StepRunner,
    policy: PolicyConfig,
    *,
    overlap: bool = True,  # noqa: N802
    prefix_caching: bool = True,
    num_blocks: int | None = None,
    num_host_blocks: int | None = None,
) -> InProcessEngine:
    """An InProcessEngine whose config has these scheduling settings (`overlap`: two steps
    in flight, as `--async-scheduling`); a test queues all its requests at once, so the
    waiting queue is unbounded."""
    config = Config().replace(
        scheduler={"async_scheduling": overlap, "max_waiting": 1 << 30},
        cache={"enable_prefix_caching": prefix_caching},
    )
    return InProcessEngine(
        runner, config, policy, num_blocks=num_blocks, num_host_blocks=num_host_blocks
    )
