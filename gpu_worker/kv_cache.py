"""The paged KV cache: one tensor for all layers, sized from a memory budget.

    kv [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, row_width]

row_width is head_dim, or head_dim + 4 bytes for int8 rows with their scale (a quantized
cache, `--kv-cache-dtype`, stores rows as gpu_worker/kv_quant.py says): a block's bytes,
kv[:, :, block], are all that is needed to read it back.

A token's slot is `block_id * block_size + offset`; the scheduler owns which blocks a
request holds, the worker only reads and writes the slots it is told.
"""

from __future__ import annotations

import torch

from gpu_worker.cpu import huge_pages as cpu_huge_pages
from gpu_worker.kv_quant import KVFormat

GIB = 1 << 30


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """K and V of one block across every layer, stored as `kv_cache_dtype` says."""
    fmt = KVFormat.create(kv_cache_dtype, dtype)
    itemsize = torch.empty((), dtype=fmt.storage_dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * fmt.row_width(head_dim) * itemsize


def cuda_kv_budget_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    """A fraction of the memory still free on the GPU once the weights are loaded."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * gpu_memory_utilization)


class KVCache:
    """The KV tensor of a model, zero-filled so padded slots never hold NaN."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        huge_pages: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`huge_pages`: on the CPU, the tensor in transparent huge pages (gpu_worker/cpu/
        huge_pages.py) where the kernel has them; `kv_cache_dtype`: auto (`dtype`) or a
        quantized format (gpu_worker/kv_quant.py)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one slot, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format = KVFormat.create(kv_cache_dtype, dtype)
        dtype = self.format.storage_dtype
        shape = (
            num_layers,
            2,
            num_blocks,
            block_size,
            num_kv_heads,
            self.format.row_width(head_dim),
        )
        # zeros, not empty: a masked score of 0 times a NaN from stale memory is still NaN
        if huge_pages and device.type == "cpu" and cpu_huge_pages.available():
            self.tensor = cpu_huge_pages.zeros(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.host: torch.Tensor | None = None
        self.tier = torch.empty(0)  # the prefix cache's host slots (allocate_tier)

    def allocate_host(self, budget_bytes: int) -> int:
        """A host-memory pool for swapped-out blocks (pinned when the cache is on CUDA)."""
        per_block = self.tensor[:, :, 0].numel() * self.tensor.element_size()
        n = budget_bytes // per_block
        shape = (*self.tensor.shape[:2], n, *self.tensor.shape[3:])
        pin = self.tensor.device.type == "cuda"
        self.host = torch.zeros(shape, dtype=self.tensor.dtype, pin_memory=pin) if n else None
        return n

    def swap_out(self, src: list[int], dst: list[int]) -> None:
        """Device blocks src[i] -> host blocks dst[i], every layer, K and V."""
        assert self.host is not None and len(src) == len(dst)
        self.host[:, :, dst] = self.tensor[:, :, src].to("cpu")

    def swap_in(self, src: list[int], dst: list[int]) -> None:
        """Host blocks src[i] -> device blocks dst[i]."""
        assert self.host is not None and len(src) == len(dst)
        self.tensor[:, :, dst] = self.host[:, :, src].to(self.tensor.device)

    # the prefix cache's host tier (gpu_worker/kv_tiers.py) ------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block, every layer: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        s = self.tensor.shape
        return (s[0], s[1], *s[3:])

    @property
    def block_bytes(self) -> int:
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    def allocate_tier(self, num_slots: int) -> None:
        """Host slots for evicted prefix-cache blocks (pinned when the cache is on CUDA;
        never read before written, so not zero-filled)."""
        s = self.tensor.shape
        pin = self.tensor.device.type == "cuda"
        shape = (s[0], s[1], num_slots, *s[3:])
        self.tier = torch.empty(shape, dtype=self.tensor.dtype, pin_memory=pin)

    def tier_save(self, src: list[int], dst: list[int]) -> None:
        """Device blocks src[i] -> host slots dst[i]."""
        assert len(src) == len(dst)
        self.tier[:, :, dst] = self.tensor[:, :, src].to("cpu")

    def tier_load(self, src: list[int], dst: list[int]) -> None:
        """Host slots src[i] -> device blocks dst[i]."""
        assert len(src) == len(dst)
        self.tensor[:, :, dst] = self.tier[:, :, src].to(self.tensor.device)

    def tier_block(self, slot: int) -> torch.Tensor:
        """A host slot, [num_layers, 2, block_size, num_kv_heads, head_dim] (a view)."""
        return self.tier[:, :, slot]

    def set_tier_block(self, slot: int, block: torch.Tensor) -> None:
        self.tier[:, :, slot] = block

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device blocks src[i] -> dst[i] (copy-on-write of shared blocks)."""
        assert len(src) == len(dst)
        self.tensor[:, :, dst] = self.tensor[:, :, src]

    def layer(self, i: int) -> torch.Tensor:
        """[2, num_blocks, block_size, num_kv_heads, row_width], a view."""
        return self.tensor[i]

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
