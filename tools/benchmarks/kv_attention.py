"""Time the CPU decode attention kernel alone over each KV cache format (ms per decode step).

    .venv/bin/python -m tools.benchmarks.kv_attention [--batch 64] [--context 300] [--threads 2]
    .venv/bin/python -m tools.benchmarks.kv_attention --cpu-time     # one thread, CPU time

One decode step of SmolLM2-135M's attention: `--batch` sequences of about `--context` tokens
(contexts spread over +-15%), 9 query heads over 3 KV heads of 64, one call of the C kernel
(gpu_worker/cpu/paged_decode.py) per layer over that layer's own cache (30 caches, so the step
reads its KV from memory as a served step does, not from a cache that fits in L3), blocks of
the server's default size scattered at random. Formats: float32, bfloat16 and the quantized
rows of `--kv-cache-dtype` (gpu_worker/kv_quant.py), all from the same float32 values. A
repeat times `--steps` steps of every format in turn (neighbours' load then weighs on all
alike); each figure is the median over `--repeats` repeats of one step's mean time. On a machine
whose cores are busy elsewhere, `--cpu-time` runs one thread and counts the CPU time it used
(what a core costs, less the neighbours' effect on the caches and memory).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch

from common.config import CacheConfig
from gpu_worker.cpu import paged_decode
from gpu_worker.kv_quant import KVFormat
from tools.benchmarks.peers import cpu_identity

FORMATS = ("float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M


def _format(name: str) -> KVFormat:
    if name in ("float32", "bfloat16"):
        return KVFormat.create("auto", getattr(torch, name))
    return KVFormat.create(name, torch.float32)


def _tables(contexts: list[int], block_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """[batch, max blocks] int32 block tables over shuffled blocks, and the blocks in all."""
    counts = [-(-c // block_size) for c in contexts]
    order = list(range(sum(counts)))
    random.Random(seed).shuffle(order)
    tables = torch.zeros(len(contexts), max(counts), dtype=torch.int32)
    at = 0
    for i, n in enumerate(counts):
        tables[i, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
    return tables, len(order)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if paged_decode.load() is None:
        raise SystemExit("the C decode kernel cannot be built here")
    spread = random.Random(1)
    contexts = [int(args.context * spread.uniform(0.85, 1.15)) for _ in range(args.batch)]
    tables, num_blocks = _tables(contexts, args.block_size, seed=2)
    lens = torch.tensor(contexts, dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen)
    shape = (2, num_blocks, args.block_size, KV_HEADS, HEAD_DIM)
    caches: dict[str, list[torch.Tensor]] = {name: [] for name in args.formats}
    for _ in range(args.layers):  # one float32 layer at a time, stored in every format
        values = torch.randn(shape, generator=gen)
        for name in args.formats:
            caches[name].append(_format(name).quantize(values))
    scale = HEAD_DIM**-0.5

    def step(name: str) -> None:
        fmt = _format(name)
        for cache in caches[name]:
            out = paged_decode.paged_decode(q, cache, tables, lens, scale, kv_format=fmt)
            assert out is not None

    samples: dict[str, list[float]] = {name: [] for name in args.formats}
    for name in args.formats:
        step(name)  # warm: the library built, pages touched
    clock = time.thread_time if args.cpu_time else time.perf_counter
    for _ in range(args.repeats):
        for name in args.formats:
            t0 = clock()
            for _ in range(args.steps):
                step(name)
            samples[name].append((clock() - t0) / args.steps * 1e3)
    rows = []
    for name in args.formats:
        per_step = sum(c[0].nbytes + c[1].nbytes for c in caches[name]) / num_blocks
        read = per_step * sum(-(-c // args.block_size) for c in contexts)  # whole blocks
        ms = statistics.median(samples[name])
        rows.append({"format": name, "ms": ms, "samples_ms": samples[name],
                     "kv_mb": read / 1e6, "gb_s": read / ms / 1e6})  # fmt: skip
    return {
        "machine": cpu_identity()
        | {"threads": args.threads, "load": os.getloadavg(), "cpu_time": args.cpu_time},
        "shape": {
            "batch": args.batch,
            "context": args.context,
            "layers": args.layers,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": args.block_size,
        },
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["shape"]
    threads = "1 thread (CPU time)" if m["cpu_time"] else f"{m['threads']} threads"
    lines = [
        f"CPU: {m['cpu']}, flags {' '.join(m['flags'])}; {threads}; "
        f"load average {' '.join(f'{x:.2f}' for x in m['load'])}",
        f"{s['batch']} sequences of ~{s['context']} tokens, {s['layers']} layers of "
        f"{s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, blocks of {s['block_size']}",
        f"{'format':<10} {'ms/step':>8} {'x f32':>6} {'KV MB':>7} {'GB/s':>6}  samples (ms)",
    ]
    base = next((r["ms"] for r in result["rows"] if r["format"] == "float32"), None)
    for r in result["rows"]:
        ratio = f"{base / r['ms']:.2f}" if base else "-"
        samples = " ".join(f"{x:.2f}" for x in r["samples_ms"])
        lines.append(f"{r['format']:<10} {r['ms']:>8.2f} {ratio:>6} {r['kv_mb']:>7.1f} "
                     f"{r['gb_s']:>6.1f}  {samples}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--context", type=int, default=300, help="their typical length (tokens)")
    p.add_argument("--layers", type=int, default=LAYERS, help="kernel calls (caches) per step")
    p.add_argument("--block-size", type=int, default=CacheConfig().block_size)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="the figure is their median")
    p.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    p.add_argument("--cpu-time", action="store_true", help="one thread, its CPU time")
    args = p.parse_args(argv)
    if args.cpu_time:
        args.threads = 1
    unknown = set(args.formats) - set(FORMATS)
    if unknown:
        p.error(f"unknown formats {sorted(unknown)}; choose from {list(FORMATS)}")
    print(render(measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
