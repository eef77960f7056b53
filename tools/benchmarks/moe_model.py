"""A mixture of experts of realistic proportions for timing, built once: the tests' model
builders (tests/tiny_moe_models.py, tests/gguf_moe_models.py) at a size that fits this
machine, random weights (timing does not need trained ones).

    .venv/bin/python -m tools.benchmarks.moe_model [--out DIR]

writes, under DIR (default ~/.cache/shuttle/bench/moe-16x1024-32e512-top4):

    folder/            the Hugging Face folder (qwen3_moe, float32 safetensors)
    moe-f32.gguf       the same weights in llama.cpp's layout, F32
    moe-q8_0.gguf      every matrix but the routers in Q8_0
    moe-q4_1.gguf      likewise in Q4_1

Qwen3-30B-A3B's shape shrunk: 16 layers, hidden 1024, 16 query heads of 64 over 4 KV
heads, 32 experts of 512 in every layer, top-4 renormalised, q/k norms; SmolLM2's
vocabulary (49152) so the default tokenizer serves it. ~0.95 B parameters (0.85 B in the
experts, 0.2 B active a token). Then, one sitting (see tools/benchmarks/peers.py):

    tools/bench --compare shuttle,llamacpp --model DIR/moe-q4_1.gguf --workloads single
    tools/bench --compare shuttle,vllm,llamacpp --model DIR/folder --workloads mixed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

DEFAULT_OUT = Path.home() / ".cache" / "shuttle" / "bench" / "moe-16x1024-32e512-top4"

# Qwen3-30B-A3B (48 layers, hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8)
# shrunk to fit a 24 GiB machine in float32 with a MoE's proportions kept: every layer
# sparse, 4 query heads per KV head, a small share of the experts active (4 of 32), each
# expert narrower than the hidden width.
SHAPE: dict[str, Any] = dict(
    num_hidden_layers=16,
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    mlp_only_layers=[],
    max_position_embeddings=4096,
    initializer_range=0.02,
)


def build(out: Path) -> dict[str, Path]:
    """The folder and its three GGUF files under `out` (each skipped when present)."""
    from gguf import GGMLQuantizationType as Q

    from tests.gguf_moe_models import write_moe_gguf
    from tests.tiny_moe_models import make_tiny_moe_model

    out.mkdir(parents=True, exist_ok=True)
    folder = make_tiny_moe_model(out / "folder", "qwen3_moe", seed=0, **SHAPE)
    paths = {"folder": folder}
    for name, qtype in (("f32", Q.F32), ("q8_0", Q.Q8_0), ("q4_1", Q.Q4_1)):
        path = out / f"moe-{name}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            write_moe_gguf(folder, tmp, qtype)
            tmp.rename(path)
        paths[name] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder to write into")
    args = p.parse_args(argv)
    for name, path in build(Path(args.out)).items():
        size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else 0
        size = size or path.stat().st_size
        print(f"{name}: {path} ({size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
