"""Each MoE family's sharding under tensor parallelism 2, in one process: every rank's sparse
block (its share of each expert's width, the router replicated, gpt-oss's down biases on
rank 0) gives a partial output, and the ranks' partials sum to the whole block's output (what
the decoder layer's all-reduce computes); gpt-oss's sinks split with the heads, float and
MXFP4 experts alike. OLMoE, whose q/k norms span every head, is refused by name. The served
model under `--tensor-parallel-size 2` is tests/integration/test_moe_serving.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.layers.kernel_choice import choose_kernels
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import check_tensor_parallel, load_model
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig
from tests.tiny_moe_models import make_tiny_moe_model, make_tiny_mxfp4_gpt_oss

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4")
# gpt-oss's one KV head does not split over two ranks: two here
TP_FIELDS = {"num_key_value_heads": 2}


def _folder(root: Path, family: str) -> Path:
    if family == "gpt_oss_mxfp4":
        return make_tiny_mxfp4_gpt_oss(root / family, **TP_FIELDS)[0]
    fields = TP_FIELDS if family == "gpt_oss" else {}
    return make_tiny_moe_model(root / family, family, **fields)


def _load(folder: Path, tp: TensorParallel) -> LlamaForCausalLM:
    cfg, cpu = LlamaConfig.from_hf(read_hf_config(folder)), torch.device("cpu")
    check_tensor_parallel(cfg, tp.size, folder)
    backend = TorchAttentionBackend(
        num_heads=cfg.num_heads // tp.size, num_kv_heads=cfg.num_kv_heads // tp.size,
        head_dim=cfg.head_dim, dtype=torch.float32, device=cpu,
    )  # fmt: skip
    kernels = choose_kernels(device=cpu, backend_name="torch", dtype=torch.float32)
    return load_model(
        folder, backend, dtype=torch.float32, device=cpu, max_positions=64, tp=tp,
        kernels=kernels,
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_the_ranks_partial_blocks_sum_to_the_whole(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    folder = _folder(tmp_path_factory.mktemp("moe-tp"), family)
    whole = _load(folder, TensorParallel())
    ranks = [_load(folder, TensorParallel(rank=r, size=2)) for r in range(2)]
    x = torch.randn(7, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for i, layer in enumerate(whole.model.layers):
            parts = [r.model.layers[i] for r in ranks]
            want = layer.mlp(x)
            got = parts[0].mlp(x) + parts[1].mlp(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            sinks = [layer.self_attn.sinks, *(p.self_attn.sinks for p in parts)]
            if sinks[0] is not None:
                assert all(s is not None for s in sinks)
                assert torch.equal(torch.cat(sinks[1:]), sinks[0])  # type: ignore[arg-type]


def test_olmoe_is_served_on_one_rank(tmp_path: Path) -> None:
    folder = make_tiny_moe_model(tmp_path / "olmoe", "olmoe")
    cfg = LlamaConfig.from_hf(read_hf_config(folder))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2.*olmoe"):
        check_tensor_parallel(cfg, 2, folder)
