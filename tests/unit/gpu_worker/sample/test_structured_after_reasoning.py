"""A structured output after a reasoning model's thinking (gpu_worker/sample/structured.py): the
grammar covers only what follows the reasoning's end ids; before them the output is free
text, masked by nothing. The tokenizer skips the wait when the prompt already closed the
reasoning (services/tokenizer/actor.reasoning_ended). Real xgrammar matchers."""

from __future__ import annotations

import dataclasses

import torch

from common.messages import SamplingParams
from gpu_worker.sample.structured import GrammarCache, RowGrammar, apply_grammars
from services.tokenizer.actor import reasoning_ended
from tests.unit.gpu_worker.sample.test_structured import ID, VOCAB, _info

END = [ID["x"], ID[":"]]  # the test vocabulary's stand-in for "</think>"


def _grammar(start_after: list[int]) -> RowGrammar:
    params = SamplingParams(structured_kind="choice", structured_spec='["yes", "no"]')
    grammar = GrammarCache(_info).matcher(
        dataclasses.replace(params, structured_after_ids=start_after), "tok"
    )
    assert grammar is not None
    return grammar


def _allowed(grammar: RowGrammar, output: list[int]) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_grammars(logits, [(0, grammar, output)])
    return {i for i in range(VOCAB) if logits[0, i] > float("-inf")}


def test_the_grammar_starts_after_the_reasoning_ends() -> None:
    grammar = _grammar(END)
    thinking = [ID["a"], ID["b"], ID[" "], ID["c"]]
    assert _allowed(grammar, []) == set(range(VOCAB))  # free while thinking
    assert _allowed(grammar, thinking) == set(range(VOCAB))
    assert _allowed(grammar, [*thinking, ID["x"]]) == set(range(VOCAB))  # half the marker
    assert _allowed(grammar, [*thinking, *END]) == {ID["yes"], ID["no"]}
    assert _allowed(grammar, [*thinking, *END, ID["no"]]) == {0}
    assert grammar.start == len(thinking) + 2 and grammar.num_accepted == 1


def test_a_rollback_into_the_reasoning_frees_it_again() -> None:
    grammar = _grammar(END)
    assert _allowed(grammar, [ID["a"], *END, ID["yes"]]) == {0}
    assert _allowed(grammar, [ID["a"], ID["x"]]) == set(range(VOCAB))
    assert grammar.start is None and grammar.num_accepted == 0
    assert _allowed(grammar, [ID["a"], *END]) == {ID["yes"], ID["no"]}


def test_without_a_marker_the_grammar_starts_at_once() -> None:
    assert _allowed(_grammar([]), []) == {ID["yes"], ID["no"]}


def test_a_prompt_that_closed_the_reasoning() -> None:
    end = [90, 91]
    assert reasoning_ended([1, 2, 3, 90, 91, 5, 5], end)  # <think></think> at its end
    assert not reasoning_ended([1, 2, 3, 90, 91, *[5] * 9], end)  # far back: an old turn
    assert not reasoning_ended([1, 2, 3, 89], end)
    assert not reasoning_ended([90, 91], [])
