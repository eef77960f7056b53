"""Time a prefill/decode hand-over's block moves alone (ms per block), and their parts.

    .venv/bin/python -m tools.benchmarks.kv_handover [--blocks 64] [--repeats 3] [--dir /dev/shm]

Two KV pools of SmolLM2-135M's shape (30 layers, 3 KV heads of 64, blocks of 16: 737 KiB a
float32 block, `--kv-cache-dtype` for others), one thread: the prefill worker's export of
`--blocks` blocks to files in `--dir` (gpu_worker/kv_handover.py: out of the pool, checksum,
header, write) and the decode worker's import of the same files into other blocks (read,
checks, checksum, copy in); each figure the median over `--repeats`. Then the import's parts
on one block, timed alone: the file read, the CRC-32 checksum, the copy into the pool.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.cpu_features import cpu_flags
from common.messages import StepPlan
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_handover import KVHandover
from gpu_worker.kv_tiers import checksum, read_header


def _pool(num_blocks: int, kv_cache_dtype: str) -> KVCache:
    kv = KVCache(num_layers=30, num_blocks=num_blocks, block_size=16, num_kv_heads=3,
                 head_dim=64, dtype=torch.float32, device=torch.device("cpu"),
                 kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    kv.tensor.copy_(torch.randint(0, 255, kv.tensor.shape).to(kv.tensor.dtype))
    return kv


def _ms(fn: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - start) / n


def measure(blocks: int, repeats: int, folder: Path, kv_cache_dtype: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    src, dst = _pool(blocks, kv_cache_dtype), _pool(2 * blocks, kv_cache_dtype)
    ids = list(range(blocks))
    keys, tokens = [1000 + b for b in ids], [[b] * 16 for b in ids]
    paths = [str(folder / f"{b}.kv") for b in ids]
    export = StepPlan(step_id=1, kv_export_src=ids, kv_export_keys=keys, kv_export_tokens=tokens,
                      kv_export_versions=["v"] * blocks, kv_export_paths=paths)  # fmt: skip
    imp = StepPlan(step_id=2, kv_import_dst=[blocks + b for b in ids], kv_import_keys=keys,
                   kv_import_tokens=tokens, kv_import_versions=["v"] * blocks,
                   kv_import_paths=paths)  # fmt: skip
    out, into = KVHandover(src, TensorParallel()), KVHandover(dst, TensorParallel())
    exports, imports = [], []
    for _ in range(repeats):
        exports.append(_ms(lambda: out.apply(export), 1) / blocks)
        imports.append(_ms(lambda: into.apply(imp), 1) / blocks)
    assert torch.equal(dst.tensor[:, :, blocks:], src.tensor), "a block did not land intact"
    raw = Path(paths[0]).read_bytes()
    payload = memoryview(raw)[read_header(raw)[1] :]
    block = src.tensor[:, :, 0].clone()
    return {
        "block_bytes": len(payload),
        "kv_cache_dtype": kv_cache_dtype,
        "export_ms": statistics.median(exports),
        "import_ms": statistics.median(imports),
        "read_ms": _ms(lambda: Path(paths[0]).read_bytes(), 100),
        "checksum_ms": _ms(lambda: checksum(payload), 100),
        "copy_in_ms": _ms(lambda: dst.tensor[:, :, 0].copy_(block), 100),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else "")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as folder:
        r = measure(args.blocks, args.repeats, Path(folder), args.kv_cache_dtype)
    flags = " ".join(f for f in sorted(cpu_flags()) if f.startswith(("avx", "amx")))
    print(f"cpu flags: {flags}")
    print(
        f"{r['block_bytes'] / 1024:.0f} KiB a block ({r['kv_cache_dtype']}), 1 thread: "
        f"export {r['export_ms']:.3f} ms, import {r['import_ms']:.3f} ms a block; "
        f"alone: read {r['read_ms']:.3f}, CRC-32 {r['checksum_ms']:.3f}, "
        f"copy in {r['copy_in_ms']:.3f} ms"
    )


if __name__ == "__main__":
    main()
