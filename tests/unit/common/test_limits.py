"""common/limits.py: ranges say what they hold, and the gateway and the tokenizer, which both
check a request against them, accept and refuse the same values at every edge."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from common.limits import (
    ENGINE_MAX_TOKENS,
    REPETITION_PENALTY,
    SAMPLING_FLOAT_RANGES,
    TEMPERATURE,
    TOP_P,
    Range,
)
from common.messages import SamplingParams
from services.gateway.openai.chat_protocol import ChatCompletionRequest
from services.gateway.openai.request_errors import RequestRejected, parse_request
from services.tokenizer.validate import InvalidRequest, check_sampling


def test_a_range_holds_its_ends_unless_open_and_no_nan() -> None:
    assert 0.0 in TEMPERATURE and 2.0 in TEMPERATURE and 2.0001 not in TEMPERATURE
    assert 0.0 not in TOP_P and 1.0 in TOP_P
    assert float("nan") not in TEMPERATURE and float("inf") not in REPETITION_PENALTY
    assert 1e9 in REPETITION_PENALTY and 0.0 not in REPETITION_PENALTY
    assert 0 in ENGINE_MAX_TOKENS and -1 not in ENGINE_MAX_TOKENS


def test_a_range_describes_itself_and_gives_pydantic_bounds() -> None:
    assert TEMPERATURE.describe() == "in [0, 2]"
    assert TOP_P.describe() == "in (0, 1]"
    assert REPETITION_PENALTY.describe() == "> 0 (1 = off)"
    assert Range(None, 5, high_open=True).describe() == "< 5"
    assert TOP_P.bounds() == {"gt": 0.0, "le": 1.0}
    assert Range(-1, None).bounds() == {"ge": -1}


def _edges(allowed: Range) -> list[float]:
    values = []
    for end in (allowed.low, allowed.high):
        if end is not None:
            values += [end - 0.001, end, end + 0.001]
    return values


def _gateway_accepts(field: str, value: float) -> bool:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    try:
        parse_request(ChatCompletionRequest, orjson.dumps(body))
    except RequestRejected as e:
        assert e.message.startswith(f"{field}: ")
        return False
    return True


def _tokenizer_accepts(field: str, value: float) -> bool:
    try:
        check_sampling(dataclasses.replace(SamplingParams(), **{field: value}))
    except InvalidRequest as e:
        assert e.param == field
        return False
    return True


@pytest.mark.parametrize("field", sorted(SAMPLING_FLOAT_RANGES))
def test_gateway_and_tokenizer_agree_at_every_edge(field: str) -> None:
    allowed = SAMPLING_FLOAT_RANGES[field]
    for value in _edges(allowed):
        expected = value in allowed
        assert _gateway_accepts(field, value) is expected, (field, value)
        assert _tokenizer_accepts(field, value) is expected, (field, value)


def test_the_engine_takes_max_tokens_0_and_says_so_when_refusing() -> None:
    check_sampling(SamplingParams(max_tokens=0))  # 0: as many as fit
    with pytest.raises(InvalidRequest) as e:
        check_sampling(SamplingParams(max_tokens=-1))
    assert e.value.message == "max_tokens: must be >= 0 (0 = as many as fit), got -1"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", ["s"] * 65),
        ("stop", [""]),
        ("stop", ["x" * 257]),
        ("bad_words", ["w"] * 65),
        ("bad_words", ["  "]),
        ("bad_words", ["w" * 257]),
    ],
)
def test_gateway_and_tokenizer_refuse_a_list_field_with_one_message(
    field: str, value: list[str]
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(RequestRejected) as at_gateway:
        parse_request(ChatCompletionRequest, orjson.dumps(body))
    with pytest.raises(InvalidRequest) as at_tokenizer:
        check_sampling(dataclasses.replace(SamplingParams(), **{field: value}))
    assert at_gateway.value.message == at_tokenizer.value.message
    assert at_tokenizer.value.message.startswith(f"{field}: ")
