"""Speculative decoding with the real runner and policy (in process, the plans the real
processes exchange): greedy outputs identical to plain decoding on the default model with
both drafters, through prefix hits, forks and preemption, the KV integrity check after every
step; and sampled outputs that keep the target's distribution (chi-square) on a tiny model."""

from __future__ import annotations

import dataclasses
import itertools

import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.messages import SamplingParams
from common.prepare_model import prepare_default_model
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.tiny_models import make_tiny_model
from tests.unit.gpu_worker.sample.test_speculative import CHI2_999, chi_square
from tests.waiting import wait_until

SYSTEM = "You are a helpful assistant. Keep answers short and exact. " * 3
TEXTS = [
    "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    SYSTEM + "Question: what colour is the sky?",
    SYSTEM + "Question: name a large city in Japan.",
    "Tell me a short story about a lighthouse keeper.",
]
NUM_NEW = 24


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(prepare_default_model())


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random model with SmolLM2's vocabulary: it agrees with the target rarely."""
    return str(make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=3))


def _runner(model_dir: str, **kw: object) -> ModelRunner:
    options = RunnerOptions(
        block_size=16, kv_cache_memory_gib=0.1, num_threads=2, swap_space_gib=0.05, **kw
    )  # type: ignore[arg-type]
    return ModelRunner(model_dir, options)


@pytest.fixture(scope="module")
def plain(model_dir: str) -> ModelRunner:
    return _runner(model_dir)


@pytest.fixture(scope="module")
def expected(plain: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    engine = LocalEngine(plain, PolicyConfig(max_num_seqs=8))
    ids = [engine.add(p, _greedy())[0] for p in prompts]
    out = engine.run()
    return [out[i] for i in ids]


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, n=n)


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec_runner(request: pytest.FixtureRequest, model_dir: str, draft_dir: str) -> ModelRunner:
    if request.param == "ngram":
        return _runner(model_dir, speculative="ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    return _runner(model_dir, speculative="draft", draft_model=draft_dir)


@pytest.mark.parametrize("case", ["plain", "overlap", "preempt-recompute", "preempt-swap", "forks"])
def test_greedy_outputs_equal_plain_decoding(
    spec_runner: ModelRunner, prompts: list[list[int]], expected: list[list[int]], case: str
) -> None:
    config = PolicyConfig(max_num_seqs=8, num_speculative_tokens=4)
    kw: dict = {"overlap": False}
    if case == "overlap":
        kw["overlap"] = True
    if case.startswith("preempt"):  # a pool far too small for all five at once
        config = dataclasses.replace(config, preemption_mode=case.removeprefix("preempt-"))
        kw.update(num_blocks=14, num_host_blocks=40)
    engine = LocalEngine(spec_runner, config, **kw)
    n = 2 if case == "forks" else 1
    groups = [engine.add(p, _greedy(n)) for p in prompts]
    out = engine.run()  # check_integrity after every step
    for ids, want in zip(groups, expected, strict=True):
        for rid in ids:
            assert out[rid] == want, (case, rid)
    policy = engine.policy
    assert policy.blocks.num_used_blocks == 0
    if case != "overlap":  # (overlapped, a decode's token is still pending when it is
        # planned again, so it gets no drafts: the serving scheduler turns overlap off)
        assert policy.num_draft_tokens > 0  # speculation really ran
    if case.startswith("preempt"):
        assert policy.num_preemptions > 0
    if spec_runner.options.speculative == "ngram" and case != "overlap":  # lists and code repeat
        assert policy.num_accepted_tokens > 0


def test_sampled_requests_with_speculation_finish_with_their_token_counts(
    spec_runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """Greedy and sampled requests in one batch, with and without seeds."""
    engine = LocalEngine(
        spec_runner, PolicyConfig(max_num_seqs=8, num_speculative_tokens=3), overlap=False
    )
    ids = []
    for i, p in enumerate(prompts):
        params = SamplingParams(
            max_tokens=NUM_NEW,
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            seed=i if i % 2 else None,
            ignore_eos=True,
        )
        ids += engine.add(p, params if i % 3 else _greedy())
    out = engine.run()
    vocab = spec_runner.config.vocab_size
    for rid in ids:
        assert len(out[rid]) == NUM_NEW and all(0 <= t < vocab for t in out[rid])
    assert engine.policy.num_draft_tokens > 0


# --- the distribution: a tiny target and a drafter that often disagrees ------------------------
VOCAB = 8
PROMPT = [1, 3, 5, 7, 4, 3, 5]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    target = make_tiny_model(tmp_path_factory.mktemp("t8"), "llama", seed=11, vocab_size=VOCAB)
    draft = make_tiny_model(tmp_path_factory.mktemp("d8"), "llama", seed=12, vocab_size=VOCAB)
    return str(target), str(draft)


def _exact_marginals(target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t2) and P(t3) of sampled continuations of PROMPT (temperature 1), from the target's
    own next-token distributions: one batched forward over every (t1, t2)."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    ids = torch.tensor([PROMPT + [a, b] for a, b in pairs])
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits.float(), dim=-1)
    p1 = probs[0, len(PROMPT) - 1]  # [V]
    p2 = torch.zeros(VOCAB, VOCAB)  # p2[a] = P(t2 | t1 = a)
    p3 = torch.zeros(VOCAB, VOCAB, VOCAB)  # p3[a, b] = P(t3 | t1 = a, t2 = b)
    for row, (a, b) in enumerate(pairs):
        p2[a] = probs[row, len(PROMPT)]
        p3[a, b] = probs[row, len(PROMPT) + 1]
    marginal2 = p1 @ p2
    marginal3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    return marginal2, marginal3


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_outputs_keep_the_target_distribution(
    tiny_pair: tuple[str, str], method: str
) -> None:
    target, draft = tiny_pair
    kw = {"draft_model": draft} if method == "draft" else {"prompt_lookup_min": 1}
    options = RunnerOptions(block_size=4, num_blocks=4096, num_threads=2, speculative=method, **kw)  # type: ignore[arg-type]
    runner = ModelRunner(target, options)
    engine = LocalEngine(
        runner,
        PolicyConfig(max_num_seqs=256, max_num_batched_tokens=4096, num_speculative_tokens=3),
        overlap=False,
    )
    n = 3000
    ids = [
        engine.add(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True))[
            0
        ]
        for s in range(n)
    ]
    out = engine.run()
    policy = engine.policy
    rate = policy.num_accepted_tokens / policy.num_draft_tokens
    assert 0.05 < rate < 0.8, rate  # the drafter is often wrong, and sometimes right
    marginal2, marginal3 = _exact_marginals(target)
    for position, probs in ((1, marginal2), (2, marginal3)):
        counts = torch.bincount(torch.tensor([out[r][position] for r in ids]), minlength=VOCAB)
        stat, df = chi_square(counts, probs)
        assert stat < CHI2_999[df], (method, position, stat, counts, probs * n)


