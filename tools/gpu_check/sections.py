"""gpu-check's sections, run in order by cli.py once Triton's mode is decided."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from common.prepare_model import default_model_dir
from gpu_worker.runner.cuda_graphs import graph_batch_sizes
from tools.gpu_check import kernels as K
from tools.gpu_check import lora as L
from tools.gpu_check import model as M
from tools.gpu_check import quant as Q
from tools.gpu_check.plan import SHAPES, Plan
from tools.gpu_check.report import Report

LORA_PATTERNS = ("round-robin", "segments")


def _shapes() -> list[K.AttnShape]:
    return [K.AttnShape(*s) for s in SHAPES]


def kernel_checks(plan: Plan, device: str) -> list[dict[str, Any]]:
    rng = random.Random(0)
    torch.manual_seed(0)
    rows = []
    for dtype in plan.dtypes:
        for shape in _shapes():
            for batch, max_ctx in plan.decode_batches:
                # mixed lengths: the longest, 1, one past a block edge, then random ones
                fixed = [max_ctx, 1, plan.block_size + 1]
                lens = (fixed + [rng.randint(1, max_ctx) for _ in range(batch)])[:batch]
                rows.append(K.check_paged_decode(shape, lens, plan.block_size, dtype, device))
            for requests in plan.extend_batches:
                rows.append(K.check_extend(shape, list(requests), plan.block_size, dtype, device))
            rows.append(K.check_kv_store(shape, plan.store_tokens, plan.block_size, dtype, device))
            rows.append(K.check_rotary(shape, plan.store_tokens, dtype, device))
        rows.append(K.check_rms_norm(*plan.norm_shape, dtype, device))
        for m, n, k in plan.quant_checks:
            rows += [Q.check_gguf(qtype, m, n, k, dtype, device) for qtype in Q.QTYPES]
            rows.append(Q.check_int8(m, n, k, dtype, device))
        for case in plan.lora_checks:
            rows += [L.check_lora(case, p, dtype, device) for p in LORA_PATTERNS]
    return rows


def decode_bandwidth(plan: Plan, device: str) -> list[dict[str, Any]]:
    copy = K.copy_bandwidth(plan.copy_bytes, device, plan.iters)
    return [
        K.decode_bandwidth(
            shape,
            b,
            ctx,
            plan.block_size,
            torch.bfloat16 if device == "cuda" else torch.float32,
            device,
            plan.iters,
            copy,
        )  # fmt: skip
        for shape in _shapes()
        for b, ctx in plan.bandwidth_cases
    ]


def extend_speed(plan: Plan, device: str) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return [
        K.extend_speed(shape, b, n, plan.block_size, dtype, device, plan.iters)
        for shape in _shapes()
        for b, n in plan.flops_cases
    ]


def quant_speed(plan: Plan, device: str) -> list[dict[str, Any]]:
    """GGUF and int8 GEMMs vs dequantize-then-torch.mm and vs torch.mm on dense weights."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for m, n, k in plan.quant_speed_cases:
        rows += [Q.gguf_speed(qtype, m, n, k, dtype, device, plan.iters) for qtype in Q.QTYPES]
        rows.append(Q.int8_speed(m, n, k, dtype, device, plan.iters))
    return rows


def lora_speed(plan: Plan, device: str) -> list[dict[str, Any]]:
    """The LoRA kernels vs torch per adapter and vs the base layer's GEMM."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return [
        L.lora_speed(case, pattern, dtype, device, plan.iters)
        for case in plan.lora_speed_cases
        for pattern in LORA_PATTERNS
    ]


def model_folder(plan: Plan, given: Path | None, tmp: Path) -> tuple[Path, str]:
    if given is not None:
        return given, str(given)
    if plan.model_shape == "smollm2" and (default_model_dir() / "config.json").is_file():
        return default_model_dir(), "default SmolLM2-135M-Instruct"
    shape = M.SMOLLM2_SHAPE if plan.model_shape == "smollm2" else M.TINY_SHAPE
    return M.random_model_folder(tmp / "model", shape), f"random {plan.model_shape}-shaped"


def graph_timing(plan: Plan, device: str, folder: Path) -> dict[str, Any]:
    """bf16 (fp32 on the CPU) decode steps: eager vs graph replay, triton backend."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    max_batch = max(plan.graph_batches)
    blocks = max_batch * (-(-(plan.graph_context + 1) // 16)) + 1
    engine = M.Engine(folder, backend="triton", dtype=dtype, device=device, num_blocks=blocks,
                      max_model_len=plan.graph_context + 16)  # fmt: skip
    result: dict[str, Any] = {"buckets": graph_batch_sizes(max_batch)}
    if device == "cuda":
        engine.capture(max_batch)
    else:
        result["note"] = "no CUDA: eager timings only, graphs not captured"
    result["steps"] = M.decode_step_times(engine, list(plan.graph_batches), plan.graph_context,
                                          plan.iters)  # fmt: skip
    return result


def greedy_parity(plan: Plan, device: str, folder: Path) -> dict[str, Any]:
    """fp32 greedy tokens of our model (triton, CUDA graphs) vs transformers, same device."""
    rng = random.Random(1)
    vocab = M.LlamaConfig.from_hf(M.read_hf_config(folder)).vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 60))]
               for _ in range(plan.parity_prompts)]  # fmt: skip
    new = plan.parity_new_tokens
    blocks = sum(-(-(len(p) + new) // 16) for p in prompts) + 1
    engine = M.Engine(folder, backend="triton", dtype=torch.float32, device=device,
                      num_blocks=blocks, max_model_len=128)  # fmt: skip
    if device == "cuda":
        engine.capture(len(prompts))
    ours = engine.greedy(prompts, new, use_graphs=device == "cuda")
    reference = M.hf_greedy(folder, prompts, new, device)
    return {**M.parity(ours, reference), "cuda_graphs": device == "cuda"}


def run_sections(report: Report, plan: Plan, device: str, model: Path | None, tmp: Path) -> None:
    """Correctness first, so a spent time budget skips measurements, not proofs."""
    report.run("kernels", lambda: kernel_checks(plan, device))
    folder, source = model_folder(plan, model, tmp)
    report.sections["model"] = source
    report.run("parity", lambda: greedy_parity(plan, device, folder))
    report.run("cuda_graphs", lambda: graph_timing(plan, device, folder))
    report.run("decode_bandwidth", lambda: decode_bandwidth(plan, device))
    report.run("extend_speed", lambda: extend_speed(plan, device))
    report.run("quant_speed", lambda: quant_speed(plan, device))
    report.run("lora_speed", lambda: lora_speed(plan, device))
