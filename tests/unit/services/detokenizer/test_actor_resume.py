"""The detokenizer with resumed sequences (DetokNew.resumed_token_ids): a sequence sent
again after a process died decodes the outputs the client already has silently, so its text
goes on exactly where the first attempt's stopped, stop strings across the cut included, and
its output count includes them. A dead scheduler's sequences are forgotten."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.messages import FinishReason, ProcessDown, TokenBatch
from tests.unit.services.detokenizer.test_actor import (
    TEXTS,
    encode,
    folders,  # noqa: F401  (the fixture)
    make_actor,
    new,
    texts_by_sequence,
)

NONE, STOP, LENGTH = FinishReason.NONE, FinishReason.STOP, FinishReason.LENGTH


def tokens(rid: str, ids: list[int], finish: FinishReason = NONE) -> TokenBatch:
    return TokenBatch(request_ids=[rid], token_ids=[ids], finish_reasons=[int(finish)])


@pytest.mark.parametrize("stop", [[], ["lazy"], ["zy d"]])
def test_a_resumed_sequence_continues_the_text_without_repeating(
    folders: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
    stop: list[str],
) -> None:
    a, _ = folders
    ids = encode(a, TEXTS[0])
    whole = TEXTS[0][: TEXTS[0].index(stop[0])] if stop else TEXTS[0]
    for cut in range(1, len(ids)):
        first, first_gateway, _ = make_actor(a, tmp_path)
        first._on_new(new(("r", 0, ""), stop=stop))
        for token in ids[:cut]:  # one step each, then the process dies
            first._on_tokens(tokens("r", [token]))
        if first_gateway.sent[-1].finish_reasons[-1] != int(NONE):
            continue  # the stop came before the cut: nothing to resume
        streamed = texts_by_sequence(first_gateway.sent)["r", 0]
        again, gateway, _ = make_actor(a, tmp_path)
        again._on_new(
            dataclasses.replace(new(("r/1", 0, ""), stop=stop), resumed_token_ids=[ids[:cut]])
        )
        rest = ids[cut:]
        for j, token in enumerate(rest):  # one step each, the last one at the length
            again._on_tokens(tokens("r/1", [token], LENGTH if j == len(rest) - 1 else NONE))
        assert streamed + texts_by_sequence(gateway.sent)["r/1", 0] == whole, cut
        last = gateway.sent[-1]
        assert last.finish_reasons == [int(STOP if stop else LENGTH)]
        if not stop:
            assert last.num_output_tokens == [len(ids)]


def test_a_dead_scheduler_s_sequences_are_forgotten(
    folders: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    a, _ = folders
    actor, _, _ = make_actor(a, tmp_path)
    actor._on_new(new(("r", 0, ""), ("q", 0, "")))
    actor._on_process_down(ProcessDown(name="tokenizer-0", exit_code=-9))
    assert len(actor.streams) == 2
    actor._on_process_down(ProcessDown(name="scheduler", exit_code=-9))
    assert actor.streams == {}
