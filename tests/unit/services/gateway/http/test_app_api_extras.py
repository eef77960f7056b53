"""Issue 24's small fixes on the real HTTP app over the scripted engine: GET
/v1/models/{id}, a draining server's message, stream_options.continuous_usage_stats and
detokenize: false and return_tokens_as_token_ids (services/gateway/openai/token_output.py), chat
echo."""

from __future__ import annotations

from typing import Any

from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta
from services.gateway.openai.logprobs import TokenLogprob
from tests.fake_engine import MODEL, FakeEngine
from tests.sse_events import parse_sse
from tests.unit.services.gateway.http.test_app import CHAT, COMPLETIONS, chat_body, error_of, run


def test_a_model_card_by_id_and_a_404_for_another_name() -> None:
    engine = FakeEngine()
    engine.aliases = ["org/alias"]
    card = run(engine, "GET", f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["root"] == MODEL
    assert run(engine, "GET", "/v1/models/org/alias").json()["id"] == "org/alias"
    error = error_of(run(engine, "GET", "/v1/models/nope"), 404)
    assert error["param"] == "model" and "`nope` does not exist" in error["message"]


def test_a_draining_server_says_so() -> None:
    engine = FakeEngine()
    engine.ready, engine.draining = False, True
    error = error_of(run(engine, "POST", CHAT, json=chat_body()), 503)
    assert "draining" in error["message"] and "not ready" not in error["message"]
    assert run(engine, "GET", "/health").json() == {"status": "draining"}
    engine.draining = False  # starting, not draining
    assert "not ready yet" in error_of(run(engine, "POST", CHAT, json=chat_body()), 503)["message"]


def _chunks(resp: Any) -> list[dict[str, Any]]:
    events = parse_sse(resp.content)
    assert events[-1] == "[DONE]"
    return [e for e in events[:-1] if isinstance(e, dict)]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    for url, body in ((CHAT, chat_body()), (COMPLETIONS, {"prompt": "hello big world"})):
        body = body | {"stream": True, "stream_options": options}
        chunks = _chunks(run(FakeEngine(), "POST", url, json=body))
        texts = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason") is None]
        # the fake engine's deltas: 5 prompt tokens, the n-th word is output token n
        counted = [c["usage"]["completion_tokens"] for c in texts if "usage" in c]
        assert counted[-3:] == [1, 2, 3], url
        assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks)  # (role chunks too)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8
    # include_usage alone: the usage chunk at the end only
    body = chat_body(stream=True, stream_options={"include_usage": True})
    chunks = _chunks(run(FakeEngine(), "POST", CHAT, json=body))
    assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_detokenize_false_answers_token_ids_without_text() -> None:
    engine = FakeEngine()
    body = {"prompt": "a b", "return_token_ids": True}
    token_ids = run(engine, "POST", COMPLETIONS, json=body).json()["choices"][0]["token_ids"]
    out = run(engine, "POST", COMPLETIONS, json={"prompt": "a b", "detokenize": False}).json()
    assert out["choices"][0]["text"] == "" and out["choices"][0]["token_ids"] == token_ids
    out = run(engine, "POST", CHAT, json=chat_body(detokenize=False)).json()
    assert out["choices"][0]["message"]["content"] == ""
    assert out["choices"][0]["token_ids"]
    out = run(engine, "POST", CHAT, json=chat_body(detokenize=True)).json()
    assert out["choices"][0]["message"]["content"] == " hello big world"
    assert "token_ids" not in out["choices"][0]
    for extra in ({"stop": ["x"]}, {"stream": True}):
        body = chat_body(detokenize=False, **extra)
        assert error_of(run(engine, "POST", CHAT, json=body), 400)["param"] == "detokenize"


