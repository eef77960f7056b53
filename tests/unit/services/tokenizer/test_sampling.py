"""How the tokenizer completes and checks a request's sampling: the model's generation_config
defaults for unset fields (--generation-config auto | vllm), bad words as token ids, and the
controls' ranges and vocabulary checks (400s naming the field). No processes, no sockets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from common.config import Config, ConfigError
from common.messages import GenerateRequest, ModelChanged, SamplingParams
from common.messages.types import MODEL_DEFAULT_FIELDS
from common.model_facts import tokenizer_fingerprint
from services.tokenizer.actor import TokenizerActor, startup_model
from services.tokenizer.sampling import bad_words_token_ids, fill_defaults, read_sampling_defaults
from services.tokenizer.validate import InvalidRequest, check_sampling
from tests.tiny_models import OWN_VOCAB_EOS_ID, make_own_vocab_tokenizer

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def _model_folder(folder: Path, generation_config: dict[str, object] | None) -> Path:
    make_own_vocab_tokenizer(folder, vocab_size=300)
    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = {"vocab_size": size, "eos_token_id": OWN_VOCAB_EOS_ID, "max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model whose generation_config.json sets sampling defaults, and one whose does not."""
    root = tmp_path_factory.mktemp("models")
    with_defaults = _model_folder(root / "with", {"eos_token_id": 2, **MODEL_DEFAULTS})
    without = _model_folder(root / "without", {"eos_token_id": 2})
    return with_defaults, without


def _actor(folder: Path, tmp_path: Path, mode: str = "auto") -> TokenizerActor:
    config = Config().replace(
        model={"model": str(folder), "generation_config": mode}, server={"run_dir": str(tmp_path)}
    )
    actor = TokenizerActor(config, 0)
    actor.model = startup_model(folder, 0, mode)  # what start() loads, without its sockets
    return actor


def _request(sampling: SamplingParams, unset: list[str] | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model="tiny",
        sampling=sampling,
        prompt="the quick brown fox",
        unset_sampling=list(MODEL_DEFAULT_FIELDS) if unset is None else unset,
    )


def _encode(folder: Path, text: str) -> list[int]:
    return list(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)


# --- generation_config defaults ---------------------------------------------------------------


def test_unset_fields_take_the_models_defaults(folders: tuple[Path, Path], tmp_path: Path) -> None:
    with_defaults, _ = folders
    actor = _actor(with_defaults, tmp_path)
    got = actor.tokenize(_request(SamplingParams())).sampling
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert got.min_p == 0.0  # the file has none


def test_fields_the_client_set_keep_its_values(folders: tuple[Path, Path], tmp_path: Path) -> None:
    with_defaults, _ = folders
    actor = _actor(with_defaults, tmp_path)
    mine = SamplingParams(temperature=1.0, top_k=0)  # set to our defaults, on purpose
    got = actor.tokenize(_request(mine, unset=["top_p", "min_p", "repetition_penalty"])).sampling
    assert (got.temperature, got.top_k) == (1.0, 0)
    assert (got.top_p, got.repetition_penalty) == (0.9, 1.1)


def test_generation_config_vllm_ignores_the_file(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    with_defaults, _ = folders
    got = _actor(with_defaults, tmp_path, "vllm").tokenize(_request(SamplingParams())).sampling
    assert got == dataclasses.replace(SamplingParams(), max_tokens=16)


def test_a_model_without_defaults_keeps_ours(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, without = folders
    got = _actor(without, tmp_path).tokenize(_request(SamplingParams())).sampling
    assert got == dataclasses.replace(SamplingParams(), max_tokens=16)


def test_a_model_change_brings_its_defaults(folders: tuple[Path, Path], tmp_path: Path) -> None:
    with_defaults, without = folders
    actor = _actor(without, tmp_path)
    actor._on_model_changed(
        ModelChanged(
            name="tiny",
            version="v2",
            path=str(with_defaults),
            tokenizer_fingerprint=tokenizer_fingerprint(with_defaults),
            max_model_len=64,
            vocab_size=300,
            eos_token_ids=[OWN_VOCAB_EOS_ID],
        )
    )
    assert actor.tokenize(_request(SamplingParams())).sampling.temperature == 0.6


def test_read_sampling_defaults_keeps_valid_non_default_values(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 3.5,  # out of range: ignored
                "top_p": 0.95,
                "top_k": 50,  # transformers' own default, not the model's (as vLLM)
                "min_p": 0.05,
                "repetition_penalty": None,
                "do_sample": True,
                "max_new_tokens": 100,
            }
        )
    )
    assert read_sampling_defaults(tmp_path) == {"top_p": 0.95, "min_p": 0.05}
    assert read_sampling_defaults(tmp_path, "vllm") == {}
    assert read_sampling_defaults(tmp_path / "missing") == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_sampling_defaults(tmp_path) == {}


