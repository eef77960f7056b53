"""tools/gpu-check: prove and measure the worker's GPU path in one command (< 5 minutes).

On a CUDA machine it
  1. checks every Triton kernel against its float32 torch reference on realistic shapes
     (SmolLM2's 9 heads / 3 KV heads / 64 dims and a 32 / 8 / 128 layer; contexts up to 8k;
     batches up to 256), in fp32 (max abs error <= 2e-3) and bf16 (<= 2e-2);
  2. measures the paged decode kernel's bytes/s against a device-to-device copy of the run;
  3. measures the extend kernel's TFLOP/s against torch's scaled_dot_product_attention;
  4. times a bf16 decode step with and without CUDA graphs at batch 1, 8 and 64;
  5. compares greedy tokens (fp32, triton backend, CUDA graphs) with transformers;
then writes one JSON file and prints a table. It needs only torch, triton and transformers.

`--dry-run` validates the plan anywhere: it prints the plan and its memory estimate, then
runs every check on tiny shapes (under Triton's interpreter on a CPU) and verifies that no
module outside torch/triton/transformers was imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# the wire stack of the other processes: none of it exists on the GPU machine
FORBIDDEN_MODULES = ("orjson", "zmq", "fastapi", "uvicorn", "httpx", "openai", "pydantic")
SHAPES = (("smollm2-9h-3kv-64d", 9, 3, 64), ("32h-8kv-128d", 32, 8, 128))
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every shape gpu-check runs; `full()` on a GPU, `tiny()` for --dry-run."""

    dtypes: tuple[torch.dtype, ...]
    block_size: int
    decode_batches: tuple[tuple[int, int], ...]  # (batch, longest context): lengths random
    extend_batches: tuple[tuple[tuple[int, int], ...], ...]  # requests of (prefix, new)
    store_tokens: int
    norm_shape: tuple[int, int]  # (rows, hidden)
    bandwidth_cases: tuple[tuple[int, int], ...]  # (batch, context)
    copy_bytes: int
    flops_cases: tuple[tuple[int, int], ...]  # (batch, new tokens), prefill from 0
    iters: int
    graph_batches: tuple[int, ...]
    graph_context: int
    model_shape: str  # "smollm2" or "tiny" (random weights when no default model)
    parity_prompts: int
    parity_new_tokens: int

    @classmethod
    def full(cls) -> Plan:
        return cls(
            dtypes=(torch.float32, torch.bfloat16), block_size=16,
            decode_batches=((1, 8192), (7, 17), (64, 4096), (256, 8192)),
            extend_batches=(((0, 1), (15, 17), (0, 2048), (3000, 500), (7000, 1192)),
                            ((16, 16), (33, 1), (1000, 3000))),
            store_tokens=8192, norm_shape=(8192, 4096),
            bandwidth_cases=((1, 8192), (64, 8192), (256, 2048)), copy_bytes=GIB,
            flops_cases=((1, 8192), (8, 2048)), iters=20,
            graph_batches=(1, 8, 64), graph_context=512, model_shape="smollm2",
            parity_prompts=4, parity_new_tokens=32,
        )  # fmt: skip

    @classmethod
    def tiny(cls) -> Plan:
        return cls(
            dtypes=(torch.float32,), block_size=16,
            decode_batches=((3, 40),), extend_batches=(((0, 5), (17, 3)),),
            store_tokens=16, norm_shape=(4, 576),
            bandwidth_cases=((1, 32),), copy_bytes=1 << 20,
            flops_cases=((1, 32),), iters=1,
            graph_batches=(1, 2), graph_context=16, model_shape="tiny",
            parity_prompts=2, parity_new_tokens=4,
        )  # fmt: skip


def memory_estimate(plan: Plan) -> dict[str, float]:
    """GiB of the largest tensors each section holds at once (kernels: the worst case)."""
    from tools.gpu_check_kernels import AttnShape, kv_cache_bytes

    shapes = [AttnShape(*s) for s in SHAPES]
    big = max(shapes, key=lambda s: s.num_kv_heads * s.head_dim)
    bs, fp32 = plan.block_size, 4
    decode = max(kv_cache_bytes([ctx] * b, big, bs, fp32) for b, ctx in plan.decode_batches)
    extend = 0
    for reqs in plan.extend_batches:
        kv = kv_cache_bytes([c + n for c, n in reqs], big, bs, fp32)
        # the reference's float32 scores and probabilities for its largest request
        scores = max(3 * big.num_heads * n * (c + n) * 4 for c, n in reqs)
        extend = max(extend, kv + scores)
    bandwidth = max(kv_cache_bytes([ctx] * b, big, bs, 2) for b, ctx in plan.bandwidth_cases)
    sizes = {
        "kernels": max(decode, extend) / GIB,
        "bandwidth": max(bandwidth, 2 * plan.copy_bytes) / GIB,
        "model": 2.0 if plan.model_shape == "smollm2" else 0.1,
    }
    return {**sizes, "peak": max(sizes.values())}


