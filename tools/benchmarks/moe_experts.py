"""A mixture of experts' float32 experts in moe.c, layer by layer, weights cold.

    .venv/bin/python -m tools.benchmarks.moe_experts [--tokens 512 64 1] [--against REV]
        [--march haswell]

One call of moe.c's `moe_experts` per layer over `--layers` layers of the proportions of
tools/benchmarks/moe_model.py (hidden 1024, 32 experts of width 512, top-4; random weights in
linear.c's GEMM panels, 192 MB a layer: more than the caches, as in a served model), each
token routed to 4 distinct experts at random. Prints the median over `--rounds` passes of ms
a layer and GFLOP/s of the experts' arithmetic, for each token count. With `--against REV`,
the kernels' sources of that git revision are built beside this checkout's and the two run
alternately in this process, on the same weights and routes, with a check that they give the
same bits (a kernel change's before and after in one sitting).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker.cpu import linear, moe
from gpu_worker.cpu.build import load_library

HIDDEN, WIDTH, EXPERTS, TOP_K = 1024, 512, 32, 4


def build(source_dir: Path, march: str) -> ctypes.CDLL:
    """moe.c of `source_dir` and the sources beside it that it #includes, built (once, in the
    kernels' cache) by build.py for gcc's -march=`march`."""
    source = source_dir / "moe.c"
    includes = tuple(sorted(p for p in source_dir.glob("*.[ch]") if p != source))
    return load_library(source, includes, march)


def sources_at(rev: str, into: Path) -> Path:
    """gpu_worker/cpu's C sources and headers of git revision `rev`, written into `into`."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "gpu_worker/cpu/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for name in names:
        if name.endswith((".c", ".h")):
            text = subprocess.run(
                ["git", "show", f"{rev}:{name}"], check=True, capture_output=True
            ).stdout
            (into / Path(name).name).write_bytes(text)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 64, 1])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", default="", help="a git revision to compare with")
    parser.add_argument("--march", default="native", help="gcc's -march (haswell: AVX2 only)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    libs = {"this checkout": build(Path(moe.HERE), args.march)}
    if args.against:
        old = sources_at(args.against, Path(tempfile.mkdtemp(prefix="moe-experts-")))
        libs[args.against] = build(old, args.march)
    layers = []
    for _ in range(args.layers):
        w13 = linear.pack_panels(torch.randn(EXPERTS, 2 * WIDTH, HIDDEN) * 0.03)
        w2 = linear.pack_panels(torch.randn(EXPERTS, HIDDEN, WIDTH) * 0.03)
        desc = moe.experts_desc(moe.KIND_F32, w13, w2, WIDTH, HIDDEN)
        assert desc is not None
        layers.append((w13, w2, desc))
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN)
        ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
        weights = torch.rand(tokens, TOP_K)
        counts = torch.zeros(EXPERTS, dtype=torch.int64)
        times: dict[str, list[float]] = {name: [] for name in libs}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name, lib in libs.items():
                y = torch.empty(tokens, HIDDEN)
                t0 = time.perf_counter()
                for _, _, desc in layers:
                    code = lib.moe_experts(
                        ctypes.byref(desc), ctypes.c_void_p(x.data_ptr()), tokens,
                        ctypes.c_void_p(ids.data_ptr()), ctypes.c_void_p(weights.data_ptr()),
                        TOP_K, ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(counts.data_ptr()),
                        args.threads,
                    )  # fmt: skip
                    if code:
                        raise SystemExit(f"moe_experts returned {code}")
                times[name].append((time.perf_counter() - t0) / len(layers))
                outs[name] = y
        flops = tokens * TOP_K * 2 * 3 * WIDTH * HIDDEN
        same = all(torch.equal(o, outs["this checkout"]) for o in outs.values())
        print(
            f"{tokens} tokens{'' if len(libs) == 1 else ', same bits' if same else ', BITS DIFFER'}"
        )
        for name, t in times.items():
            ms = statistics.median(t) * 1e3
            print(f"  {name:20s} {ms:8.2f} ms a layer  {flops / ms / 1e6:6.0f} GFLOP/s")


if __name__ == "__main__":
    main()
