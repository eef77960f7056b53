"""Greedy reference tokens from `transformers` on the same weights (fp32, KV cache, no EOS)."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import torch


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(model_dir: str | Path, prompt_ids: list[int], num_new: int) -> list[int]:
    """Argmax decoding with transformers' own forward and KV cache; never stops at EOS."""
    return greedy(_hf_model(str(model_dir)), prompt_ids, num_new)


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt_ids: list[int], num_new: int) -> list[int]:
    """Argmax decoding of a transformers model (or a peft model around one) with its own
    forward and KV cache; never stops at EOS."""
    # transformers 5.x renames `past_key_values` to `cache` in forward()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's
    key = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(num_new):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        past = getattr(out, "cache", None) or out.past_key_values
        out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, **{key: past})
    return tokens
