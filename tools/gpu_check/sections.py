"""gpu-check's sections, run in order by tools/gpu_check.py, and its printed table."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpu_worker.cuda_graphs import graph_batch_sizes
from gpu_worker.prepare_model import default_model_dir
from tools import gpu_check_kernels as K
from tools import gpu_check_model as M

if TYPE_CHECKING:
    from tools.gpu_check import Plan, Report


def _shapes() -> list[K.AttnShape]:
    from tools.gpu_check import SHAPES

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


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    if not rows:
        return
    print(f"\n{title}")
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.2f}"
    return str(value)


def print_table(doc: dict[str, Any]) -> None:
    _table(
        "kernels vs reference",
        doc.get("kernels", []),
        ["kernel", "shape", "case", "dtype", "max_abs_err", "tolerance", "ok"],
    )
    _table(
        "paged decode bandwidth",
        doc.get("decode_bandwidth", []),
        ["shape", "batch", "context", "ms", "achieved_GBps", "copy_GBps", "fraction_of_copy"],
    )
    _table(
        "extend (prefill) attention",
        doc.get("extend_speed", []),
        ["shape", "batch", "new_tokens", "ours_TFLOPs", "sdpa_TFLOPs", "ours_over_sdpa"],
    )
    graphs = doc.get("cuda_graphs", {})
    _table(
        f"decode step, {doc.get('model', '')} model",
        graphs.get("steps", []),
        ["batch", "context", "eager_ms", "graph_ms", "speedup"],
    )
    if "parity" in doc:
        p = doc["parity"]
        print(
            f"\ngreedy parity with transformers: {p['matching']}/{p['tokens']} tokens"
            f" (first mismatch: {p['first_mismatch']})"
        )
    for error in doc.get("errors", []):
        print(f"\nERROR in {error['section']}: {error['error']}")  # fmt: skip
