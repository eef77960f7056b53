"""The model process (worker) and what it runs: model runner, models, attention, kernels."""

import ctypes
import os
import sys

# OpenMP threads that spin while they wait for work are ruinous when the worker shares its
# cores with other busy jobs: measured on 2 cores, decode steps were 2.5-20x slower with
# spinning threads than with sleeping ones. But a thread that sleeps at once takes tens of
# microseconds to wake, and a decode step runs ~150 parallel regions (one per matmul): on
# cores that serve nothing else, a brief spin (GOMP_SPINCOUNT=10000, ~0.1-0.2 ms, then
# sleep) made one stream's inter-token latency 24% lower and the mixed workload 18% faster
# (docs/benchmarks.md, "Peers"). So: sleep, after a brief spin. On a machine shared with
# other work, GOMP_SPINCOUNT=0 makes them sleep at once (the tests run so). libgomp reads
# these when torch loads, so they are set here, before any gpu_worker module imports torch;
# an operator's own settings win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# oneDNN keeps one compiled primitive per linear shape, and the number of rows changes with
# every step (prefill chunks, decode batches): ~1 ms to create one, against 0.3-5 ms to run
# it (gpu_worker/cpu/linear.py). Room for every row count up to a few thousand across the
# model's five weight shapes, instead of the default 1024 entries.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")


def _keep_freed_memory() -> None:
    """glibc's malloc hands every block over its mmap threshold (128 KB at start, raised
    as such blocks are freed, at most 32 MB) straight from the kernel and back, and gives the
    top of its heap back once 128 KB of it is free: each step's activations (a 512-token chunk
    of a 1024-wide model: 2 MB a tensor, dozens of them a layer) then cost a page fault per
    4 KB, again every step. Blocks up to 32 MB from the heap, and freed memory kept for reuse
    up to 1 GiB, made a 512-token prefill step of a float32 MoE model 1,340-1,510 -> 1,060-
    1,120 ms on 2 Zen 4 cores (docs/benchmarks.md; what vLLM's CPU backend gets by preloading
    tcmalloc). glibc reads its MALLOC_* settings at start, before this: an operator who set
    them (or GLIBC_TUNABLES) keeps them."""
    if not sys.platform.startswith("linux") or any(
        k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in os.environ
    ):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


_keep_freed_memory()
