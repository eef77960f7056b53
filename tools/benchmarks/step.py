"""Time the worker alone: ms per decode step at batch sizes B, and prefill tokens/s.

    .venv/bin/python -m tools.benchmarks.step --batch-sizes 1,16,64 --context 300 --threads 2
    .venv/bin/python -m tools.benchmarks.step --profile 16      # torch profiler table, B=16

Drives a ModelRunner with StepPlans as the scheduler would (blocks scattered over the pool):
B requests are prefilled to `--context` tokens, then `--steps` decode steps are timed; the
median is reported (this CPU is shared, so single runs are noisy).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from common.messages.scheduler_worker import StepPlan
from common.messages.types import SamplingParams


class _Driver:
    """Just enough of a scheduler to keep B requests decoding."""

    def __init__(self, runner: Any, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.step_id = 0
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.known: dict[str, int] = {}

    def _blocks_for(self, rid: str, end: int) -> list[int]:
        need = -(-end // self.block_size) - len(self.tables[rid])
        new = [self.free.pop() for _ in range(max(0, need))]
        self.tables[rid].extend(new)
        return new

    def step(self, new: dict[str, list[int]], sched: list[tuple[str, int]]) -> float:
        plan = StepPlan(
            step_id=self.step_id,
            new_req_ids=list(new),
            new_prompt_token_ids=list(new.values()),
            new_sampling=[SamplingParams(temperature=0.0)] * len(new),
        )
        for rid, prompt in new.items():
            self.tables[rid], self.computed[rid], self.known[rid] = [], 0, len(prompt)
        for rid, n in sched:
            plan.req_ids.append(rid)
            plan.num_computed_tokens.append(self.computed[rid])
            plan.num_new_tokens.append(n)
            plan.new_block_ids.append(self._blocks_for(rid, self.computed[rid] + n))
        self.step_id += 1
        start = time.perf_counter()
        result = self.runner.execute(plan)
        elapsed = time.perf_counter() - start
        for rid, n in sched:
            self.computed[rid] += n
        for rid in result.req_ids:
            self.known[rid] += 1
        return elapsed

    def finish(self, rids: list[str]) -> None:
        self.runner.execute(StepPlan(step_id=self.step_id, finished_req_ids=rids))
        self.step_id += 1
        for rid in rids:
            self.free.extend(self.tables.pop(rid))


def start_batch(
    runner: Any, batch: int, context: int, chunk: int, seed: int
) -> tuple[_Driver, list[str], float]:
    """B requests prefilled to `context` tokens (one request per step, chunked)."""
    rng = random.Random(seed)
    drv = _Driver(runner, seed)
    rids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    prefill_s = 0.0
    for rid in rids:
        prompt, done = [rng.randrange(1000, 40000) for _ in range(context)], 0
        while done < context:
            n = min(chunk, context - done)
            prefill_s += drv.step({rid: prompt} if done == 0 else {}, [(rid, n)])
            done += n
    return drv, rids, prefill_s


def measure(
    runner: Any, batch: int, context: int, steps: int, chunk: int = 512, seed: int = 0
) -> dict[str, float]:
    """Median decode-step seconds at `batch` requests of ~`context` tokens, and prefill tok/s."""
    drv, rids, prefill_s = start_batch(runner, batch, context, chunk, seed)
    times = [drv.step({}, [(r, 1) for r in rids]) for _ in range(steps)]
    drv.finish(rids)
    median = statistics.median(times)
    return {
        "batch": batch,
        "context": context,
        "decode_step_ms": median * 1e3,
        "decode_step_ms_min": min(times) * 1e3,
        "decode_tok_s": batch / median,
        "prefill_tok_s": batch * context / prefill_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="HF folder (default: SmolLM2)")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="torch")
    p.add_argument("--no-cpu-kernels", action="store_true", help="torch only (the reference)")
    p.add_argument("--no-cpu-packed-weights", action="store_true", help="torch's GEMM for >8 rows")
    p.add_argument("--profile", type=int, default=0, help="profile decode at this batch size")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    from common.prepare_model import prepare_default_model
    from gpu_worker.runner.model_runner import ModelRunner
    from gpu_worker.runner.options import RunnerOptions

    options = RunnerOptions(
        dtype=args.dtype,
        num_threads=args.threads,
        kv_cache_memory_gib=1.5,
        attention_backend=args.backend,
        cpu_kernels=not args.no_cpu_kernels,
        cpu_packed_weights=not args.no_cpu_packed_weights,
    )
    runner = ModelRunner(args.model or str(prepare_default_model()), options)
    if args.profile:
        return _profile(runner, args.profile, args.context)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        measure(runner, b, 64, 3, seed=1)  # warm-up: allocator, compiled kernels
        row = measure(runner, b, args.context, args.steps)
        rows.append(row)
        print(
            f"B={b:4d} ctx={args.context}: decode {row['decode_step_ms']:7.1f} ms/step "
            f"(min {row['decode_step_ms_min']:.1f}), {row['decode_tok_s']:7.1f} tok/s; "
            f"prefill {row['prefill_tok_s']:7.1f} tok/s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": args.threads, "rows": rows}, f, indent=2)
    return 0


def _profile(runner: Any, batch: int, context: int) -> int:
    """The torch profiler's table over 5 decode steps at `batch` (prefill not included)."""
    import torch.profiler as tp

    drv, rids, _ = start_batch(runner, batch, context, 512, 3)
    drv.step({}, [(r, 1) for r in rids])
    with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            drv.step({}, [(r, 1) for r in rids])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
