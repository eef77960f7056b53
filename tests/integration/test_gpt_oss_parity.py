"""Greedy parity of gpt-oss with transformers on a tiny random model built from gpt-oss-20b's
config (tests/tiny_moe_models.py: q/k/v/o biases, a sink logit per head, layers alternating a
16-position window and full attention, YaRN rope, top-4 of 8 experts with the router bias and
the clamped SwiGLU): each prompt alone, all in one batch, chunked prefill beside decodes and
preemption (MiniScheduler), then through the real scheduler with prefix hits, n = 2 and a KV
pool small enough to preempt. Prompts cross the window several times. Then the shipped
layout: MXFP4 experts (written here from random nibbles and exponents) served packed, against
transformers on the same folder (which dequantizes it). And the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.messages import SamplingParams
from gpu_worker.cpu.linear import load as linear_kernel
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.moe_methods.cpu_float import CpuFloatMoEMethod
from gpu_worker.layers.moe_methods.mxfp4 import MXFP4MoEMethod
from gpu_worker.model_loader.loader import check_tensor_parallel
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.policy import PolicyConfig
from tests.engine import LocalEngine
from tests.integration.test_model_parity import GREEDY, MiniScheduler, hf_references, run_greedy
from tests.tiny_models import VOCAB_SIZE
from tests.tiny_moe_models import make_tiny_moe_model, make_tiny_mxfp4_gpt_oss, moe_config

torch.set_num_threads(2)

NUM_NEW = 12
PROMPT_LENS = (1, 3, 17, 40, 70)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = make_tiny_moe_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return path, prompts, hf_references(path, prompts, NUM_NEW)


def test_config_reads_gpt_oss_fields() -> None:
    cfg = LlamaConfig.from_hf(moe_config("gpt_oss").to_dict())
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias
    assert cfg.sliding_windows == (16, 0, 16, 0)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.moe is not None and cfg.moe.routing.scoring == "topk_softmax"
    assert cfg.moe.router_bias and cfg.moe.expert_bias and cfg.moe.activation == "swiglu_clamp"
    assert cfg.is_llama_layout  # the one-call step carries sinks and windows
    default = moe_config("gpt_oss").to_dict()
    default.pop("layer_types")  # transformers' default: even layers slide
    assert LlamaConfig.from_hf(default).sliding_windows == (16, 0, 16, 0)


@pytest.mark.parametrize("kernels", ["cpu-kernels", "torch-only"])
def test_gpt_oss_parity(gpt_oss, kernels: str) -> None:
    path, prompts, expected = gpt_oss
    options = RunnerOptions(block_size=4, num_blocks=512, cpu_kernels=kernels == "cpu-kernels")
    runner = ModelRunner(str(path), options)
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 4
    c_path = kernels == "cpu-kernels" and linear_kernel() is not None
    assert all(isinstance(e.method, CpuFloatMoEMethod) == c_path for e in experts)
    # the one-call step carries gpt-oss's sinks, windows and experts beside the C kernels
    assert (runner.model.model.one_call_step is not None) == c_path
    assert run_greedy(runner, prompts, NUM_NEW, together=False) == expected
    assert run_greedy(runner, prompts, NUM_NEW) == expected
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=7) == expected


def test_gpt_oss_preempted_request_recomputes_the_same_tokens(gpt_oss) -> None:
    path, prompts, expected = gpt_oss
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


def test_gpt_oss_engine_prefix_hits_n_and_preemption(gpt_oss) -> None:
    """The real scheduler: a shared prefix of 32 (two windows: hits on the second pass),
    n = 2, and a pool small enough to preempt; every sequence's tokens are transformers'."""
    path, prompts, expected = gpt_oss
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
    # blocks of one layer group's layers (windows 0 and 16): 22 hold the longest sequence
    # (20) but not all, and a running one is preempted (found by driving the policy alone)
    assert runner.kv_groups is not None and runner.kv_groups.windows == (0, 16)
    small = LocalEngine(
        runner,
        PolicyConfig(max_num_batched_tokens=48, watermark=0.0),
        num_blocks=22,
        prefix_caching=False,
    )
    ids = [small.add(p, sp) for p in prompts]
    out = small.run()
    assert [out[s[0]] for s in ids] == expected
    assert small.policy.num_preemptions > 0


def test_gpt_oss_refusals() -> None:
    # served under tensor parallelism where its heads and widths split (2 KV heads), not
    # where they do not (the tiny config's one KV head)
    cfg = LlamaConfig.from_hf(moe_config("gpt_oss", num_key_value_heads=2).to_dict())
    check_tensor_parallel(cfg, 2)
    one_kv_head = LlamaConfig.from_hf(moe_config("gpt_oss").to_dict())
    with pytest.raises(ValueError, match="--tensor-parallel-size 2.*KV heads"):
        check_tensor_parallel(one_kv_head, 2)
    bad = moe_config("gpt_oss").to_dict()
    bad["layer_types"] = ["chunked_attention"] * 4
    with pytest.raises(ValueError, match="layer_types"):
        LlamaConfig.from_hf(bad)


@pytest.mark.parametrize("kernels", ["cpu-kernels", "torch-only"])
def test_mxfp4_gpt_oss_serves_packed_with_transformers_tokens(kernels: str, tmp_path) -> None:
    """The MXFP4 folder loads into packed experts (uint8 blocks and exponents resident) and
    gives transformers' greedy tokens on it (transformers dequantizes MXFP4 on the CPU; the
    dequantized float folder gives the same), alone, batched and in chunks."""
    packed, dense = make_tiny_mxfp4_gpt_oss(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = hf_references(packed, prompts, NUM_NEW)
    assert hf_references(dense, prompts, NUM_NEW) == expected
    options = RunnerOptions(block_size=4, num_blocks=512, cpu_kernels=kernels == "cpu-kernels")
    runner = ModelRunner(str(packed), options)
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 4
    for e in experts:
        assert isinstance(e.method, MXFP4MoEMethod)
        assert e.method.kernel == (
            "cpu" if kernels == "cpu-kernels" and linear_kernel() else "torch"
        )
        assert e.w13_weight.dtype == torch.uint8 and e.w2_weight.dtype == torch.uint8
    assert run_greedy(runner, prompts, NUM_NEW, together=False) == expected
    assert run_greedy(runner, prompts, NUM_NEW) == expected
    assert run_greedy(runner, prompts, NUM_NEW, token_budget=7) == expected


def test_mxfp4_refusals(tmp_path) -> None:
    packed, _ = make_tiny_mxfp4_gpt_oss(tmp_path)
    with pytest.raises(ValueError, match="--quantization int8.*mxfp4"):
        ModelRunner(str(packed), RunnerOptions(num_blocks=16, quantization="int8"))
