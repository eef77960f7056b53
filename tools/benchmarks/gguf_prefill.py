"""A prefill chunk's GEMMs on GGUF weights: the AMX int8-tile GEMM against the AVX one and
oneDNN (float32 pre-packed, as gpu_worker's float path; int8 W8A8 pre-packed, as int8.py).

    .venv/bin/python -m tools.benchmarks.gguf_prefill [--rows 512] [--threads 2] [--cpu-time]

For each SmolLM2-135M weight shape of the real Q4_1 file (its Q8_0 vocabulary matrix too),
milliseconds for `--rows` rows of x, the fastest of a few calls (weights hot):
  amx       gguf_linear_many on AMX tiles (gguf_amx.h; "-" where the CPU or OS has none)
  avx       the same GEMM on AVX registers (VNNI, or AVX2 maddubs)
  f32_pk    oneDNN float32 on the dequantized weight, pre-packed (linear.linear_packed)
  i8_onednn oneDNN int8 on a per-row int8 copy of the weight, pre-packed (int8._onednn; "-"
            where int8.can_pack() is False)
then the sum over one layer's linears (q, k, v, o, gate, up, down) times the file's layers.
`--cpu-time`: one thread, the CPU time it used (what a core costs; on a shared machine the
wall-clock fastest still moves with the neighbours' load: say so with the figures).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from gpu_worker.cpu import int8, linear
from gpu_worker.cpu.gguf import GgufKernels
from tools.benchmarks.gguf_kernels import load_tensors

COLUMNS = ("amx", "avx", "f32_pk", "i8_onednn")


def fastest_ms(fn: Callable[[], object], cpu_time: bool, reps: int = 10) -> float:
    clock = time.thread_time if cpu_time else time.perf_counter
    fn()
    best = float("inf")
    for _ in range(reps):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best * 1e3


def calls(
    k: GgufKernels, x: torch.Tensor, w: torch.Tensor, qtype: int, out: int, inn: int
) -> dict[str, Callable[[], object] | None]:
    wf = k.dequantize(w, qtype, out, inn)
    pk = linear.pack_weight(wf) if linear.can_pack(torch.float32) else None
    wq, ws = int8.quantize_weight(wf)
    qpk, lib8 = int8.pack_weight(wq), int8.load()
    amx = k.amx_available()
    return {
        "amx": (lambda: k.linear_rows(x, w, qtype, out, inn, path="amx")) if amx else None,
        "avx": lambda: k.linear_rows(x, w, qtype, out, inn, path="many_avx"),
        "f32_pk": (lambda: linear.linear_packed(x, pk, None)) if pk is not None else None,
        "i8_onednn": (lambda: int8._onednn(lib8, x, qpk, ws, None))
        if qpk is not None and lib8 is not None
        else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, CPU time")
    args = parser.parse_args(argv)
    torch.set_num_threads(1 if args.cpu_time else args.threads)
    k = GgufKernels()
    if k.load() is None:
        raise SystemExit("the GGUF kernel library could not be built")
    tensors = load_tensors()
    layers = sum(1 for name, *_ in tensors if name.endswith("attn_q.weight"))
    clock = "CPU time, 1 thread" if args.cpu_time else f"wall, {args.threads} threads"
    print(f"{args.rows} rows, ms ({clock}); AMX {'on' if k.amx_available() else 'off'}")
    print(f"{'tensor':<22} {'type':<5} {'shape':<13}" + "".join(f"{c:>10}" for c in COLUMNS))
    layer = dict.fromkeys(COLUMNS, 0.0)
    x_by_in: dict[int, torch.Tensor] = {}
    for name, w, qtype, out, inn in tensors:
        if not (name.startswith("blk.0.") or name == "token_embd.weight"):
            continue  # every layer has blk.0's shapes
        x = x_by_in.setdefault(inn, torch.randn(args.rows, inn))
        times = {
            c: (fastest_ms(fn, args.cpu_time) if fn is not None else float("nan"))
            for c, fn in calls(k, x, w, qtype, out, inn).items()
        }
        if name.startswith("blk."):
            for c in COLUMNS:
                layer[c] += times[c]
        qname = "Q8_0" if qtype == 8 else "Q4_1" if qtype == 3 else str(qtype)
        cells = "".join(f"{times[c]:10.2f}" for c in COLUMNS)
        print(f"{name:<22} {qname:<5} {f'{out}x{inn}':<13}{cells}", flush=True)
    cells = "".join(f"{layer[c] * layers:10.1f}" for c in COLUMNS)
    print(f"{f'{layers} layers linears':<41}{cells}")


if __name__ == "__main__":
    main()
