"""The StepPlan rules both runners share (gpu_worker/runner/request_table.py): the same plans give
the same request state and the same refusals on the real ModelRunner (a tiny random model on the
CPU) and on the compute-free SyntheticRunner; the worker drives either through `Runner` alone."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import Config
from common.messages import LoadModel, Ready, Reset, SamplingParams, StepPlan
from common.model_paths import prepare_synthetic_folder
from gpu_worker.runner import kv_pool
from gpu_worker.runner.base import Runner
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from gpu_worker.runner.request_table import RequestTable
from gpu_worker.runner.synthetic import SyntheticRunner
from gpu_worker.worker import WorkerActor, check_loadable
from tests.tiny_models import make_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 16
OPTIONS = RunnerOptions(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
CONTROLLED = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.2, ignore_eos=True)

Batch = list[tuple[str, int, int, list[int]]]  # (request, num_computed, num_new, new blocks)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """A synthetic model with the tiny model's config (max_model_len 1024) and tokenizer."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHUTTLE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return prepare_synthetic_folder(f"synthetic:num_blocks={NUM_BLOCKS}", tiny_dir)


@pytest.fixture(params=["model", "synthetic"])
def make_runner(
    request: pytest.FixtureRequest, tiny_dir: Path, synthetic_dir: Path
) -> Callable[[], ModelRunner | SyntheticRunner]:
    """A fresh runner of either kind with the same blocks, block size and max_model_len."""
    if request.param == "model":
        return lambda: ModelRunner(str(tiny_dir), OPTIONS)
    return lambda: SyntheticRunner(str(synthetic_dir), block_size=BLOCK_SIZE)


def _plan(
    step: int,
    batch: Batch = (),
    *,
    new: dict[str, list[int]] | None = None,
    spec: list[int] | None = None,
    sampling: SamplingParams = GREEDY,
    **diffs: Any,
) -> StepPlan:
    new = new or {}
    return StepPlan(
        step,
        new_req_ids=list(new),
        new_prompt_token_ids=list(new.values()),
        new_sampling=[sampling] * len(new),
        req_ids=[rid for rid, _, _, _ in batch],
        num_computed_tokens=[c for _, c, _, _ in batch],
        num_new_tokens=[n for _, _, n, _ in batch],
        new_block_ids=[b for _, _, _, b in batch],
        num_spec_tokens=spec or [],
        **diffs,
    )


def _table(runner: ModelRunner | SyntheticRunner) -> dict[str, tuple[list[int], int, int, str]]:
    """Each request's (block table, num computed, num tokens, version)."""
    out = {}
    for rid in ("a", "b", "c"):
        state = runner.requests.get(rid)
        if state is not None:
            out[rid] = (
                list(state.block_table),
                state.num_computed,
                len(state.token_ids),
                state.version,
            )
    return out


