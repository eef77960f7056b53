"""Logprobs, echo and prompt_logprobs as the gateway shapes them (chat and completions,
streamed and not), from a scripted engine's entries."""

from __future__ import annotations

from typing import Any

from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta, TokenLogprob
from tests.fake_engine import FakeEngine
from tests.sse_events import parse_sse
from tests.unit.services.gateway.http.test_app import CHAT, COMPLETIONS, chat_body, run

HI = TokenLogprob(5, " hi", -0.5, [(5, " hi", -0.5), (6, " yo", -1.5)])
BANG = TokenLogprob(8, "!", -2.0, [(9, ".", -0.3), (5, " hi", -1.0)])  # outside the top 2
PROMPT = [
    TokenLogprob(1, "a", None, []),
    TokenLogprob(2, "b", -3.0, [(3, "c", -0.1), (2, "b", -3.0)]),
]


def _engine() -> FakeEngine:
    return FakeEngine(
        [
            OutputDelta(" hi", [5], FinishReason.NONE, 2, 1, False, logprobs=[HI],
                        prompt_logprobs=PROMPT),
            OutputDelta("!", [8], FinishReason.STOP, 2, 2, True, logprobs=[BANG]),
        ]
    )  # fmt: skip


def _chunks(resp: Any) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    events = parse_sse(resp.content)
    assert events[-1] == "[DONE]"
    return [e for e in events[:-1] if isinstance(e, dict)]


def test_chat_logprobs_with_top_alternatives() -> None:
    engine = _engine()
    resp = run(engine, "POST", CHAT, json=chat_body(logprobs=True, top_logprobs=1))
    assert engine.requests[-1].sampling.logprobs == 1
    (choice,) = resp.json()["choices"]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": " hi",
                "logprob": -0.5,
                "bytes": [32, 104, 105],
                "top_logprobs": [{"token": " hi", "logprob": -0.5, "bytes": [32, 104, 105]}],
            },
            {
                "token": "!",
                "logprob": -2.0,
                "bytes": [33],
                "top_logprobs": [{"token": ".", "logprob": -0.3, "bytes": [46]}],
            },
        ]
    }


def test_chat_without_logprobs_has_none_and_asks_for_none() -> None:
    engine = _engine()
    (choice,) = run(engine, "POST", CHAT, json=chat_body()).json()["choices"]
    assert choice["logprobs"] is None and engine.requests[-1].sampling.logprobs is None
    resp = run(engine, "POST", CHAT, json=chat_body(logprobs=True))
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [c["top_logprobs"] for c in content] == [[], []]
    assert engine.requests[-1].sampling.logprobs == 0


def test_chat_stream_logprobs_per_chunk() -> None:
    body = chat_body(logprobs=True, top_logprobs=2, stream=True)
    chunks = _chunks(run(_engine(), "POST", CHAT, json=body))
    text = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert [t["delta"]["content"] for t in text] == [" hi", "!"]
    assert [[e["token"] for e in t["logprobs"]["content"]] for t in text] == [[" hi"], ["!"]]
    assert [len(t["logprobs"]["content"][0]["top_logprobs"]) for t in text] == [2, 2]


def test_completion_logprobs() -> None:
    engine = _engine()
    resp = run(engine, "POST", COMPLETIONS, json={"prompt": "ab", "logprobs": 1})
    (choice,) = resp.json()["choices"]
    assert choice["text"] == " hi!"
    assert choice["logprobs"] == {
        "tokens": [" hi", "!"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{" hi": -0.5}, {"!": -2.0, ".": -0.3}],
        "text_offset": [0, 3],
    }
    assert "prompt_logprobs" not in choice
    sampling = engine.requests[-1].sampling
    assert (sampling.logprobs, sampling.prompt_logprobs) == (1, None)


def test_completion_echo_with_logprobs_puts_the_prompt_first() -> None:
    engine = _engine()
    body = {"prompt": "ab", "logprobs": 1, "echo": True}
    (choice,) = run(engine, "POST", COMPLETIONS, json=body).json()["choices"]
    sampling = engine.requests[-1].sampling
    assert (sampling.logprobs, sampling.prompt_logprobs) == (1, 1)  # echo needs the prompt's
    assert choice["text"] == "ab hi!"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", " hi", "!"],
        "token_logprobs": [None, -3.0, -0.5, -2.0],
        "top_logprobs": [None, {"b": -3.0, "c": -0.1}, {" hi": -0.5}, {"!": -2.0, ".": -0.3}],
        "text_offset": [0, 1, 2, 5],
    }


def test_completion_echo_streamed() -> None:
    body = {"prompt": "ab", "logprobs": 0, "echo": True, "stream": True}
    chunks = [c["choices"][0] for c in _chunks(run(_engine(), "POST", COMPLETIONS, json=body))]
    assert [c["text"] for c in chunks] == ["ab", " hi", "!", ""]
    assert chunks[0]["logprobs"]["tokens"] == ["a", "b"]
    assert chunks[0]["logprobs"]["token_logprobs"] == [None, -3.0]
    assert chunks[1]["logprobs"]["text_offset"] == [2]
    assert chunks[2]["logprobs"]["text_offset"] == [5]
    assert chunks[2]["logprobs"]["top_logprobs"] == [{"!": -2.0}]
    assert chunks[3]["finish_reason"] == "stop"


