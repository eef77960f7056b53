"""tools/benchmarks/peers.py: the bytes a token reads (the single-stream limit) and the notes
under the comparison table."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tools.benchmarks.peers import served_weight_bytes, table


def _folder(root: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(root / "model.safetensors"))
    return root


def test_a_moe_folder_counts_its_routed_share_and_not_an_untied_embedding(tmp_path: Path) -> None:
    tensors = {
        "model.embed_tokens.weight": torch.zeros(100, 8),
        "lm_head.weight": torch.zeros(100, 8),
        "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(8, 16),
        "model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(8, 16),
        "model.layers.0.mlp.shared_expert.down_proj.weight": torch.zeros(8, 16),
    }
    moe = _folder(tmp_path / "moe", {"num_experts": 2, "num_experts_per_tok": 1}, tensors)
    # lm_head 3200 B, one of two experts 512 B, the shared expert 512 B; no embedding
    assert served_weight_bytes(str(moe), "float32") == 3200 + 512 + 512
    assert served_weight_bytes(str(moe), "bfloat16") == (3200 + 512 + 512) // 2
    tied = _folder(tmp_path / "tied", {}, {"model.embed_tokens.weight": torch.zeros(100, 8)})
    assert served_weight_bytes(str(tied), "float32") == 3200


def test_the_table_says_how_each_peer_ran() -> None:
    timing = {"median": 0.01}
    result = {
        "machine": {
            "cpu": "x", "threads": 2, "flags": ["avx2"], "read_gb_s": 20.0,
            "weight_bytes": 1e8, "single_stream_limit_ms": 5.0,
        },
        "dtype": "float32",
        "weights": {"shuttle": "m.gguf"},
        "servers": {
            name: {"start_s": 1.0, "single": {"itl_s": timing, "output_tok_s": 100.0}}
            for name in ("shuttle", "llamacpp")
        },
        "notes": {"llamacpp": "--no-repack: its default weight repacking died on signal 11"},
    }  # fmt: skip
    text = table(result)
    assert "| single | ITL p50 ms | 10.0 | 10.0 | 1.00x (faster) |" in text
    assert text.endswith("llamacpp: --no-repack: its default weight repacking died on signal 11")
