"""Greedy parity of ModelRunner with transformers, driven by StepPlans like the scheduler's.

The reference is a transformers model loaded from the same folder, decoding greedily with
its own KV cache. Our runner is driven by `MiniScheduler`, a few lines imitating the real
scheduler: FCFS, a token budget per step, blocks from a shuffled free list, diffs only.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from common.kv_groups import PLACEHOLDER
from common.messages.scheduler_worker import StepPlan
from common.messages.types import SamplingParams
from common.prepare_model import default_model_dir
from gpu_worker.cpu.linear import load as linear_kernel
from gpu_worker.layers.linear_methods.cpu_float import CpuFloatLinearMethod
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from tests.tiny_models import LONGROPE_ARCHS, TINY_ARCHS, VOCAB_SIZE, make_tiny_model

torch.set_num_threads(2)

GREEDY = SamplingParams(temperature=0.0)
SMOL_NEW_TOKENS = 32
TINY_NEW_TOKENS = 16
TINY_PROMPT_LENS = (1, 2, 15, 16, 17, 33, 64, 100)


@dataclasses.dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    # KV layer groups (a windowed model): each group's table (none released here)
    group_blocks: list[list[int]] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class MiniScheduler:
    """Just enough of a scheduler to drive the runner: budget, blocks, diffs."""

    def __init__(self, runner: ModelRunner, *, token_budget: int = 1 << 30, seed: int = 0):
        self.runner = runner
        self.token_budget = token_budget
        self.rng = random.Random(seed)
        self.free = list(range(runner.num_blocks))
        self.rng.shuffle(self.free)  # block tables are scattered, never contiguous
        self.reqs: dict[str, _Req] = {}
        self.done: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.step_id = 0

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, max_tokens: int) -> None:
        self.reqs[req_id] = _Req(list(prompt), params, max_tokens)

    def preempt(self, req_id: str) -> None:
        req = self.reqs[req_id]
        self.free.extend(req.blocks)
        for table in req.group_blocks:
            self.free.extend(b for b in table if b != PLACEHOLDER)
        req.blocks, req.group_blocks, req.num_computed = [], [], 0
        self.preempted.append(req_id)

    def run(self) -> dict[str, list[int]]:
        while self.reqs:
            self.step()
        return self.done

    def step(self) -> None:
        budget, batch = self.token_budget, []
        for req_id, req in self.reqs.items():
            num_new = min(req.num_tokens - req.num_computed, budget)
            if num_new > 0:
                batch.append((req_id, num_new, self._allocate(req, num_new)))
                budget -= num_new
        self.rng.shuffle(batch)  # the runner must not care about batch order
        plan = self._plan(batch)
        result = self.runner.execute(plan)
        self.step_id += 1
        for req_id, num_new, _ in batch:
            self.reqs[req_id].num_computed += num_new
        sampled = [r for r, _, _ in batch if self._samples(self.reqs[r])]
        assert result.req_ids == [r for r in plan.req_ids if r in sampled]
        for req_id, token_id in zip(result.req_ids, result.token_ids, strict=True):
            self._append(req_id, token_id)

    def _samples(self, req: _Req) -> bool:
        return req.num_computed == req.num_tokens

    def _allocate(self, req: _Req, num_new: int) -> list[list[int]]:
        """Each layer group's new blocks (one group for a model without windows)."""
        block_size, groups = self.runner.block_size, self.runner.kv_groups
        want = -(-(req.num_computed + num_new) // block_size)
        if groups is None:
            new_blocks = [self.free.pop() for _ in range(max(0, want - len(req.blocks)))]
            req.blocks.extend(new_blocks)
            return [new_blocks]
        if not req.group_blocks:
            req.group_blocks = [[] for _ in groups.windows]
        added = []
        for window, table in zip(groups.windows, req.group_blocks, strict=True):
            # a sliding group lets go of the blocks before the window of the step's first
            # token (the worker keeps their ids in its table: it never reads them)
            first = max(0, req.num_computed - window + 1) // block_size if window else 0
            for i in range(first):
                if table[i] != PLACEHOLDER:
                    self.free.append(table[i])
                    table[i] = PLACEHOLDER
            added.append([self.free.pop() for _ in range(max(0, want - len(table)))])
            table.extend(added[-1])
        return added

    def _plan(self, batch: list[tuple[str, int, list[list[int]]]]) -> StepPlan:
        groups = self.runner.kv_groups
        ref = groups.ref_group if groups else 0
        new_ids = [r for r, _, _ in batch if not self.reqs[r].sent]
        for req_id in new_ids:
            self.reqs[req_id].sent = True
        plan = StepPlan(
            step_id=self.step_id,
            new_req_ids=new_ids,
            new_prompt_token_ids=[self.reqs[r].prompt for r in new_ids],
            new_sampling=[self.reqs[r].params for r in new_ids],
            finished_req_ids=self.finished,
            preempted_req_ids=self.preempted,
            req_ids=[r for r, _, _ in batch],
            num_computed_tokens=[self.reqs[r].num_computed for r, _, _ in batch],
            num_new_tokens=[n for _, n, _ in batch],
            new_block_ids=[blocks[ref] for _, _, blocks in batch],
            new_group_block_ids=[blocks for _, _, blocks in batch] if groups else [],
        )
        self.finished, self.preempted = [], []
        return plan

    def _append(self, req_id: str, token_id: int) -> None:
        req = self.reqs[req_id]
        req.output.append(token_id)
        if len(req.output) == req.max_tokens:
            self.done[req_id] = req.output
            self.free.extend(req.blocks)
            for table in req.group_blocks:
                self.free.extend(b for b in table if b != PLACEHOLDER)
            del self.reqs[req_id]
            self.finished.append(req_id)


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    """transformers' own KV cache, argmax, no EOS stop."""
    out_ids: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(num_new):
            token = out.logits[0, -1].argmax()
            out_ids.append(int(token))
            out = model(input_ids=token.view(1, 1), cache=out.cache, use_cache=True)
    return out_ids


def hf_references(path: Path, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(model, p, num_new) for p in prompts]


def run_greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    num_new: int,
    *,
    token_budget: int = 1 << 30,
    together: bool = True,
) -> list[list[int]]:
    """Every prompt through a MiniScheduler, all at once or one after another."""
    if not together:
        return [run_greedy(runner, [p], num_new, token_budget=token_budget)[0] for p in prompts]
    sched = MiniScheduler(runner, token_budget=token_budget)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, GREEDY, num_new)
    done = sched.run()
    assert runner.num_requests() == len(sched.finished)  # they reach it with the next plan
    runner.execute(sched._plan([]))
    assert runner.num_requests() == 0
    return [done[f"r{i}"] for i in range(len(prompts))]


