"""SmoothQuant for tools/export_int8: migrate activation outliers into the weights before
the int8 W8A8 rounding (Xiao et al. 2023; LLM Compressor's SmoothQuantModifier).

For a linear group whose input X is produced by a scalable "smoothing" tensor (an RMSNorm's
weight, or the output rows of a linear), each input channel j gets

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)        (W: the group's weights, joined)

the smoothing tensor's channel j is divided by s_j and every balanced linear's input column
j multiplied by s_j: the float model is unchanged in exact arithmetic, while per-token int8
activations see channels of evener range. The mappings are LLM Compressor's default ones for
the Llama family, per layer:

    input_layernorm           -> q_proj, k_proj, v_proj
    post_attention_layernorm  -> gate_proj, up_proj
    up_proj (output rows)     -> down_proj   (down's input is silu(gate) * up, linear in up)

and, with `num_kv_heads` given (what tools/export_int8 does), v_proj (output rows) -> o_proj:
exact with grouped KV heads too, as long as every query head sharing a KV head gets the same
scale: o's input channel (head h, dim d) is a convex combination of v's output channel
(h // group, d), so s is taken per (KV head, dim) over the group's channels.

max|X_j| comes from a calibration pass through transformers in float32 over
CALIBRATION_TOPICS of the standard library's pydoc_data.topics: other topics than the
perplexity tool's held ones (tools/benchmarks/perplexity.py HELD_TOPICS), checked to share
no line with the held text (`calibration_text` raises otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CALIBRATION_TOPICS = ("formatstrings", "string-methods", "import")
CALIBRATION_TOKENS = 2048
CALIBRATION_CHUNK = 512  # tokens per forward (separate sequences)
# best of 0, 0.3, 0.4, 0.5, 0.6, 0.8 by perplexity on SmolLM2-135M (docs/benchmarks.md);
# LLM Compressor's SmoothQuantModifier defaults to 0.8 (+2.0% there, 0.5: +0.5%)
DEFAULT_ALPHA = 0.5
# model types whose decoder layers are Llama's (RMSNorm scaling by `weight`, gated MLP)
SMOOTHABLE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_MIN_SCALE = 1e-5  # LLM Compressor's clamp of both maxima
_OVERLAP_MIN_LINE = 40  # lines shorter than this (rules, short code) may repeat harmlessly


def calibration_text() -> str:
    """CALIBRATION_TOPICS joined by blank lines; raises ValueError if any of them is a held
    topic of the perplexity tool or shares a line (of 40+ characters) with its held text."""
    from pydoc_data.topics import topics

    from tools.benchmarks.perplexity import HELD_TOPICS, held_text

    if shared := set(CALIBRATION_TOPICS) & set(HELD_TOPICS):
        raise ValueError(f"calibration topics {sorted(shared)} are held topics")
    text = "\n\n".join(topics[name] for name in CALIBRATION_TOPICS)
    held = held_text()
    lines = {line.strip() for line in text.splitlines() if len(line.strip()) >= _OVERLAP_MIN_LINE}
    if shared_lines := sorted(line for line in lines if line in held):
        raise ValueError(f"calibration text overlaps the held text: {shared_lines[:3]}")
    return text


def mappings(num_layers: int) -> list[tuple[str, list[str]]]:
    """(smoothing tensor, balanced linears' weights) per layer, by state-dict name."""
    out: list[tuple[str, list[str]]] = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        mlp = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        out.append((f"{p}input_layernorm.weight", attn))
        out.append((f"{p}post_attention_layernorm.weight", mlp))
        out.append((f"{p}mlp.up_proj.weight", [f"{p}mlp.down_proj.weight"]))
    return out


def activation_maxima(model: Any, ids: list[int], chunk: int = CALIBRATION_CHUNK) -> dict:
    """max |input| per input channel of every nn.Linear of `model` over `ids` (run in
    separate sequences of `chunk` tokens): {state-dict weight name: float32 [in_features]}."""
    maxima: dict[str, torch.Tensor] = {}
    hooks = []

    def hook_for(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            maxima[name] = torch.maximum(maxima[name], x) if name in maxima else x

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(hook_for(f"{name}.weight")))
    try:
        with torch.no_grad():
            for start in range(0, len(ids), chunk):
                model(torch.tensor([ids[start : start + chunk]]))
    finally:
        for h in hooks:
            h.remove()
    return maxima


def smoothing_scales(
    act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float
) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha), both maxima clamped at 1e-5 (as LLM
    Compressor does); `weights` are the balanced linears' [out, in] weights."""
    w_max = torch.cat([w.float().abs().amax(dim=0, keepdim=True) for w in weights]).amax(dim=0)
    x = act_max.float().clamp(min=_MIN_SCALE)
    return x.pow(alpha) / w_max.clamp(min=_MIN_SCALE).pow(1 - alpha)


