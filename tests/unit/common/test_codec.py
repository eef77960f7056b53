"""Every registered message survives encode -> decode unchanged; bad frames fail clearly."""

from __future__ import annotations

import dataclasses
import types
import typing

import orjson
import pytest

from common import codec
from common.messages import SamplingParams, StepPlan

_SAMPLES: dict[object, object] = {
    int: 7,
    float: 0.5,
    str: "r-1",
    bool: True,
    typing.Any: {"k": [1, "x"]},
}


def _sample(hint: object) -> object:
    if hint in _SAMPLES:
        return _SAMPLES[hint]
    if dataclasses.is_dataclass(hint):
        return _instance(hint)  # type: ignore[arg-type]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)))
    if origin is list:
        return [_sample(args[0]), _sample(args[0])]
    if origin is dict:
        return {"a": _sample(args[1])}
    raise AssertionError(f"no sample for {hint}")


def _instance(cls: type) -> object:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("kind", sorted(codec.registry()))
def test_round_trip(kind: str) -> None:
    cls = codec.registry()[kind]
    msg = _instance(cls)
    frame = codec.encode(msg)
    assert orjson.loads(frame)["k"] == kind
    back = codec.decode(frame)
    assert type(back) is cls
    assert back == msg


def test_registry_covers_every_connection() -> None:
    kinds = set(codec.registry())
    assert {
        "generate",
        "tokenized",
        "step_plan",
        "step_result",
        "token_batch",
        "output_batch",
        "abort",
        "ready",
        "ping",
    } <= kinds


def test_nested_struct_is_rebuilt() -> None:
    plan = StepPlan(
        step_id=3,
        new_req_ids=["a"],
        new_prompt_token_ids=[[1, 2]],
        new_sampling=[SamplingParams(temperature=0.0, stop=["\n"])],
    )
    back = codec.decode(codec.encode(plan))
    assert isinstance(back.new_sampling[0], SamplingParams)
    assert back.new_sampling[0].is_greedy and back.new_sampling[0].stop == ["\n"]


def test_duplicate_kind_fails_at_declaration() -> None:
    with pytest.raises(TypeError, match="duplicate"):

        @codec.message("step_plan")
        class Other:
            x: int


@pytest.mark.parametrize(
    "frame",
    [
        b"not json",
        b"[1,2]",
        b'{"x": 1}',
        b'{"k": "nope"}',
        b'{"k": "ping", "reply_to": "a"}',
        b'{"k": "ping", "bad": 1}',
    ],
)
def test_bad_frames_raise_codec_error(frame: bytes) -> None:
    with pytest.raises(codec.CodecError):
        codec.decode(frame)


def test_unregistered_object_is_refused() -> None:
    with pytest.raises(codec.CodecError):
        codec.encode(SamplingParams())