# --- SmolLM2, the default model -------------------------------------------------------------

SMOL_TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Germany and France experimented with two-wheeled machines pushed along by the rider's "
    "feet. Pedals arrived decades later, attached directly to the front wheel, which grew "
    "enormous to make each turn carry the rider farther. These high-wheelers were fast but "
    "dangerous, and the safety bicycle, with two wheels of equal size and a chain driving the "
    "rear wheel, replaced them by the 1890s. Pneumatic tyres made the ride smooth, and within "
    "a few years cycling clubs, road maps and repair shops had spread across Europe and North "
    "America. Women in particular found new independence on the bicycle, and reformers argued "
    "about the clothing it required. In the twentieth century the car pushed bicycles to the "
    "edge of the road in many countries, but cities such as Amsterdam and Copenhagen built "
    "networks of separate lanes, and today bicycles are again a common sight in traffic. "
    "Question: why did the safety bicycle replace the high-wheeler? Answer:"
)
SMOL_PROMPT_LENS = (1, 5, 16, 17, 31, 64, 120, 200)


@pytest.fixture(scope="module")
def smol() -> tuple[Path, list[list[int]], list[list[int]]]:
    path = default_model_dir()
    if not (path / "config.json").is_file():
        pytest.skip(f"default model not prepared at {path} (python -m common.prepare_model)")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(SMOL_TEXT).ids
    assert len(ids) >= max(SMOL_PROMPT_LENS)
    # each prompt ends at a different place in the text, so their continuations differ
    prompts = [ids[len(ids) - n - 7 * i :][:n] for i, n in enumerate(SMOL_PROMPT_LENS)]
    return path, prompts, hf_references(path, prompts, SMOL_NEW_TOKENS)


