"""The batched LoRA kernels on the CPU (gpu_worker/cpu/lora.c) against torch, and the one-call
decode step of SmolLM2 with and without an active adapter.

    .venv/bin/python -m tools.benchmarks.lora_kernels [--threads 2] [--tokens 1 8 64 512]
    .venv/bin/python -m tools.benchmarks.lora_kernels --no-kernels     # the decode step only
    .venv/bin/python -m tools.benchmarks.lora_kernels --no-kernels --lora-dtype bfloat16

Kernels: 8 adapters of rank 16 in float32 on SmolLM2-135M's four LoRA layers (qkv_proj
576 -> 576|192|192, o_proj 576 -> 576, gate_up_proj 576 -> 1536|1536, down_proj 1536 -> 576),
T tokens whose slots are round-robin (a decode batch: every token another adapter) or 8
contiguous segments (prefill chunks of 8 requests). Milliseconds, best of a few calls, for
  seg      torch per segment (per slot): x[rows] @ A.T, then @ B.T into y's slice
  bmm      torch gather-style: each token's A and B gathered, two torch.bmm
  C        lora.c (lora_add), in place
Decode step: SmolLM2 (float32, the C kernels, the one-call step) at context `--context`, B=1
with no adapter, then with a rank-16 adapter on all 7 targets, median ms per step (the ITL
ratio; the issue's target is <= 1.15x); then B=8 with 8 adapters round-robin against B=8 base;
steps without and with adapters interleaved; wall time (best, median) and the process's CPU
time (median: less sensitive to a busy machine's preemption, but counts OpenMP spinning);
`--lora-dtype bfloat16` keeps the slots in bf16 (half the bytes; lora.c widens them).
Timings on a machine whose cores are shared are upper bounds: say so with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gpu_worker.cpu import lora
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig

RANK, ADAPTERS = 16, 8
# (layer, in, slice bounds) of SmolLM2-135M
SHAPES = (
    ("qkv_proj", 576, [0, 576, 768, 960]),
    ("o_proj", 576, [0, 576]),
    ("gate_up_proj", 576, [0, 1536, 3072]),
    ("down_proj", 1536, [0, 576]),
)


def best_ms(fn: Callable[[], object], budget_s: float = 0.2, max_reps: int = 30) -> float:
    """The fastest of a few calls (after one warm-up), in ms."""
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < max_reps and (reps < 3 or spent < budget_s):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best * 1e3


def torch_segments(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: list[int],
    slots: torch.Tensor,
) -> None:  # fmt: skip
    """torch's way for segments: per slot, the rows' shrink and expand, added into y."""
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().flatten()
        xs = x[rows]
        for s in range(len(bounds) - 1):
            lo, hi = bounds[s], bounds[s + 1]
            y[rows, lo:hi] += (xs @ a[slot, s].T) @ b[slot, lo:hi].T


def torch_bmm(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: list[int],
    slots: torch.Tensor,
) -> None:  # fmt: skip
    """torch's way for decode rows: each token's A and B gathered, torch.bmm (every token has
    an adapter here)."""
    idx = slots.long()
    num_slices = a.shape[1]
    ag = a[idx].reshape(x.shape[0], num_slices * a.shape[2], a.shape[3])  # [T, C*R, in]
    z = torch.bmm(ag, x.unsqueeze(2)).reshape(x.shape[0], num_slices, a.shape[2])
    bg = b[idx]  # [T, out, R]
    for s in range(num_slices):
        lo, hi = bounds[s], bounds[s + 1]
        y[:, lo:hi] += torch.bmm(bg[:, lo:hi], z[:, s].unsqueeze(2)).squeeze(2)


def _row(name: str, inn: int, bounds: list[int], tokens: int, pattern: str) -> str:
    a = torch.randn(ADAPTERS, len(bounds) - 1, RANK, inn) * 0.05
    b = torch.randn(ADAPTERS, bounds[-1], RANK) * 0.05
    x, y = torch.randn(tokens, inn), torch.zeros(tokens, bounds[-1])
    if pattern == "round-robin":
        order = [t % ADAPTERS for t in range(tokens)]
    else:
        order = [t * ADAPTERS // tokens for t in range(tokens)]
    slots, bt = torch.tensor(order, dtype=torch.int32), lora.slice_bounds_tensor(bounds)
    seg = best_ms(lambda: torch_segments(y, x, a, b, bounds, slots))
    bmm = best_ms(lambda: torch_bmm(y, x, a, b, bounds, slots)) if tokens <= 64 else float("nan")
    c = best_ms(lambda: lora.lora_add(y, x, a, b, bt, slots))
    return f"{name:13s} {tokens:4d} {pattern:12s} {seg:8.3f} {bmm:8.3f} {c:8.3f}"


def kernels(tokens_list: list[int]) -> None:
    print(f"LoRA kernels: {ADAPTERS} adapters, rank {RANK}, float32, ms (best of a few)")
    print(f"{'layer':13s} {'T':>4s} {'slots':12s} {'seg':>8s} {'bmm':>8s} {'C':>8s}")
    for name, inn, bounds in SHAPES:
        for tokens in tokens_list:
            for pattern in ("round-robin", "segments"):
                print(_row(name, inn, bounds, tokens, pattern))


def _smollm2() -> LlamaForCausalLM:
    """SmolLM2-135M (float32) with the CPU's C kernels and one-call step."""
    from common.prepare_model import default_model_dir
    from gpu_worker.attention.torch_backend import TorchAttentionBackend
    from gpu_worker.layers.kernel_choice import choose_kernels
    from gpu_worker.model_loader.hf_folder import read_hf_config
    from gpu_worker.model_loader.loader import load_model

    folder, cpu = default_model_dir(), torch.device("cpu")
    cfg = LlamaConfig.from_hf(read_hf_config(folder))
    backend = TorchAttentionBackend(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        dtype=torch.float32, device=cpu,
    )  # fmt: skip
    kernels = choose_kernels(device=cpu, backend_name="torch", dtype=torch.float32)
    return load_model(folder, backend, dtype=torch.float32, device=cpu, max_positions=2048,
                      kernels=kernels)  # fmt: skip


