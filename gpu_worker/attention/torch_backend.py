"""The reference attention backend in plain PyTorch: CPU and CUDA, any dtype.

Decodes run as one batch: their whole blocks are gathered (one `index_select` per K and V
into a reused workspace, never per token), GQA is folded into the query dimension

    q [num_decodes, num_kv_heads, q_per_kv, head_dim]  x  K [num_decodes, num_kv_heads, L, head_dim]

and positions past each sequence's end are masked. Prefill and extend chunks run one
request at a time with `scaled_dot_product_attention` (fp32 softmax inside): a chunk that
starts at position 0 attends to its own fresh K/V with `is_causal`, a later chunk gathers its
cached blocks and uses an explicit mask, causal within the new tokens.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The common metadata plus what the torch backend precomputes once per step."""

    decode_block_ids: torch.Tensor | None  # [num_decodes * max_decode_blocks] int32
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_decode_blocks * block_size]
    # one per non-decode request: None when the chunk starts at 0 (plain causal), else a
    # bool [num_new, seq_len] mask, True where a query may attend
    extend_masks: list[torch.Tensor | None]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops only; see the module docstring for the method."""

    name = "torch"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        base = {f.name: getattr(common, f.name) for f in dataclasses.fields(AttentionMetadata)}
        block_ids, mask = self._decode_inputs(common)
        extend_reqs = range(common.num_decodes, common.num_reqs)
        return TorchAttentionMetadata(
            **base,
            decode_block_ids=block_ids,
            decode_mask=mask,
            extend_masks=[self._extend_mask(common, r) for r in extend_reqs],
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata), "call build_metadata first"
        _store_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta)
        for r in range(num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc_host[r], meta.query_start_loc_host[r + 1]
            out[start:end] = self._extend(q, k, v, kv_cache, meta, r)
        return out

    def _decode_inputs(
        self, meta: AttentionMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        n = meta.num_decodes
        if n == 0:
            return None, None
        max_blocks = _cdiv(max(meta.seq_lens_host[:n]), meta.block_size)
        block_ids = meta.block_tables[:n, :max_blocks].reshape(-1)
        key_pos = torch.arange(max_blocks * meta.block_size, device=self.device)
        beyond = key_pos[None, :] >= meta.seq_lens[:n, None]  # [n, L]
        mask = torch.zeros(beyond.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(beyond, float("-inf"))
        return block_ids, mask[:, None, None, :]

    def _extend_mask(self, meta: AttentionMetadata, r: int) -> torch.Tensor | None:
        num_computed = meta.num_computed_host[r]
        if num_computed == 0:
            return None
        num_new = meta.seq_lens_host[r] - num_computed
        query_pos = torch.arange(num_new, device=self.device)[:, None] + num_computed
        key_pos = torch.arange(meta.seq_lens_host[r], device=self.device)[None, :]
        return key_pos <= query_pos

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: TorchAttentionMetadata
    ) -> torch.Tensor:
        n = meta.num_decodes
        assert meta.decode_block_ids is not None
        k, v = self._gather(kv_cache, meta.decode_block_ids)
        k = k.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_per_kv = self.num_heads // self.num_kv_heads
        q = q.reshape(n, self.num_kv_heads, q_per_kv, self.head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(n, self.num_heads, self.head_dim)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        r: int,
    ) -> torch.Tensor:
        start, end = meta.query_start_loc_host[r], meta.query_start_loc_host[r + 1]
        mask = meta.extend_masks[r - meta.num_decodes]
        if mask is None:  # nothing cached before this chunk: its own K/V is the context
            kr, vr = k[start:end], v[start:end]
        else:
            seq_len = meta.seq_lens_host[r]
            num_blocks = _cdiv(seq_len, meta.block_size)
            kr, vr = self._gather(kv_cache, meta.block_tables[r, :num_blocks])
            kr = kr.view(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            vr = vr.view(-1, self.num_kv_heads, self.head_dim)[:seq_len]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            kr.transpose(0, 1),
            vr.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.transpose(0, 1)

    def _gather(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks of K and V into the reused workspace: [n, block_size, kv_heads, dim]."""
        n = block_ids.numel()
        capacity = 0 if self._workspace is None else self._workspace[0].shape[0]
        if capacity < n:  # grow geometrically so steady state never allocates
            shape = (max(n, 64, 2 * capacity), *kv_cache.shape[2:])
            self._workspace = (
                torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device),
                torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device),
            )
        k_buf, v_buf = self._workspace
        k = torch.index_select(kv_cache[0], 0, block_ids, out=k_buf[:n])
        v = torch.index_select(kv_cache[1], 0, block_ids, out=v_buf[:n])
        return k, v


def _store_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's K/V into its slot (block_id * block_size + offset)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