def test_fill_defaults_turns_top_k_minus_one_into_off() -> None:
    got = fill_defaults(SamplingParams(), ["top_k", "temperature"], {"top_k": -1, "top_p": 0.5})
    assert (got.top_k, got.top_p, got.temperature) == (0, 1.0, 1.0)


def test_generation_config_flag_is_checked() -> None:
    assert Config().model.generation_config == "auto"
    with pytest.raises(ConfigError, match="generation-config"):
        Config().replace(model={"generation_config": "file"})


# --- bad words --------------------------------------------------------------------------------


def test_bad_words_are_tokenised_with_and_without_a_leading_space(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = folders
    actor = _actor(folder, tmp_path)
    got = actor.tokenize(_request(SamplingParams(bad_words=["over", "  quick brown"]))).sampling
    want = []
    for word in ("over", "quick brown"):
        plain, spaced = _encode(folder, word), _encode(folder, " " + word)
        want.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            want.append(spaced)
    assert got.bad_words_token_ids == want
    assert len(want) > 2  # the spaced forms differ here, so both are banned
    assert got.bad_words == ["over", "  quick brown"]


def test_bad_words_token_ids_follow_vllms_rule() -> None:
    table = {"a": [1], " a": [2], "bc": [3, 4], " bc": [5], "d": [6], " d": [6]}
    got = bad_words_token_ids(["a", "bc", " d"], lambda text: table[text])
    # " bc" has another length, " d" the same first token: only their plain forms are kept
    assert got == [[1], [2], [3, 4], [6]]


# --- checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias_token_ids": [1], "logit_bias_values": [150.0]}, "logit_bias"),
        ({"logit_bias_token_ids": [1, 2], "logit_bias_values": [1.0]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_control_ranges_are_checked(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_sampling(dataclasses.replace(SamplingParams(), **change))
    assert refused.value.param == field and refused.value.status == 400
    assert refused.value.message.startswith(f"{field}: ")


def test_logit_bias_ids_are_checked_against_the_vocabulary(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    _, folder = folders
    actor = _actor(folder, tmp_path)
    top = actor.model.vocab_size - 1
    ok = SamplingParams(logit_bias_token_ids=[top], logit_bias_values=[1.0])
    assert actor.tokenize(_request(ok)).sampling.logit_bias_token_ids == [top]
    bad = dataclasses.replace(ok, logit_bias_token_ids=[top + 1])
    with pytest.raises(InvalidRequest, match=r"^logit_bias: token id \d+ is outside") as refused:
        actor.tokenize(_request(bad))
    assert refused.value.param == "logit_bias"


def test_min_tokens_must_fit_the_output_budget(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, folder = folders
    actor = _actor(folder, tmp_path)
    assert actor.tokenize(_request(SamplingParams(max_tokens=5, min_tokens=5))).sampling
    with pytest.raises(InvalidRequest) as refused:
        actor.tokenize(_request(SamplingParams(max_tokens=5, min_tokens=6)))
    assert refused.value.param == "min_tokens"
    # max_tokens 0 (chat's default: as many as fit): min_tokens is checked against the room
    room = actor.tokenize(_request(SamplingParams(max_tokens=0))).sampling.max_tokens
    assert actor.tokenize(_request(SamplingParams(max_tokens=0, min_tokens=room))).sampling
    with pytest.raises(InvalidRequest, match="min_tokens"):
        actor.tokenize(_request(SamplingParams(max_tokens=0, min_tokens=room + 1)))
