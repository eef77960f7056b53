"""Structured outputs without processes or a model: the gateway's reading of the request
fields, the worker's grammar cache, matchers and token bitmask (on a tiny character vocab),
the request table's matchers, and the scheduler holding a request until its grammar is
compiled."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest
import torch
import xgrammar as xgr

from common.messages import (
    CompileGrammar,
    FinishReason,
    GrammarCompiled,
    RequestError,
    SamplingParams,
    StepPlan,
    TokenBatch,
)
from gpu_worker.runner import RequestTable
from gpu_worker.structured import GrammarCache, GrammarError, RowGrammar, apply_grammars
from services.gateway.openai.structured import StructuredError, parse_structured
from tests.unit.services.scheduler.test_engine_core import _core, _request, _run, _tokens

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


# --- the gateway's fields ---------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "kind", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },  # fmt: skip
            "json",
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, "json", "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["x"]}}, "choice", "structured_outputs.choice"),
        (
            {"structured_outputs": {"grammar": "root ::= 'a'"}},
            "grammar",
            "structured_outputs.grammar",
        ),  # fmt: skip
        (
            {"structured_outputs": {"json_object": True}},
            "json_object",
            "structured_outputs.json_object",
        ),  # fmt: skip
        ({"guided_json": orjson.dumps(SCHEMA).decode()}, "json", "guided_json"),
        ({"guided_regex": "a+"}, "regex", "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
        ({"guided_grammar": "root ::= 'a'"}, "grammar", "guided_grammar"),
    ],
)
def test_each_field_gives_one_grammar(body: dict[str, Any], kind: str, field: str) -> None:
    got = parse_structured(body)
    assert got is not None and (got.kind, got.field) == (kind, field)
    if kind == "json":
        assert orjson.loads(got.spec) == SCHEMA


def test_free_text_asks_for_nothing() -> None:
    assert parse_structured({}) is None
    assert parse_structured({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
        ),  # fmt: skip
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "flavour": 1}}, "structured_outputs.flavour"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
        ),  # fmt: skip
    ],
)
def test_bad_shapes_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(StructuredError) as e:
        parse_structured(body)
    assert e.value.field == field and str(e.value).startswith(field + ": ")


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


# --- the scheduler holds a request until its grammar is compiled --------------------------------
def _constrained(rid: str, n: int = 1) -> Any:
    msg = _request(rid, n=n)
    sampling = dataclasses.replace(
        msg.sampling, structured_kind="regex", structured_spec="a", structured_field="guided_regex"
    )
    return dataclasses.replace(msg, sampling=sampling)


def test_a_request_waits_for_its_grammar_then_runs() -> None:
    core, out = _core()
    core.add(_constrained("g", n=2))
    core.add(_request("free"))
    (ask,) = out.of(CompileGrammar)
    assert (ask.request_id, ask.kind, ask.spec, ask.tokenizer_fingerprint) == (
        "g", "regex", "a", "tok-a"
    )  # fmt: skip
    _run(core, out)
    assert not any("g" in p.req_ids[i] for p in out.of(StepPlan) for i in range(len(p.req_ids)))
    assert _tokens(out)[("free", 0)]  # the free request ran meanwhile
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-a"))
    _run(core, out)
    got = _tokens(out)
    assert len(got[("g", 0)]) == 3 and len(got[("g", 1)]) == 3
    assert not core.groups and core.policy is not None and not core.policy.requests


def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field() -> None:
    core, out = _core()
    core.add(_constrained("g"))
    failed = GrammarCompiled("g", "Unsupported regex", tokenizer_fingerprint="tok-a")
    core.on_grammar_compiled(failed)
    (error,) = out.of(RequestError)
    assert (error.status, error.param) == (400, "guided_regex")
    assert error.message == "guided_regex: Unsupported regex"
    assert not core.groups and not len(core.grammar_wait)
    assert core.policy is not None and core.policy.blocks.num_used_blocks == 0


def test_a_request_aborted_while_its_grammar_compiles_ends_there() -> None:
    core, out = _core()
    core.add(_constrained("g", n=2))
    core.abort(["g"], FinishReason.CANCELLED)
    (batch,) = out.of(TokenBatch)
    assert batch.finish_reasons == [int(FinishReason.CANCELLED)] * 2
    assert not core.groups and not len(core.grammar_wait)
    # late: nothing to queue
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-a"))
    assert core.policy is not None and not core.policy.requests


def test_a_worker_restart_fails_requests_waiting_for_a_grammar() -> None:
    core, out = _core()
    core.add(_constrained("g"))
    core.on_worker_down("the worker died")
    (error,) = out.of(RequestError)
    assert error.status == 503 and not core.groups and not len(core.grammar_wait)


def test_a_request_past_its_deadline_while_its_grammar_compiles_times_out() -> None:
    core, out = _core()
    core.add(dataclasses.replace(_constrained("late", n=2), timeout=1.0, arrival_time=1.0))
    core.add(_constrained("on-time"))
    core.expire()  # the clock is far past 1.0 + 1.0
    (batch,) = out.of(TokenBatch)
    assert batch.request_ids == ["late", "late"]
    assert batch.finish_reasons == [int(FinishReason.TIMEOUT)] * 2
    assert "late" not in core.groups and "on-time" in core.grammar_wait


def test_an_answer_for_another_tokenizer_does_not_release_a_request() -> None:
    # tokenised again for a new tokenizer (a swap) while the old compile was running
    core, out = _core()
    core.add(_constrained("g"))
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-old"))
    assert "g" in core.grammar_wait
    core.on_grammar_compiled(GrammarCompiled(request_id="g", tokenizer_fingerprint="tok-a"))
    assert "g" not in core.grammar_wait
    _run(core, out)
    assert len(_tokens(out)[("g", 0)]) == 3
