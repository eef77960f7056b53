"""The Triton attention backend: the CUDA default, and runnable on the CPU under the interpreter.

Per layer and step, three launches at most:

    store_kv          the step's new K/V into their slots (negative slot: padding, skipped),
                      quantized once there with --kv-cache-dtype int8/fp8 (kernels/kv_rows.py)
    paged_decode      requests [0, num_decodes): one query each, split-K over the context
    extend_attention  the other requests: their new tokens, causal, over the cached prefix

Decodes use device tensors only (no host numbers), so a decode step can be captured in a
CUDA graph and replayed for any batch padded to the captured size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gpu_worker.attention import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.kernels import interpreting
from gpu_worker.kernels.extend_attention.kernel import extend_attention
from gpu_worker.kernels.kv_store.kernel import store_kv
from gpu_worker.kernels.paged_decode.kernel import DEFAULT_NUM_SPLITS, paged_decode


@dataclasses.dataclass(frozen=True)
class TritonAttentionMetadata(AttentionMetadata):
    """The common metadata plus the grid size of the extend launch."""

    max_extend_len: int  # most new tokens of any non-decode request; 0 when all decode


class TritonAttentionBackend(AttentionBackend):
    """Paged attention by the kernels in gpu_worker/kernels; see the module docstring."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, *, decode_num_splits: int = DEFAULT_NUM_SPLITS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"the triton attention backend needs a CUDA device, got {self.device} "
                "(on the CPU it runs only under TRITON_INTERPRET=1, for tests)"
            )
        # fixed for the backend's lifetime: a captured graph replays the same launch
        self.decode_num_splits = decode_num_splits

    def build_metadata(self, common: AttentionMetadata) -> TritonAttentionMetadata:
        base = {f.name: getattr(common, f.name) for f in dataclasses.fields(AttentionMetadata)}
        qsl = common.query_start_loc_host
        extend_lens = [qsl[r + 1] - qsl[r] for r in range(common.num_decodes, common.num_reqs)]
        return TritonAttentionMetadata(**base, max_extend_len=max(extend_lens, default=0))

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
        assert isinstance(meta, TritonAttentionMetadata), "call build_metadata first"
        kv_dtype = self.kv_format.name
        store_kv(k, v, kv_cache, meta.slot_mapping, kv_dtype)
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            paged_decode(
                q[:n],
                kv_cache,
                meta.block_tables[:n],
                meta.seq_lens[:n],
                self.scale,
                window=window,
                softcap=self.softcap,
                sinks=sinks,
                num_splits=self.decode_num_splits,
                out=out[:n],
                kv_cache_dtype=kv_dtype,
            )
        if n < meta.num_reqs:
            extend_attention(
                q,
                kv_cache,
                meta.block_tables[n:],
                meta.query_start_loc[n:],
                meta.seq_lens[n:],
                self.scale,
                max_query_len=meta.max_extend_len,
                window=window,
                softcap=self.softcap,
                sinks=sinks,
                out=out,
                kv_cache_dtype=kv_dtype,
            )
        return out
