"""Hot-swap to a model whose tokenizer differs from the served one, under load (issue 14).

The scheduler owns the served model's identity and pushes it (ModelChanged) to every
tokenizer, the detokenizer and the gateway; a request tokenised by the old tokenizer that
has not started when the tokenizer changes is tokenised again. Here SmolLM2 (the default
model) is swapped, while 4 streaming clients loop, to a tiny Llama with a BPE vocabulary of
its own and the same KV layout, and back, in `overlap` and in `drain` mode:

- no request fails;
- every output equals the greedy output of the version that served it (its
  system_fingerprint): the tiny model's transformers reference, or SmolLM2's own outputs
  from before any swap (so swapping back restores them);
- every request sent after the swap call returned is served by the new version, and
  `/v1/models` names it in the very first call after the swap call returns;
- prompt token counts, chat templates and the vocabulary check follow the new model.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from common.prepare_model import prepare_default_model
from tests.reference import hf_greedy
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model_own_vocab

TOKEN = "swap-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NUM_NEW = 16
NUM_CLIENTS = 4
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog and" for i in range(8)]
CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
RETOKENIZED = "tokenising again"  # the gateway's log line when it resends a request
DEADLINE_S = 900.0  # generous: a busy machine makes the test slower, never wrong


@dataclasses.dataclass(frozen=True)
class Greedy:
    """A prompt's greedy output: its text and token ids."""

    text: str
    token_ids: list[int]


@pytest.fixture(scope="module")
def own_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with its own tokenizer and SmolLM2-135M's KV layout (30 layers, 3 KV
    heads of 64), so it can share the KV pool and swap in `overlap` mode too."""
    folder = tmp_path_factory.mktemp("models") / "own-vocab"
    return make_tiny_model_own_vocab(
        folder, seed=4, num_layers=30, hidden_size=96, num_heads=3, num_kv_heads=3, head_dim=64
    )


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # two tokenizer processes: ModelChanged must reach each of them
    with running_server("--admin-token", TOKEN, "--num-tokenizers", "2") as s:
        yield s


@pytest.fixture(scope="module")
def smol_outputs(server: Server) -> dict[str, Greedy]:
    """SmolLM2's outputs, served before any swap: what swapping back must restore."""

    async def all_prompts() -> list[Greedy]:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as c:
            return list(await asyncio.gather(*(_complete(c, server.model, p) for p in PROMPTS)))

    return dict(zip(PROMPTS, asyncio.run(all_prompts()), strict=True))


@pytest.fixture(scope="module")
def own_reference(own_vocab: Path) -> dict[str, Greedy]:
    """The tiny model's greedy outputs from transformers, on its own tokenizer's ids."""
    tok = AutoTokenizer.from_pretrained(own_vocab)
    refs = {}
    for prompt in PROMPTS:
        ids = hf_greedy(own_vocab, tok.encode(prompt), NUM_NEW)
        text = tok.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        refs[prompt] = Greedy(text, ids)
    return refs


@dataclasses.dataclass(frozen=True)
class Result:
    client: int
    num_swapped: int  # how many swap calls had returned when the request was sent
    prompt: str
    text: str = ""
    finish: str = ""
    version: str = ""
    error: str = ""


