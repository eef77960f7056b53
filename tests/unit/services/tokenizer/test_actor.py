"""The tokenizer actor follows the model the scheduler pushes (ModelChanged): it tokenises
with that model's tokenizer, checks against its facts, and stamps every request with the
fingerprint of the tokenizer that made its ids. No processes, no sockets: the handler and
`tokenize` are called directly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer

from common.config import Config, ConfigError
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


def test_the_lora_adapter_travels_with_the_request(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    out = make_actor(a, tmp_path).tokenize(dataclasses.replace(request(), lora_name="sql"))
    assert out.lora_name == "sql" and out.prompt_token_ids == encode(a, PROMPT)


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


# an operator's template: the messages' contents, with a marker the kwargs can switch off
OPERATOR_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
CHAT = [{"role": "user", "content": "hello there"}]


def chat_request(**fields: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id="r", model="tiny", sampling=SamplingParams(4), messages=CHAT, **fields
    )


def templated_actor(folder: Path, tmp_path: Path, chat_template: str) -> TokenizerActor:
    config = Config().replace(
        model={"model": str(folder)},
        server={"run_dir": str(tmp_path), "chat_template": chat_template},
    )
    actor = TokenizerActor(config, 0)
    actor.model = startup_model(folder)
    return actor


def test_the_operators_template_file_renders_chats_across_a_model_change(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = folders
    path = tmp_path / "template.jinja"
    path.write_text(OPERATOR_TEMPLATE)
    actor = templated_actor(a, tmp_path, str(path))
    rendered = "[user] hello there\n<think>[assistant]"
    assert actor.tokenize(chat_request()).prompt_token_ids == encode(a, rendered)
    actor._on_model_changed(changed(b))  # the server's template, not the model's: it stays
    assert actor.tokenize(chat_request()).prompt_token_ids == encode(b, rendered)


def test_an_inline_operator_template_and_the_requests_kwargs(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    actor = templated_actor(a, tmp_path, OPERATOR_TEMPLATE)
    out = actor.tokenize(chat_request(chat_template_kwargs={"enable_thinking": False}))
    assert out.prompt_token_ids == encode(a, "[user] hello there\n[assistant]")
    # /tokenize renders with the operator's template too, and the query's kwargs / template
    sent: list[Any] = []
    actor.outbox = lambda addr: SimpleNamespace(send=sent.append)  # type: ignore[assignment,method-assign]
    for fields in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        actor._on_tokenize_query(
            TokenizeQuery(
                query_id=1, reply_to="gw", messages=CHAT, add_special_tokens=False, **fields
            )
        )
    own = "{{ messages[0]['content'] | upper }}"
    actor._on_tokenize_query(
        TokenizeQuery(query_id=1, reply_to="gw", messages=CHAT, chat_template=own)
    )
    assert sent[0].token_ids == encode(a, "[user] hello there\n<think>[assistant]")
    assert sent[1].token_ids == encode(a, "[user] hello there\n[assistant]")
    assert sent[2].token_ids == encode(a, "HELLO THERE")


def test_a_requests_own_template_comes_first(folders: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = folders
    own = "{{ messages[0]['content'] | upper }}{{ suffix }}"
    for actor in (make_actor(a, tmp_path), templated_actor(a, tmp_path, OPERATOR_TEMPLATE)):
        out = actor.tokenize(chat_request(chat_template=own, chat_template_kwargs={"suffix": "!"}))
        assert out.prompt_token_ids == encode(a, "HELLO THERE!")
    # without one, the model's own (ChatML) renders, kwargs or not
    out = make_actor(a, tmp_path).tokenize(chat_request(chat_template_kwargs={"x": 1}))
    assert out.prompt_token_ids == encode(
        a, "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_failures_are_the_requests_400s(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    actor = make_actor(a, tmp_path)
    with pytest.raises(InvalidRequest) as refused:
        actor.tokenize(chat_request(chat_template_kwargs={"tokenize": True}))
    assert refused.value.param == "chat_template_kwargs" and "tokenize" in refused.value.message
    with pytest.raises(InvalidRequest) as refused:
        actor.tokenize(chat_request(chat_template="{% if %}"))
    assert refused.value.param == "chat_template" and refused.value.status == 400
    with pytest.raises(InvalidRequest) as refused:
        actor.tokenize(chat_request(chat_template="{{ raise_exception('no users') }}"))
    assert refused.value.param == "chat_template" and "no users" in refused.value.message


def test_reserved_kwargs_cover_apply_chat_templates_parameters() -> None:
    import inspect

    from transformers import PreTrainedTokenizerBase

    from services.tokenizer.chat_template import RESERVED_KWARGS

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {p for p, v in params.items() if v.kind != v.VAR_KEYWORD and p != "self"}
    assert named <= RESERVED_KWARGS, named - RESERVED_KWARGS


def test_a_bad_chat_template_flag_stops_the_start(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    with pytest.raises(ConfigError, match="no such file"):
        templated_actor(a, tmp_path, str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        templated_actor(a, tmp_path, "{% for m in messages %}")


def test_shuttle_serve_checks_the_template_and_passes_its_full_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.launch import prepare

    (tmp_path / "t.jinja").write_text(OPERATOR_TEMPLATE)
    monkeypatch.chdir(tmp_path)  # the children run elsewhere: a relative path is resolved
    config = Config().replace(
        model={"model": "synthetic"},
        server={"run_dir": str(tmp_path), "chat_template": "t.jinja"},
    )
    assert prepare(config).server.chat_template == str(tmp_path / "t.jinja")
    with pytest.raises(ConfigError, match="no such file"):
        prepare(config.replace(server={"chat_template": "missing.jinja"}))
