"""The LoRA contract every piece of the adapter path shares: the per-layer buffers, the
per-token slot mapping, and the reference arithmetic the kernels must equal.

A LoRA-enabled model has, in each targeted `Linear` (qkv_proj, o_proj, gate_up_proj,
down_proj of every decoder layer), a `LoraLinearMethod` wrapping the layer's base method
(float, GGUF, int8: whatever the kernel choice gave it) and holding two buffers of
`max_loras` slots:

    lora_a  [max_loras, num_slices, max_rank, in_features]   float32 (the model's dtype on CUDA)
    lora_b  [max_loras, out_features, max_rank]               scaling folded in at load

The layer's output is cut into `num_slices` slices by `slice_bounds` (qkv_proj: q | k | v;
gate_up_proj: gate | up; others: one slice): output row j of slice s uses slice s's A. PEFT's
separate q_proj/k_proj/v_proj (gate_proj/up_proj) adapters land in their slice; an adapter
that does not target a module, a rank below max_rank and an empty slot are zeros. For a token
t whose slot is s = token_slots[t] (-1: the base model, no delta):

    y[t, j] += sum_k lora_b[s, j, k] * sum_i lora_a[s, slice(j), k, i] * x[t, i]

`lora_delta_reference` is that formula in torch: the kernels (C on the CPU, inside the
one-call step too; Triton on CUDA) are tested against it.

One `LoraMapping` per model, shared by all its LoRA layers, holds the step's token slots; the
runner sets it before each forward (vLLM's punica wrapper shape: layers read the step's
mapping and the forward signature does not change). CUDA graphs are off while LoRA is on
(gpu_worker/runner/options.py): the layers read the mapping's host-side runs and flags.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpu_worker.cpu import lora as cpu_lora
from gpu_worker.cpu import one_call_descriptors
from gpu_worker.cpu.one_call_descriptors import DecodeLinear, Keep
from gpu_worker.layers.linear import Linear, LinearMethod
from gpu_worker.layers.linear_methods.weights import CheckpointWeight

# PEFT target module -> (our fused layer, slice index within it)
TARGET_SLICES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


# a run of at least this many consecutive tokens of one adapter (a prefill chunk) takes the
# CPU's GEMM (oneDNN through torch: 3-5x the C kernel's speed at 512 tokens, which is built
# for gathered decode rows); shorter runs, and every decode of the one-call step (at most
# linear.MAX_ROWS rows), take the C kernel
LONG_RUN = 64


class LoraMapping:
    """Which adapter slot each token of the step uses (-1: none), for every LoRA layer of one
    model. `token_slots` is a persistent int32 buffer of `max_tokens` entries; `num_tokens`
    of them are this step's. `active` is False when no token of the step has an adapter (the
    layers then add nothing and cost nothing). For the CPU kernel the step is also cut once
    into `long_runs` ((slot, first, end) of runs of >= LONG_RUN tokens of one adapter) and
    `short_slots` (token_slots with those runs' tokens at -1)."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.buffer = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.num_tokens = 0
        self.active = False
        self.long_runs: list[tuple[int, int, int]] = []
        self.short_slots = self.buffer[:0]
        self.any_short = False

    def set(self, token_slots: list[int]) -> None:
        """This step's slots, token by token in the packed order of the forward's input."""
        n = len(token_slots)
        if n > self.buffer.numel():  # grow
            self.buffer = torch.full((n,), -1, dtype=torch.int32, device=self.buffer.device)
        self.buffer[:n].copy_(torch.tensor(token_slots, dtype=torch.int32))
        self.num_tokens = n
        self.active = any(s >= 0 for s in token_slots)
        self.long_runs = _long_runs(token_slots) if self.active else []
        short = list(token_slots)
        for _, lo, hi in self.long_runs:
            short[lo:hi] = [-1] * (hi - lo)
        self.any_short = any(s >= 0 for s in short)
        self.short_slots = (
            torch.tensor(short, dtype=torch.int32, device=self.buffer.device)
            if self.long_runs
            else self.token_slots
        )

    def clear(self) -> None:
        self.num_tokens = 0
        self.active = False
        self.long_runs = []

    @property
    def token_slots(self) -> torch.Tensor:
        return self.buffer[: self.num_tokens]


def _long_runs(token_slots: list[int]) -> list[tuple[int, int, int]]:
    """(slot, first, end) of each run of >= LONG_RUN consecutive tokens of one adapter."""
    runs: list[tuple[int, int, int]] = []
    lo = 0
    for i in range(1, len(token_slots) + 1):
        if i == len(token_slots) or token_slots[i] != token_slots[lo]:
            if token_slots[lo] >= 0 and i - lo >= LONG_RUN:
                runs.append((token_slots[lo], lo, i))
            lo = i
    return runs


def lora_delta_reference(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, num_slices, R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    slice_bounds: list[int],  # [num_slices + 1] output offsets, 0 .. out
    token_slots: torch.Tensor,  # [T] int32, -1: none
) -> torch.Tensor:  # [T, out] float32
    """The LoRA delta of each token by the module docstring's formula, in float32."""
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().flatten()
        for s in range(len(slice_bounds) - 1):
            lo, hi = slice_bounds[s], slice_bounds[s + 1]
            shrunk = xf[rows] @ lora_a[slot, s].float().T  # [n, R]
            out[rows, lo:hi] += shrunk @ lora_b[slot, lo:hi].float().T
    return out


class LoraLinearMethod:
    """A layer's base method plus each token's adapter delta (see the module docstring).
    The base method keeps the layer's weight; this one adds `lora_a`/`lora_b` and reads the
    model's shared `mapping`. `kernel`: "torch" (the reference), "cpu" (C), "triton"."""

    name = "lora"

    def __init__(
        self,
        base: LinearMethod,
        *,
        in_features: int,
        slice_bounds: list[int],
        max_loras: int,
        max_rank: int,
        mapping: LoraMapping,
        dtype: torch.dtype,
        device: torch.device,
        kernel: str = "torch",
    ) -> None:
        self.base = base
        self.slice_bounds = slice_bounds
        self.mapping = mapping
        self.kernel = kernel
        out_features, num_slices = slice_bounds[-1], len(slice_bounds) - 1
        self.lora_a = torch.zeros(
            max_loras, num_slices, max_rank, in_features, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)
        # [num_slices + 1] int32: the kernels' copy of slice_bounds
        self.bounds = torch.tensor(slice_bounds, dtype=torch.int32, device=device)
        self._kernel_add = self._choose_kernel(kernel)

    @property
    def storage(self) -> str:
        return self.base.storage

    def load_weights(
        self, layer: Linear, weight: CheckpointWeight, bias: torch.Tensor | None
    ) -> None:
        self.base.load_weights(layer, weight, bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        if not self.mapping.active:
            return y
        if self._kernel_add is not None:
            flat = y.reshape(-1, y.shape[-1])
            if flat.is_contiguous() and self._kernel_add(flat, x.reshape(-1, x.shape[-1])):
                return y
        delta = lora_delta_reference(
            x.reshape(-1, x.shape[-1]),
            self.lora_a,
            self.lora_b,
            self.slice_bounds,
            self.mapping.token_slots,
        )
        return y + delta.to(y.dtype).reshape(y.shape)

    def one_call_linear(self, layer: Linear, keep: Keep) -> DecodeLinear | None:
        """The base method's descriptor plus this layer's slots, and the model's mapping
        into `keep`; None unless lora.c adds the deltas (the "cpu" kernel: the layers' own
        arithmetic would differ from lora.c's)."""
        if self.kernel != "cpu":
            return None
        desc = self.base.one_call_linear(layer, keep)
        if desc is None:
            return None
        assert keep.lora in (None, self.mapping), "one mapping per model"
        keep.lora = self.mapping
        return one_call_descriptors.with_lora(desc, self.lora_a, self.lora_b, self.bounds)

    def _choose_kernel(self, kernel: str) -> Callable[[torch.Tensor, torch.Tensor], bool] | None:
        """The function adding the step's deltas into y [T, out] in place for x [T, in] (False:
        it cannot run here, the caller takes the reference); None for "torch". Chosen once:
        triton is imported only where it is asked for."""
        if kernel == "torch":
            return None
        if kernel == "cpu":

            def cpu(y: torch.Tensor, x: torch.Tensor) -> bool:
                mapping = self.mapping
                if mapping.long_runs:  # prefill chunks: the CPU's GEMM
                    for slot, lo, hi in mapping.long_runs:
                        self._add_run_gemm(y[lo:hi], x[lo:hi], slot)
                    if not mapping.any_short:
                        return True
                slots = mapping.short_slots
                return cpu_lora.lora_add(y, x, self.lora_a, self.lora_b, self.bounds, slots)

            return cpu
        if kernel == "triton":
            from gpu_worker.kernels.lora.kernel import lora_add

            def triton(y: torch.Tensor, x: torch.Tensor) -> bool:
                lora_add(
                    y, x, self.lora_a, self.lora_b, self.slice_bounds, self.mapping.token_slots
                )
                return True

            return triton
        raise ValueError(f"unknown LoRA kernel {kernel!r} (torch, cpu or triton)")

    def _add_run_gemm(self, y: torch.Tensor, x: torch.Tensor, slot: int) -> None:
        """y [n, out] += the delta of n tokens of one adapter: one GEMM for every slice's
        shrink, one per slice's expand (float32 sums; bf16 weights widened first)."""
        num_slices, rank, n_in = self.lora_a.shape[1:]
        a = self.lora_a[slot].reshape(num_slices * rank, n_in).float()
        z = x.float() @ a.T  # [n, num_slices * rank]
        b = self.lora_b[slot].float()
        for c in range(num_slices):
            lo, hi = self.slice_bounds[c], self.slice_bounds[c + 1]
            zc = z[:, c * rank : (c + 1) * rank]
            if y.dtype == torch.float32:  # in place: no delta tensor, one pass over y
                y[:, lo:hi].addmm_(zc, b[lo:hi].T)
            else:
                y[:, lo:hi] += (zc @ b[lo:hi].T).to(y.dtype)

    def extra_bytes(self, layer: Linear) -> int:
        lora = self.lora_a.numel() * self.lora_a.element_size()
        return (
            self.base.extra_bytes(layer) + lora + self.lora_b.numel() * self.lora_b.element_size()
        )

    def __repr__(self) -> str:
        slots, _, rank, _ = self.lora_a.shape
        return f"LoRA({self.base!r}, slots={slots}, rank={rank}, kernel={self.kernel})"


def lora_layers(model: nn.Module) -> list[tuple[str, Linear, list[int]]]:
    """Every linear a LoRA adapter may target, with its name and output slice bounds (this
    rank's shard under tensor parallelism: the bounds are the shard's)."""
    from gpu_worker.models.llama import MLP, Attention

    found: list[tuple[str, Linear, list[int]]] = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            q, k, v = module.split_sizes
            found.append((f"{name}.qkv_proj", module.qkv_proj, [0, q, q + k, q + k + v]))
            found.append((f"{name}.o_proj", module.o_proj, [0, module.o_proj.out_features]))
        elif isinstance(module, MLP):
            width = module.down_proj.in_features
            found.append((f"{name}.gate_up_proj", module.gate_up_proj, [0, width, 2 * width]))
            found.append(
                (f"{name}.down_proj", module.down_proj, [0, module.down_proj.out_features])
            )
    return found


def enable_lora(
    model: nn.Module,
    *,
    max_loras: int,
    max_rank: int,
    max_tokens: int,
    kernel: str = "torch",
    dtype: torch.dtype | None = None,
) -> LoraMapping:
    """Wrap every targetable linear's method in a `LoraLinearMethod` of `max_loras` empty
    slots (after the base weights are loaded); returns the mapping they share."""
    param = next(model.parameters())
    if dtype is None:  # the model's float dtype (float32 for a GGUF/int8 model's blocks)
        dtype = param.dtype if param.is_floating_point() else torch.float32
    mapping = LoraMapping(max_tokens, param.device)
    for _, layer, bounds in lora_layers(model):
        layer.method = LoraLinearMethod(
            layer.method,
            in_features=layer.in_features,
            slice_bounds=bounds,
            max_loras=max_loras,
            max_rank=max_rank,
            mapping=mapping,
            dtype=dtype,
            device=param.device,
            kernel=kernel,
        )
    return mapping
