"""Structured outputs on the worker (gpu_worker/sample/structured.py), without processes or a
model: the grammar cache, matchers and token bitmask (on a tiny character vocab), and the
request table's matchers."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from common.messages import (
    SamplingParams,
    StepPlan,
)
from gpu_worker.runner.request_table import RequestTable
from gpu_worker.sample.structured import GrammarCache, GrammarError, RowGrammar, apply_grammars

# a tiny vocabulary: id -> text; 0 ends the sequence. The model's logits have more rows
# (VOCAB) than the tokenizer has tokens, as real models often do
TOKENS = ["</s>", "a", "b", "c", "{", "}", '"', ":", ",", "1", "2", "ab", "yes", "no", "x", " "]
VOCAB = 20
ID = {t: i for i, t in enumerate(TOKENS)}


def _info(fingerprint: str) -> xgr.TokenizerInfo:
    if fingerprint != "tok":
        raise KeyError(fingerprint)
    return xgr.TokenizerInfo(
        TOKENS, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[0]
    )


@pytest.fixture
def cache() -> GrammarCache:
    return GrammarCache(_info)


def _allowed(grammar: RowGrammar, output: list[int]) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_grammars(logits, [(0, grammar, output)])
    return {i for i in range(VOCAB) if logits[0, i] > float("-inf")}


def _matcher(cache: GrammarCache, kind: str, spec: str) -> RowGrammar:
    params = SamplingParams(structured_kind=kind, structured_spec=spec)
    grammar = cache.matcher(params, "tok")
    assert grammar is not None
    return grammar


# --- the worker's cache, matchers and bitmask ---------------------------------------------------
def test_compiled_once_per_spec_and_tokenizer(cache: GrammarCache) -> None:
    first = cache.compile("regex", "ab", "tok")
    assert cache.compile("regex", "ab", "tok") is first
    cache.submit("regex", "ab", "tok").result()  # in the background: a cache hit
    assert cache.num_compiles == 1
    cache.compile("regex", "a+", "tok")
    assert cache.num_compiles == 2


@pytest.mark.parametrize(
    ("kind", "spec", "what"),
    [
        ("json", '{"type": "nonsense"}', "nonsense"),
        ("regex", "a(b", "parenthesis"),
        ("grammar", "root ::= missing", "missing"),
    ],
)
def test_a_spec_that_does_not_compile_says_why(
    cache: GrammarCache, kind: str, spec: str, what: str
) -> None:
    with pytest.raises(GrammarError, match=what) as e:
        cache.submit(kind, spec, "tok").result()
    assert ".cc:" not in str(e.value)  # xgrammar's C++ location is left out


def test_an_unknown_tokenizer_is_an_error(cache: GrammarCache) -> None:
    with pytest.raises(GrammarError, match="no longer served"):
        cache.compile("regex", "a", "other")


def test_the_mask_allows_only_what_the_grammar_allows(cache: GrammarCache) -> None:
    grammar = _matcher(cache, "choice", '["yes", "no"]')
    assert _allowed(grammar, []) == {ID["yes"], ID["no"]}
    assert _allowed(grammar, [ID["no"]]) == {0}  # complete: only the stop token
    assert grammar.num_accepted == 1


def test_rows_without_a_grammar_are_untouched(cache: GrammarCache) -> None:
    grammar = _matcher(cache, "regex", "a+")
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    apply_grammars(logits, [(1, grammar, [])])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert {i for i in range(VOCAB) if logits[1, i] > float("-inf")} == {ID["a"]}


def test_sync_follows_tokens_and_rolls_back(cache: GrammarCache) -> None:
    grammar = _matcher(cache, "regex", "(ab|c)+x")
    assert ID["x"] in _allowed(grammar, [ID["a"], ID["b"]])
    # tokens cut away (a recompute that keeps fewer): the matcher rolls back with them
    assert _allowed(grammar, [ID["a"]]) == {ID["b"]}
    assert _allowed(grammar, [ID["a"], ID["b"], ID["c"]]) == {ID["x"], ID["c"], ID["a"], ID["ab"]}
    assert grammar.num_accepted == 3
    with pytest.raises(ValueError, match="breaks the request's grammar"):
        grammar.sync([ID["a"], ID["b"], ID["c"], ID["yes"]])


def test_each_sequence_has_its_own_matcher(cache: GrammarCache) -> None:
    first, second = _matcher(cache, "regex", "(a|b)c"), _matcher(cache, "regex", "(a|b)c")
    logits = torch.zeros(2, VOCAB)
    apply_grammars(logits, [(0, first, [ID["a"]]), (1, second, [])])
    assert {i for i in range(VOCAB) if logits[0, i] > float("-inf")} == {ID["c"]}
    assert {i for i in range(VOCAB) if logits[1, i] > float("-inf")} == {ID["a"], ID["b"]}


def test_a_terminated_matcher_masks_nothing(cache: GrammarCache) -> None:
    # overlapped scheduling runs one more step for a request whose stop token is out
    grammar = _matcher(cache, "regex", "a")
    assert _allowed(grammar, [ID["a"], 0]) == set(range(VOCAB))
    assert grammar.is_terminated


def test_json_schema_output_is_compact(cache: GrammarCache) -> None:
    grammar = _matcher(cache, "json", '{"type": "object", "properties": {}, "required": []}')
    assert ID[" "] not in _allowed(grammar, [ID["{"]])


# --- the request table --------------------------------------------------------------------------
def test_new_sequences_get_their_matcher_and_keep_it_through_preemption(
    cache: GrammarCache,
) -> None:
    table = RequestTable(
        block_size=4,
        num_blocks=8,
        max_model_len=64,
        new_grammar=lambda params, version: cache.matcher(params, "tok"),
    )
    regex = SamplingParams(structured_kind="regex", structured_spec="a+")
    plan = StepPlan(
        step_id=1,
        new_req_ids=["0/r", "1/r", "free"],
        new_prompt_token_ids=[[1, 2], [1, 2], [3]],
        new_sampling=[regex, regex, SamplingParams()],
    )
    table.apply_diffs(plan, "v", {"v"})
    first, second, free = (table.get(k) for k in ("0/r", "1/r", "free"))
    assert first and second and free
    assert first.grammar is not None and second.grammar is not None
    assert first.grammar is not second.grammar and free.grammar is None
    first.token_ids.append(ID["a"])
    grammar = first.grammar
    table.apply_diffs(StepPlan(step_id=2, preempted_req_ids=["0/r"]), "v", {"v"})
    assert first.grammar is grammar and first.output_ids == [ID["a"]]


def test_a_table_without_grammars_refuses_a_constrained_request() -> None:
    table = RequestTable(block_size=4, num_blocks=8, max_model_len=64)
    plan = StepPlan(
        step_id=1,
        new_req_ids=["r"],
        new_prompt_token_ids=[[1]],
        new_sampling=[SamplingParams(structured_kind="regex", structured_spec="a")],
    )
    with pytest.raises(ValueError, match="no structured outputs"):
        table.apply_diffs(plan, "v", {"v"})
