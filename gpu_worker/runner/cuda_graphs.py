"""CUDA graphs for decode steps: captured per batch-size bucket, replayed with padding.

    buckets      1, 2, 4, 8, 16, 32, 48, ... up to max_graph_batch_size
    capture      largest bucket first, every graph in one memory pool (the smaller graphs
                 reuse the largest one's memory), after one eager warm-up run per bucket
    replay       a decode batch of n requests runs the smallest bucket b >= n: its inputs are
                 copied into static buffers, rows n..b-1 padded (token 0, slot -1 so their
                 K/V is written nowhere, context length 1 on block 0), logits rows [0, n)
    eager        prefill/extend steps, batches above the largest bucket, enforce_eager

Only a backend whose decode path reads device tensors alone can be captured
(`AttentionBackend.supports_cuda_graphs`, the triton backend).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from gpu_worker.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from gpu_worker.models.llama import LlamaForCausalLM
    from gpu_worker.sample.pooling import PoolBatch

PAD_SLOT = -1  # the KV store skips negative slots
PAD_SEQ_LEN = 1  # a padded row attends to slot 0 of block 0: valid memory, output ignored


def graph_batch_sizes(max_graph_batch_size: int) -> list[int]:
    """The buckets, ascending: 1, 2, 4, 8, then every multiple of 16 up to the maximum."""
    small = [s for s in (1, 2, 4, 8) if s <= max_graph_batch_size]
    return small + list(range(16, max_graph_batch_size + 1, 16))


def pick_bucket(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `batch_size` rows; None above the largest (eager)."""
    return next((s for s in sizes if s >= batch_size), None)


