"""tools/smoothquant.py: smoothing a tiny float model leaves its logits as they were, the
calibration text is not the perplexity tool's held text, and a smoothed export still reads
back through shuttle's compressed-tensors reader and through transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.model_loader.compressed_tensors import Int8Weight
from gpu_worker.model_loader.hf_folder import read_hf_config
from gpu_worker.model_loader.loader import read_checkpoint
from tests.tiny_models import make_tiny_model
from tools.benchmarks.perplexity import HELD_TOPICS, held_text
from tools.export_int8 import main
from tools.smoothquant import (
    CALIBRATION_TOPICS,
    activation_maxima,
    calibrate,
    calibration_text,
    smooth_tensors,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("smoothquant") / "float", "llama")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_calibration_text_is_not_the_held_text() -> None:
    assert not set(CALIBRATION_TOPICS) & set(HELD_TOPICS)
    text, held = calibration_text(), held_text()
    lines = {line.strip() for line in text.splitlines() if len(line.strip()) >= 40}
    assert len(lines) > 100 and not [line for line in lines if line in held]
    assert text[:200] not in held and held[:200] not in text


@pytest.mark.parametrize("alpha", [0.5, 0.8])
@pytest.mark.parametrize("v_to_o", [False, True])
def test_smoothing_leaves_the_float_logits_unchanged(
    tiny: Path, alpha: float, v_to_o: bool
) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    kv = model.config.num_key_value_heads
    assert model.config.num_attention_heads > kv > 1  # grouped KV heads
    maxima = calibrate(tiny, num_tokens=256)
    assert maxima["model.layers.0.self_attn.q_proj.weight"].shape == (model.config.hidden_size,)
    ids = torch.tensor([list(range(3, 40))])
    before = _logits(model, ids)
    state = model.state_dict()
    smoothed = smooth_tensors(state, maxima, alpha, kv if v_to_o else 0)
    changed = [n for n in state if not torch.equal(state[n], smoothed[n])]
    assert "model.layers.1.input_layernorm.weight" in changed
    assert "model.layers.1.mlp.down_proj.weight" in changed
    assert ("model.layers.1.self_attn.o_proj.weight" in changed) == v_to_o
    model.load_state_dict(smoothed)
    after = _logits(model, ids)
    assert ((after - before).abs().max() / before.abs().max()).item() < 1e-4


def test_smoothing_evens_the_activation_channels(tiny: Path) -> None:
    """After smoothing with alpha 1, each smoothed linear's input has max|X_j| = 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    maxima = calibrate(tiny, num_tokens=128)
    kv = model.config.num_key_value_heads
    model.load_state_dict(smooth_tensors(model.state_dict(), maxima, 1.0, kv))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny))
    ids = tokenizer(calibration_text(), add_special_tokens=False)["input_ids"][:128]
    after = activation_maxima(model, ids)  # the calibration's own tokens
    for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):  # one scale each
        x = after[f"model.layers.0.{name}.weight"]
        torch.testing.assert_close(x, torch.ones_like(x), rtol=1e-3, atol=1e-3)
    o = after["model.layers.0.self_attn.o_proj.weight"].reshape(kv, -1)  # one per group
    torch.testing.assert_close(o.amax(dim=1), torch.ones(kv), rtol=1e-3, atol=1e-3)


def test_a_smoothed_export_reads_back(tiny: Path, tmp_path: Path) -> None:
    import transformers

    assert main([str(tiny), str(tmp_path / "int8"), "--smoothquant", "0.8"]) == 0
    recipe = (tmp_path / "int8" / "recipe.yaml").read_text()
    assert "smoothing_strength: 0.8" in recipe and "re:.*o_proj" in recipe
    ours = read_checkpoint(tmp_path / "int8", read_hf_config(tmp_path / "int8"), TensorParallel())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "int8", dtype=torch.float32
    )
    ids = torch.tensor([list(range(3, 20))])
    logits = _logits(model, ids)  # decompresses on the first forward
    params = dict(model.named_parameters())
    for name, value in ours.items():
        if isinstance(value, Int8Weight):
            expect = value.weight.float() * value.scale[:, None]
            torch.testing.assert_close(params[name], expect, rtol=0, atol=0)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    expect = _logits(float_model, ids)
    assert ((logits - expect).abs().max() / expect.abs().max()).item() < 0.05


def test_an_unsmoothable_model_type_is_refused(tiny: Path, tmp_path: Path) -> None:
    from tools.smoothquant import smooth_checkpoint

    with pytest.raises(ValueError, match="SmoothQuant supports"):
        smooth_checkpoint(tiny, {}, {"model_type": "gemma"}, 0.8)
    same = smooth_checkpoint(tiny, {"x": torch.ones(1)}, {"model_type": "gemma"}, 0)
    assert same == {"x": torch.ones(1)}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_smoothing_is_exact_for_the_other_llama_family_archs(arch: str, tmp_path: Path) -> None:
    """qwen2: q/k/v biases (v's divided with its rows) and one KV head; qwen3: q/k norms."""
    import transformers

    src = make_tiny_model(tmp_path / arch, arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(3, 40))])
    before = _logits(model, ids)
    kv = model.config.num_key_value_heads
    model.load_state_dict(smooth_tensors(model.state_dict(), calibrate(src, 256), 0.5, kv))
    after = _logits(model, ids)
    assert ((after - before).abs().max() / before.abs().max()).item() < 1e-4