def _step(model: LlamaForCausalLM, batch: int, context: int) -> Callable[[], object]:
    """A decode step of `batch` sequences at `context` (the same step each call: its cost does
    not depend on the tokens)."""
    from gpu_worker.attention.metadata import build_metadata

    inner = model.model
    attn = inner.layers[0].self_attn
    block_size = 16
    per_seq = context // block_size + 1
    kv = torch.randn(len(inner.layers), 2, batch * per_seq, block_size, attn.num_kv_heads,
                     attn.head_dim) * 0.1  # fmt: skip
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    meta = attn.backend.build_metadata(
        build_metadata([context] * batch, [1] * batch, tables, block_size)
    )
    ids = torch.randint(0, 49152, (batch,))

    def step() -> object:
        with torch.inference_mode():
            return inner(ids, meta.positions, kv, meta)

    return step


def decode_steps(context: int, steps: int, lora_dtype: torch.dtype) -> None:
    """Steps without and with adapters interleaved (a busy machine slows both alike), best
    and median of each."""
    from gpu_worker.cpu import one_call_step
    from gpu_worker.lora.layer import LoraLinearMethod, enable_lora, lora_layers

    model = _smollm2()
    assert isinstance(model.model.one_call_step, one_call_step.OneCallStep)
    mapping = enable_lora(model, max_loras=ADAPTERS, max_rank=RANK, max_tokens=8, kernel="cpu")
    with torch.no_grad():
        for _, layer, _ in lora_layers(model):
            method = layer.method
            assert isinstance(method, LoraLinearMethod)
            # slots in another dtype than the model's (lora.c reads float32 or bf16)
            method.lora_a = torch.randn(method.lora_a.shape).mul_(0.02).to(lora_dtype)
            method.lora_b = torch.randn(method.lora_b.shape).mul_(0.02).to(lora_dtype)
    print(
        f"one-call step, SmolLM2-135M float32, LoRA slots {lora_dtype}, context "
        f"{context}, {steps} steps each: "
        "wall ms best / median, CPU ms (all threads) median"
    )
    for batch, lora_slots in ((1, [0]), (8, list(range(ADAPTERS)))):
        step = _step(model, batch, context)
        wall: dict[str, list[float]] = {"base": [], "lora": []}
        cpu: dict[str, list[float]] = {"base": [], "lora": []}
        for i in range(steps + 2):
            for key, slots in (("base", [-1] * batch), ("lora", lora_slots)):
                mapping.set(slots)
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                if i >= 2:
                    wall[key].append((time.perf_counter() - t0) * 1e3)
                    cpu[key].append((time.process_time() - c0) * 1e3)
        best = {k: min(v) for k, v in wall.items()}
        med = {k: statistics.median(v) for k, v in wall.items()}
        cmed = {k: statistics.median(v) for k, v in cpu.items()}
        print(
            f"B={batch}, {len(set(lora_slots))} adapter(s) of rank {RANK} on 7 targets: "
            f"base {best['base']:.2f} / {med['base']:.2f} / {cmed['base']:.2f}, "
            f"LoRA {best['lora']:.2f} / {med['lora']:.2f} / {cmed['lora']:.2f}; ratio "
            f"{best['lora'] / best['base']:.3f} / {med['lora'] / med['base']:.3f} / "
            f"{cmed['lora'] / cmed['base']:.3f}"
        )
    mapping.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-kernels", action="store_true")
    p.add_argument("--no-step", action="store_true")
    p.add_argument("--lora-dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if lora.load() is None:
        raise SystemExit("the LoRA C kernel cannot be built here")
    if not args.no_kernels:
        kernels(args.tokens)
    if not args.no_step:
        decode_steps(args.context, args.steps, getattr(torch, args.lora_dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
