"""A tiny random Llama and PEFT adapters of it, shared by the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lora_adapters import make_adapter
from tests.tiny_models import make_tiny_model

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """Every target, rank 4 (v_proj rank 2 and alpha 3 by pattern), alpha 8."""
    return make_adapter(
        tiny_dir,
        tmp_path_factory.mktemp("adapters") / "all",
        r=4,
        lora_alpha=8,
        target_modules=ALL_TARGETS,
        rank_pattern={"v_proj": 2},
        alpha_pattern={"v_proj": 3},
        seed=1,
    )


@pytest.fixture(scope="session")
def rslora_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """rsLoRA on o_proj and down_proj, rank 8."""
    return make_adapter(
        tiny_dir,
        tmp_path_factory.mktemp("adapters") / "rs",
        r=8,
        lora_alpha=4,
        target_modules=["o_proj", "down_proj"],
        use_rslora=True,
        seed=2,
    )