def test_echo_without_logprobs_and_of_a_token_prompt() -> None:
    engine = _engine()
    (choice,) = run(engine, "POST", COMPLETIONS, json={"prompt": "ab", "echo": True}).json()[
        "choices"
    ]
    assert choice["text"] == "ab hi!" and choice["logprobs"] is None
    assert engine.requests[-1].sampling.prompt_logprobs is None
    body = {"prompt": [72, 105], "echo": True}  # the fake decodes ids as characters
    (choice,) = run(engine, "POST", COMPLETIONS, json=body).json()["choices"]
    assert choice["text"] == "Hi hi!"


def test_prompt_logprobs_vllm_shape() -> None:
    engine = _engine()
    resp = run(engine, "POST", COMPLETIONS, json={"prompt": "ab", "prompt_logprobs": 2})
    (choice,) = resp.json()["choices"]
    assert engine.requests[-1].sampling.prompt_logprobs == 2
    assert choice["prompt_logprobs"] == [
        None,
        {
            "2": {"logprob": -3.0, "rank": 2, "decoded_token": "b"},
            "3": {"logprob": -0.1, "rank": 1, "decoded_token": "c"},
        },
    ]
    assert choice["logprobs"] is None
    body = chat_body(prompt_logprobs=0)
    answer = run(_engine(), "POST", CHAT, json=body).json()
    assert answer["prompt_logprobs"][0] is None and "2" in answer["prompt_logprobs"][1]


def test_echo_of_a_batch_of_prompts_with_n_choices() -> None:
    # the fake answers each prompt's words back, as sequence 0 only: choices 0 and 2
    engine = FakeEngine()
    body = {"prompt": ["a b", [72, 105]], "echo": True, "n": 2}
    choices = run(engine, "POST", COMPLETIONS, json=body).json()["choices"]
    assert [(c["index"], c["text"]) for c in choices] == [(0, "a b a b"), (2, "Hi 72 105")]
    body = body | {"stream": True}
    chunks = [c["choices"][0] for c in _chunks(run(engine, "POST", COMPLETIONS, json=body))]
    texts: dict[int, str] = {}
    for c in chunks:
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "a b a b", 2: "Hi 72 105"}


VLLM_PROMPT_LOGPROBS = [
    None,
    {
        "2": {"logprob": -3.0, "rank": 2, "decoded_token": "b"},
        "3": {"logprob": -0.1, "rank": 1, "decoded_token": "c"},
    },
]


def test_completion_stream_sends_prompt_logprobs_in_its_first_chunk() -> None:
    body = {"prompt": "ab", "prompt_logprobs": 2, "stream": True}
    chunks = [c["choices"][0] for c in _chunks(run(_engine(), "POST", COMPLETIONS, json=body))]
    assert [c["text"] for c in chunks] == [" hi", "!", ""]
    assert chunks[0]["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS  # as the answer's choice
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    # with echo the echoed prompt's chunk is the first
    body |= {"echo": True, "logprobs": 1}
    chunks = [c["choices"][0] for c in _chunks(run(_engine(), "POST", COMPLETIONS, json=body))]
    assert chunks[0]["text"] == "ab" and chunks[0]["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS
    assert all("prompt_logprobs" not in c for c in chunks[1:])


def test_chat_stream_sends_prompt_logprobs_once_for_the_response() -> None:
    body = chat_body(prompt_logprobs=2, stream=True)
    chunks = _chunks(run(_engine(), "POST", CHAT, json=body))
    carrying = [c for c in chunks if "prompt_logprobs" in c]
    assert len(carrying) == 1 and carrying[0]["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS
    assert carrying[0]["choices"][0]["delta"] == {"content": " hi"}  # the first text chunk
    answer = run(_engine(), "POST", CHAT, json=chat_body(prompt_logprobs=2)).json()
    assert answer["prompt_logprobs"] == carrying[0]["prompt_logprobs"]  # as not streamed


def test_a_first_delta_without_text_still_carries_the_prompt_logprobs() -> None:
    engine = FakeEngine(
        [
            OutputDelta("", [7], FinishReason.NONE, 2, 1, False, prompt_logprobs=PROMPT),
            OutputDelta("!", [8], FinishReason.STOP, 2, 2, True),
        ]
    )
    body = {"prompt": "ab", "prompt_logprobs": 0, "stream": True}
    chunks = [c["choices"][0] for c in _chunks(run(engine, "POST", COMPLETIONS, json=body))]
    assert [(c["text"], "prompt_logprobs" in c) for c in chunks] == [
        ("", True),
        ("!", False),
        ("", False),
    ]
