"""Embeddings requests in the tokenizer: `dimensions` only where the model's config.json says
it was trained for them (services/tokenizer/matryoshka.py, vLLM's rule), and an input that
may fill the model's length but not pass it (truncate_prompt_tokens keeps its last tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from common.messages import GenerateRequest, SamplingParams
from services.tokenizer.matryoshka import Matryoshka, check_dimensions, read_matryoshka
from services.tokenizer.validate import InvalidRequest
from tests.tiny_models import OWN_VOCAB_EOS_ID, make_own_vocab_tokenizer
from tests.unit.services.tokenizer.test_actor import make_actor

MEAN = SamplingParams(max_tokens=1, temperature=0.0, pooling="mean")


def _folder(root: Path, **config: object) -> Path:
    folder = make_own_vocab_tokenizer(root, vocab_size=300)
    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    facts = {"vocab_size": size, "eos_token_id": OWN_VOCAB_EOS_ID, "max_position_embeddings": 16}
    (folder / "config.json").write_text(json.dumps(facts | {"hidden_size": 64} | config))
    return folder


def _embed(ids: list[int], dimensions: int | None = None, **kw: int) -> GenerateRequest:
    return GenerateRequest(
        request_id="e",
        model="tiny",
        sampling=MEAN,
        prompt_token_ids=ids,
        dimensions=dimensions,
        **kw,  # type: ignore[arg-type]
    )


def test_read_matryoshka_from_config_json(tmp_path: Path) -> None:
    assert read_matryoshka(_folder(tmp_path / "plain")) == Matryoshka(64, False, ())
    assert read_matryoshka(_folder(tmp_path / "any", is_matryoshka=True)) == Matryoshka(64, True)
    listed = _folder(tmp_path / "listed", matryoshka_dimensions=[16, 32])
    assert read_matryoshka(listed) == Matryoshka(64, True, (16, 32))
    assert read_matryoshka(tmp_path / "no-folder") == Matryoshka()


def test_check_dimensions_follows_vllm() -> None:
    plain, listed = Matryoshka(64, False, ()), Matryoshka(64, True, (16, 32))
    check_dimensions(None, plain, "m")
    check_dimensions(64, plain, "m")  # the whole vector: nothing is cut
    with pytest.raises(InvalidRequest, match="does not support matryoshka") as e:
        check_dimensions(8, plain, "m")
    assert e.value.param == "dimensions"
    check_dimensions(16, listed, "m")
    with pytest.raises(InvalidRequest, match=r"supports only \[16, 32\]"):
        check_dimensions(8, listed, "m")
    with pytest.raises(InvalidRequest, match="hidden size"):
        check_dimensions(65, Matryoshka(64, True, ()), "m")


def test_an_embeddings_input_fills_the_model_length_and_no_more(tmp_path: Path) -> None:
    actor = make_actor(_folder(tmp_path / "m", is_matryoshka=True), tmp_path)
    out = actor.tokenize(_embed(list(range(3, 19)), dimensions=8))  # 16 = max_model_len
    assert out.prompt_token_ids == list(range(3, 19))
    assert out.sampling.pooling == "mean" and out.sampling.max_tokens == 1
    with pytest.raises(InvalidRequest, match="more than the model's maximum") as e:
        actor.tokenize(_embed(list(range(3, 20))))
    assert e.value.param == "prompt"  # (the gateway names it `input`)
    kept = actor.tokenize(_embed(list(range(3, 20)), truncate_prompt_tokens=5))
    assert kept.prompt_token_ids == list(range(15, 20))


def test_dimensions_refused_for_a_model_not_trained_for_them(tmp_path: Path) -> None:
    actor = make_actor(_folder(tmp_path / "m"), tmp_path)
    with pytest.raises(InvalidRequest, match="does not support matryoshka") as e:
        actor.tokenize(_embed([3, 4, 5], dimensions=8))
    assert e.value.param == "dimensions"