@dataclasses.dataclass
class DecodeGraphInputs:
    """Static inputs of every captured graph; a graph of bucket b reads rows [0, b)."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    num_computed: torch.Tensor  # [max_bs] int32
    query_start_loc: torch.Tensor  # [max_bs + 1] int32, always 0, 1, 2, ...
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32
    logits_indices: torch.Tensor  # [max_bs] int64, always 0, 1, 2, ...

    @classmethod
    def allocate(
        cls, max_batch_size: int, max_blocks: int, device: torch.device | str
    ) -> DecodeGraphInputs:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        inputs = cls(
            input_ids=zeros(max_batch_size, dtype=torch.int64),
            positions=zeros(max_batch_size, dtype=torch.int64),
            slot_mapping=zeros(max_batch_size, dtype=torch.int64),
            seq_lens=zeros(max_batch_size, dtype=torch.int32),
            num_computed=zeros(max_batch_size, dtype=torch.int32),
            query_start_loc=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
            block_tables=zeros(max_batch_size, max_blocks, dtype=torch.int32),
            logits_indices=torch.arange(max_batch_size, dtype=torch.int64, device=device),
        )
        inputs.pad(0, max_batch_size)
        return inputs

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding that reads valid memory and writes nothing."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = PAD_SLOT
        self.seq_lens[start:end] = PAD_SEQ_LEN
        self.num_computed[start:end] = PAD_SEQ_LEN - 1
        self.block_tables[start:end] = 0

    def fill(self, input_ids: torch.Tensor, meta: AttentionMetadata, bucket: int) -> None:
        """Copy a decode batch of n <= bucket requests into rows [0, n), pad [n, bucket)."""
        n = meta.num_reqs
        assert meta.num_decodes == n <= bucket <= self.input_ids.shape[0], "not a decode batch"
        width = meta.block_tables.shape[1]
        assert width <= self.block_tables.shape[1], f"{width} blocks exceed the graph's table"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.num_computed[:n].copy_(meta.num_computed, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:] = 0  # entries past a sequence's end are never read
        self.pad(n, bucket)

    def metadata(self, bucket: int, block_size: int) -> AttentionMetadata:
        """The common metadata of a bucket's graph: views of the buffers' first rows.

        The host lists describe padding only; a capturable backend never reads them.
        """
        return AttentionMetadata(
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            num_computed=self.num_computed[:bucket],
            block_tables=self.block_tables[:bucket],
            block_size=block_size,
            num_decodes=bucket,
            query_start_loc_host=list(range(bucket + 1)),
            seq_lens_host=[PAD_SEQ_LEN] * bucket,
            num_computed_host=[PAD_SEQ_LEN - 1] * bucket,
        )


class CUDAGraphRunner:
    """Captures the model's decode step per bucket and replays it; see the module docstring.

    The model is called as model(input_ids, positions, kv_cache, meta, logits_indices) and
    returns logits [rows, vocab] for the chosen rows, like LlamaForCausalLM.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        *,
        block_size: int,
        max_model_len: int,
        max_graph_batch_size: int,
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} attention backend cannot be captured")
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_graph_batch_size)
        if not self.sizes:
            raise ValueError(f"max_graph_batch_size must be >= 1, got {max_graph_batch_size}")
        max_blocks = -(-max_model_len // block_size)
        self.inputs = DecodeGraphInputs.allocate(self.sizes[-1], max_blocks, kv_cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._metas: dict[int, AttentionMetadata] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(
            self.inputs.input_ids[:bucket],
            self.inputs.positions[:bucket],
            self.kv_cache,
            self._metas[bucket],
            self.inputs.logits_indices[:bucket],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            self.inputs.pad(0, self.sizes[-1])
            common = self.inputs.metadata(bucket, self.block_size)
            self._metas[bucket] = self.backend.build_metadata(common)
            self._forward(bucket)  # eager warm-up: compiles every kernel before capture
            torch.cuda.synchronize(self.kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.kv_cache.device)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A decode-only batch that fits a captured bucket (rows and block-table width)."""
        n = meta.num_reqs
        fits = 0 < n <= self.max_batch_size
        fits = fits and meta.block_tables.shape[1] <= self.inputs.block_tables.shape[1]
        return bool(self.graphs) and meta.num_decodes == n and fits

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch; valid until the next replay."""
        bucket = pick_bucket(meta.num_reqs, self.sizes)
        assert bucket is not None and bucket in self.graphs, "call can_run first"
        self.inputs.fill(input_ids, meta, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: meta.num_reqs]


def maybe_capture_graphs(
    model: torch.nn.Module,
    backend: AttentionBackend,
    kv_cache: torch.Tensor,
    *,
    block_size: int,
    max_model_len: int,
    enforce_eager: bool,
    max_graph_batch_size: int,
) -> CUDAGraphRunner | None:
    """Captured decode graphs, or None when running eagerly (CPU, enforce_eager, a backend
    that cannot be captured, or a maximum batch size of 0)."""
    if enforce_eager or kv_cache.device.type != "cuda" or max_graph_batch_size < 1:
        return None
    if not backend.supports_cuda_graphs:
        return None
    runner = CUDAGraphRunner(
        model,
        backend,
        kv_cache,
        block_size=block_size,
        max_model_len=max_model_len,
        max_graph_batch_size=max_graph_batch_size,
    )
    runner.capture()
    return runner


def run_model(
    model: LlamaForCausalLM,
    graphs: CUDAGraphRunner | None,
    input_ids: torch.Tensor,  # [T]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,  # [S] packed index of each sampling token
    pool: PoolBatch | None = None,
) -> tuple[Any, dict[str, list[float]]]:
    """Every forward of a step enters here: the logits ([S, vocab] float32) and the vectors
    of the embeddings requests the step finishes (gpu_worker/sample/pooling.py). A decode
    batch that fits replays a graph; everything else, and a step with embeddings rows (the
    graphs compute logits only, and such a step holds a prefill chunk), runs eagerly."""
    if pool is not None:
        logits, hidden = model.forward_hidden(
            input_ids, meta.positions, kv_cache, meta, logits_indices, pool.indices
        )
        return logits, pool.accumulate(hidden)
    if graphs is not None and graphs.can_run(meta):
        # in a decode batch token i is request i: the graph computed logits for every row
        return graphs.run(input_ids, meta)[logits_indices], {}
    return model(input_ids, meta.positions, kv_cache, meta, logits_indices), {}