MAX_PEAK_GIB = 40.0  # the full plan must fit a 48 GB GPU beside the CUDA context


def plan_problems(plan: Plan) -> list[str]:
    """What is wrong with a plan, checked before anything runs: [] when it is sound."""
    from gpu_worker.cuda_graphs import graph_batch_sizes

    problems = []
    for name, heads, kv_heads, head_dim in SHAPES:
        if heads % kv_heads or head_dim % 2:
            problems.append(f"{name}: {heads} heads / {kv_heads} KV heads / {head_dim} dims")
    contexts = [ctx for _, ctx in plan.decode_batches + plan.bandwidth_cases]
    contexts += [c + n for reqs in plan.extend_batches for c, n in reqs]
    contexts += [n for _, n in plan.flops_cases]
    if max(contexts) > 8192 or min(contexts) < 1:
        problems.append(f"contexts must be in [1, 8192], got {min(contexts)}..{max(contexts)}")
    if max(b for b, _ in plan.decode_batches + plan.bandwidth_cases) > 256:
        problems.append("decode batches above 256")
    buckets = graph_batch_sizes(max(plan.graph_batches))
    if not set(plan.graph_batches) <= set(buckets):
        problems.append(f"graph batches {plan.graph_batches} are not all buckets of {buckets}")
    peak = memory_estimate(plan)["peak"]
    if peak > MAX_PEAK_GIB:
        problems.append(f"peak memory estimate {peak:.1f} GiB exceeds {MAX_PEAK_GIB} GiB")
    return problems


class Report:
    """Sections of rows, errors, and the time spent; written as one JSON document."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.sections: dict[str, Any] = {}
        self.section_s: dict[str, float] = {}
        self.errors: list[dict[str, str]] = []

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        """Run one section; an exception fails that section only, the rest still run."""
        if time.monotonic() - self.start > self.budget_s:
            self.errors.append({"section": name, "error": "skipped: time budget spent"})
            return
        t0 = time.monotonic()
        try:
            self.sections[name] = fn()
        except Exception as e:  # a broken section must not hide the others' results
            self.errors.append({"section": name, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()})  # fmt: skip
        self.section_s[name] = time.monotonic() - t0
        print(f"[gpu-check] {name}: {self.section_s[name]:.1f} s", file=sys.stderr)

    def ok(self) -> bool:
        if self.errors:
            return False
        kernels = self.sections.get("kernels", [])
        return all(r["ok"] for r in kernels) and self.sections.get("parity", {}).get("ok", True)


def environment(device: str) -> dict[str, Any]:
    import transformers
    import triton

    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        env.update(gpu_free_gib=free / GIB, gpu_total_gib=total / GIB)
    return env


def _describe(plan: Plan) -> dict[str, str]:
    return {k: str(v) for k, v in dataclasses.asdict(plan).items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/gpu-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the plan and run every check on tiny shapes",
    )
    parser.add_argument("--out", default="gpu-check.json", help="the JSON file to write")
    parser.add_argument(
        "--model",
        default="",
        help="HF folder for the model checks "
        "(default: the SmolLM2 default model if prepared, else random weights)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="skip the sections not yet started after this many seconds",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not args.dry_run:
            print("gpu-check needs a CUDA device; use --dry-run to validate it here.")
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        torch.set_num_threads(min(2, torch.get_num_threads()))
    from tools.gpu_check_sections import print_table, run_sections

    plan = Plan.tiny() if args.dry_run else Plan.full()
    estimate = memory_estimate(Plan.full())
    report = Report(args.budget_s)
    problems = plan_problems(Plan.full()) + plan_problems(plan)
    if (
        device == "cuda"
        and memory_estimate(plan)["peak"] > 0.9 * torch.cuda.mem_get_info()[0] / GIB
    ):
        problems.append("the plan's peak memory estimate exceeds 90% of the free GPU memory")
    for problem in problems:
        report.errors.append({"section": "plan", "error": problem})
    print(f"[gpu-check] device {device}; full plan peak memory ~{estimate['peak']:.1f} GiB",
          file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run_sections(report, plan, device, Path(args.model) if args.model else None, Path(tmp))
    leaked = sorted(m for m in FORBIDDEN_MODULES if sys.modules.get(m) is not None)
    if leaked:
        report.errors.append({"section": "imports", "error": f"imported {leaked}"})
    doc = {
        "ok": report.ok(),
        "dry_run": args.dry_run,
        "wall_s": time.monotonic() - report.start,
        "section_s": report.section_s,
        "environment": environment(device),
        "plan": _describe(plan),
        "full_plan": _describe(Plan.full()),
        "memory_estimate_gib": estimate,
        "forbidden_modules_imported": leaked,
        **report.sections,
        "errors": report.errors,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str))
    print_table(doc)
    print(f"wrote {args.out}; {'OK' if doc['ok'] else 'FAILED'}")
    return 0 if doc["ok"] else 1
