"""Greedy parity with transformers + peft for LoRA adapters: one batch mixing several random
adapters (different ranks, targets, alpha, rsLoRA, rank/alpha patterns) with the base model,
through chunked prefill, prefix hits, preemption (recompute and swap) and n > 1. In-process:
the real scheduler (EngineCore) drives the real ModelRunner; the adapters are built here with
peft (`init_lora_weights=False`, so each one changes the output)."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

from common.messages import SamplingParams
from common.prepare_model import prepare_default_model
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.lora_adapters import lora_config, make_adapter, peft_model
from tests.reference import greedy, hf_greedy
from tests.tiny_models import make_tiny_model

NUM_NEW = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> make_adapter's settings
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"o_proj": 2}, seed=1),
    "qv-rs": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True, seed=2),
    "mlp-r16": dict(
        r=16,
        lora_alpha=8,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        alpha_pattern={"down_proj": 32},
        seed=3,
    ),
}
LORAS = ["all-r8", "qv-rs", "mlp-r16", ""] * 2  # request i's adapter ("": the base model)
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_adapter(tiny_dir, root / name, **kw))  # type: ignore[arg-type]
        for name, kw in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Distinct prompts of 9..40 tokens (no two share a first block: the adapter's identity
    in the prefix cache's root is the scheduler's part, tested there)."""
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(9, 41))] for _ in LORAS]


@functools.lru_cache(maxsize=64)
def _reference(model_dir: str, adapter_dir: str, prompt: tuple[int, ...]) -> list[int]:
    if not adapter_dir:
        return hf_greedy(model_dir, list(prompt), NUM_NEW)
    return greedy(peft_model(model_dir, adapter_dir), list(prompt), NUM_NEW)


@pytest.fixture(scope="module")
def expected(tiny_dir: str, adapters: dict[str, str], prompts: list[list[int]]) -> list[list[int]]:
    out = [
        _reference(tiny_dir, adapters.get(lora, ""), tuple(p))
        for lora, p in zip(LORAS, prompts, strict=True)
    ]
    for lora, p, tokens in zip(LORAS, prompts, out, strict=True):  # each adapter matters
        if lora:
            assert tokens != _reference(tiny_dir, "", tuple(p)), lora
    return out


@pytest.fixture(scope="module")
def runner(tiny_dir: str, adapters: dict[str, str]) -> ModelRunner:
    options = lora_config(adapters.items(), max_loras=3, max_lora_rank=16)
    return ModelRunner(
        tiny_dir,
        RunnerOptions(
            block_size=4, num_blocks=512, swap_space_gib=0.01, num_threads=1, lora=options
        ),
    )


def _engine(runner: ModelRunner, **kw) -> LocalEngine:  # type: ignore[no-untyped-def]
    policy = {k: kw.pop(k) for k in list(kw) if k in PolicyConfig.__dataclass_fields__}
    return LocalEngine(runner, PolicyConfig(**{"max_num_batched_tokens": 16, **policy}), **kw)


def _serve(
    engine: LocalEngine, prompts: list[list[int]], sp: SamplingParams = GREEDY
) -> list[list[list[int]]]:
    ids = [engine.add(p, sp, lora_name=lora) for p, lora in zip(prompts, LORAS, strict=True)]
    out = engine.run()
    return [[out[s] for s in seqs] for seqs in ids]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_mixed_batch_in_chunks_then_from_the_prefix_cache(
    runner: ModelRunner, prompts: list[list[int]], expected: list[list[int]], overlap: bool
) -> None:
    engine = _engine(runner, overlap=overlap)
    assert [o[0] for o in _serve(engine, prompts)] == expected
    mixed = [r for r in engine.results if len(r.req_ids) > 1]
    assert mixed, "the requests never shared a step"
    hits = engine.policy.blocks.num_cached_hits
    assert [o[0] for o in _serve(engine, prompts)] == expected  # the same prompts again
    assert engine.policy.blocks.num_cached_hits - hits >= sum(len(p) // 4 for p in prompts) // 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_adapters_outputs(
    runner: ModelRunner, prompts: list[list[int]], expected: list[list[int]], mode: str
) -> None:
    engine = _engine(
        runner,
        num_blocks=24,
        num_host_blocks=64,
        preemption_mode=mode,
        watermark=0.0,
        prefix_caching=False,
    )
    assert [o[0] for o in _serve(engine, prompts)] == expected
    assert engine.policy.num_preemptions > 0


