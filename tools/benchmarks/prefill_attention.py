"""Time a prefill chunk's batch-invariant attention: the blocked kernel (paged_prefill) against
the row-by-row path it replaced (each token a decode of its own length through paged_decode),
ms per layer and per 30-layer model, over each KV cache format.

    .venv/bin/python -m tools.benchmarks.prefill_attention [--chunk 512] [--prefix 0 1536]
    .venv/bin/python -m tools.benchmarks.prefill_attention --threads 2

SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64, blocks of 16 scattered at
random; a `--chunk`-token chunk after each `--prefix` cached positions. One thread by default,
timed in CPU time (time.process_time: what a core costs, less the neighbours' effect on a
shared machine); each figure is the median of `--repeats` calls. Both paths give the same bits
(tests/unit/gpu_worker/cpu/test_paged_prefill.py), checked here too.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch

from gpu_worker.cpu import paged_decode
from gpu_worker.kv_quant import KVFormat

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
FORMATS = [("float32", "auto", torch.float32), ("bfloat16", "auto", torch.bfloat16),
           ("int8", "int8", torch.float32), ("fp8_e4m3", "fp8_e4m3", torch.float32)]  # fmt: skip


def _median_ms(f, repeats: int, clock) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = clock()
        f()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--prefix", type=int, nargs="+", default=[0, 1536])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    print(f"{'format':>9} {'context':>8} {'rows ms':>8} {'blocked ms':>10} {'x':>5}  (per layer)")
    for label, name, dtype in FORMATS:
        fmt = KVFormat.create(name, dtype)
        for first in args.prefix:
            n = args.chunk
            blocks = -(-(first + n) // BLOCK)
            ids = list(range(blocks + 8))
            random.Random(0).shuffle(ids)
            table = torch.tensor(ids[:blocks], dtype=torch.int32)
            cache = fmt.quantize(torch.randn(2, blocks + 8, BLOCK, KV_HEADS, HEAD_DIM).to(dtype))
            q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
            lens = torch.arange(first + 1, first + n + 1, dtype=torch.int32)
            tables = table[None].expand(n, -1)
            rows = functools.partial(
                paged_decode.paged_decode, q, cache, tables, lens, 0.125, kv_format=fmt
            )
            blocked = functools.partial(
                paged_decode.paged_prefill, q, cache, table, first, 0.125, kv_format=fmt
            )

            a, b = rows(), blocked()
            assert a is not None and b is not None and torch.equal(a, b), "bits differ"
            t_rows = _median_ms(rows, args.repeats, clock)
            t_blocked = _median_ms(blocked, args.repeats, clock)
            print(f"{label:>9} {first + n:>8} {t_rows:>8.2f} {t_blocked:>10.2f} "
                  f"{t_rows / t_blocked:>5.2f}  ({LAYERS} layers: "
                  f"{t_rows * LAYERS:.0f} -> {t_blocked * LAYERS:.0f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
