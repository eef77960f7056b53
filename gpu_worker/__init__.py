"""The model process (worker) and what it runs: model runner, models, attention, kernels."""

import os

# OpenMP threads that spin while they wait for work are ruinous when the worker shares its
# cores (with the gateway, scheduler, detokenizer, a load generator, anything else): measured
# on 2 cores, matmuls and decode steps were 3-20x slower with spinning threads than with
# sleeping ones, and at most ~10% faster when the cores were otherwise idle. libgomp reads
# this when torch loads, so it is set here, before any gpu_worker module imports torch; an
# operator's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