def test_chat_echo_starts_the_answer_with_the_last_message() -> None:
    engine = FakeEngine()
    partial = {"role": "assistant", "content": "The answer is"}
    body = chat_body(echo=True, add_generation_prompt=False)
    body["messages"].append(partial)
    out = run(engine, "POST", CHAT, json=body).json()
    # (the fake engine echoes the last message's words back as its output)
    assert out["choices"][0]["message"]["content"] == "The answer is The answer is"
    chunks = _chunks(run(engine, "POST", CHAT, json=body | {"stream": True}))
    texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert texts[:3] == ["", "The answer is", " The"]
    # the last message is the user's, the answer the assistant's: nothing to echo
    out = run(engine, "POST", CHAT, json=chat_body(echo=True)).json()
    assert out["choices"][0]["message"]["content"] == " hello big world"


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id() -> None:
    entry = TokenLogprob(7, "\ufffd", -0.5, [(7, "\ufffd", -0.5), (9, "x", -1.5)])
    done = OutputDelta(" hi", [7], FinishReason.STOP, 5, 1, last=True, logprobs=[entry])
    body = chat_body(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    out = run(FakeEngine([done]), "POST", CHAT, json=body).json()
    (token,) = out["choices"][0]["logprobs"]["content"]
    assert token["token"] == "token_id:7"
    assert [t["token"] for t in token["top_logprobs"]] == ["token_id:7", "token_id:9"]
    out = run(FakeEngine([done]), "POST", CHAT, json=chat_body(logprobs=True)).json()
    assert out["choices"][0]["logprobs"]["content"][0]["token"] == "\ufffd"


def test_prompt_options_reach_the_tokenizer_checked() -> None:
    engine = FakeEngine()  # max_model_len 256
    body = {"prompt": "a b", "truncate_prompt_tokens": -1, "add_special_tokens": False}
    assert run(engine, "POST", COMPLETIONS, json=body).status_code == 200
    sent = engine.requests[-1]
    assert sent.truncate_prompt_tokens == 256 and sent.add_special_tokens is False
    for value in (0, 257, -2):
        body = {"prompt": "a b", "truncate_prompt_tokens": value}
        error = error_of(run(engine, "POST", COMPLETIONS, json=body), 400)
        assert error["param"] == "truncate_prompt_tokens"
    error = error_of(run(engine, "POST", CHAT, json=chat_body(continue_final_message=True)), 400)
    assert error["param"] == "continue_final_message"
    assert "add_generation_prompt: false" in error["message"]
    body = chat_body(continue_final_message=True, add_generation_prompt=False)
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    assert engine.requests[-1].continue_final_message
    assert not engine.requests[-1].add_generation_prompt


def test_stop_reason_beside_the_finish_reason() -> None:
    done = OutputDelta(" hi", [7], FinishReason.STOP, 5, 1, last=True, stop_reason="\n\n")
    out = run(FakeEngine([done]), "POST", COMPLETIONS, json={"prompt": "x"}).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["stop_reason"] == "\n\n"
    body = chat_body(stream=True)
    chunks = _chunks(run(FakeEngine([done]), "POST", CHAT, json=body))
    assert chunks[-1]["choices"][0]["stop_reason"] == "\n\n"
    # EOS or length: none (vLLM's null, left out)
    out = run(FakeEngine(), "POST", COMPLETIONS, json={"prompt": "x"}).json()
    assert "stop_reason" not in out["choices"][0]


def test_output_options_reach_the_engine() -> None:
    engine = FakeEngine()
    body = chat_body(include_stop_str_in_output=True, skip_special_tokens=False)
    assert run(engine, "POST", CHAT, json=body).status_code == 200
    sampling = engine.requests[-1].sampling
    assert sampling.include_stop_str_in_output and not sampling.skip_special_tokens
    body = chat_body(spaces_between_special_tokens=False)  # (a fast tokenizer's no-op)
    assert run(engine, "POST", CHAT, json=body).status_code == 200


def test_cache_salt_reaches_the_engine_and_is_not_empty() -> None:
    engine = FakeEngine()
    assert run(engine, "POST", CHAT, json=chat_body(cache_salt="s3cret")).status_code == 200
    assert engine.requests[-1].cache_salt == "s3cret"
    assert error_of(run(engine, "POST", CHAT, json=chat_body(cache_salt="")), 400)["param"] == (
        "cache_salt"
    )
