"""tools/export_int8.py: an int8 W8A8 compressed-tensors checkpoint from a tiny float model,
read back by compressed-tensors itself (through transformers, as LLM Compressor's are)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.model_loader.compressed_tensors import Int8Weight
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import read_checkpoint
from tests.tiny_models import make_tiny_model
from tools.export_int8 import export_int8, main


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export_int8")
    src = make_tiny_model(root / "float", "llama")
    assert main([str(src), str(root / "int8")]) == 0
    return root / "int8"


def test_config_is_llm_compressors_w8a8(exported: Path) -> None:
    source = json.loads((exported.parent / "float" / "config.json").read_text())
    config = json.loads((exported / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == source  # every other field kept
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    assert qc["kv_cache_scheme"] is None and "version" in qc
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    weights, acts = group["weights"], group["input_activations"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (8, "int", True)
    assert (weights["strategy"], weights["dynamic"], weights["group_size"]) == (
        "channel",
        False,
        None,
    )
    assert (acts["num_bits"], acts["type"], acts["symmetric"]) == (8, "int", True)
    assert (acts["strategy"], acts["dynamic"]) == ("token", True)


def test_tokenizer_files_are_copied_and_weights_rewritten(exported: Path) -> None:
    src = exported.parent / "float"
    copied = {p.name for p in src.iterdir() if not p.name.endswith(".safetensors")}
    assert copied <= {p.name for p in exported.iterdir()}
    assert [p.name for p in exported.glob("*.safetensors")] == ["model.safetensors"]
    if (src / "tokenizer.json").is_file():
        assert (exported / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_transformers_reads_the_same_weights(exported: Path) -> None:
    """compressed-tensors' own decompression (what transformers runs on LLM Compressor's
    checkpoints) gives exactly our dequantized weights; the LM head stays float."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # decompresses on the first forward
    ours = read_checkpoint(exported, read_hf_config(exported), TensorParallel())
    params = dict(model.named_parameters())
    for name, value in ours.items():
        if isinstance(value, Int8Weight):
            torch.testing.assert_close(
                params[name], value.weight.float() * value.scale[:, None], rtol=0, atol=0
            )
    lm_head = ours["lm_head.weight"]
    assert isinstance(lm_head, torch.Tensor) and torch.equal(params["lm_head.weight"], lm_head)


def test_refuses_a_quantized_source_or_a_used_destination(exported: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="already quantized"):
        export_int8(exported, tmp_path / "again")
    assert main([str(exported.parent / "float"), str(exported)]) == 1  # not empty
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
