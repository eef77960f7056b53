"""The tokenizer actor follows the model the scheduler pushes (ModelChanged): it tokenises
with that model's tokenizer, checks against its facts, and stamps every request with the
fingerprint of the tokenizer that made its ids. No processes, no sockets: the handler and
`tokenize` are called directly."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer

from common.config import Config
from common.messages import (
    DetokenizeQuery,
    GenerateRequest,
    ModelChanged,
    SamplingParams,
    TokenizeQuery,
    TokenizeResult,
)
from common.model_facts import tokenizer_fingerprint
from services.tokenizer.actor import TokenizerActor, startup_model
from services.tokenizer.validate import InvalidRequest
from tests.tiny_models import OWN_VOCAB_EOS_ID, make_own_vocab_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest."


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two model folders whose tokenizers differ (other merges, other sizes)."""
    root = tmp_path_factory.mktemp("models")
    a = make_own_vocab_tokenizer(root / "a", vocab_size=300)
    b = make_own_vocab_tokenizer(root / "b", vocab_size=450)
    for folder in (a, b):  # what load_model_facts reads at start-up
        size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
        config = {
            "vocab_size": size,
            "eos_token_id": OWN_VOCAB_EOS_ID,
            "max_position_embeddings": 256,
        }
        (folder / "config.json").write_text(json.dumps(config))
    return a, b


def encode(folder: Path, text: str) -> list[int]:
    return list(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)


def vocab_size(folder: Path) -> int:
    return int(Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size())


def changed(folder: Path, *, max_model_len: int = 128, vocab: int | None = None) -> ModelChanged:
    return ModelChanged(
        name="tiny",
        version=folder.name,
        path=str(folder),
        tokenizer_fingerprint=tokenizer_fingerprint(folder),
        max_model_len=max_model_len,
        vocab_size=vocab or vocab_size(folder),
        eos_token_ids=[OWN_VOCAB_EOS_ID, 0],
    )


def make_actor(folder: Path, tmp_path: Path) -> TokenizerActor:
    config = Config().replace(model={"model": str(folder)}, server={"run_dir": str(tmp_path)})
    actor = TokenizerActor(config, 0)
    actor.model = startup_model(folder)  # what start() loads, without its sockets
    return actor


def request(
    prompt: str | None = PROMPT,
    *,
    prompt_token_ids: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int = 4,
) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model="tiny",
        sampling=SamplingParams(max_tokens),
        prompt=None if prompt_token_ids or messages else prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
    )


def test_the_tokenizers_differ(folders: tuple[Path, Path]) -> None:
    # guards the meaning of the tests below
    a, b = folders
    assert encode(a, PROMPT) != encode(b, PROMPT)
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)


