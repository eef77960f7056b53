"""tools/gpu-check: prove and measure the worker's GPU path in one command (see cli.py).

    python tools/gpu-check [--dry-run] [--out FILE]     (or: python -m tools.gpu_check)

    cli        the command: environment, plan checks, the import guard, the JSON document
    plan       every shape it runs and its memory estimate (torch only)
    report     sections of rows, errors, time spent; the printed table
    sections   the checks in order: kernels, parity, CUDA graphs, bandwidth, TFLOP/s
    kernels    each Triton kernel against its torch reference, and timings
    model      a decode step with and without CUDA graphs, greedy parity with transformers

cli imports plan and report; sections (imported by cli once Triton's mode is set) imports
plan, report, kernels and model; nothing imports cli or sections back. Outside torch,
triton and transformers they import only gpu_worker and common/prepare_model.py: the GPU
machine has none of the serving stack (cli checks that nothing of it was imported).
"""