# --- served: every process, the real messages ---------------------------------------------------
def test_served_with_ngram_speculation_matches_plain_serving(server) -> None:  # type: ignore[no-untyped-def]
    """The shared plain server and a speculating one give the same greedy text; the
    speculating one reports its drafts in /metrics."""
    import httpx

    from tests.server import running_server

    body = {"prompt": TEXTS[0], "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    want = httpx.post(
        server.url + "/v1/completions", timeout=120, json={**body, "model": server.model}
    ).json()
    # a stop string inside the plain output: several tokens arrive per step with drafts,
    # and the text must still end where plain decoding's does
    stop = want["choices"][0]["text"].split()[4]
    want_stop = httpx.post(
        server.url + "/v1/completions",
        timeout=120,
        json={**body, "model": server.model, "stop": [stop]},
    ).json()
    with running_server("--speculative", "ngram", "--num-speculative-tokens", "4") as spec:
        got = httpx.post(
            spec.url + "/v1/completions", timeout=120, json={**body, "model": spec.model}
        ).json()
        got_stop = httpx.post(
            spec.url + "/v1/completions",
            timeout=120,
            json={**body, "model": spec.model, "stop": [stop]},
        ).json()
        streamed = []
        with httpx.stream(
            "POST",
            spec.url + "/v1/completions",
            timeout=120,
            json={**body, "model": spec.model, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    streamed += [c["text"] for c in chunk["choices"]]
        # the gateway refreshes the scheduler's figures every second
        values = wait_until(
            lambda: _spec_metrics(spec.url), 60, "speculative figures in /metrics", 0.2
        )
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got_stop["choices"][0] == want_stop["choices"][0], (stop, got_stop, want_stop)
    assert got_stop["choices"][0]["finish_reason"] == "stop"
    assert "".join(streamed) == want["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == 32
    assert values["shuttle:spec_decode_num_draft_tokens_total"] > 0, values
    assert values["shuttle:spec_decode_num_accepted_tokens_total"] > 0, values
    assert 0 < values["shuttle:spec_decode_acceptance_rate"] <= 1, values


def _spec_metrics(url: str) -> dict[str, float]:
    """The shuttle:spec_decode* figures of /metrics, once any draft token is counted."""
    import httpx

    metrics = httpx.get(url + "/metrics", timeout=30).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("shuttle:spec_decode")
    }
    return values if values.get("shuttle:spec_decode_num_draft_tokens_total") else {}


def test_a_truncated_model_drafts_for_its_full_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """prepare_truncated_model keeps the first layers, the embeddings, the head and the
    tokenizer files; the result loads as a draft model, and greedy outputs are unchanged."""
    import json

    from common.prepare_model import prepare_truncated_model

    full = make_tiny_model(tmp_path / "full", "llama", num_layers=3, seed=5)
    cut = prepare_truncated_model(1, source=full)
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == 1
    assert (cut / "tokenizer.json").is_file() == (full / "tokenizer.json").is_file()
    assert prepare_truncated_model(1, source=full) == cut  # made once
    outputs = []
    for kw in ({}, {"speculative": "draft", "draft_model": str(cut)}):
        options = RunnerOptions(block_size=4, num_blocks=256, num_threads=2, **kw)
        runner = ModelRunner(str(full), options)
        engine = LocalEngine(runner, PolicyConfig(num_speculative_tokens=3), overlap=False)
        rid = engine.add(
            PROMPT * 3, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )[0]
        outputs.append(engine.run()[rid])
        if kw:
            assert engine.policy.num_draft_tokens > 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative", "draft"], "--draft-model must be set"),
        (["--draft-model", "/no/such/folder"], "no config.json there"),
        (["--model", "synthetic", "--speculative", "ngram"], "needs a real model"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "in [1, 16]"),
        (["--speculative", "eagle"], "'', ngram or draft"),
    ],
)
def test_bad_speculative_flags_are_refused_at_start(flags: list[str], message: str) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr[-500:]
