"""gpu-check, model part: decode step time with and without CUDA graphs, greedy parity.

Drives the model directly (no ModelRunner: that imports the wire codec, which needs orjson,
and the GPU machine has only torch, triton and transformers). The model folder is the
default SmolLM2 model when it is present, else a random model of the same shape written by
transformers into a temporary folder.
"""

from __future__ import annotations

import functools
import inspect
import random
from pathlib import Path
from typing import Any

import torch

from gpu_worker.attention import AttentionBackend, build_metadata, create_backend
from gpu_worker.kv_cache import KVCache
from gpu_worker.layers.kernel_choice import choose_kernels
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import load_model
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.cuda_graphs import CUDAGraphRunner, run_model
from tools.gpu_check.kernels import time_ms

SMOLLM2_SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip


def random_model_folder(folder: Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """A random Llama saved by transformers; a wide init so greedy argmaxes are not ties."""
    import transformers

    config = transformers.LlamaConfig(**shape, initializer_range=0.08)
    torch.manual_seed(seed)
    # no dtype argument: transformers 4 calls it torch_dtype, 5 dtype; float32 is the default
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(folder)
    return folder


class Engine:
    """Our model, its backend and a KV cache: just enough to prefill and decode greedily."""

    def __init__(
        self, folder: Path, *, backend: str, dtype: torch.dtype, device: str, num_blocks: int,
        block_size: int = 16, max_model_len: int = 2048,
    ) -> None:  # fmt: skip
        cfg = LlamaConfig.from_hf(read_hf_config(folder))
        self.device, self.block_size = torch.device(device), block_size
        self.backend: AttentionBackend = create_backend(
            backend, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, dtype=dtype, device=self.device,
        )  # fmt: skip
        kernels = choose_kernels(device=self.device, backend_name=backend, dtype=dtype)
        self.model = load_model(folder, self.backend, dtype=dtype, device=self.device,
                                max_positions=max_model_len, kernels=kernels)  # fmt: skip
        self.kv = KVCache(num_layers=cfg.num_layers, num_blocks=num_blocks, block_size=block_size,
                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                          device=self.device)  # fmt: skip
        self.max_model_len = max_model_len
        self.graphs: CUDAGraphRunner | None = None

    def capture(self, max_graph_batch_size: int) -> None:
        self.graphs = CUDAGraphRunner(
            self.model, self.backend, self.kv.tensor, block_size=self.block_size,
            max_model_len=self.max_model_len, max_graph_batch_size=max_graph_batch_size,
        )  # fmt: skip
        self.graphs.capture()

    def tables(self, context_lens: list[int], seed: int = 0) -> list[list[int]]:
        """Scattered block tables holding each context."""
        needed = [-(-n // self.block_size) for n in context_lens]
        free = list(range(self.kv.num_blocks))
        random.Random(seed).shuffle(free)
        assert sum(needed) <= len(free), "KV cache too small for the plan"
        return [[free.pop() for _ in range(n)] for n in needed]

    @torch.inference_mode()
    def step(self, token_ids: list[list[int]], num_computed: list[int],
             tables: list[list[int]], use_graphs: bool) -> torch.Tensor:  # fmt: skip
        """Logits [R, vocab] of each request's last new token."""
        num_new = [len(t) for t in token_ids]
        common = build_metadata(num_computed, num_new, tables, self.block_size, self.device)
        meta = self.backend.build_metadata(common)
        flat = [t for ids in token_ids for t in ids]
        input_ids = torch.tensor(flat, dtype=torch.int64, device=self.device)
        last = torch.tensor(common.query_start_loc_host[1:], device=self.device) - 1
        graphs = self.graphs if use_graphs else None
        return run_model(self.model, graphs, input_ids, self.kv.tensor, meta, last)[0]

    def greedy(self, prompts: list[list[int]], num_new: int, use_graphs: bool) -> list[list[int]]:
        """All prompts prefilled in one step, then decoded together, argmax, no EOS."""
        tables = self.tables([len(p) + num_new for p in prompts])
        outputs: list[list[int]] = [[] for _ in prompts]
        logits = self.step(prompts, [0] * len(prompts), tables, use_graphs=False)
        for _ in range(num_new):
            for out, token in zip(outputs, logits.argmax(-1).tolist(), strict=True):
                out.append(token)
            computed = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs, strict=True)]
            logits = self.step([[o[-1]] for o in outputs], computed, tables, use_graphs)
        return outputs


def decode_step_times(
    engine: Engine, batches: list[int], context: int, iters: int
) -> list[dict[str, Any]]:
    """ms per decode step at each batch size: eager, and replayed from a CUDA graph."""
    rows = []
    for batch in batches:
        tables = engine.tables([context + 1] * batch)
        tokens = [[7]] * batch
        computed = [context] * batch

        eager = functools.partial(engine.step, tokens, computed, tables, use_graphs=False)
        graphed = functools.partial(engine.step, tokens, computed, tables, use_graphs=True)
        eager_ms = time_ms(eager, iters=iters)
        row: dict[str, Any] = {"batch": batch, "context": context, "eager_ms": eager_ms}
        if engine.graphs is not None:
            graph_ms = time_ms(graphed, iters=iters)
            row.update(graph_ms=graph_ms, speedup=eager_ms / graph_ms)
        rows.append(row)
    return rows


@torch.inference_mode()
def hf_greedy(folder: Path, prompts: list[list[int]], num_new: int, device: str) -> list[list[int]]:
    """transformers' own forward and KV cache, fp32, argmax, no EOS stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).float().to(device).eval()
    # transformers 5 renamed `past_key_values` to `cache` in forward()
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outputs = []
    for prompt in prompts:
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        tokens: list[int] = []
        for _ in range(num_new):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            past = getattr(out, "cache", None) or out.past_key_values
            ids = torch.tensor([[token]], device=device)
            out = model(input_ids=ids, use_cache=True, **{key: past})
        outputs.append(tokens)
    return outputs


def parity(ours: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How many greedy tokens agree, and where the first disagreement is."""
    first = None
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        diff = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if diff is not None and first is None:
            first = {"prompt": i, "token": diff, "ours": a[diff], "transformers": b[diff]}
    pairs = [pair for a, b in zip(ours, reference, strict=True) for pair in zip(a, b, strict=True)]
    same = sum(x == y for x, y in pairs)
    total = sum(len(r) for r in reference)
    return {"tokens": total, "matching": same, "first_mismatch": first, "ok": same == total}
