"""What this machine's CPU can do fast, read from /proc/cpuinfo (Linux; elsewhere: nothing).

`--dtype auto` asks here: bfloat16 pays on a CPU only with native bf16 arithmetic
(AVX512_BF16 dot products, or AMX tiles); without them (AVX2-only CPUs) every bf16 weight is
converted in software and float32 is faster (docs/benchmarks.md), so auto picks float32.
"""

from __future__ import annotations

import functools
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags (empty when the file cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def auto_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """`--dtype auto`: bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere."""
    if device == "cuda":
        return "bfloat16"
    have = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in have for f in BF16_FLAGS) else "float32"