def test_n_sequences_of_an_adapter_request_each_equal_the_reference(
    runner: ModelRunner, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    engine = _engine(runner, prefix_caching=False)
    sp = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, n=2)
    for seqs, exp in zip(_serve(engine, prompts, sp), expected, strict=True):
        assert seqs == [exp, exp]


def test_long_prompts_take_the_gemm_path_and_equal_the_reference(
    runner: ModelRunner, adapters: dict[str, str], tiny_dir: str
) -> None:
    """Prompts of 70..150 tokens in chunks of 160: runs of >= LONG_RUN tokens of one adapter
    (gpu_worker/lora/layer.py's GEMM path) beside decodes and short runs (the C kernel)."""
    rng = random.Random(1)
    long = [[rng.randrange(100, 40000) for _ in range(rng.randrange(70, 151))] for _ in LORAS]
    engine = _engine(runner, max_num_batched_tokens=160, prefix_caching=False)
    want = [
        _reference(tiny_dir, adapters.get(lora, ""), tuple(p))
        for lora, p in zip(LORAS, long, strict=True)
    ]
    assert [o[0] for o in _serve(engine, long)] == want


def test_smollm2_with_two_adapters_and_the_base_model(tmp_path: Path) -> None:
    model_dir = str(prepare_default_model())
    a = str(make_adapter(model_dir, tmp_path / "a", r=8, target_modules=["q_proj", "v_proj"]))
    b = str(
        make_adapter(
            model_dir,
            tmp_path / "b",
            r=16,
            lora_alpha=16,
            target_modules=["o_proj", "up_proj", "down_proj"],
            use_rslora=True,
            seed=1,
            scale=0.2,
        )
    )
    options = lora_config((("a", a), ("b", b)), max_loras=2, max_lora_rank=16)
    runner = ModelRunner(
        model_dir,
        RunnerOptions(block_size=16, kv_cache_memory_gib=0.1, num_threads=2, lora=options),
    )
    texts = [[1, 504, 3575, 282, 4649, 314], [1, 1348, 5125, 429], [1, 23, 3227, 28, 216]]
    loras = [("a", a), ("b", b), ("", "")]
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=64))
    ids = [engine.add(t, GREEDY, lora_name=name) for t, (name, _) in zip(texts, loras, strict=True)]
    out = engine.run()
    for t, (name, folder), seqs in zip(texts, loras, ids, strict=True):
        want = _reference(model_dir, folder, tuple(t))
        assert out[seqs[0]] == want, name
        if name:
            assert want != _reference(model_dir, "", tuple(t)), name


def test_a_hot_swapped_version_has_slots_of_its_own(
    tmp_path: Path, adapters: dict[str, str], prompts: list[list[int]]
) -> None:
    """overlap swap: the new weights get their own LoRA layers; the old version's request
    and the new one's run with the adapter in the same steps."""
    first = str(make_tiny_model(tmp_path / "v1", "llama", seed=3))
    second = str(make_tiny_model(tmp_path / "v2", "llama", seed=4))
    folder = adapters["all-r8"]
    options = lora_config((("x", folder),), max_loras=2, max_lora_rank=16)
    runner = ModelRunner(
        first, RunnerOptions(block_size=4, num_blocks=256, num_threads=1, lora=options)
    )
    engine = _engine(runner)
    old = [engine.add(p, GREEDY, lora_name="x") for p in prompts[:1]]
    engine.core.step()  # the old request starts on the first version (its first chunk)
    runner.set_default_version(runner.load_version(second))
    engine.core.adopt(runner.model_info())
    new = [engine.add(p, GREEDY, lora_name="x") for p in prompts[1:3]]
    out = engine.run()
    for seqs, p in zip(old, prompts[:1], strict=True):
        assert out[seqs[0]] == _reference(first, folder, tuple(p))
    for seqs, p in zip(new, prompts[1:3], strict=True):
        assert out[seqs[0]] == _reference(second, folder, tuple(p))