def test_start_up_requests_carry_the_start_up_fingerprint(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    out = make_actor(a, tmp_path).tokenize(request())
    assert out.prompt_token_ids == encode(a, PROMPT)
    assert out.tokenizer_fingerprint == tokenizer_fingerprint(a)
    assert out.eos_token_ids == [OWN_VOCAB_EOS_ID]


def test_model_changed_switches_tokenizer_and_facts(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = folders
    actor = make_actor(a, tmp_path)
    actor._on_model_changed(changed(b, max_model_len=100))
    out = actor.tokenize(request())
    assert out.prompt_token_ids == encode(b, PROMPT)
    assert out.tokenizer_fingerprint == tokenizer_fingerprint(b)
    assert out.eos_token_ids == [0, OWN_VOCAB_EOS_ID]  # the message's, with the tokenizer's
    # max_tokens 0: as many as fit the new model's length
    room = actor.tokenize(request(max_tokens=0)).sampling.max_tokens
    assert room == 100 - len(encode(b, PROMPT))
    chat = actor.tokenize(request(messages=[{"role": "user", "content": "hello there"}]))
    # rendered by b's template (CHATML_TEMPLATE), tokenised by b's tokenizer
    assert chat.prompt_token_ids == encode(
        b, "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )
    actor._on_model_changed(changed(a))  # and back
    assert actor.tokenize(request()).prompt_token_ids == encode(a, PROMPT)


def test_token_ids_are_checked_against_the_current_vocabulary(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = folders
    actor = make_actor(a, tmp_path)
    top_a, top_b = vocab_size(a) - 1, vocab_size(b) - 1
    assert top_b > top_a
    with pytest.raises(InvalidRequest) as refused:
        actor.tokenize(request(prompt_token_ids=[5, top_b]))
    assert refused.value.param == "prompt" and refused.value.status == 400
    actor._on_model_changed(changed(b))
    assert actor.tokenize(request(prompt_token_ids=[5, top_b])).prompt_token_ids == [5, top_b]
    actor._on_model_changed(changed(b, vocab=10))  # the model's rows, not the tokenizer's
    with pytest.raises(InvalidRequest, match=r"outside the vocabulary \(0\.\.9\)"):
        actor.tokenize(request(prompt_token_ids=[5, 10]))


def test_an_unchanged_fingerprint_reuses_the_loaded_tokenizer(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    actor = make_actor(a, tmp_path)
    loaded = actor.model.tokenizer
    # a new version of the same model (another path even): no reload, the new facts
    actor._on_model_changed(
        ModelChanged(
            name="tiny",
            version="v2",
            path="/nowhere",
            tokenizer_fingerprint=actor.model.fingerprint,
            max_model_len=64,
            vocab_size=vocab_size(a),
            eos_token_ids=[OWN_VOCAB_EOS_ID],
        )
    )
    assert actor.model.tokenizer is loaded and actor.model.max_model_len == 64


def test_a_tokenizer_that_fails_to_load_keeps_the_old_one(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    actor = make_actor(a, tmp_path)
    before = actor.model
    actor._on_model_changed(
        ModelChanged(
            name="tiny",
            version="broken",
            path=str(tmp_path / "missing"),
            tokenizer_fingerprint="0123456789abcdef",
            max_model_len=64,
            vocab_size=10,
            eos_token_ids=[],
        )
    )
    assert actor.model is before
    out = actor.tokenize(request())
    assert out.tokenizer_fingerprint == tokenizer_fingerprint(a)
    assert out.prompt_token_ids == encode(a, PROMPT)


def test_tokenize_and_detokenize_queries_are_answered_to_their_sender(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    actor = make_actor(a, tmp_path)
    sent: dict[str, list[Any]] = {}
    actor.outbox = lambda addr: SimpleNamespace(send=sent.setdefault(addr, []).append)  # type: ignore[assignment,method-assign]
    ids = encode(a, PROMPT)
    actor._on_tokenize_query(TokenizeQuery(query_id=1, reply_to="gw", prompt=PROMPT))
    actor._on_detokenize_query(DetokenizeQuery(query_id=2, reply_to="gw", token_ids=ids))
    actor._on_detokenize_query(DetokenizeQuery(query_id=3, reply_to="gw", token_ids=[10**6]))
    chat = [{"role": "user", "content": "hi"}]
    for generation_prompt in (True, False):
        actor._on_tokenize_query(
            TokenizeQuery(
                query_id=4,
                reply_to="gw",
                messages=chat,
                add_special_tokens=False,
                add_generation_prompt=generation_prompt,
            )
        )
    tokenized, detokenized, refused, chat_open, chat_closed = sent["gw"]
    assert tokenized == TokenizeResult(query_id=1, token_ids=ids)
    assert detokenized == TokenizeResult(query_id=2, text=PROMPT)
    assert (refused.query_id, refused.status, refused.param) == (3, 400, "tokens")
    assert refused.message.startswith("tokens: token id 1000000 is outside the vocabulary")
    # the template's rendering, tokenised: the generation prompt adds the assistant's turn
    assert chat_open.token_ids[: len(chat_closed.token_ids)] == chat_closed.token_ids
    assert len(chat_open.token_ids) > len(chat_closed.token_ids)
