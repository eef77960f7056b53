"""tools/benchmarks/perplexity.py: the held text's windows, the NLL arithmetic, and the
transformers path against the model's own loss on a tiny random model (float32)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_models import make_tiny_model
from tools.benchmarks.perplexity import (
    LOGPROB_FLOOR,
    held_text,
    load_tokenizer,
    load_transformers,
    main,
    make_windows,
    quantize_activations,
    score,
    special_prefix,
    split_label,
    table,
    tokens_digest,
    transformers_logprobs,
)

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("no default model folder to copy SmolLM2's tokenizer from")
    return folder


def test_windows_are_consecutive_slices_of_the_held_text(tiny: Path) -> None:
    tokenizer = load_tokenizer(str(tiny))
    text = held_text()
    assert text.startswith("Execution model") and text == held_text()
    assert special_prefix(tokenizer) == []  # SmolLM2's tokenizer adds no BOS
    windows = make_windows(tokenizer, text, 3, 40)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert windows == [ids[0:40], ids[40:80], ids[80:120]]
    assert tokens_digest(windows) == tokens_digest(make_windows(tokenizer, text, 3, 40))
    with pytest.raises(ValueError, match="fewer than"):
        make_windows(tokenizer, text, 10_000, 40)


def test_a_tokenizer_that_adds_a_bos_starts_every_window_with_it(tiny: Path) -> None:
    from tokenizers.processors import TemplateProcessing

    tokenizer = load_tokenizer(str(tiny))
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert special_prefix(tokenizer) == [bos]
    windows = make_windows(tokenizer, held_text(), 2, 16)
    ids = tokenizer(held_text(), add_special_tokens=False)["input_ids"]
    assert windows == [[bos, *ids[0:15]], [bos, *ids[15:30]]]


def test_score_is_the_mean_nll_over_every_scored_token() -> None:
    s = score("x", [[math.log(0.5), math.log(0.25)], [math.log(0.125)]], 1.5)
    assert (s.windows, s.tokens) == (2, 3)
    assert s.nll == pytest.approx((1 + 2 + 3) * math.log(2) / 3)
    assert s.ppl == pytest.approx(4.0)
    line = s.as_json(window_len=2)
    assert line["ppl"] == pytest.approx(4.0) and line["source"] == "x" and line["window_len"] == 2
    ref = {**line, "source": "ref", "ppl": 2.0}
    rows = table([ref, {**line, "ratio": 2.0, "reference": "ref"}]).splitlines()
    assert rows[2:] == ["| ref | 3 | 2.0000 |  |  |", "| x | 3 | 4.0000 | 2.0000 | ref |"]
    with pytest.raises(ValueError, match="not finite"):
        score("llamacpp", [[-1.0, -3.4028234663852886e38]])  # log(0.0f) as llama-server sends it
    assert -3.4e38 < LOGPROB_FLOOR


def test_a_source_flag_may_carry_a_label() -> None:
    assert split_label("Q4_1 dequantized=/m/q.gguf") == ("Q4_1 dequantized", "/m/q.gguf")
    assert split_label("/m/a=b/q.gguf") == ("", "/m/a=b/q.gguf")
    assert split_label("http://h:1/x?a=b") == ("", "http://h:1/x?a=b")
    assert split_label("shuttle=http://h:1") == ("shuttle", "http://h:1")


def _direct_nll(model: Any, windows: list[list[int]]) -> float:
    """The mean NLL by transformers' own shifted cross-entropy (labels = the inputs)."""
    losses = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    return sum(losses) / len(losses)  # the windows are equally long


def test_transformers_nll_equals_the_models_own_loss(tiny: Path) -> None:
    windows = make_windows(load_tokenizer(str(tiny)), held_text(), 2, 64)
    model = load_transformers(str(tiny))
    assert next(model.parameters()).dtype == torch.float32
    logprobs = transformers_logprobs(model, windows)
    assert [len(w) for w in logprobs] == [63, 63]
    s = score("transformers", logprobs)
    assert s.tokens == 126
    assert s.nll == pytest.approx(_direct_nll(model, windows), rel=1e-5)
    assert s.nll > 5.0  # a random model: near log(vocab) ~ 10.8, far from a trained one's ~2


