"""tools/gpu-check: prove and measure the worker's GPU path in one command (< 5 minutes).

On a CUDA machine it
  1. checks every Triton kernel against its float32 torch reference on realistic shapes
     (SmolLM2's 9 heads / 3 KV heads / 64 dims and a 32 / 8 / 128 layer; contexts up to 8k;
     batches up to 256), in fp32 (max abs error <= 2e-3) and bf16 (<= 2e-2);
  2. measures the paged decode kernel's bytes/s against a device-to-device copy of the run;
  3. measures the extend kernel's TFLOP/s against torch's scaled_dot_product_attention;
  4. times a bf16 decode step with and without CUDA graphs at batch 1, 8 and 64;
  5. compares greedy tokens (fp32, triton backend, CUDA graphs) with transformers;
  6. times the quantized GEMMs (every GGUF block type, W8A8 int8; checked in step 1) against
     dequantize-then-torch.mm and torch.mm on dense weights, decode M=1/8 to prefill M=512;
  7. checks the batched LoRA kernels (in step 1: 8 adapters round-robin with base rows, and
     runs of one adapter) and times them against torch per adapter and the base layer's GEMM;
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
from pathlib import Path
from typing import Any

import torch

from tools.gpu_check.plan import GIB, Plan, memory_estimate, plan_problems
from tools.gpu_check.report import Report, print_table

# the wire stack of the other processes: none of it exists on the GPU machine
FORBIDDEN_MODULES = ("orjson", "zmq", "fastapi", "uvicorn", "httpx", "openai", "pydantic")


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
    from tools.gpu_check.sections import run_sections

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


if __name__ == "__main__":
    sys.exit(main())