@pytest.fixture(scope="module", params=["cpu-kernels", "torch-only"])
def smol_runner(request, smol: tuple[Path, list[list[int]], list[list[int]]]) -> ModelRunner:
    """Both CPU paths that serve: the default, whose few-row linears run in C
    (gpu_worker/cpu/linear.py), and the torch-only reference (--no-cpu-kernels)."""
    kernels = request.param == "cpu-kernels"
    runner = ModelRunner(str(smol[0]), RunnerOptions(num_blocks=256, seed=0, cpu_kernels=kernels))
    in_c = [isinstance(m.method, CpuFloatLinearMethod) for _, m in runner.model.linears()]
    assert any(in_c) == (kernels and linear_kernel() is not None)
    return runner


def test_smol_each_prompt_alone(smol, smol_runner) -> None:
    _, prompts, expected = smol
    assert run_greedy(smol_runner, prompts, SMOL_NEW_TOKENS, together=False) == expected


def test_smol_all_prompts_in_one_batch(smol, smol_runner) -> None:
    _, prompts, expected = smol
    assert run_greedy(smol_runner, prompts, SMOL_NEW_TOKENS) == expected


def test_smol_chunked_prefill_mixed_with_decodes(smol, smol_runner) -> None:
    _, prompts, expected = smol
    assert run_greedy(smol_runner, prompts, SMOL_NEW_TOKENS, token_budget=7) == expected


def test_smol_model_info(smol_runner) -> None:
    info = smol_runner.model_info()
    assert info.model_type == "llama" and info.num_layers == 30
    assert (info.num_kv_heads, info.head_dim, info.vocab_size) == (3, 64, 49152)
    assert info.eos_token_ids == [2] and info.max_model_len == 8192
    assert info.num_blocks == 256 and len(info.weights_version) == 16


# --- tiny random models of each architecture ------------------------------------------------


@pytest.fixture(scope="module", params=[a for a in TINY_ARCHS if a not in LONGROPE_ARCHS])
def tiny(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in TINY_PROMPT_LENS]
    return path, prompts, hf_references(path, prompts, TINY_NEW_TOKENS)


TINY_BLOCK_SIZES = (1, 5, 16)


def tiny_block_sizes(arch: str) -> tuple[int, ...]:
    """Every block size for llama; one each for the others, in turn, so that every size
    meets windows, biases and soft caps somewhere without the sweep tripling the suite."""
    if arch == "llama":
        return TINY_BLOCK_SIZES
    return (TINY_BLOCK_SIZES[TINY_ARCHS.index(arch) % len(TINY_BLOCK_SIZES)],)


def test_tiny_parity(request, tiny) -> None:
    path, prompts, expected = tiny
    for block_size in tiny_block_sizes(request.node.callspec.params["tiny"]):
        runner = ModelRunner(
            str(path), RunnerOptions(block_size=block_size, num_blocks=2048 // block_size)
        )
        assert run_greedy(runner, prompts, TINY_NEW_TOKENS, together=False) == expected
        assert run_greedy(runner, prompts, TINY_NEW_TOKENS) == expected
        assert run_greedy(runner, prompts, TINY_NEW_TOKENS, token_budget=7) == expected


def test_tiny_preempted_request_recomputes_the_same_tokens(tiny) -> None:
    path, prompts, expected = tiny
    runner = ModelRunner(str(path), RunnerOptions(block_size=4, num_blocks=512))
    sched = MiniScheduler(runner, token_budget=20)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, GREEDY, TINY_NEW_TOKENS)
    for step in range(12):
        sched.step()
        if step in (4, 11):  # drop the KV of whoever is furthest along; it recomputes
            victim = max(sched.reqs, key=lambda r: sched.reqs[r].num_computed)
            sched.preempt(victim)
    done = sched.run()
    assert [done[f"r{i}"] for i in range(len(prompts))] == expected


