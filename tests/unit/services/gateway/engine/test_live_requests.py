"""The live-request registry (services/gateway/engine/live_requests.py): rows as deltas come,
running totals, what listeners hear, and two observers chained."""

from __future__ import annotations

from typing import Any

from common.messages import FinishReason, GenerateRequest, SamplingParams
from services.gateway.engine.client import OutputDelta
from services.gateway.engine.live_requests import LiveRequests, chain_observers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(rid: str, lora: str = "", n: int = 1) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=16, n=n)
    return GenerateRequest(
        request_id=rid, model="m", prompt="hi", sampling=sampling, lora_name=lora
    )


def tokens(num: int, finish: FinishReason = FinishReason.NONE, index: int = 0) -> OutputDelta:
    last = finish != FinishReason.NONE
    return OutputDelta("x" * num, [1] * num, finish, 3, num, last, index=index, version="v1")


def registry() -> tuple[LiveRequests, Clock, list[tuple[str, dict[str, Any]]]]:
    clock = Clock()
    live = LiveRequests(lambda: "base", clock)
    heard: list[tuple[str, dict[str, Any]]] = []
    live.listeners.append(lambda what, row: heard.append((what, row)))
    return live, clock, heard


def test_a_request_row_from_arrival_to_its_end() -> None:
    live, clock, heard = registry()
    watch = live.observe(request("r1"))
    assert heard == [("started", live.rows()[0])]
    assert live.rows()[0] | {"elapsed_s": 0} == {
        "id": "r1",
        "model": "base",
        "state": "queued",
        "n": 1,
        "max_tokens": 16,
        "num_prompt_tokens": 0,
        "num_output_tokens": 0,
        "ttft_s": None,
        "elapsed_s": 0,
        "arrival": 1000.0,
        "version": "",
    }
    clock.now += 0.25
    watch.delta(tokens(2))
    clock.now += 0.75
    watch.delta(tokens(3))
    row = live.rows()[0]
    assert (row["state"], row["num_prompt_tokens"], row["num_output_tokens"]) == ("running", 3, 5)
    assert (row["ttft_s"], row["elapsed_s"], row["version"]) == (0.25, 1.0, "v1")
    watch.delta(tokens(1, FinishReason.LENGTH))
    watch.end()  # after the last delta: nothing more
    assert live.rows() == []
    assert [what for what, _ in heard] == ["started", "finished"]
    assert heard[1][1]["state"] == "length" and heard[1][1]["num_output_tokens"] == 6
    t = live.totals
    assert (t.num_finished, t.num_output_tokens, t.num_with_first_token) == (1, 6, 1)
    assert (t.ttft_sum_s, t.e2e_sum_s) == (0.25, 1.0)


def test_an_adapter_request_names_its_adapter() -> None:
    live, _, _ = registry()
    live.observe(request("r1", lora="sql"))
    assert live.rows()[0]["model"] == "sql"


def test_a_stream_closed_early_ends_cancelled() -> None:
    live, _, heard = registry()
    watch = live.observe(request("r1"))
    watch.delta(tokens(1))
    watch.end()
    assert live.rows() == [] and heard[-1][1]["state"] == "cancelled"
    assert live.totals.num_finished == 1


def test_a_refused_request_ends_failed_without_a_ttft() -> None:
    live, _, heard = registry()
    watch = live.observe(request("r1"))
    watch.failed(503)
    watch.end()
    assert heard[-1][0] == "finished" and heard[-1][1]["state"] == "failed (503)"
    assert (live.totals.num_finished, live.totals.num_with_first_token) == (1, 0)


def test_n_sequences_end_with_the_last() -> None:
    live, _, _ = registry()
    watch = live.observe(request("r1", n=2))
    first_done = OutputDelta("ab", [1, 1], FinishReason.STOP, 3, 2, False, index=0)
    watch.delta(first_done)
    assert live.rows()[0]["state"] == "running"  # until its last sequence finishes
    watch.delta(OutputDelta("", [9], FinishReason.LENGTH, 3, 1, True, index=1))
    assert live.rows() == [] and live.totals.num_output_tokens == 3


class Recorder:
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def delta(self, delta: OutputDelta) -> None:
        self.calls.append(f"{self.name}.delta")

    def failed(self, status: int) -> None:
        self.calls.append(f"{self.name}.failed")

    def end(self) -> None:
        self.calls.append(f"{self.name}.end")


def test_chained_observers_both_see_everything_in_order() -> None:
    calls: list[str] = []
    both = chain_observers(lambda r: Recorder(calls, "a"), lambda r: Recorder(calls, "b"))
    watch = both(request("r1"))
    watch.delta(tokens(1))
    watch.failed(500)
    watch.end()
    assert calls == ["a.delta", "b.delta", "a.failed", "b.failed", "a.end", "b.end"]
    alone = chain_observers(None, lambda r: Recorder(calls, "c"))
    alone(request("r2")).end()
    assert calls[-1] == "c.end"
