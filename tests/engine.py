"""The scheduler policy and the model runner in one process, no sockets: the same plans the
real processes exchange, for parity tests that exercise scheduling features quickly."""

from __future__ import annotations

import dataclasses
from collections import deque

from common.messages import SamplingParams
from gpu_worker.model_runner import ModelRunner
from services.scheduler.block_manager import BlockManager, HostBlockPool
from services.scheduler.plan import to_plan
from services.scheduler.policy import PolicyConfig, Scheduler
from services.scheduler.request import Request


class LocalEngine:
    def __init__(self, runner: ModelRunner, config: PolicyConfig, *, num_blocks: int | None = None,
                 num_host_blocks: int = 0, overlap: bool = True, root: int = 1,
                 prefix_caching: bool = True) -> None:
        self.runner = runner
        n = num_blocks or runner.num_blocks
        self.policy = Scheduler(BlockManager(n, runner.block_size, prefix_caching), config,
                                host_pool=HostBlockPool(num_host_blocks))
        self.depth = 2 if overlap else 1
        self.root = root
        self.outputs: dict[str, list[int]] = {}
        self._ids = 0

    def add(self, prompt: list[int], sampling: SamplingParams) -> list[str]:
        """Queue a request (n sequences for sampling.n > 1); returns the sequence ids."""
        self._ids += 1
        base = f"r{self._ids}"
        ids = [base] if sampling.n == 1 else [f"{base}#{i}" for i in range(sampling.n)]
        leader = None
        for i, rid in enumerate(ids):
            sp = sampling if sampling.seed is None or not i else dataclasses.replace(
                sampling, seed=sampling.seed + i)
            req = Request(rid, prompt, sp, eos_token_ids=self.runner.eos_token_ids,
                          max_model_len=self.runner.max_model_len, cache_root=self.root,
                          fork_of=leader)
            leader = leader or req
            self.policy.add(req)
            self.outputs[rid] = []
        return ids

    def run(self) -> dict[str, list[int]]:
        """Step until every request has finished; integrity is checked after every step."""
        in_flight: deque = deque()
        step = 0
        while self.policy.has_work() or in_flight:
            while len(in_flight) < self.depth and self.policy.has_work():
                out = self.policy.schedule()
                if out.is_empty:
                    break
                step += 1
                in_flight.append(to_plan(step, out))
            plan = in_flight.popleft()
            result = self.runner.execute(plan)
            for req, tokens, _ in self.policy.update(result.req_ids, result.token_ids,
                                                     result.num_tokens, result.num_proposed):
                self.outputs[req.request_id].extend(tokens)
            self.policy.check_integrity()
        return self.outputs