# --- refusals ---------------------------------------------------------------------------------
A = [5, 6, 7]  # request a's prompt
A_FIRST = _plan(0, [("a", 0, 2, [3])], new={"a": A})  # computes [0, 2) of its 3 tokens
CASES: dict[str, tuple[list[StepPlan], str]] = {
    "unknown request": ([_plan(0, [("x", 0, 1, [0])])], "step 0: unknown request x"),
    "computed mismatch": (
        [A_FIRST, _plan(1, [("a", 0, 1, [])])],
        "request a: plan says 0 tokens computed, worker has 2",
    ),
    "past the known tokens": (
        [A_FIRST, _plan(1, [("a", 2, 2, [])])],
        "request a: cannot compute tokens [2, 4) of 3 known (max_model_len 1024)",
    ),
    "no new token": (
        [A_FIRST, _plan(1, [("a", 2, 0, [])])],
        "request a: cannot compute tokens [2, 2) of 3 known (max_model_len 1024)",
    ),
    "block id out of range": (
        [A_FIRST, _plan(1, [("a", 2, 1, [16])])],
        "request a: block ids [16] outside [0, 16)",
    ),
    "blocks too few": (
        [_plan(0, [("a", 0, 5, [0])], new={"a": [1, 2, 3, 4, 5]})],
        "request a: 1 blocks cannot hold 5 tokens",
    ),
    "draft slots past the blocks": (
        [_plan(0, [("a", 0, 3, [0])], new={"a": A}, spec=[2])],
        "request a: 2 draft slots after token 3 do not fit its 1 blocks or max_model_len",
    ),
    "draft slots mid-prompt": (
        [_plan(0, [("a", 0, 2, [0])], new={"a": A}, spec=[1])],
        "request a: draft slots on a step that does not reach its last token",
    ),
    "draft slots with logits controls": (
        [_plan(0, [("a", 0, 3, [0, 1])], new={"a": A}, spec=[1], sampling=CONTROLLED)],
        "request a: draft slots for a request with logits controls, logprobs or a grammar",
    ),
    "fields differ in length": (
        [dataclasses.replace(A_FIRST, new_block_ids=[])],
        "step 0: batch fields differ in length",
    ),
    "scheduled twice": (
        [_plan(0, [("a", 0, 2, [0]), ("a", 0, 2, [1])], new={"a": A})],
        "step 0: a request is scheduled twice",
    ),
    "new twice": ([A_FIRST, _plan(1, new={"a": A})], "request a is already running on the worker"),
    "empty prompt": ([_plan(0, new={"a": []})], "request a has an empty prompt"),
    "unknown version": (
        [dataclasses.replace(_plan(0, new={"a": A}), new_versions=["v9"])],
        "request a wants model version 'v9', loaded: ['v1']",
    ),
    "copy for unknown request": (
        [_plan(0, copy_req_ids=["z"], copy_index=[0], copy_src=[1], copy_dst=[2])],
        "copy-on-write for unknown request z",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_plan_is_refused_with_the_same_error(make_runner, case: str) -> None:
    plans, error = CASES[case]
    runner = make_runner()
    runner.relabel("v1")  # both runners list the same loaded versions
    for plan in plans[:-1]:
        runner.execute(plan)
    with pytest.raises(ValueError) as info:
        runner.execute(plans[-1])
    assert str(info.value) == error


# --- the diffs --------------------------------------------------------------------------------
def test_finished_preempted_new_and_copy_on_write_apply_identically(make_runner) -> None:
    runner = make_runner()
    v = runner.default_version
    # a prefills in two chunks; b (3 tokens) prefills at once and samples
    result = runner.execute(
        _plan(0, [("a", 0, 4, [0]), ("b", 0, 3, [1])], new={"a": [9, 8, 7, 6, 5, 4], "b": A})
    )
    assert result.req_ids == ["b"] and len(result.token_ids) == 1
    assert _table(runner) == {"a": ([0], 4, 6, v), "b": ([1], 3, 4, v)}
    result = runner.execute(_plan(1, [("b", 3, 1, []), ("a", 4, 2, [2])]))
    assert result.req_ids == ["b", "a"]  # plan order
    assert _table(runner) == {"a": ([0, 2], 6, 7, v), "b": ([1], 4, 5, v)}
    # a is preempted (recompute); b's shared block 1 is replaced by its private copy 5
    result = runner.execute(
        _plan(
            2,
            [("b", 4, 1, [6])],
            preempted_req_ids=["a"],
            copy_req_ids=["b"],
            copy_index=[0],
            copy_src=[1],
            copy_dst=[5],
        )
    )
    assert result.req_ids == ["b"]
    assert _table(runner) == {"a": ([], 0, 7, v), "b": ([5, 6], 5, 6, v)}
    # b finishes; a comes back with a prefix hit of one block (its table arrives whole)
    result = runner.execute(_plan(3, [("a", 4, 3, [0, 7])], finished_req_ids=["b", "b"]))
    assert result.req_ids == ["a"]
    assert _table(runner) == {"a": ([0, 7], 7, 8, v)}
    assert runner.num_requests() == 1


def test_kv_copies_run_in_the_documented_order() -> None:
    """finished -> swap out -> preempted reset -> new -> swap in -> copy-on-write."""
    table = RequestTable(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=64)
    table.apply_diffs(_plan(0, new={"old": A, "gone": A}), "v", {"v"})
    table.schedule(_plan(0, [("old", 0, 3, [4]), ("gone", 0, 3, [5])]))
    seen: list[tuple[str, bool, bool, list[int]]] = []

    class Recorder:
        def _note(self, what: str) -> None:
            old = table.get("old")
            assert old is not None
            seen.append(
                (
                    what,
                    table.get("gone") is None,
                    table.get("new") is not None,
                    list(old.block_table),
                )
            )

        def swap_out(self, src: list[int], dst: list[int]) -> None:
            self._note("swap_out")

        def swap_in(self, src: list[int], dst: list[int]) -> None:
            self._note("swap_in")

        def copy_blocks(self, src: list[int], dst: list[int]) -> None:
            self._note("copy_blocks")

    plan = _plan(
        1,
        new={"new": A},
        finished_req_ids=["gone"],
        preempted_req_ids=["old"],
        swap_out_src=[4],
        swap_out_dst=[0],
        swap_in_src=[0],
        swap_in_dst=[9],
        copy_req_ids=["new"],
        copy_index=[0],
        copy_src=[1],
        copy_dst=[2],
    )
    table.apply_diffs(plan, "v", {"v"}, Recorder())
    assert seen == [
        ("swap_out", True, False, [4]),  # finished dropped, old not yet reset
        ("swap_in", True, True, []),  # preempted reset, new added
        ("copy_blocks", True, True, []),
    ]


def test_model_runner_copies_kv_blocks_and_seeds_sampled_requests(tiny_dir: Path) -> None:
    runner = ModelRunner(str(tiny_dir), OPTIONS)
    runner.execute(_plan(0, [("a", 0, 3, [1])], new={"a": A}, sampling=SAMPLED))
    state = runner.requests.get("a")
    assert state is not None and state.generator is not None
    kv = runner.kv_cache.tensor
    assert kv[:, :, 1].abs().sum() > 0  # the prompt's K/V
    runner.execute(
        _plan(1, [("a", 3, 1, [])], copy_req_ids=["a"], copy_index=[0], copy_src=[1], copy_dst=[5])
    )
    assert torch.equal(kv[:, :, 5, :3], kv[:, :, 1, :3])
    assert state.block_table == [5]


def test_model_runner_resumes_a_seeded_request_where_it_stopped(tiny_dir: Path) -> None:
    """A request resumed on a new runner with its outputs so far (its worker died) counts
    them as outputs and samples what the first runner samples next."""
    first = ModelRunner(str(tiny_dir), OPTIONS)
    first.execute(_plan(0, [("a", 0, 3, [1])], new={"a": A}, sampling=SAMPLED))
    first.execute(_plan(1, [("a", 3, 1, [])]))
    first.execute(_plan(2, [("a", 4, 1, [2])]))
    state = first.requests.get("a")
    assert state is not None and len(state.output_ids) == 3
    again = ModelRunner(str(tiny_dir), OPTIONS)
    resumed_plan = _plan(
        0,
        [("a", 0, 5, [1, 2])],
        new={"a": [*A, *state.output_ids[:2]]},
        sampling=SAMPLED,
        new_num_output_tokens=[2],
    )
    again.execute(resumed_plan)
    resumed = again.requests.get("a")
    assert resumed is not None and resumed.num_prompt == len(A)
    assert resumed.output_ids == state.output_ids


def test_model_runner_applies_controls_and_frees_their_token_counts(tiny_dir: Path) -> None:
    runner = ModelRunner(str(tiny_dir), OPTIONS)
    # a: greedy, pushed to token 42 (+100) but with min_tokens 2 masking 42, its stop token
    pushed = dataclasses.replace(
        CONTROLLED, min_tokens=2, logit_bias_token_ids=[42], logit_bias_values=[100.0]
    )
    first = dataclasses.replace(
        _plan(0, [("a", 0, 3, [0]), ("b", 0, 3, [1])], new={"a": A, "b": A}),
        new_sampling=[pushed, GREEDY],
        new_stop_token_ids=[[42], []],
    )
    out = {"a": [], "b": []}
    for plan in (
        first,
        _plan(1, [("a", 3, 1, []), ("b", 3, 1, [])]),
        _plan(2, [("a", 4, 1, [2]), ("b", 4, 1, [3])]),
    ):
        result = runner.execute(plan)
        for rid, token in zip(result.req_ids, result.token_ids, strict=True):
            out[rid].append(token)
    assert 42 not in out["a"][:2] and out["a"][2] == 42
    assert 42 not in out["b"]  # b has no controls: untouched by a's bias
    state = runner.requests.get("a")
    assert state is not None and state.stop_token_ids == [42]
    counts = runner.versions[runner.default_version].counts
    assert len(counts) == 1  # a's penalties keep its counts; b needs none
    runner.execute(_plan(3, finished_req_ids=["a"]))
    assert len(counts) == 0
    runner.execute(
        dataclasses.replace(_plan(4, [("c", 0, 3, [0])], new={"c": A}), new_sampling=[CONTROLLED])
    )
    assert len(counts) == 1
    runner.reset()
    assert len(counts) == 0


def test_logprobs_have_the_same_layout_on_both_runners(make_runner) -> None:
    """a asks for 2 top logprobs and 1 prompt logprob, its 6-token prompt in two chunks
    (preempted and recomputed after the first); b asks for nothing."""
    runner = make_runner()
    prompt = [5, 6, 7, 8, 9, 10]
    asks = dataclasses.replace(GREEDY, logprobs=2, prompt_logprobs=1)
    first = dataclasses.replace(
        _plan(0, [("a", 0, 3, [0]), ("b", 0, 3, [1])], new={"a": prompt, "b": A}),
        new_sampling=[asks, GREEDY],
    )
    result = runner.execute(first)
    assert result.req_ids == ["b"] and not result.logprob_token_ids  # nobody asking sampled
    runner.execute(_plan(1, preempted_req_ids=["a"]))
    result = runner.execute(_plan(2, [("a", 0, 6, [2, 3]), ("b", 3, 1, [])]))
    assert result.req_ids == ["a", "b"]
    ids, values = result.logprob_token_ids, result.logprob_values
    assert len(ids) == 2 and ids[1] == [] and values[1] == []
    assert ids[0][0] == result.token_ids[0] and len(ids[0]) == len(values[0]) == 3
    assert all(v <= 0.0 for v in values[0]) and values[0][1] >= values[0][2]
    (prompt_ids, no_prompt) = result.prompt_logprob_token_ids
    assert no_prompt == [] and result.prompt_logprob_values[1] == []
    assert [entry[0] for entry in prompt_ids] == prompt  # once per prompt token, in order
    assert prompt_ids[0] == [5] and result.prompt_logprob_values[0][0] == []
    assert all(len(e) == 2 for e in prompt_ids[1:])
    result = runner.execute(_plan(3, [("a", 6, 1, []), ("b", 4, 1, [4])]))
    assert not result.prompt_logprob_token_ids  # sent once
    assert len(result.logprob_token_ids[0]) == 3 and result.logprob_token_ids[1] == []


# --- forgetting and relabelling ---------------------------------------------------------------
def test_reset_forgets_every_request(make_runner) -> None:
    runner = make_runner()
    runner.execute(_plan(0, [("a", 0, 3, [0]), ("b", 0, 2, [1])], new={"a": A, "b": A}))
    runner.drop("b")
    runner.drop("b")  # idempotent
    assert runner.num_requests() == 1
    runner.reset()
    assert runner.num_requests() == 0
    with pytest.raises(ValueError, match="unknown request a"):
        runner.execute(_plan(1, [("a", 3, 1, [])]))
    runner.execute(_plan(2, [("a", 0, 3, [0])], new={"a": A}))  # the id is new again
    assert _table(runner)["a"][:3] == ([0], 3, 4)


def test_relabel_renames_the_default_version_and_its_requests(make_runner) -> None:
    runner = make_runner()
    runner.execute(_plan(0, [("a", 0, 2, [0])], new={"a": A}))
    old = runner.default_version
    runner.relabel(old)  # the same label: nothing to do
    runner.relabel("v2")
    assert runner.default_version == "v2" and runner.model_info().weights_version == "v2"
    assert list(runner.versions) == ["v2"]
    assert _table(runner)["a"][3] == "v2"
    assert runner.execute(_plan(1, [("a", 2, 1, [])])).req_ids == ["a"]  # runs on v2
    runner.execute(dataclasses.replace(_plan(2, new={"b": A}), new_versions=["v2"]))
    with pytest.raises(ValueError, match=f"wants model version '{old}'"):
        runner.execute(dataclasses.replace(_plan(3, new={"c": A}), new_versions=[old]))


# --- configuration ----------------------------------------------------------------------------
def test_from_config_passes_every_setting_gpu_memory_utilization_included(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[torch.device, float, float, float]] = []

    def budget(
        device: torch.device, memory_gib: float, utilization: float, share: float = 1.0
    ) -> int:
        calls.append((device, memory_gib, utilization, share))
        return 1 << 20

    monkeypatch.setattr(kv_pool, "kv_budget_bytes", budget)
    config = Config().replace(
        model={"max_model_len": 256, "seed": 3},
        cache={
            "block_size": BLOCK_SIZE,
            "kv_cache_memory": 0.01,
            "gpu_memory_utilization": 0.42,
            "swap_space": 0.01,
        },
        scheduler={"preemption_mode": "swap"},
        speculative={"speculative": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    )
    runner = ModelRunner.from_config(str(tiny_dir), config)
    assert calls == [(torch.device("cpu"), 0.01, 0.42, 1.0)]
    assert runner.options.gpu_memory_utilization == 0.42
    per_block = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers, K/V, block, kv heads, head dim, fp32
    assert runner.num_blocks == (1 << 20) // per_block
    assert (runner.block_size, runner.max_model_len) == (BLOCK_SIZE, 256)
    assert runner.num_host_blocks == int(0.01 * (1 << 30)) // per_block
    assert (runner.options.speculative, runner.options.prompt_lookup) == ("ngram", (1, 3))


# --- the worker drives a runner through the protocol only -------------------------------------
class _Outbox:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def _worker(tmp_path: Path, folder: Path) -> tuple[WorkerActor, _Outbox]:
    config = Config().replace(
        model={"model": str(folder)},
        cache={"block_size": BLOCK_SIZE},
        server={"run_dir": str(tmp_path)},
    )
    worker = WorkerActor(config)
    worker.runner = worker._build(str(folder))
    outbox = _Outbox()
    worker.scheduler = outbox  # type: ignore[assignment]  # a recorder, not a socket
    return worker, outbox


def test_worker_reset_and_a_swap_to_a_folder_without_tokenizer(
    tmp_path: Path, synthetic_dir: Path, tiny_dir: Path
) -> None:
    worker, outbox = _worker(tmp_path, synthetic_dir)
    runner: Runner = worker.runner
    runner.execute(_plan(0, [("a", 0, 3, [0])], new={"a": A}))
    worker._on_reset(Reset())
    assert runner.num_requests() == 0 and isinstance(outbox.sent[-1], Ready)
    broken = tmp_path / "no-tokenizer"
    broken.mkdir()
    shutil.copy(tiny_dir / "config.json", broken / "config.json")
    with pytest.raises(ValueError, match="tokenizer cannot be loaded"):
        check_loadable(str(broken))
    check_loadable(str(tiny_dir))
    for mode in ("drain", "overlap"):
        worker._on_load_model(LoadModel(path=str(broken), version="v2", mode=mode))
        reply = outbox.sent[-1]
        assert "tokenizer cannot be loaded" in reply.error, mode
        assert worker.runner is runner and runner.default_version != "v2"  # old one serves
    worker._on_load_model(LoadModel(path=str(synthetic_dir), version="v3", mode="drain"))
    assert outbox.sent[-1].error == "" and outbox.sent[-1].version == "v3"
    assert worker.runner is not runner and worker.runner.default_version == "v3"


def test_a_compiled_grammar_is_answered_at_the_next_step_while_plans_keep_coming(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """The loop runs queued handlers back to back: the answer must not wait for a callback
    that only runs once the queue is empty (constrained requests held behind the rest)."""
    import asyncio

    from common.messages import CompileGrammar, GrammarCompiled, StepResult

    worker, outbox = _worker(tmp_path, tiny_dir)

    async def steps() -> None:
        worker._on_compile_grammar(CompileGrammar("g", "json", '{"type": "object"}', ""))
        worker._compiles[0][0].result(timeout=60)  # compiled; the loop has not run since
        worker._on_step_plan(_plan(0, [("a", 0, 3, [0])], new={"a": A}))

    asyncio.run(steps())
    assert [type(m) for m in outbox.sent[-2:]] == [StepResult, GrammarCompiled]
    answer = outbox.sent[-1]
    assert answer.request_id == "g" and answer.error == "" and not worker._compiles


def test_layer_groups_keep_one_table_per_group() -> None:
    """KV layer groups: each group's entries extend its own table (-1 where a sliding group
    let a block go), copy-on-write names its group, a preemption empties every table, and
    a plan without the groups' entries is refused."""
    table = RequestTable(
        block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=64, group_windows=(8, 0)
    )
    assert table.ref_group == 1  # the global group stands for the request
    first = StepPlan(
        0,
        new_req_ids=["a"],
        new_prompt_token_ids=[list(range(3, 15))],
        new_sampling=[GREEDY],
        req_ids=["a"],
        num_computed_tokens=[0],
        num_new_tokens=[12],
        new_block_ids=[[3, 4, 5]],
        new_group_block_ids=[[[0, 1, 2], [3, 4, 5]]],
    )
    table.apply_diffs(first, "v", {"v"})
    (state,) = table.schedule(first)
    assert state.group_tables == [[0, 1, 2], [3, 4, 5]] and state.block_table == [3, 4, 5]
    state.token_ids.append(99)
    second = StepPlan(
        1,
        req_ids=["a"],
        num_computed_tokens=[12],
        num_new_tokens=[1],
        new_block_ids=[[6]],
        new_group_block_ids=[[[7], [6]]],
        copy_req_ids=["a"],
        copy_index=[2],
        copy_src=[2],
        copy_dst=[8],
        copy_groups=[0],
    )
    table.apply_diffs(second, "v", {"v"})
    table.schedule(second)
    assert state.group_tables == [[0, 1, 8, 7], [3, 4, 5, 6]]
    with pytest.raises(ValueError, match="batch fields differ"):
        table.schedule(dataclasses.replace(second, step_id=2, new_group_block_ids=[]))
    whole = StepPlan(3, preempted_req_ids=["a"], req_ids=["a"], num_computed_tokens=[0],
                     num_new_tokens=[13], new_block_ids=[[3, 4, 5, 6]],
                     new_group_block_ids=[[[-1, -1, 9, 10], [3, 4, 5, 6]]])  # fmt: skip
    table.apply_diffs(whole, "v", {"v"})
    table.schedule(whole)
    assert state.group_tables == [[-1, -1, 9, 10], [3, 4, 5, 6]]
    bad = dataclasses.replace(whole, step_id=4, preempted_req_ids=["a"],
                              new_group_block_ids=[[[99], [3, 4, 5, 6]]])  # fmt: skip
    table.apply_diffs(bad, "v", {"v"})
    with pytest.raises(ValueError, match=r"block ids \[99\] outside"):
        table.schedule(bad)
