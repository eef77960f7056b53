"""Random PEFT LoRA adapters for tests: built with `peft` on a Hugging Face model folder,
`init_lora_weights=False` so that they change the model's output, saved as PEFT saves them
(adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from common.lora_config import LoraConfig


def make_adapter(
    model_dir: str | Path,
    folder: str | Path,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    scale: float = 1.0,
    **config: Any,
) -> Path:
    """Save a random LoRA adapter of `model_dir` into `folder` (created once, reused if
    there). `scale` multiplies its B matrices (how far the outputs move from the base's)."""
    import peft
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    lora = peft.LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        init_lora_weights=False,
        **config,
    )
    torch.manual_seed(seed)
    peft_model = peft.get_peft_model(model, lora)
    if scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
    peft_model.save_pretrained(str(folder))
    return folder


@functools.lru_cache(maxsize=8)
def peft_model(model_dir: str, adapter_dir: str) -> Any:
    """transformers + peft: the base model with the adapter, for reference outputs."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def lora_config(modules: Iterable[tuple[str, str | Path]] = (), **flags: Any) -> LoraConfig:
    """The config's LoRA section with --enable-lora, `modules` ((name, folder) pairs) as
    --lora-modules, and any other of its flags."""
    entries = "\n".join(f"{name}={path}" for name, path in modules)
    return LoraConfig(enable_lora=True, lora_modules=entries, **flags)
