"""The reference attention backend in plain PyTorch: CPU and CUDA, any dtype.

Decodes run as one batch. On the CPU they go to a small C kernel that reads each K/V row
where it lies in the paged cache, each sequence only up to its own length, with GQA folded
(gpu_worker/cpu/paged_decode.py, paged_decode.c): no copy, no padding. Elsewhere,
or when that kernel cannot be built, their whole blocks are gathered (one `index_select` per
K and V into a reused workspace, never per token), GQA is folded into the query dimension

    q [num_decodes, num_kv_heads, q_per_kv, head_dim]  x  K [num_decodes, num_kv_heads, L, head_dim]

and positions past each sequence's end are masked. Prefill and extend chunks run one
request at a time. In float32 on the CPU, where the head size is 64 or 128, a chunk goes to
the blocked prefill kernel (paged_prefill, below): faster than SDPA's flash kernel on these
chunks (2 threads, 16 heads over 4 of 64, a 512-token prompt 9.4 -> 6.4 ms a layer; 128
tokens 0.74 -> 0.48). Elsewhere `scaled_dot_product_attention` (fp32 softmax inside): a chunk
that starts at position 0 attends to its own fresh K/V with `is_causal`, a later chunk gathers
its cached blocks and uses an explicit mask, causal within the new tokens. With
`batch_invariant` (quantized models: their activations are rounded to int8 per row, so a
last-bit difference in attention can flip a rounding and, rarely, a greedy token) a chunk's
queries go to the decode kernel instead, each as a decode of its own length: a token's
attention is then the same bits however the prompt was chunked or batched. (For head sizes
64 and 128 a chunk goes to the blocked prefill kernel beside it, paged_prefill: the same
bits for every row, each block's K/V read once per tile of 16 tokens rather than per token.)

A layer with a sliding window passes it to `forward`: the decode kernel starts each sequence
at its last `window` positions, the eager paths mask the keys before them. With a soft cap
(Gemma 2) the decode kernel caps its scores; SDPA cannot, so the eager paths then compute
the scores, cap, mask and softmax (in float32) themselves, as they do for attention sinks
(a per-head logit in every softmax's denominator; the decode kernel takes them too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.cpu import paged_decode


@dataclasses.dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The common metadata plus what the torch backend precomputes once per step."""

    decode_tables: torch.Tensor | None  # [num_decodes, max_decode_blocks] int32
    # one per non-decode request: None when the chunk starts at 0 (plain causal), else a
    # bool [num_new, seq_len] mask, True where a query may attend
    extend_masks: list[torch.Tensor | None]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops only; see the module docstring for the method."""

    name = "torch"

    def __init__(
        self,
        *,
        cpu_decode_kernel: bool | None = None,
        batch_invariant: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # the C decode kernel, on the CPU only (CUDA has the triton backend); built here, once
        # per machine (about a second of gcc), so that no request waits for it
        if cpu_decode_kernel is None:
            cpu_decode_kernel = self.device.type == "cpu"
        self.cpu_decode_kernel = cpu_decode_kernel and paged_decode.load() is not None
        # every query row attended by the decode kernel, so a token's attention is the same
        # bits in a decode, a prefill chunk of any size or a speculative verification
        self.batch_invariant = batch_invariant and self.cpu_decode_kernel

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        base = {f.name: getattr(common, f.name) for f in dataclasses.fields(AttentionMetadata)}
        extend_reqs = range(common.num_decodes, common.num_reqs)
        return TorchAttentionMetadata(
            **base,
            decode_tables=self._decode_tables(common),
            extend_masks=[self._extend_mask(common, r) for r in extend_reqs],
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata), "call build_metadata first"
        _store_kv(
            kv_cache, self.kv_format.quantize(k), self.kv_format.quantize(v), meta.slot_mapping
        )
        num_decodes = meta.num_decodes
        if num_decodes == meta.num_reqs:  # a decode-only step: no output to assemble
            return self._decode(q, kv_cache, meta, window, sinks)
        out = torch.empty_like(q)
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta, window, sinks)
        for r in range(num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc_host[r], meta.query_start_loc_host[r + 1]
            out[start:end] = self._extend(q, k, v, kv_cache, meta, r, window, sinks)
        return out

    def _decode_tables(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The decodes' block tables, cut to the blocks the longest of them uses."""
        n = meta.num_decodes
        if n == 0:
            return None
        max_blocks = _cdiv(max(meta.seq_lens_host[:n]), meta.block_size)
        return meta.block_tables[:n, :max_blocks]

    def _extend_mask(self, meta: AttentionMetadata, r: int) -> torch.Tensor | None:
        num_computed = meta.num_computed_host[r]
        if num_computed == 0:
            return None
        num_new = meta.seq_lens_host[r] - num_computed
        query_pos = torch.arange(num_new, device=self.device)[:, None] + num_computed
        key_pos = torch.arange(meta.seq_lens_host[r], device=self.device)[None, :]
        return key_pos <= query_pos

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        window: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        tables, seq_lens = meta.decode_tables, meta.seq_lens[: meta.num_decodes]
        assert tables is not None
        if self.cpu_decode_kernel:
            o = paged_decode.paged_decode(
                q,
                kv_cache,
                tables,
                seq_lens,
                self.scale,
                window,
                self.softcap,
                sinks,
                kv_format=self.kv_format,
            )
            if o is not None:
                return o
        return self._decode_eager(q, kv_cache, tables, seq_lens, window, sinks)

    def _decode_eager(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Whole blocks gathered into the workspace, then SDPA with GQA folded into q."""
        n = q.shape[0]
        k, v = self._gather(kv_cache, tables.reshape(-1))
        k = k.reshape(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_per_kv = self.num_heads // self.num_kv_heads
        q = q.reshape(n, self.num_kv_heads, q_per_kv, self.head_dim)
        mask = torch.zeros(n, k.shape[2], dtype=q.dtype, device=q.device)
        key_pos = torch.arange(k.shape[2], device=q.device)
        mask.masked_fill_(key_pos[None, :] >= seq_lens[:, None], float("-inf"))
        if window > 0:  # the query sits at seq_len - 1
            mask.masked_fill_(key_pos[None, :] < seq_lens[:, None] - window, float("-inf"))
        if self.softcap > 0 or sinks is not None:
            head_sinks = None if sinks is None else sinks.view(1, self.num_kv_heads, -1, 1)
            o = self._manual(q, k, v, mask[:, None, None, :] == 0, head_sinks)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[:, None, None, :], scale=self.scale
            )
        return o.reshape(n, self.num_heads, self.head_dim)

    def _manual(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        visible: torch.Tensor,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention with a soft cap and/or sinks, as transformers' eager Gemma 2 and gpt-oss
        compute it: q [..., n, D] against k, v [..., L, D] (broadcast), visible bool
        [..., n, L], sinks [..., n or 1, 1] (broadcast to the scores' rows) or None."""
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        if self.softcap > 0:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:  # the sink's column joins the softmax, then is dropped (it has no value)
            column = sinks.float().expand(*scores.shape[:-1], 1)
            both = torch.cat((scores, column), dim=-1)
            probs = (both - both.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        return torch.matmul(probs, v.float()).to(q.dtype)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        r: int,
        window: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        start, end = meta.query_start_loc_host[r], meta.query_start_loc_host[r + 1]
        if self.batch_invariant:
            o = self._extend_by_rows(q[start:end], kv_cache, meta, r, window, sinks)
            if o is not None:
                return o
        elif self.cpu_decode_kernel and q.dtype == torch.float32:
            o = self._blocked_prefill(q[start:end], kv_cache, meta, r, window, sinks)
            if o is not None:
                return o
        mask = meta.extend_masks[r - meta.num_decodes]
        if window > 0 and meta.seq_lens_host[r] > window:  # some keys fall out of the window
            mask = self._window_mask(meta, r, window)
        if meta.num_computed_host[r] == 0 and not self.kv_format.quantized:
            # nothing cached before: its own K/V is the context (quantized: read back as stored)
            kr, vr = k[start:end], v[start:end]
        else:
            seq_len = meta.seq_lens_host[r]
            num_blocks = _cdiv(seq_len, meta.block_size)
            kr, vr = self._gather(kv_cache, meta.block_tables[r, :num_blocks])
            kr = kr.reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            vr = vr.reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
        if self.softcap > 0 or sinks is not None:
            return self._extend_manual(q[start:end], kr, vr, mask, sinks)
        # 4-D [1, heads, tokens, dim]: with 3-D inputs the CPU dispatches to the math kernel
        # (scores materialised, ~1.8x slower), with 4-D to the flash kernel, masked or causal
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],
            kr.transpose(0, 1)[None],
            vr.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1)

    def _extend_manual(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """A chunk's attention with a soft cap or sinks: q [n, H, D] over k, v [L, KVH, D];
        mask None (causal, the chunk is the whole context) or bool [n, L]."""
        n, length = q.shape[0], k.shape[0]
        if mask is None:
            mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril()
        q_per_kv = self.num_heads // self.num_kv_heads
        k = k.transpose(0, 1).repeat_interleave(q_per_kv, dim=0)  # [H, L, D]
        v = v.transpose(0, 1).repeat_interleave(q_per_kv, dim=0)
        head_sinks = None if sinks is None else sinks.view(-1, 1, 1)
        return self._manual(q.transpose(0, 1), k, v, mask[None], head_sinks).transpose(0, 1)

    def _window_mask(self, meta: AttentionMetadata, r: int, window: int) -> torch.Tensor:
        """bool [num_new, seq_len]: key j visible to the query at position i when
        i - window < j <= i."""
        num_computed, seq_len = meta.num_computed_host[r], meta.seq_lens_host[r]
        query_pos = torch.arange(num_computed, seq_len, device=self.device)[:, None]
        key_pos = torch.arange(seq_len, device=self.device)[None, :]
        return (key_pos <= query_pos) & (key_pos > query_pos - window)

    def _blocked_prefill(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        r: int,
        window: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Request r's chunk q by the blocked prefill kernel (paged_prefill), or None where it
        does not cover the shape (head sizes other than 64 and 128)."""
        return paged_decode.paged_prefill(
            q,
            kv_cache,
            meta.block_tables[r],
            meta.num_computed_host[r],
            self.scale,
            window,
            self.softcap,
            sinks,
            kv_format=self.kv_format,
        )

    def _extend_by_rows(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        r: int,
        window: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """A chunk's queries as decodes of their own lengths (row i attends to the first
        num_computed + i + 1 positions of request r's blocks): by the blocked prefill kernel,
        which gives every row the decode kernel's bits while reading each block once per tile
        of rows, else (head sizes other than 64 and 128) row by row by the decode kernel."""
        o = self._blocked_prefill(q, kv_cache, meta, r, window, sinks)
        if o is not None:
            return o
        n, first = q.shape[0], meta.num_computed_host[r]
        table = meta.block_tables[r : r + 1].expand(n, -1)  # one table for every row
        lens = torch.arange(first + 1, first + n + 1, dtype=torch.int32)
        return paged_decode.paged_decode(
            q,
            kv_cache,
            table,
            lens,
            self.scale,
            window,
            self.softcap,
            sinks,
            kv_format=self.kv_format,
        )

    def _gather(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks of K and V into the reused workspace: [n, block_size, kv_heads, dim]
        (a quantized cache's rows read back in the model's dtype)."""
        n = block_ids.numel()
        capacity = 0 if self._workspace is None else self._workspace[0].shape[0]
        if capacity < n:  # grow geometrically so steady state never allocates
            shape = (max(n, 64, 2 * capacity), *kv_cache.shape[2:])
            self._workspace = (
                torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device),
                torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device),
            )
        assert self._workspace is not None
        k_buf, v_buf = self._workspace
        k = torch.index_select(kv_cache[0], 0, block_ids, out=k_buf[:n])
        v = torch.index_select(kv_cache[1], 0, block_ids, out=v_buf[:n])
        if self.kv_format.quantized:
            return self.kv_format.dequantize(k), self.kv_format.dequantize(v)
        return k, v


def _store_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's K/V into its slot (block_id * block_size + offset)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