def test_logprobs_of_adapter_rows_are_peft_s(
    tiny_dir: str, adapters: dict[str, str], runner: ModelRunner, prompts: list[list[int]]
) -> None:
    """Prompt logprobs (every prompt position, across prefill chunks) and sampled tokens'
    logprobs of adapter requests, batched with a base one, equal peft's log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    engine = _engine(runner, prefix_caching=False)
    sp = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    loras = ["all-r8", "", "mlp-r16"]
    ids = [engine.add(p, sp, lora_name=n)[0][0] for p, n in zip(prompts, loras, strict=False)]
    engine.run()
    prompt_lp: dict[str, list[float]] = {}
    output_lp: dict[str, list[float]] = {rid: [] for rid in ids}
    for batch in engine.batches:
        for j, rid in enumerate(batch.request_ids):
            if batch.prompt_logprob_values and batch.prompt_logprob_values[j]:
                prompt_lp[rid] = [v[0] for v in batch.prompt_logprob_values[j][1:]]
            if batch.logprob_values and batch.logprob_values[j]:
                output_lp[rid] += [v[0] for v in batch.logprob_values[j]]
    for rid, prompt, lora in zip(ids, prompts, loras, strict=False):
        tokens = prompt + engine.outputs[(rid, 0)]
        model = peft_model(tiny_dir, adapters[lora]) if lora else base
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
        want = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
        got = prompt_lp[rid] + output_lp[rid]
        torch.testing.assert_close(torch.tensor(got), want[: len(got)], atol=2e-4, rtol=1e-4)
        assert len(got) == len(tokens) - 1


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures(tmp_path: Path, arch: str, prompts: list[list[int]]) -> None:
    """q/k/v biases (qwen2), head_dim != hidden / heads and q/k norms (qwen3), no GQA
    (mistral): an all-target adapter beside a base request."""
    model = str(make_tiny_model(tmp_path / arch, arch))
    folder = str(make_adapter(model, tmp_path / "a", r=8, target_modules=ALL, seed=7))
    options = lora_config((("a", folder),), max_lora_rank=8)
    runner = ModelRunner(
        model, RunnerOptions(block_size=4, num_blocks=256, num_threads=1, lora=options)
    )
    engine = _engine(runner, max_num_batched_tokens=8)
    ids = [engine.add(prompts[0], GREEDY, lora_name="a"), engine.add(prompts[1], GREEDY)]
    out = engine.run()
    assert out[ids[0][0]] == _reference(model, folder, tuple(prompts[0]))
    assert out[ids[1][0]] == _reference(model, "", tuple(prompts[1]))
    assert _reference(model, folder, tuple(prompts[0])) != _reference(model, "", tuple(prompts[0]))


def test_ngram_drafts_are_verified_with_the_adapter(
    tiny_dir: str, adapters: dict[str, str]
) -> None:
    """Draft slots count as tokens of their request in the mapping: the adapter's greedy
    tokens come out through speculation (the scheduler may refuse adapters with it; the
    worker does not need to)."""
    folder = adapters["all-r8"]
    options = lora_config((("a", folder),), max_lora_rank=16)
    runner = ModelRunner(
        tiny_dir,
        RunnerOptions(
            speculative="ngram", block_size=4, num_blocks=256, num_threads=1, lora=options
        ),
    )
    engine = _engine(runner, max_num_batched_tokens=32, num_speculative_tokens=3)
    prompt = [5, 17, 300, 2000] * 3
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = [engine.add(prompt, sp, lora_name="a"), engine.add(prompt[1:], sp)]
    out = engine.run()
    assert sum(n for r in engine.results for n in r.num_proposed) > 0
    assert out[ids[0][0]] == greedy(peft_model(tiny_dir, folder), prompt, 24)
    assert out[ids[1][0]] == hf_greedy(tiny_dir, prompt[1:], 24)