def _divide(out: dict[str, torch.Tensor], name: str, s: torch.Tensor) -> None:
    """Channel j of the smoothing tensor `name` (a norm's weight, or a linear's output row
    and bias) divided by s_j."""
    w = out[name]
    shape = (-1, 1) if w.dim() == 2 else (-1,)
    out[name] = (w.float() / s.reshape(shape)).to(w.dtype)
    bias = name.removesuffix(".weight") + ".bias"
    if w.dim() == 2 and bias in out:
        out[bias] = (out[bias].float() / s).to(out[bias].dtype)


def _smooth_v_to_o(
    out: dict[str, torch.Tensor], act_max: torch.Tensor, prefix: str, kv: int, alpha: float
) -> None:
    """v_proj's output rows -> o_proj's input columns, one scale per (KV head, dim)."""
    v_name, o_name = f"{prefix}self_attn.v_proj.weight", f"{prefix}self_attn.o_proj.weight"
    v, o = out[v_name], out[o_name]
    head_dim, group = v.shape[0] // kv, o.shape[1] // v.shape[0]
    x = act_max.float().reshape(kv, group, head_dim).amax(dim=1)
    w = o.float().abs().amax(dim=0).reshape(kv, group, head_dim).amax(dim=1)
    s = x.clamp(min=_MIN_SCALE).pow(alpha) / w.clamp(min=_MIN_SCALE).pow(1 - alpha)
    _divide(out, v_name, s.reshape(-1))
    cols = s[:, None, :].expand(kv, group, head_dim).reshape(-1)
    out[o_name] = (o.float() * cols[None, :]).to(o.dtype)


def smooth_tensors(
    tensors: dict[str, torch.Tensor],
    maxima: dict[str, torch.Tensor],
    alpha: float,
    num_kv_heads: int = 0,
) -> dict[str, torch.Tensor]:
    """A copy of the state dict `tensors` with every mapping smoothed (computed in float32,
    stored in each tensor's dtype); `maxima` from activation_maxima. alpha 0: unchanged.
    With `num_kv_heads` (the model's), v_proj -> o_proj is smoothed too."""
    out = dict(tensors)
    if alpha <= 0:
        return out
    num_layers = 1 + max(
        (int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")), default=-1
    )
    for smooth, balanced in mappings(num_layers):
        if smooth not in out or any(b not in out for b in balanced):
            raise ValueError(f"not a Llama-family layer: {smooth} or {balanced} missing")
        s = smoothing_scales(maxima[balanced[0]], [out[b] for b in balanced], alpha)
        _divide(out, smooth, s)
        for b in balanced:
            out[b] = (out[b].float() * s[None, :]).to(out[b].dtype)
    for i in range(num_layers if num_kv_heads else 0):
        p = f"model.layers.{i}."
        _smooth_v_to_o(out, maxima[f"{p}self_attn.o_proj.weight"], p, num_kv_heads, alpha)
    return out


def calibrate(src: str | Path, num_tokens: int = CALIBRATION_TOKENS) -> dict:
    """activation_maxima of the float model in SRC (transformers, float32) over the first
    `num_tokens` tokens of calibration_text (tokenized by SRC's tokenizer, no specials)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    ids = tokenizer(calibration_text(), add_special_tokens=False)["input_ids"][:num_tokens]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.eval()
    return activation_maxima(model, ids)


def smooth_checkpoint(
    src: str | Path,
    tensors: dict[str, torch.Tensor],
    hf_config: dict,
    alpha: float,
    v_to_o: bool = True,
) -> dict[str, torch.Tensor]:
    """SRC's state dict `tensors` smoothed with strength `alpha` (calibrated on SRC; with
    `v_to_o`, v_proj -> o_proj too); `hf_config`: SRC's config.json. Raises ValueError for a
    model type outside SMOOTHABLE_TYPES."""
    if alpha <= 0:
        return dict(tensors)
    model_type = hf_config.get("model_type", "")
    if model_type not in SMOOTHABLE_TYPES:
        raise ValueError(f"SmoothQuant supports {sorted(SMOOTHABLE_TYPES)}, not {model_type!r}")
    kv = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    return smooth_tensors(tensors, calibrate(src), alpha, kv if v_to_o else 0)
