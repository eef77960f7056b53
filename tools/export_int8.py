"""tools/export-int8: write an int8 W8A8 compressed-tensors checkpoint from a float HF folder.

    tools/export-int8 SRC DST        (python -m tools.export_int8 SRC DST)

Every q/k/v/o and gate/up/down projection becomes int8 with one scale per output row
(symmetric, scale = max|row| / 127; gpu_worker/cpu/int8.py's quantize_weight), activations
are declared dynamic per token; embeddings, norms, biases and the LM head stay as they are.
config.json gets the `quantization_config` LLM Compressor writes for its W8A8 preset, written
by compressed-tensors' own ModelCompressor, so vLLM loads the folder as it loads LLM
Compressor's; the tokenizer and other small files are copied. Weights go to one
model.safetensors. Exit status: 0 written, 1 refused (bad source, DST not empty).

Before rounding, SmoothQuant (tools/smoothquant.py; `--smoothquant ALPHA`, 0 off; default
0.5, the best measured on SmolLM2-135M, docs/benchmarks.md; LLM Compressor's default is 0.8)
folds per-channel scales calibrated on text other than the perplexity tool's held text into
the float weights, as LLM Compressor's SmoothQuantModifier does; like LLM Compressor, the
folder then gets a recipe.yaml naming both steps (the checkpoint format itself is unchanged:
smoothing leaves no trace in config.json). v_proj -> o_proj is smoothed too (exact per KV
head; not in LLM Compressor's Llama mappings; `--no-v-to-o` leaves it out).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpu_worker.model_loader.compressed_tensors import Int8Weight, quantize_linear_weights
from tools.smoothquant import DEFAULT_ALPHA, smooth_checkpoint

IGNORE = ["lm_head"]
# files of SRC not copied: its weights (rewritten) and its shard index
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.gguf")


def quantization_config() -> dict:
    """The `quantization_config` of an int8 W8A8 checkpoint, as compressed-tensors'
    ModelCompressor writes it for LLM Compressor's W8A8 preset (without the version keys)."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="int-quantized",
        ignore=list(IGNORE),
        quantization_status="compressed",
    )
    return config.model_dump(exclude={"quant_method"})


def _scale_dtype(hf_config: dict) -> torch.dtype:
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def checkpoint_tensors(
    tensors: dict[str, torch.Tensor], scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: each linear of QUANTIZED_LINEARS as int8 `X.weight` plus
    `X.weight_scale` [out, 1] in `scale_dtype` (the model's, as LLM Compressor stores it; the
    int8 values are rounded against the scale as stored), the rest unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in quantize_linear_weights(tensors, scale_dtype).items():
        if isinstance(t, Int8Weight):
            out[name] = t.weight
            out[f"{name}_scale"] = t.scale.to(scale_dtype)[:, None].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def recipe_yaml(alpha: float, v_to_o: bool = True) -> str:
    """The recipe.yaml LLM Compressor writes beside a W8A8 checkpoint (SmoothQuantModifier
    with the Llama mappings when `alpha` > 0, then the W8A8 QuantizationModifier). The v -> o
    mapping (`v_to_o`) is ours: one scale per (KV head, dim), commented as such."""
    lines = ["default_stage:", "  default_modifiers:"]
    if alpha > 0:
        lines += [
            "    SmoothQuantModifier:",
            f"      smoothing_strength: {alpha}",
            "      mappings:",
            "      - [['re:.*q_proj', 're:.*k_proj', 're:.*v_proj'], 're:.*input_layernorm']",
            "      - [['re:.*gate_proj', 're:.*up_proj'], 're:.*post_attention_layernorm']",
            "      - [['re:.*down_proj'], 're:.*up_proj']",
        ]
        if v_to_o:
            lines += [
                "      # tools/smoothquant.py: one scale per (KV head, dim), shared by its group",
                "      - [['re:.*o_proj'], 're:.*v_proj']",
            ]
    lines += [
        "    QuantizationModifier:",
        "      targets: [Linear]",
        f"      ignore: {IGNORE}",
        "      scheme: W8A8",
    ]
    return "\n".join(lines) + "\n"


def export_int8(
    src: str | Path, dst: str | Path, smoothquant: float = DEFAULT_ALPHA, v_to_o: bool = True
) -> Path:
    """Write SRC's int8 W8A8 checkpoint to DST (created; must be empty or absent), smoothed
    first with strength `smoothquant` (0: not smoothed; `v_to_o`: v_proj -> o_proj as well)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src, dst = Path(src), Path(dst)
    hf_config = json.loads((src / "config.json").read_text())
    if "quantization_config" in hf_config:
        raise ValueError(f"{src} is already quantized ({hf_config['quantization_config']})")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no *.safetensors weights")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} is not empty")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    tensors = smooth_checkpoint(src, tensors, hf_config, smoothquant, v_to_o)
    dst.mkdir(parents=True, exist_ok=True)
    skip = {p.name for pattern in _WEIGHT_FILES for p in src.glob(pattern)}
    for path in src.iterdir():
        if path.is_file() and path.name not in skip:
            shutil.copy(path, dst / path.name)
    quantized = checkpoint_tensors(tensors, _scale_dtype(hf_config))
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = QuantizationConfig.model_validate(quantization_config())
    ModelCompressor(quantization_config=config).update_config(str(dst))
    (dst / "recipe.yaml").write_text(recipe_yaml(smoothquant, v_to_o))
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/export-int8", description=__doc__.split("\n")[0])
    parser.add_argument("src", help="float Hugging Face folder (config.json, *.safetensors)")
    parser.add_argument("dst", help="new folder for the int8 W8A8 checkpoint")
    parser.add_argument(
        "--no-v-to-o",
        action="store_true",
        help="smooth only LLM Compressor's Llama mappings, not v_proj -> o_proj",
    )
    parser.add_argument(
        "--smoothquant",
        type=float,
        default=DEFAULT_ALPHA,
        metavar="ALPHA",
        help=f"SmoothQuant strength before rounding (default {DEFAULT_ALPHA}; 0: off)",
    )
    args = parser.parse_args(argv)
    try:
        dst = export_int8(args.src, args.dst, args.smoothquant, not args.no_v_to_o)
    except (ValueError, OSError) as e:
        print(f"export-int8: {e}", file=sys.stderr)
        return 1
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
