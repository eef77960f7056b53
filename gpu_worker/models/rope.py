"""Rotary position embeddings' frequencies, with the scalings transformers defines.

    rope_type   inverse frequencies                                   cos/sin scaled by
    default     theta ** -(2i / d)                                    1
    llama3      long wavelengths / factor, short kept, band between   1
    linear      default / factor (position interpolation)             1
    yarn        per frequency between interpolated (/ factor) and     attention_factor, or
                extrapolated (kept), by a ramp over the dimensions       0.1 ln(factor) + 1
                that turn beta_fast .. beta_slow times in the            (mscale, mscale_all_dim)
                original context

Each is computed as transformers' modeling_rope_utils computes it, op for op in float32, so
the tables are the same bits. Two scalings are refused by name: "dynamic" and "longrope"
recompute or swap the frequencies per forward call from the longest position in that call,
so a token's rotation depends on how its sequence was cut into calls (prompt at once or in
chunks, the batch around it) — not a function of the token's position that a paged cache
can hold.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SERVED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
_PER_CALL = {
    "dynamic": "its frequencies grow with the longest position of each forward call",
    "longrope": "it picks short or long factors by the longest position of each forward call",
}


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope settings in rope_parameters, older configs in rope_scaling."""
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def rope_theta(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rope_theta") or rope_params(cfg).get("rope_theta") or 10000.0)


def rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling's parameters (original_max_position_embeddings filled in as transformers
    fills it), None for plain rope; unserved types refused by name."""
    params = dict(rope_params(cfg))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (1.0)")
    if rope_type in _PER_CALL:
        raise ValueError(f"rope_type {rope_type!r} is not supported: {_PER_CALL[rope_type]}")
    if rope_type not in SERVED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported {SERVED_ROPE_TYPES}")
    if rope_type == "default":
        return None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):  # transformers' standardize_rope_params
        original = cfg.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if not isinstance(params.get("factor"), (int, float)):
        raise ValueError(f"rope_parameters.factor is missing for rope_type {rope_type!r}")
    return params


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for the scaling (None: plain rope)."""
    # on the CPU explicitly, as HF does, even while the loader builds modules on "meta"
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    return _llama3_inv_freq(inv_freq, scaling)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What transformers multiplies cos and sin by (yarn's attention scaling; 1 otherwise)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: dimensions turning fewer than beta_slow times in the original context are
    interpolated, more than beta_fast extrapolated, a linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's wavelength-dependent scaling."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
