"""The servers tools/benchmarks/perplexity.py scores: each window's logprobs of its tokens
after the first, given the ones before them.

A vLLM-compatible server (shuttle, vLLM): one POST /v1/completions per window, the window as
a list of ids, max_tokens 1, temperature 0 and `prompt_logprobs: 0`; the answer's
`prompt_logprobs` has an entry per prompt token (null for the first) whose map holds the
token's own logprob under its id.

llama.cpp: llama-server cannot return prompt token logprobs: `n_probs` covers generated
tokens only, and its /v1/completions refuses `echo` ("Only no echo is supported",
tools/server/server-common.cpp). So each scored position is one request to /completion:
the window's ids before it as the prompt, `n_predict: 1`, `n_probs: 1` and a logit bias of
+1e4 on the window's next id, which is then the sampled token; the logprob llama-server
reports for a sampled token is log_softmax of the model's raw logits, taken before any
sampler (the bias included) runs (server-context.cpp populate_token_probs,
post_sampling_probs false). Its prompt cache makes each request evaluate about one new
token: (window_len - 1) requests per window, the windows in parallel slots. It computes
that softmax in float32: a probability below ~1e-38 underflows, which is reported as an
error, not averaged. On the default model's f32 GGUF it gives transformers' float32
perplexity within 1e-4 (tests/integration/test_perplexity.py; llama-server's KV cache is
float16). About 0.1 s a request on 2 busy cores: give llama-server as many slots as
windows (-np) and `--concurrency` as many.
"""

from __future__ import annotations

import asyncio
from typing import Any

LLAMACPP_FORCE_BIAS = 1e4  # on the next id's logit: it is sampled, whatever the model says


async def _in_parallel(jobs: list[Any], concurrency: int) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def run(job: Any) -> Any:
        async with gate:
            return await job

    return list(await asyncio.gather(*(run(j) for j in jobs)))


def served_model(url: str) -> str:
    """The first model a vLLM-compatible server lists at /v1/models."""
    import httpx

    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=60)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def _server_window(client: Any, model: str, window: list[int]) -> list[float]:
    body = {
        "model": model,
        "prompt": window,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    entries = r.json()["choices"][0]["prompt_logprobs"]
    if len(entries) != len(window) or entries[0] is not None:
        raise ValueError(f"prompt_logprobs has {len(entries)} entries for {len(window)} tokens")
    return [float(e[str(t)]["logprob"]) for e, t in zip(entries[1:], window[1:], strict=True)]


def server_logprobs(
    url: str, model: str, windows: list[list[int]], concurrency: int = 4
) -> list[list[float]]:
    """Each window's prompt logprobs from a vLLM-compatible server's /v1/completions."""
    import httpx

    async def run() -> list[list[float]]:
        async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=600) as client:
            jobs = [_server_window(client, model, w) for w in windows]
            return await _in_parallel(jobs, concurrency)

    return asyncio.run(run())


async def _llamacpp_window(client: Any, window: list[int]) -> list[float]:
    out = []
    for i in range(1, len(window)):
        body = {
            "prompt": window[:i],
            "n_predict": 1,
            "n_probs": 1,
            "temperature": 0.0,
            "cache_prompt": True,
            "logit_bias": [[window[i], LLAMACPP_FORCE_BIAS]],
        }
        r = await client.post("/completion", json=body)
        r.raise_for_status()
        (entry,) = r.json()["completion_probabilities"]
        if entry["id"] != window[i]:
            raise ValueError(f"llama-server sampled {entry['id']}, not the forced {window[i]}")
        out.append(float(entry["logprob"]))
    return out


def llamacpp_logprobs(
    url: str, windows: list[list[int]], concurrency: int = 4
) -> list[list[float]]:
    """Each window's token logprobs from llama-server, one forced token per request (see the
    module docstring)."""
    import httpx

    async def run() -> list[list[float]]:
        async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=600) as client:
            return await _in_parallel([_llamacpp_window(client, w) for w in windows], concurrency)

    return asyncio.run(run())
