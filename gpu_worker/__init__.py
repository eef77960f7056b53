"""The model process (worker) and what it runs: model runner, models, attention, kernels."""

import os

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
