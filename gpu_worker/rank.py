"""Ranks 1..N-1 of a tensor-parallel worker group.

A follower has no ZMQ inbox: it takes rank 0's messages from the group's broadcast
(gpu_worker/worker.py explains why) and runs them through the same handlers as rank 0, with
the answers discarded. Its runner holds its shard of the weights and its KV heads for the
same block ids; it computes every step with the others, gets the same all-gathered logits and
samples the same tokens (the same seeded generators, in the same order), so its request
states (tokens, block tables, grammar matchers, draft-model pools) stay equal to rank 0's
without a second collective per step. Only rank 0's answers reach the scheduler.

It is started by the supervisor (`shuttle serve` on the first host, `shuttle worker-ranks` on
the others) as `python -m gpu_worker --config-file RUN/config.json --rank R
--dist-init-addr HOST:PORT`. SIGTERM stops it at once (it holds nothing to flush); a failed
broadcast (rank 0 gone) ends it with exit code 1.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from common import codec
from common.actor import Actor
from common.config import Config
from common.messages import Ready, Shutdown
from gpu_worker.worker import Discard, WorkerActor

log = logging.getLogger(__name__)


class RankFollower(WorkerActor):
    """Rank `rank` > 0: runs what rank 0 broadcasts, answers nobody."""

    def __init__(self, config: Config, rank: int) -> None:
        super().__init__(config, rank)
        if not 0 < rank < config.parallel.tensor_parallel_size:
            raise ValueError(
                f"--rank {rank}: a follower is rank 1..{config.parallel.tensor_parallel_size - 1}"
            )

    @property
    def inbox_name(self) -> str:
        return f"worker-rank-{self.rank}"

    def ready_targets(self) -> list[str]:
        return Actor.ready_targets(self)  # the supervisor only, never the scheduler

    def ready_info(self) -> dict[str, Any]:
        return {"rank": self.rank, "num_blocks": self.runner.num_blocks}

    def _scheduler_outbox(self) -> Discard:
        return Discard()

    async def run(self) -> None:
        """Join, load, report Ready, then follow rank 0 until Shutdown or a broken group."""
        try:
            await self.start()
            assert self.tp is not None, "a follower needs --tensor-parallel-size > 1"
            ready = Ready(name=self.inbox_name, info=self.ready_info())
            for target in self.ready_targets():
                self.outbox(target).send(ready)
            log.info("rank %d ready", self.rank)
            while True:
                msg = codec.decode(await asyncio.to_thread(self.tp.receive_frame))
                await self.dispatch(msg)
                if isinstance(msg, Shutdown):
                    break
        finally:
            for box in self._outboxes.values():
                box.close()
