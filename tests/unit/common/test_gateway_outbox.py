"""Which gateway process gets which message (common/gateway_outbox.py, common/wire_id.py)."""

from __future__ import annotations

from typing import Any

import pytest

from common.gateway_outbox import GatewayOutbox, route
from common.messages import (
    LorasChanged,
    ModelChanged,
    OutputBatch,
    ProcessDown,
    RequestError,
    Retokenize,
)
from common.wire_id import client_id, owner, wire_id


def test_wire_ids_name_their_gateway_with_several_and_are_the_client_id_with_one() -> None:
    assert wire_id(0, 1, "abc") == "abc"
    assert owner("abc", 1) == 0 and owner("g7:x", 1) == 0
    assert wire_id(1, 2, "abc") == "g1:abc"
    assert owner("g1:abc", 2) == 1 and owner("g1:abc/resume-2", 2) == 1
    assert client_id("g1:abc/resume-2", 2) == "abc/resume-2"
    # a client's id that looks like a mark is still inside the gateway's
    assert owner(wire_id(0, 2, "g1:x"), 2) == 0 and client_id(wire_id(0, 2, "g1:x"), 2) == "g1:x"


@pytest.mark.parametrize("wire", ["abc", "g:abc", "gx:abc", "g2:abc", "h1:abc", ""])
def test_an_id_no_gateway_minted_has_no_owner(wire: str) -> None:
    assert owner(wire, 2) is None
    assert client_id(wire, 2) == wire


def test_a_requests_error_or_retokenize_goes_to_its_owner_only() -> None:
    error = RequestError(request_id="g1:a", status=503, message="x")
    assert route(error, 3) == [(1, error)]
    again = Retokenize(request_id="g2:b")
    assert route(again, 3) == [(2, again)]
    stray = RequestError(request_id="nobody", status=500, message="x")  # each ignores it
    assert route(stray, 2) == [(0, stray), (1, stray)]


def test_notices_go_to_every_gateway() -> None:
    for notice in (
        _model_changed(),
        LorasChanged(replica=0, names=[], paths=[]),
        ProcessDown(name="tokenizer-0", exit_code=-9),
    ):
        assert route(notice, 2) == [(0, notice), (1, notice)]
        assert route(notice, 1) == [(0, notice)]


def _model_changed() -> ModelChanged:
    return ModelChanged(
        name="m",
        version="v",
        path="/m",
        tokenizer_fingerprint="f",
        max_model_len=8,
        vocab_size=10,
        eos_token_ids=[2],
    )


def _batch(ids: list[str], **more: Any) -> OutputBatch:
    n = len(ids)
    return OutputBatch(
        request_ids=ids,
        texts=[f"t{i}" for i in range(n)],
        token_ids=[[i] for i in range(n)],
        finish_reasons=[0] * n,
        num_prompt_tokens=[3] * n,
        num_output_tokens=list(range(n)),
        **more,
    )


def test_an_output_batch_is_split_by_owner_each_part_its_rows_in_order() -> None:
    batch = _batch(["g0:a", "g1:b", "g0:c"], versions=["v1", "v2", "v3"])
    (i0, part0), (i1, part1) = route(batch, 2)
    assert (i0, i1) == (0, 1)
    assert part0.request_ids == ["g0:a", "g0:c"]
    assert part0.texts == ["t0", "t2"] and part0.token_ids == [[0], [2]]
    assert part0.num_output_tokens == [0, 2] and part0.versions == ["v1", "v3"]
    assert part0.logprob_token_ids == [] and part0.stop_reasons == []  # unsent stays unsent
    assert part1.request_ids == ["g1:b"] and part1.versions == ["v2"]


def test_a_batch_of_one_gateway_goes_whole() -> None:
    batch = _batch(["g1:a", "g1:b"])
    assert route(batch, 2) == [(1, batch)]
    assert route(batch, 1) == [(0, batch)]


def test_a_batch_with_a_ragged_field_is_refused() -> None:
    batch = _batch(["g0:a", "g1:b"], versions=["v1"])
    with pytest.raises(ValueError, match="versions"):
        route(batch, 2)


class _Box:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def test_the_outbox_sends_each_part_to_its_gateways_inbox() -> None:
    boxes = [_Box(), _Box()]
    out = GatewayOutbox(boxes)  # type: ignore[arg-type]
    out.send(_batch(["g1:a"]))
    out.send(_model_changed())
    assert [type(m).__name__ for m in boxes[0].sent] == ["ModelChanged"]
    assert [type(m).__name__ for m in boxes[1].sent] == ["OutputBatch", "ModelChanged"]
