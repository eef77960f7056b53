"""Time one linear layer on the CPU: float32 paths against int8 W8A8 paths (microseconds).

    .venv/bin/python -m tools.benchmarks.int8_linear [--rows 1,8,64,512] [--budget 0.3]
    .venv/bin/python -m tools.benchmarks.int8_linear --cpu-time     # one thread, CPU time

SmolLM2-135M's shapes [out, in]. Columns: float32 `F.linear` (MKL), float32 C small-batch
kernel (gpu_worker/cpu/linear.c, <= 8 rows), float32 oneDNN on a pre-packed weight; int8 by
torch (int8_linear_torch: `torch._int_mm` with VNNI), int8 sums alone by torch's float32 GEMM
on the integer values (exact; the torch path's without VNNI), int8 by oneDNN on a pre-packed
weight (x quantized per row by the C kernel), int8 C kernel (int8.c), and `int8_linear` as it
chooses. Each figure is the
fastest of as many calls as fit in `--budget` seconds: on a shared CPU the fastest is the
run least disturbed, and medians move with the neighbours' load. Where the cores are
oversubscribed even that is not enough: `--cpu-time` runs every path on one thread and counts
the CPU time that thread used (what a core costs, less cache effects of the neighbours).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_worker.cpu import int8, linear

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
COLUMNS = ("f32", "f32_c", "f32_pk", "i8_torch", "i8_fgemm", "i8_onednn", "i8_c", "int8_linear")


def fastest_us(
    fn: Callable[[], object], budget: float, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The fastest of at least 3 calls of `fn` (more while `budget` seconds last), in us of
    `clock`."""
    fn()
    best, n, start = float("inf"), 0, time.perf_counter()
    while n < 3 or (time.perf_counter() - start < budget and n < 1000):
        t = clock()
        fn()
        best = min(best, clock() - t)
        n += 1
    return best * 1e6


def _calls(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object] | None]:
    wq, ws = int8.quantize_weight(w)
    pk = linear.pack_weight(w) if linear.can_pack(torch.float32) else None
    qpk = int8.pack_weight(wq)
    lib = int8.load()
    y = torch.empty(x.shape[0], w.shape[0])
    if lib is None:
        raise SystemExit("the int8 kernel library cannot be built here")
    return {
        "f32": lambda: F.linear(x, w),
        "f32_c": (lambda: linear.linear_small(x, w, None)) if x.shape[0] <= 8 else None,
        "f32_pk": (lambda: linear.linear_packed(x, pk, None)) if pk is not None else None,
        "i8_torch": lambda: int8.int8_linear_torch(x, wq, ws, None),
        "i8_fgemm": lambda: int8.exact_sums(int8.quantize_rows(x)[0], wq, int_mm=False),
        "i8_onednn": (lambda: int8._onednn(lib, x, qpk, ws, None)) if qpk is not None else None,
        "i8_c": lambda: int8._kernel(lib, x, wq, ws, None, y),
        "int8_linear": lambda: int8.int8_linear(x, wq, ws, None, qpk),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,64,512", help="rows of x, comma-separated")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per figure")
    parser.add_argument("--layers", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    parser.add_argument("--cpu-time", action="store_true", help="one thread, its CPU time")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    what = "thread CPU time" if args.cpu_time else "wall time"
    print(f"threads {torch.get_num_threads()}; us of {what}, fastest in {args.budget} s")
    print(f"{'layer':8} {'rows':>4} " + " ".join(f"{c:>11}" for c in COLUMNS))
    for name in args.layers.split(","):
        out, inn = SHAPES[name]
        w = torch.randn(out, inn)
        for rows in (int(r) for r in args.rows.split(",")):
            calls = _calls(torch.randn(rows, inn), w)
            cells = [
                f"{fastest_us(fn, args.budget, clock):11.0f}" if fn is not None else f"{'-':>11}"
                for fn in (calls[c] for c in COLUMNS)
            ]
            print(f"{name:8} {rows:4d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
