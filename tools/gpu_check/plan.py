"""gpu-check's plan: every shape it runs (`Plan.full()` on a GPU, `Plan.tiny()` for
--dry-run), its memory estimate, and the checks a plan must pass before anything runs.

Imports torch only; the kernel helpers are imported inside functions, once cli.py has
decided whether Triton interprets (CPU) or compiles (CUDA).
"""

from __future__ import annotations

import dataclasses

import torch

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
    # (M, N, K) of the quantized GEMMs, every GGUF type and int8; K a multiple of 256
    quant_checks: tuple[tuple[int, int, int], ...]
    quant_speed_cases: tuple[tuple[int, int, int], ...]
    # (tokens, in, output slice widths, rank) of the LoRA kernels, each round-robin over 8
    # adapters and base rows, and as 8 runs of one adapter (tools/gpu_check/lora.py)
    lora_checks: tuple[tuple[int, int, tuple[int, ...], int], ...]
    lora_speed_cases: tuple[tuple[int, int, tuple[int, ...], int], ...]

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
            quant_checks=((7, 1000, 1536), (300, 2048, 4096)),  # decode and prefill tiles
            quant_speed_cases=((1, 4096, 4096), (8, 14336, 4096), (64, 4096, 14336),
                               (512, 4096, 4096)),
            lora_checks=((8, 4096, (4096, 1024, 1024), 16), (300, 4096, (14336, 14336), 64),
                         (33, 14336, (4096,), 16)),
            lora_speed_cases=((1, 4096, (4096, 1024, 1024), 16), (8, 4096, (4096, 1024, 1024), 16),
                              (64, 4096, (14336, 14336), 16), (512, 4096, (14336, 14336), 16),
                              (8, 576, (576, 192, 192), 16), (512, 576, (1536, 1536), 16)),
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
            quant_checks=((3, 40, 256),), quant_speed_cases=((2, 32, 256),),
            lora_checks=((5, 64, (48, 16, 16), 8), (20, 64, (96,), 16)),  # bgmv, sgmv
            lora_speed_cases=((3, 64, (96,), 8),),
        )  # fmt: skip


def memory_estimate(plan: Plan) -> dict[str, float]:
    """GiB of the largest tensors each section holds at once (kernels: the worst case)."""
    from tools.gpu_check.kernels import AttnShape, kv_cache_bytes

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
    # a float32 dequantized weight, its bf16 copy and the raw weight, at most 4 bytes each
    quant = max(3 * 4 * n * k for _, n, k in plan.quant_checks + plan.quant_speed_cases)
    sizes = {
        "kernels": max(decode, extend) / GIB,
        "quant": quant / GIB,
        "bandwidth": max(bandwidth, 2 * plan.copy_bytes) / GIB,
        "model": 2.0 if plan.model_shape == "smollm2" else 0.1,
    }
    return {**sizes, "peak": max(sizes.values())}


MAX_PEAK_GIB = 40.0  # the full plan must fit a 48 GB GPU beside the CUDA context


def plan_problems(plan: Plan) -> list[str]:
    """What is wrong with a plan, checked before anything runs: [] when it is sound."""
    from gpu_worker.runner.cuda_graphs import graph_batch_sizes

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
    if any(k % 256 for _, _, k in plan.quant_checks + plan.quant_speed_cases):
        problems.append("quantized GEMM K must be a multiple of 256 (the K-quant blocks)")
    peak = memory_estimate(plan)["peak"]
    if peak > MAX_PEAK_GIB:
        problems.append(f"peak memory estimate {peak:.1f} GiB exceeds {MAX_PEAK_GIB} GiB")
    return problems
