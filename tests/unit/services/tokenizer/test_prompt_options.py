"""vLLM's prompt options on the tokenizer actor (services/tokenizer/actor.py), with a
test-built tokenizer that adds a BOS token: add_special_tokens, truncate_prompt_tokens,
continue_final_message. No processes: `tokenize` is called directly."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from common.config import Config
from common.messages import GenerateRequest, SamplingParams
from services.tokenizer.actor import TokenizerActor, startup_model
from services.tokenizer.validate import InvalidRequest
from tests.tiny_models import OWN_VOCAB_EOS_ID, make_own_vocab_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog."
BOS_ID = 0  # "<|endoftext|>", the tokenizer's first special token
CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "The fox"}]


@pytest.fixture(scope="module")
def actor(tmp_path_factory: pytest.TempPathFactory) -> TokenizerActor:
    folder = make_own_vocab_tokenizer(tmp_path_factory.mktemp("bos"), vocab_size=300)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS_ID)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_token_id": OWN_VOCAB_EOS_ID,
        "max_position_embeddings": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    cfg = Config().replace(
        model={"model": str(folder)}, server={"run_dir": str(tmp_path_factory.mktemp("run"))}
    )
    out = TokenizerActor(cfg, 0)
    out.model = startup_model(folder)
    return out


def _ids(actor: TokenizerActor, **fields: object) -> list[int]:
    base = GenerateRequest(request_id="r", model="tiny", sampling=SamplingParams(4))
    if "messages" not in fields and "prompt_token_ids" not in fields:
        fields = {"prompt": PROMPT} | fields
    return actor.tokenize(dataclasses.replace(base, **fields)).prompt_token_ids  # type: ignore[arg-type]


def test_add_special_tokens_follows_the_endpoint_default_unless_asked(
    actor: TokenizerActor,
) -> None:
    with_bos = _ids(actor)
    assert with_bos[0] == BOS_ID  # a completions prompt: with them by default
    assert _ids(actor, add_special_tokens=False) == with_bos[1:]
    chat = _ids(actor, messages=CHAT[:1])
    assert chat[0] != BOS_ID  # a chat: the template writes its own
    assert _ids(actor, messages=CHAT[:1], add_special_tokens=True) == [BOS_ID, *chat]


def test_truncate_prompt_tokens_keeps_the_last_ones(actor: TokenizerActor) -> None:
    whole = _ids(actor)
    assert _ids(actor, truncate_prompt_tokens=3) == whole[-3:]
    assert _ids(actor, truncate_prompt_tokens=1000) == whole
    ids = [5, 6, 7, 8, 9]
    assert _ids(actor, prompt_token_ids=ids, truncate_prompt_tokens=2) == [8, 9]


def test_continue_final_message_leaves_the_last_message_open(actor: TokenizerActor) -> None:
    closed = _ids(actor, messages=CHAT, add_generation_prompt=False)
    open_ = _ids(actor, messages=CHAT, add_generation_prompt=False, continue_final_message=True)
    # the template closes every message with "<|im_end|>\n"; continued, the last one is not
    assert closed[-2] == OWN_VOCAB_EOS_ID and open_ == closed[:-2]


def test_allowed_token_ids_must_be_in_the_vocabulary(actor: TokenizerActor) -> None:
    base = GenerateRequest(request_id="r", model="tiny", sampling=SamplingParams(4), prompt=PROMPT)
    ok = dataclasses.replace(base, sampling=SamplingParams(4, allowed_token_ids=[5, 7]))
    assert actor.tokenize(ok).sampling.allowed_token_ids == [5, 7]
    bad = dataclasses.replace(base, sampling=SamplingParams(4, allowed_token_ids=[5, 10**6]))
    with pytest.raises(InvalidRequest) as info:
        actor.tokenize(bad)
    assert info.value.param == "allowed_token_ids"