class Load:
    """NUM_CLIENTS streaming clients, each sending one greedy request after another until
    stopped; the test waits on their results, never on the clock."""

    def __init__(self, c: httpx.AsyncClient, model: str) -> None:
        self.c = c
        self.model = model
        self.num_swapped = 0
        self.results: list[Result] = []
        self._changed = asyncio.Condition()
        self._stopping = False

    async def run(self) -> None:
        await asyncio.gather(*(self._client(k) for k in range(NUM_CLIENTS)))

    def stop(self) -> None:
        self._stopping = True

    async def wait_for_each(self, num_requests: int, num_swapped: int, what: str) -> None:
        """Until every client has finished `num_requests` requests sent after `num_swapped`
        swap calls returned."""

        def done() -> bool:
            return all(
                sum(1 for r in self.results if r.client == k and r.num_swapped >= num_swapped)
                >= num_requests
                for k in range(NUM_CLIENTS)
            )

        await self._wait(done, what)

    async def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), DEADLINE_S)
            except TimeoutError:
                raise AssertionError(
                    f"waited {DEADLINE_S:g} s for {what}: {self.results}"
                ) from None

    async def _client(self, k: int) -> None:
        j = 0
        while not self._stopping:
            prompt = PROMPTS[(k + NUM_CLIENTS * j) % len(PROMPTS)]
            j += 1
            result = await self._stream(Result(k, self.num_swapped, prompt))
            async with self._changed:
                self.results.append(result)
                self._changed.notify_all()

    async def _stream(self, r: Result) -> Result:
        body = {
            "model": self.model,
            "prompt": r.prompt,
            "max_tokens": NUM_NEW,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        text, finish, version = "", "", ""
        try:
            async with self.c.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return dataclasses.replace(
                        r, error=f"{resp.status_code}: {(await resp.aread())!r}"
                    )
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        return dataclasses.replace(r, error=str(chunk["error"]))
                    version = chunk.get("system_fingerprint") or version
                    if chunk.get("choices"):
                        text += chunk["choices"][0].get("text") or ""
                        finish = chunk["choices"][0].get("finish_reason") or finish
        except httpx.HTTPError as e:
            return dataclasses.replace(r, error=repr(e))
        return dataclasses.replace(r, text=text, finish=finish, version=version)


async def _complete(c: httpx.AsyncClient, model: str, prompt: str) -> Greedy:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NUM_NEW,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return Greedy(choice["text"], choice["token_ids"])


async def _swap(c: httpx.AsyncClient, folder: Path, label: str, mode: str) -> tuple[dict, dict]:
    """Swap; return the swap's answer and what the very next /v1/models call says."""
    r = await c.post(
        "/admin/swap-model",
        headers=ADMIN,
        json={"model": str(folder), "version": label, "mode": mode},
    )
    models = await c.get("/v1/models")
    assert r.status_code == 200, r.text
    return r.json(), models.json()["data"][0]


async def _check_the_new_model_is_followed(
    c: httpx.AsyncClient, model: str, own_vocab: Path, own_reference: dict[str, Greedy]
) -> None:
    """Token for token: ids, prompt lengths, chat template and vocabulary of the new model."""
    tok = AutoTokenizer.from_pretrained(own_vocab)
    prompt = PROMPTS[1]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NUM_NEW,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = (await c.post("/v1/completions", json=body)).json()
    assert r["choices"][0]["token_ids"] == own_reference[prompt].token_ids
    assert r["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    # as the tokenizer process does: render the template, then tokenise the text
    chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(chat_text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(chat_ids[0]) == "<|im_start|>"  # its own template
    chat = (
        await c.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": CHAT,
                "max_tokens": NUM_NEW,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    expected = tok.decode(hf_greedy(own_vocab, chat_ids, NUM_NEW), skip_special_tokens=True)
    assert chat["choices"][0]["message"]["content"] == expected
    # token ids are checked against the new, much smaller vocabulary
    outside = await c.post(
        "/v1/completions", json={"model": model, "prompt": [5, len(tok)], "max_tokens": 2}
    )
    assert outside.status_code == 400 and "prompt" in outside.text, outside.text
    inside = await c.post(
        "/v1/completions", json={"model": model, "prompt": [5, len(tok) - 1], "max_tokens": 2}
    )
    assert inside.status_code == 200, inside.text


@pytest.mark.parametrize("mode", ["overlap", "drain"])
def test_swap_to_another_tokenizer_and_back_under_load(
    server: Server,
    own_vocab: Path,
    smol_outputs: dict[str, Greedy],
    own_reference: dict[str, Greedy],
    mode: str,
) -> None:
    smol = prepare_default_model()
    own_label, back_label = f"own-{mode}", f"smol-{mode}"
    num_retokenized = server.logs().count(RETOKENIZED)

    async def scenario() -> tuple[str, list[Result]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as c:
            start = (await c.get("/v1/models")).json()["data"][0]["version"]
            load = Load(c, server.model)
            clients = asyncio.create_task(load.run())
            await load.wait_for_each(1, 0, "a request of each client before the swap")

            swapped, card = await _swap(c, own_vocab, own_label, mode)
            load.num_swapped = 1
            assert swapped["ok"], swapped
            assert (swapped["previous_version"], swapped["version"]) == (start, own_label)
            assert card["version"] == own_label and card["id"] == server.model
            await _check_the_new_model_is_followed(c, server.model, own_vocab, own_reference)
            await load.wait_for_each(2, 1, "two requests of each client on the new model")

            swapped, card = await _swap(c, smol, back_label, mode)
            load.num_swapped = 2
            assert swapped["ok"], swapped
            assert (swapped["previous_version"], swapped["version"]) == (own_label, back_label)
            assert card["version"] == back_label
            await load.wait_for_each(2, 2, "two requests of each client after swapping back")
            load.stop()
            await clients
            again = await asyncio.gather(*(_complete(c, server.model, p) for p in PROMPTS))
            assert dict(zip(PROMPTS, again, strict=True)) == smol_outputs
            return start, load.results

    start, results = asyncio.run(scenario())
    failed = [r for r in results if r.error or r.finish != "length"]
    assert not failed, failed
    expected = {start: smol_outputs, own_label: own_reference, back_label: smol_outputs}
    for r in results:
        assert r.version in expected, r
        assert r.text == expected[r.version][r.prompt].text, r
    # sent after a swap call returned: served by the version it swapped to, or by a later
    # one (a request still queued when the next swap changes the model moves on with it)
    order = [start, own_label, back_label]
    assert all(order.index(r.version) >= r.num_swapped for r in results), results
    assert any(r.version == own_label for r in results)
    if mode == "drain":
        # requests that arrived while admission was paused were tokenised by the old
        # tokenizer and had not started: they were tokenised again (and served right, above)
        assert server.logs().count(RETOKENIZED) > num_retokenized
