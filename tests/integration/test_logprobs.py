"""Logprobs and prompt logprobs from the engine that ships (EngineCore plans, ModelRunner
executes: InProcessEngine) against torch.log_softmax of transformers' logits on the same
tiny fp32 weights; then through the real server with the `openai` client.

In-process: a request asking for output and prompt logprobs shares batches with one asking
for nothing, the prompts are prefilled in chunks, and a second round repeats a prompt whose
blocks are cached: a request asking only for output logprobs takes the prefix hit, one
asking for prompt logprobs bypasses the cache (the runner needs every prompt position's
logits), and both must still equal the reference.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from common.messages.types import SamplingParams
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.in_process import InProcessEngine
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.server import Server
from tests.tiny_models import make_tiny_model

torch.set_num_threads(2)

TOL = 1e-4
MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def hf_model(tiny: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **kw)


def _reference(model: Any, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `tokens`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_entry(ref_row: torch.Tensor, token: int, ids: list[int], values: list[float], k: int):
    assert ids[0] == token and len(ids) == len(values) == 1 + k
    assert abs(values[0] - float(ref_row[token])) < TOL
    top = ref_row.topk(k).values.tolist()
    assert all(abs(a - b) < TOL for a, b in zip(values[1:], top, strict=True))
    for t, v in zip(ids[1:], values[1:], strict=True):
        assert abs(v - float(ref_row[t])) < TOL


def _collect(engine: InProcessEngine, rid: str) -> tuple[list[Any], list[Any]]:
    """A request's output entries and its prompt entries, from every TokenBatch."""
    out: list[Any] = []
    prompt: list[Any] = []
    for batch in engine.batches:
        for i, r in enumerate(batch.request_ids):
            if r != rid:
                continue
            if batch.logprob_token_ids:
                out += zip(batch.logprob_token_ids[i], batch.logprob_values[i], strict=True)
            if batch.prompt_logprob_token_ids and batch.prompt_logprob_token_ids[i]:
                assert not prompt, "prompt logprobs are sent once"
                prompt = list(
                    zip(
                        batch.prompt_logprob_token_ids[i],
                        batch.prompt_logprob_values[i],
                        strict=True,
                    )
                )
    return out, prompt


def _check_request(
    model: Any, engine: InProcessEngine, rid: str, prompt: list[int], p: SamplingParams
) -> None:
    output = engine.outputs[rid, 0]
    assert len(output) == MAX_NEW
    ref = _reference(model, prompt + output)
    n = len(prompt)
    assert output == ref[n - 1 : n - 1 + MAX_NEW].argmax(-1).tolist()  # greedy, as the reference
    got, got_prompt = _collect(engine, rid)
    if p.logprobs is None:
        assert all(ids == [] for ids, _ in got)
    else:
        assert len(got) == MAX_NEW
        for j, (ids, values) in enumerate(got):
            _check_entry(ref[n - 1 + j], output[j], ids, values, p.logprobs)
    if p.prompt_logprobs is None:
        assert got_prompt == []
        return
    assert len(got_prompt) == n and got_prompt[0] == ([prompt[0]], [])
    for pos in range(1, n):
        ids, values = got_prompt[pos]
        _check_entry(ref[pos - 1], prompt[pos], ids, values, p.prompt_logprobs)


def test_logprobs_equal_log_softmax_of_transformers_logits(tiny: Path, hf_model: Any) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (37, 11, 21)]
    runner = ModelRunner(str(tiny), RunnerOptions(num_blocks=64))
    # a small budget: prompts are prefilled in chunks, prompt logprobs gathered across them
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=16), overlap=False)
    first = {
        "both": (prompts[0], _greedy(logprobs=5, prompt_logprobs=3)),
        "nothing": (prompts[1], _greedy()),
        "output": (prompts[2], _greedy(logprobs=0)),
    }
    for rid, (prompt, p) in first.items():
        engine.add(prompt, p, request_id=rid)
    engine.run()
    for rid, (prompt, p) in first.items():
        _check_request(hf_model, engine, rid, prompt, p)
    # round two: prompts[0]'s blocks are cached now
    hits_before = engine.policy.blocks.num_cached_hits
    second = {
        "hit": (prompts[0], _greedy(logprobs=2)),  # takes the prefix hit
        "prompt-again": (prompts[0], _greedy(prompt_logprobs=1)),  # must not
    }
    for rid, (prompt, p) in second.items():
        engine.add(prompt, p, request_id=rid)
    engine.run()
    assert engine.policy.blocks.num_cached_hits > hits_before
    for rid, (prompt, p) in second.items():
        _check_request(hf_model, engine, rid, prompt, p)


# --- the real server -------------------------------------------------------------------------


def test_chat_logprobs_and_completion_echo_over_http(server: Server) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":  # (no end token, whose text is not shown)
        assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0.0
        tops = [t.logprob for t in c.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert abs(c.logprob - tops[0]) < 1e-3  # greedy: the sampled token is the top one
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        c for chunk in stream for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, content, strict=True))

    prompt = "1, 2, 3, 4,"
    done = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=2, echo=True
    )
    choice = done.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    num_prompt = done.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + done.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
