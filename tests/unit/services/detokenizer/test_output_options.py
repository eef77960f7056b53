"""vLLM's output options on the detokenizer actor (services/detokenizer/actor.py), from
DetokNew to OutputBatch: include_stop_str_in_output, skip_special_tokens, and stop_reason
(the stop string or stop token id that ended a sequence). Handlers are called directly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.messages import DetokNew, FinishReason, OutputBatch, TokenBatch
from tests.tiny_models import OWN_VOCAB_EOS_ID
from tests.unit.services.detokenizer.test_actor import encode, folders, make_actor, new  # noqa: F401

NONE, STOP = FinishReason.NONE, FinishReason.STOP


def _feed(actor: object, ids: list[int], last: FinishReason = NONE) -> None:
    for k, token in enumerate(ids):
        reason = last if k == len(ids) - 1 else NONE
        actor._on_tokens(  # type: ignore[attr-defined]
            TokenBatch(request_ids=["r"], token_ids=[[token]], finish_reasons=[int(reason)])
        )


def _text(sent: list[OutputBatch]) -> str:
    return "".join(t for out in sent for t in out.texts)


def _stop_reasons(sent: list[OutputBatch]) -> list[str | int | None]:
    return [r for out in sent for r in out.stop_reasons]


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_and_the_stop_reason(
    folders: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
    include: bool,
) -> None:
    a, _ = folders
    actor, gateway, _ = make_actor(a, tmp_path)
    msg: DetokNew = new(("r", 0, ""), stop=["fox"])
    actor._on_new(dataclasses.replace(msg, include_stop_str=[include] if include else []))
    _feed(actor, encode(a, "The quick brown fox jumps"))
    assert _text(gateway.sent) == ("The quick brown fox" if include else "The quick brown ")
    assert gateway.sent[-1].finish_reasons == [int(STOP)]
    assert gateway.sent[-1].stop_reasons == ["fox"]
    assert all(not out.stop_reasons for out in gateway.sent[:-1])  # none while running


def test_a_stop_token_is_the_stop_reason_and_eos_is_none(
    folders: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    a, _ = folders
    actor, gateway, _ = make_actor(a, tmp_path)
    ids = encode(a, "Hello world")
    actor._on_new(dataclasses.replace(new(("r", 0, "")), stop_token_ids=[[ids[-1]]]))
    _feed(actor, ids, STOP)  # the scheduler finished it on its stop token
    assert _stop_reasons(gateway.sent) == [ids[-1]]
    actor, gateway, _ = make_actor(a, tmp_path)
    actor._on_new(dataclasses.replace(new(("r", 0, "")), stop_token_ids=[[ids[-1]]]))
    _feed(actor, [*ids[:-1], OWN_VOCAB_EOS_ID], STOP)  # EOS: no stop_reason
    assert _stop_reasons(gateway.sent) == []


def test_skip_special_tokens_false_keeps_them_in_the_text(
    folders: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    a, _ = folders
    ids = [*encode(a, "Hello"), OWN_VOCAB_EOS_ID]
    texts = []
    for skip in ([], [False]):
        actor, gateway, _ = make_actor(a, tmp_path)
        actor._on_new(dataclasses.replace(new(("r", 0, "")), skip_special_tokens=skip))
        _feed(actor, ids, STOP)
        texts.append(_text(gateway.sent))
    assert texts == ["Hello", "Hello<|im_end|>"]
