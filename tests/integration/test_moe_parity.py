"""Greedy parity of the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared
expert, Mixtral, OLMoE) with transformers on tiny random models built from their configs:
each prompt alone, all in one batch, chunked prefill mixed with decodes, preemption
(tests/integration/test_model_parity.py's MiniScheduler), and through the real scheduler
with prefix hits, n > 1 and a small KV pool (tests/engine.py). Then int8 experts
(`--quantization int8`): the same tokens alone and in any batch. And the refusals: a
model_type not served, LoRA on a MoE model."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from common.lora_config import LoraConfig
from common.messages import SamplingParams
from gpu_worker.cpu.linear import load as linear_kernel
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.moe_methods.cpu_float import CpuFloatMoEMethod
from gpu_worker.layers.moe_methods.int8 import Int8MoEMethod
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.integration.test_model_parity import (
    GREEDY,
    MiniScheduler,
    hf_references,
    run_greedy,
)
from tests.tiny_models import VOCAB_SIZE
from tests.tiny_moe_models import MOE_ARCHS, make_tiny_moe_model

torch.set_num_threads(2)

NUM_NEW = 12
PROMPT_LENS = (1, 3, 16, 17, 40, 70)


@functools.lru_cache(maxsize=8)
def _model(root: str, arch: str) -> Path:
    return make_tiny_moe_model(Path(root) / arch, arch)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = make_tiny_moe_model(tmp_path_factory.mktemp(request.param), request.param)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return path, prompts, hf_references(path, prompts, NUM_NEW)


def _experts(runner: ModelRunner) -> list[FusedMoE]:
    return [m for m in runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("kernels", ["cpu-kernels", "torch-only"])
def test_moe_parity(moe, kernels: str) -> None:
    path, prompts, expected = moe
    options = RunnerOptions(block_size=4, num_blocks=512, cpu_kernels=kernels == "cpu-kernels")
    runner = ModelRunner(str(path), options)
    experts = _experts(runner)
    assert experts
    c_path = kernels == "cpu-kernels" and linear_kernel() is not None
    assert all(isinstance(e.method, CpuFloatMoEMethod) == c_path for e in experts)
    # the one-call step carries the sparse layers beside the C kernels
    assert (runner.model.model.one_call_step is not None) == c_path
    assert run_greedy(runner, prompts, NUM_NEW, together=False) == expected
    assert run_greedy(runner, prompts, NUM_NEW) == expected
    results = []
    execute = runner.execute
    runner.execute = lambda plan: results.append(execute(plan)) or results[-1]  # type: ignore[method-assign]
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=7) == expected
    # each step's (token, expert) pairs ride on its result: top-k per token per sparse layer
    top_k = experts[0].routing.top_k
    steps = [r for r in results if r.expert_tokens]
    assert steps and all(sum(r.expert_tokens) % top_k == 0 for r in steps)
    assert sum(sum(r.expert_tokens) for r in steps) > 0
    assert all(sum(e.tokens_per_expert) == 0 for e in experts)  # taken by each step


def test_moe_preempted_request_recomputes_the_same_tokens(moe) -> None:
    path, prompts, expected = moe
    runner = ModelRunner(str(path), RunnerOptions(block_size=4, num_blocks=512))
    sched = MiniScheduler(runner, token_budget=20)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, GREEDY, NUM_NEW)
    for step in range(10):
        sched.step()
        if step in (3, 9):
            victim = max(sched.reqs, key=lambda r: sched.reqs[r].num_computed)
            sched.preempt(victim)
    done = sched.run()
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected


def test_moe_engine_prefix_hits_n_and_preemption(moe) -> None:
    """The real scheduler: a shared prefix (hits on the second pass), n = 2, and a pool
    small enough to preempt; every sequence's tokens are transformers'."""
    path, prompts, expected = moe
    shared = prompts[-1][:32]
    with_prefix = [shared + p for p in prompts[:3]]
    want = hf_references(path, with_prefix, NUM_NEW)
    runner = ModelRunner(str(path), RunnerOptions(block_size=8, num_blocks=256, num_threads=2))
    sp = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=48))
    for _ in range(2):  # the second pass hits the cached prompts
        ids = [engine.add(p, sp) for p in with_prefix]
        out = engine.run()
        assert [out[s[0]] for s in ids] == want
    assert engine.policy.blocks.num_cached_hits > 0
    n2 = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, n=2)
    ids = [engine.add(p, n2) for p in prompts[:3]]
    out = engine.run()
    assert [[out[s] for s in seqs] for seqs in ids] == [[e, e] for e in expected[:3]]
    small = LocalEngine(
        runner,
        PolicyConfig(max_num_batched_tokens=48, watermark=0.0),
        num_blocks=14,
        prefix_caching=False,
    )
    ids = [small.add(p, sp) for p in prompts]
    out = small.run()
    assert [out[s[0]] for s in ids] == expected
    assert small.policy.num_preemptions > 0


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_int8_experts_give_a_token_the_same_tokens_alone_and_in_any_batch(
    arch: str, tmp_path_factory
) -> None:
    """--quantization int8 quantizes every expert (Mixtral's w1/w2/w3 too) and the shared
    expert; a token's logits are then the same bits alone, batched and chunked."""
    path = _model(str(tmp_path_factory.getbasetemp()), arch)
    options = RunnerOptions(block_size=4, num_blocks=512, quantization="int8")
    runner = ModelRunner(str(path), options)
    assert all(isinstance(e.method, Int8MoEMethod) for e in _experts(runner))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    alone = run_greedy(runner, prompts, NUM_NEW, together=False)
    assert run_greedy(runner, prompts, NUM_NEW) == alone
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=5) == alone
    # int8 rounding keeps most of the float model's greedy tokens
    float_tokens = hf_references(path, prompts, NUM_NEW)
    same = sum(
        a == b for x, y in zip(alone, float_tokens, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert same >= 0.6 * NUM_NEW * len(prompts)


def test_an_unserved_model_type_is_refused_naming_it_and_the_served_ones(
    tmp_path_factory,
) -> None:
    path = _model(str(tmp_path_factory.getbasetemp()), "olmoe")
    other = tmp_path_factory.mktemp("deepseek")
    config = json.loads((path / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, model_type="deepseek_v3")))
    for f in path.glob("*.safetensors"):
        (other / f.name).symlink_to(f)
    with pytest.raises(ValueError, match="'deepseek_v3'.*qwen3_moe.*mixtral.*olmoe"):
        ModelRunner(str(other), RunnerOptions(num_blocks=16))


def test_lora_on_a_moe_model_is_refused_by_name(tmp_path_factory) -> None:
    path = _model(str(tmp_path_factory.getbasetemp()), "mixtral")
    options = RunnerOptions(num_blocks=16, lora=LoraConfig(enable_lora=True))
    with pytest.raises(ValueError, match="--enable-lora.*mixtral"):
        ModelRunner(str(path), options)


def test_an_int8_compressed_tensors_moe_folder_serves_its_int8_experts(tmp_path_factory) -> None:
    """tools/export_int8's W8A8 checkpoint of a MoE (every expert's projections int8 with
    per-row scales, routers float) loads into int8 experts, with the same tokens alone and
    batched as --quantization int8 gives the float folder (the same quantization)."""
    from tools.export_int8 import export_int8

    path = _model(str(tmp_path_factory.getbasetemp()), "qwen2_moe")
    exported = export_int8(path, tmp_path_factory.mktemp("int8") / "qwen2_moe", smoothquant=0)
    runner = ModelRunner(str(exported), RunnerOptions(block_size=4, num_blocks=512))
    assert all(isinstance(e.method, Int8MoEMethod) for e in _experts(runner))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    alone = run_greedy(runner, prompts, NUM_NEW, together=False)
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=5) == alone
    at_load = ModelRunner(
        str(path), RunnerOptions(block_size=4, num_blocks=512, quantization="int8")
    )
    assert run_greedy(at_load, prompts, NUM_NEW, together=False) == alone
