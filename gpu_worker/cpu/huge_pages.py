"""Model weights and the KV cache on the CPU in transparent huge pages (2 MB).

A decode step streams every weight once and reads the KV cache in scattered blocks: with
4 KB pages that is a TLB miss every 4 KB, and in a virtual machine (nested paging) each miss
walks two page tables. Linux gives huge pages to anonymous memory that asks for them
(madvise MADV_HUGEPAGE) where /sys/kernel/mm/transparent_hugepage/enabled is "madvise", the
usual default, and to all of it where it is "always"; torch's allocator does not ask. On a
2-core AVX2 EPYC VM the LM head's few-row linear read its 113 MB at 19.3 -> 22.5 GB/s from
huge pages, a plain sum 22.7 -> 25-28 GB/s (docs/bench/notes/peers_avx2.md).

`use_huge_pages(model)` moves every parameter into one such mapping (tied weights once);
`zeros(shape, dtype)` is a zero-filled tensor in one (the KV cache). Where the kernel has no
transparent huge pages ("never", or not Linux) they are plain anonymous memory: the same
tensors, 4 KB pages. The worker takes them unless `--no-cpu-huge-pages`
(tools/benchmarks/step_account --no-huge-pages measures the difference).
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each tensor of an arena starts on a cache line
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether madvise can ask for huge pages here: Linux, and THP not "never"."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP.read_text()
    except OSError:
        return False


def _arena(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping of at least `nbytes` asked for huge pages, and the offset in it
    of its first 2 MB-aligned byte (only whole aligned 2 MB ranges can be huge pages)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE
    m.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take 2 MB pages
    return m, offset


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in memory asked for huge pages (the mapping lives as long as
    the tensor), its pages touched now so the memory is had at once, as torch.zeros has it."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    m, offset = _arena(nbytes)
    t = torch.frombuffer(m, dtype=dtype, count=count, offset=offset).view(shape)
    t.zero_()  # anonymous memory reads as zeros already; this commits it
    return t


def use_huge_pages(model: nn.Module) -> int:
    """Move the CPU parameters of `model` into one huge-page mapping, in place (a parameter
    shared by two modules moves once); the bytes moved, 0 where huge pages are unavailable."""
    if not available():
        return 0
    params: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        if p.device.type == "cpu" and p.is_contiguous():
            params.setdefault(p.data_ptr(), p)
    if not params:
        return 0
    sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params.values()]
    m, at = _arena(sum(sizes))
    for p, size in zip(params.values(), sizes, strict=True):
        dest = torch.frombuffer(m, dtype=p.dtype, count=p.numel(), offset=at).view(p.shape)
        dest.copy_(p.data)
        p.data = dest
        at += size
    return sum(sizes)
