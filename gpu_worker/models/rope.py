"""Rotary position embeddings' frequencies, with the scalings transformers defines.

    rope_type   inverse frequencies                                   cos/sin scaled by
    default     theta ** -(2i / d)                                    1
    llama3      long wavelengths / factor, short kept, band between   1
    linear      default / factor (position interpolation)             1
    yarn        per frequency between interpolated (/ factor) and     attention_factor, or
                extrapolated (kept), by a ramp over the dimensions       0.1 ln(factor) + 1
                that turn beta_fast .. beta_slow times in the            (mscale, mscale_all_dim)
                original context
    longrope    default / short_factor[i], or / long_factor[i] when   attention_factor, or
                the served context passes the original (below)           sqrt(1 + ln(factor) /
                                                                         ln(original))
    dynamic     default (the served context never passes              1
                max_position_embeddings, where it starts: below)

`d` is the rotary dimension: head_dim * partial_rotary_factor (Phi-4-mini: 0.75). Only the
first d dimensions of each head rotate, pairs (i, i + d/2); the rest pass through unchanged.

Each is computed as transformers' modeling_rope_utils computes it, op for op in float32, so
the tables are the same bits.

A served token's rotation must not depend on its batch or on how its prompt was cut into
chunks: the tables are built once per server. transformers picks two scalings per forward
call from the longest position in that call, so they are served by a static rule:

- longrope: transformers uses the long factors for a forward whose longest position passes
  original_max_position_embeddings, the short ones otherwise. We use the long factors for every
  token when the served context (max_model_len) passes the original, the short ones otherwise —
  llama.cpp's rule (rope_long when n_ctx_per_seq > n_ctx_orig_yarn), and vLLM's since it stopped
  picking per batch (it once used the long table for a whole batch as soon as any position in
  it passed the original, so a short request's tokens rotated by whatever shared its batch, and
  a sequence's cached keys were rotated by factors its later tokens did not use). The rule is
  transformers' exactly for a sequence whose longest forward call sets the same choice: within
  the original length with a short served context; past it, in one call, with a long one. It
  differs for a sequence that stays within the original under a long served context (the long
  factors here, the short ones there: the price of a choice that no batch can change), and
  where transformers is itself inconsistent (a prompt within the original whose generation
  crosses it keeps keys rotated by the short factors beside queries rotated by the long ones).
- dynamic (NTK): transformers keeps the plain frequencies until a forward's length passes
  max_position_embeddings, then grows the base for that length. The served context never
  passes max_position_embeddings (the runner caps max_model_len there for every model), so the
  plain frequencies are transformers' for every call we serve. Serving past it would take a
  static base for one length (vLLM's, for max_position_embeddings * factor) that differs from
  transformers' for every shorter sequence; we do not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SERVED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope", "dynamic")
# the families whose transformers modeling rotates only the first head_dim * partial dims
PARTIAL_ROTARY_TYPES = ("phi3",)
# transformers' Phi3Config reads a legacy "su" or "yarn" rope_type as longrope, and defaults
# original_max_position_embeddings to Phi-3-mini's 4096
_PHI3_LONGROPE_ALIASES = ("su", "yarn")
_PHI3_ORIGINAL_LENGTH = 4096


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope settings in rope_parameters, older configs in rope_scaling."""
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def rope_theta(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rope_theta") or rope_params(cfg).get("rope_theta") or 10000.0)


def rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """How many of each head's dimensions rotate: head_dim * partial_rotary_factor (as
    transformers reads it: rope parameters first, then the config's top level)."""
    partial = rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is None or partial == 1.0:
        return head_dim
    model_type = cfg.get("model_type", "")
    if model_type not in PARTIAL_ROTARY_TYPES:
        raise ValueError(
            f"partial_rotary_factor {partial} is not supported for {model_type!r} "
            f"(only {PARTIAL_ROTARY_TYPES}, whose transformers modeling rotates part of a head)"
        )
    dim = int(head_dim * partial)
    if dim <= 0 or dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {dim} rotary dims of {head_dim}")
    return dim


def rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling's parameters (original_max_position_embeddings and longrope's factor filled
    in as transformers fills them), None for plain rope; unserved types refused by name."""
    params = dict(rope_params(cfg))
    rope_type = params.get("rope_type", params.get("type", "default"))
    is_phi3 = cfg.get("model_type") == "phi3"
    if is_phi3 and rope_type in _PHI3_LONGROPE_ALIASES:
        rope_type = "longrope"
    if rope_type not in SERVED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported {SERVED_ROPE_TYPES}")
    if rope_type == "default":
        return None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):  # transformers' standardize_rope_params
        original = cfg.get("original_max_position_embeddings")
        if original is None and is_phi3:
            original = _PHI3_ORIGINAL_LENGTH
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if rope_type == "longrope":
        return _longrope_params(params, cfg)
    if rope_type == "dynamic":
        params["max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    if not isinstance(params.get("factor"), (int, float)):
        raise ValueError(f"rope_parameters.factor is missing for rope_type {rope_type!r}")
    return params


def _longrope_params(params: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's factor defaults to max_position_embeddings / original (Phi-3's configs
    name none), and its attention factor to sqrt(1 + ln(factor) / ln(original))."""
    for name in ("short_factor", "long_factor"):
        if not isinstance(params.get(name), list):
            raise ValueError(f"rope_parameters.{name} (a list) is missing for rope_type longrope")
    original = params["original_max_position_embeddings"]
    if params.get("factor") is None:
        params["factor"] = cfg.get("max_position_embeddings", original) / original
    if params.get("attention_factor") is None:
        factor = params["factor"]
        params["attention_factor"] = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return params


def rope_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any] | None, served_len: int
) -> torch.Tensor:
    """Inverse frequencies [dim // 2] for the scaling (None: plain rope), `dim` the rotary
    dims, for a server whose context is `served_len` tokens (longrope's choice, above)."""
    # on the CPU explicitly, as HF does, even while the loader builds modules on "meta"
    exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    if rope_type == "longrope":
        return _longrope_inv_freq(dim, theta, scaling, served_len)
    if rope_type == "dynamic":
        return _dynamic_inv_freq(dim, theta, scaling, served_len)
    return _llama3_inv_freq(inv_freq, scaling)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What transformers multiplies cos and sin by (yarn's and longrope's attention scaling;
    1 otherwise)."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
    return _yarn_mscale(factor)


def uses_long_factors(scaling: dict[str, Any], served_len: int) -> bool:
    """LongRoPE: the long factors for a served context past the original length (above)."""
    return served_len > scaling["original_max_position_embeddings"]


def _longrope_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any], served_len: int
) -> torch.Tensor:
    """default / factors[i], the long or short factors by the served context (above)."""
    name = "long_factor" if uses_long_factors(scaling, served_len) else "short_factor"
    factors = scaling[name]
    if len(factors) != dim // 2:
        raise ValueError(f"rope_parameters.{name} has {len(factors)} values, not {dim // 2}")
    ext_factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext_factors * theta**shape)


def _dynamic_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any], served_len: int
) -> torch.Tensor:
    """Dynamic NTK at the length transformers starts from (max_position_embeddings): the
    plain frequencies, computed as transformers computes them (its base * 1.0 ** ...)."""
    max_len = scaling["max_position_embeddings"]
    if served_len > max_len:  # the runner caps the served context there (above)
        raise ValueError(f"rope_type 'dynamic' is served up to {max_len} positions")
    factor = scaling["factor"]
    base = theta * ((factor * max_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base**shape)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: dimensions turning fewer than beta_slow times in the original context are
    interpolated, more than beta_fast extrapolated, a linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(torch.float) / dim)
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