# --- sampling, plan validation, config ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _sampled(path: Path, companions: int, *, runner_seed: int, budget: int) -> list[int]:
    runner = ModelRunner(str(path), RunnerOptions(num_blocks=256, seed=runner_seed))
    sched = MiniScheduler(runner, token_budget=budget, seed=runner_seed)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    sched.add("seeded", list(range(100, 130)), params, 24)
    for i in range(companions):
        other = SamplingParams(temperature=1.0) if i % 2 else GREEDY
        sched.add(f"c{i}", list(range(200 + i, 240 + 3 * i)), other, 20)
    return sched.run()["seeded"]


def test_seeded_request_is_reproducible_alone_and_in_a_batch(tiny_llama) -> None:
    alone = _sampled(tiny_llama, 0, runner_seed=0, budget=1 << 30)
    assert _sampled(tiny_llama, 5, runner_seed=7, budget=1 << 30) == alone
    assert _sampled(tiny_llama, 5, runner_seed=3, budget=9) == alone
    assert len(set(alone)) > 3  # it really sampled


def _plan_a(step: int, computed: int, new: int, blocks: list[int], first: bool) -> StepPlan:
    """A one-request plan for request "a" (prompt [5, 6, 7]), sent as new when `first`."""
    intro: dict[str, Any] = dict(
        new_req_ids=["a"], new_prompt_token_ids=[[5, 6, 7]], new_sampling=[GREEDY]
    )
    return StepPlan(
        step,
        **(intro if first else {}),
        req_ids=["a"],
        num_computed_tokens=[computed],
        num_new_tokens=[new],
        new_block_ids=[blocks],
    )


def test_plan_that_disagrees_with_the_worker_is_rejected(tiny_llama) -> None:
    runner = ModelRunner(str(tiny_llama), RunnerOptions(num_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(_plan_a(0, 0, 3, [], first=True))
    runner = ModelRunner(str(tiny_llama), RunnerOptions(num_blocks=16, block_size=4))
    result = runner.execute(_plan_a(0, 0, 2, [3], first=True))
    assert result.req_ids == []  # a prefill chunk that does not reach the end samples nothing
    with pytest.raises(ValueError, match="computed"):
        runner.execute(_plan_a(1, 0, 1, [], first=False))
    with pytest.raises(ValueError, match="cannot compute"):
        runner.execute(_plan_a(2, 2, 2, [], first=False))
    with pytest.raises(ValueError, match="outside"):
        runner.execute(_plan_a(3, 2, 1, [16], first=False))


def test_kv_blocks_are_sized_from_the_memory_budget(tiny_llama) -> None:
    runner = ModelRunner(
        str(tiny_llama), RunnerOptions(kv_cache_memory_gib=0.01, max_model_len=256)
    )
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, block_size, kv_heads, head_dim, fp32
    assert runner.num_blocks == int(0.01 * (1 << 30)) // per_block
    assert runner.max_model_len == 256


def test_config_reads_legacy_rope_fields() -> None:
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    legacy = dict(
        base,
        rope_theta=5e5,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    cfg = LlamaConfig.from_hf(legacy)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is not None and cfg.num_kv_heads == 2
    cfg = LlamaConfig.from_hf(dict(base, rope_parameters=dict(rope_theta=1e6, rope_type="default")))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.head_dim == 4
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig.from_hf(dict(base, rope_parameters=dict(rope_type="su", factor=4.0)))
