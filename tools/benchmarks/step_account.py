"""Where a decode step's time goes: timers around the C kernels, the oneDNN linears, the K/V
store and the model's forward, decode steps driven as tools/benchmarks/step.py drives them
(B=1 at context 200 by default, 2 threads).

    .venv/bin/python -m tools.benchmarks.step_account
    .venv/bin/python -m tools.benchmarks.step_account --batch 64 --context 300
    .venv/bin/python -m tools.benchmarks.step_account --layer-by-layer   # kernels one by one
    .venv/bin/python -m tools.benchmarks.step_account --prefill 512      # a prompt's chunk
    .venv/bin/python -m tools.benchmarks.step_account --batch 64 --context 300 --kv-cache-dtype int8
    GOMP_SPINCOUNT=0 .venv/bin/python -m tools.benchmarks.step_account   # threads sleep at once
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import gpu_worker.attention.torch_backend as torch_backend
import gpu_worker.cpu.gguf as gguf
import gpu_worker.cpu.int8 as int8
import gpu_worker.cpu.layers as layers
import gpu_worker.cpu.linear as linear
import gpu_worker.cpu.one_call_step as one_call_step
import gpu_worker.cpu.paged_decode as paged_decode
from common.prepare_model import default_gguf_path, prepare_default_model
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from tools.benchmarks import step

LINEAR, ATTENTION, LAYERS = "linear (C, weights streamed)", "attention (C)", "norm/rotary/silu (C)"
ONE_CALL = "every decoder layer (C, one call)"
PACKED, STORE = "linear (oneDNN, packed weights)", "K/V store (torch index_copy_)"
QUANT = "linear (quantized: GGUF / int8 kernels)"
EXTEND = "prefill attention (torch SDPA, gathers; besides its C kernel)"
KERNELS = (ONE_CALL, LINEAR, PACKED, QUANT, ATTENTION, EXTEND, STORE, LAYERS)


_inner: list[float] = []  # per timed kernel call in progress: the time of the calls inside it


def _timed(spent: dict[str, float], key: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """f, its time added to spent[key]; a kernel's own time only, less the timed kernels it
    calls (the prefill attention's _extend calls paged_prefill: counted once, under it). The
    forward's time is its whole."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        own = key != "forward"
        if own:
            _inner.append(0.0)
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            took = time.perf_counter() - t
            if own:
                inside = _inner.pop()
                if _inner:
                    _inner[-1] += took
                took -= inside
            spent[key] += took

    return wrapper


def _prefills(
    runner: ModelRunner, tokens: int, steps: int, spent: dict[str, float]
) -> tuple[float, dict[str, float]]:
    """The fastest of `steps` prefills of a fresh `tokens`-token prompt, one per step:
    (ms, ms per part)."""
    drv, rng = step._Driver(runner), random.Random(0)
    best: tuple[float, dict[str, float]] = (float("inf"), {})
    for i in range(max(2, min(steps, 8))):
        spent.clear()
        prompt = [rng.randrange(1000, 40000) for _ in range(tokens)]
        t0 = time.perf_counter()
        drv.step({f"p{i}": prompt}, [(f"p{i}", tokens)])
        took = (time.perf_counter() - t0) * 1e3
        if i and took < best[0]:  # the first pays for warm-up
            best = (took, {k: v * 1e3 for k, v in spent.items()})
    return best


def _model_path(model: str) -> str:
    if model == "default-gguf":
        return str(default_gguf_path())
    return model or str(prepare_default_model())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--context", type=int, default=200, help="tokens each has before")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed (each one longer)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--layer-by-layer", action="store_true", help="not the one-call C step")
    p.add_argument("--prefill", type=int, default=0, help="time N-token prefill steps instead")
    p.add_argument("--no-huge-pages", action="store_true", help="weights, KV in 4 KB pages")
    p.add_argument(
        "--model",
        default="",
        help="a folder or GGUF file (default: the default model's float32 folder; "
        "default-gguf: its Q4_1 file)",
    )
    p.add_argument("--quantization", default="", help="'' or int8 (quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, int8, fp8, fp8_e4m3, fp8_e5m2")
    args = p.parse_args()
    steps = args.steps
    spent: dict[str, float] = collections.defaultdict(float)
    patches: list[tuple[Any, str, str]] = [
        (linear, "linear_small", LINEAR),
        (linear, "linear_packed", PACKED),
        (gguf, "gguf_linear", QUANT),
        (int8, "int8_linear", QUANT),
        (paged_decode, "paged_decode", ATTENTION),
        (paged_decode, "paged_prefill", ATTENTION),
        (torch_backend.TorchAttentionBackend, "_extend", EXTEND),
        (torch_backend, "_store_kv", STORE),
        (LlamaForCausalLM, "forward", "forward"),
        (one_call_step.OneCallStep, "_decode", ONE_CALL),
        *((layers, n, LAYERS) for n in ("rms_norm", "add_rms_norm", "rotary_neox", "silu_mul")),
    ]
    for owner, name, key in patches:
        setattr(owner, name, _timed(spent, key, getattr(owner, name)))
    options = RunnerOptions(
        quantization=args.quantization,
        dtype=args.dtype,
        num_threads=2,
        kv_cache_memory_gib=1.5,
        cpu_huge_pages=not args.no_huge_pages,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    runner = ModelRunner(_model_path(args.model), options)
    if args.layer_by_layer:  # the model's layers one by one, not the one-call C step
        runner.model.model.one_call_step = None
    if args.prefill:
        total, ms = _prefills(runner, args.prefill, steps, spent)
        what = f"prefill step ({args.prefill} tokens, {args.dtype})"
    else:
        drv, rids, _ = step.start_batch(runner, args.batch, args.context, 512, 0)
        for _ in range(3):
            drv.step({}, [(r, 1) for r in rids])
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            drv.step({}, [(r, 1) for r in rids])
        total = (time.perf_counter() - t0) / steps * 1e3
        ms = {k: v / steps * 1e3 for k, v in spent.items()}
        # each step adds a token: the timed steps attend over `steps` growing lengths (after
        # the prefill's `context` tokens and three untimed steps)
        first = args.context + 4
        what = (
            f"decode step (B={args.batch}, attending {first}..{first + steps - 1} positions, "
            f"{args.dtype}, "
            f"KV {args.kv_cache_dtype})"
        )
    kernels = sum(ms.get(k, 0.0) for k in KERNELS)
    print(
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')}"
    )
    print(f"{what}: {total:.1f} ms")
    print(f"  model forward: {ms['forward']:.1f} ms")
    for key in KERNELS:
        if key in ms:
            print(f"    {key}: {ms.get(key, 0.0):.1f} ms")
    print(f"    the rest of the forward (torch ops, Python): {ms['forward'] - kernels:.1f} ms")
    print(f"  outside the forward (plan, metadata, sampling): {total - ms['forward']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