def _int8_checkpoint(tiny: Path, folder: Path) -> Path:
    """`tiny` as a compressed-tensors int8 W8A8 checkpoint (every linear but the LM head:
    int8 weights, a float32 scale per output row, absmax / 127), written by the library."""
    import shutil

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], **INT8_W8A8)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            absmax = module.weight.abs().amax(dim=1, keepdim=True)
            module.weight_scale.data = absmax / 127.0
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    return folder


def test_an_int8_checkpoint_is_scored_with_its_weights_dequantized(
    tiny: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder = _int8_checkpoint(tiny, tmp_path / "tiny-int8")
    dequantized: dict[str, torch.Tensor] = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.endswith(".weight_scale"):
                name = key.removesuffix("_scale")
                assert f.get_tensor(name).dtype == torch.int8
                dequantized[name] = f.get_tensor(name).float() * f.get_tensor(key)
    assert len(dequantized) == 2 * 7  # q k v o gate up down, in 2 layers
    float_model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    float_model.load_state_dict(dequantized, strict=False)
    model = load_transformers(str(folder))
    q_proj = model.model.layers[1].self_attn.q_proj
    assert q_proj.weight.dtype == torch.float32
    assert torch.equal(q_proj.weight, dequantized["model.layers.1.self_attn.q_proj.weight"])
    windows = make_windows(load_tokenizer(str(folder)), held_text(), 2, 32)
    got = score("int8", transformers_logprobs(model, windows))
    want = score("float", transformers_logprobs(float_model, windows))
    assert got.nll == pytest.approx(want.nll, rel=1e-6)  # activations are not quantized


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    return torch.round(x / scale).clamp(-127, 127), scale


def test_int8_activations_are_rounded_as_w8a8_rounds_them(tiny: Path) -> None:
    torch.manual_seed(0)
    model = load_transformers(str(tiny))
    layer = model.model.layers[0].mlp.down_proj
    weight, scale = _int8_rows(layer.weight.detach())  # int8 weights, as a W8A8 checkpoint's
    with torch.no_grad():
        layer.weight.copy_(weight * scale)
    x = torch.randn(5, layer.in_features) * torch.linspace(0.1, 8.0, layer.in_features)
    before = layer(x)
    quantize_activations(model, 0)
    # W8A8 in the integer domain: int8 rows times int8 weights, then both scales
    xq, xs = _int8_rows(x)
    want = (xq @ weight.T) * xs * scale[:, 0]
    assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, want, rtol=1e-3, atol=1e-3)
    fresh = load_transformers(str(tiny))
    quantize_activations(fresh, 32)
    blocks = x.reshape(5, -1, 32)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    x_32 = (torch.round(blocks / s) * s).reshape(5, -1)
    down = fresh.model.layers[0].mlp.down_proj
    assert torch.allclose(down(x), x_32 @ down.weight.T, rtol=1e-5, atol=1e-5)
    head = fresh.lm_head
    h = torch.randn(3, head.in_features)
    assert torch.equal(head(h), h @ head.weight.T)  # the LM head's input is left as it is


def test_the_command_adds_a_source_with_int8_activations(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "ppl.jsonl"
    argv = ["--transformers", f"tiny={tiny}", "--act-int8", "token", "--windows", "2"]
    assert main([*argv, "--window-len", "32", "--json", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["source"] for x in lines] == ["tiny", "tiny, int8 activations per token"]
    assert [x["reference"] for x in lines] == ["tiny", "tiny"]
    assert lines[1]["ppl"] != lines[0]["ppl"] and lines[0]["tokens"] == lines[1]["tokens"] == 62
