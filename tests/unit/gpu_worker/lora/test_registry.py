"""The adapters a runner has loaded (gpu_worker/lora/registry.py), on both runners alike: the
worker's LoadLora -> LoraLoaded and UnloadLora, the ModelInfo fields, --lora-modules at
start, and plans naming adapters (recorded per request, refused when not loaded)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.config import Config
from common.lora_config import LoraConfig
from common.messages import (
    LoadLora,
    LoadModel,
    LoraLoaded,
    SamplingParams,
    StepPlan,
    UnloadLora,
)
from common.model_paths import prepare_synthetic_folder
from gpu_worker.lora.adapter import LoraAdapterError
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from gpu_worker.runner.synthetic import SyntheticRunner
from gpu_worker.worker import WorkerActor
from tests.lora_adapters import lora_config
from tests.tiny_models import make_tiny_model, make_tiny_model_own_vocab

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
Make = Callable[[LoraConfig | None], ModelRunner | SyntheticRunner]


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHUTTLE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return prepare_synthetic_folder("synthetic:num_blocks=16", tiny_dir)


@pytest.fixture(params=["model", "synthetic"])
def make_runner(request: pytest.FixtureRequest, tiny_dir: Path, synthetic_dir: Path) -> Make:
    if request.param == "model":
        return lambda lora: ModelRunner(
            str(tiny_dir), RunnerOptions(block_size=4, num_blocks=16, lora=lora)
        )
    return lambda lora: SyntheticRunner(str(synthetic_dir), block_size=4, lora=lora)


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def _worker(runner: ModelRunner | SyntheticRunner, run_dir: Path) -> tuple[WorkerActor, _Outbox]:
    worker = WorkerActor(Config().replace(server={"run_dir": str(run_dir)}))
    worker.runner = runner
    outbox = _Outbox()
    worker.scheduler = outbox  # type: ignore[assignment]  # a recorder, not a socket
    return worker, outbox


def _plan(step: int, lora: str) -> StepPlan:
    return StepPlan(
        step_id=step,
        new_req_ids=["r"],
        new_prompt_token_ids=[[5, 6, 7]],
        new_sampling=[GREEDY],
        new_loras=[lora] if lora else [],
        req_ids=["r"],
        num_computed_tokens=[0],
        num_new_tokens=[3],
        new_block_ids=[[0]],
    )


def test_start_modules_load_and_the_worker_loads_and_unloads(
    make_runner: Make, tmp_path: Path, adapter_dir: Path, rslora_dir: Path
) -> None:
    options = lora_config((("a", str(adapter_dir)),), max_loras=2, max_lora_rank=8)
    runner = make_runner(options)
    info = runner.model_info()
    assert (info.max_loras, info.max_lora_rank, info.lora_names) == (2, 8, ["a"])
    assert info.lora_paths == [str(adapter_dir)] and info.lora_ranks == [4]
    worker, outbox = _worker(runner, tmp_path / "run")
    worker._on_load_lora(LoadLora("b", str(rslora_dir)))
    reply = outbox.sent[-1]
    assert isinstance(reply, LoraLoaded) and reply.error == "" and reply.rank == 8
    assert len(reply.weights_hash) == 16
    assert runner.model_info().lora_weights_hashes[1] == reply.weights_hash
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{")
    worker._on_load_lora(LoadLora("c", str(tmp_path / "bad")))
    reply = outbox.sent[-1]
    assert reply.name == "c" and "adapter_config.json: not valid JSON" in reply.error
    worker._on_unload_lora(UnloadLora("a"))
    worker._on_unload_lora(UnloadLora("a"))  # twice: logged, nothing else
    assert runner.model_info().lora_names == ["b"]


def test_a_plan_records_the_adapter_and_refuses_one_not_loaded(
    make_runner: Make, adapter_dir: Path
) -> None:
    runner = make_runner(lora_config((("a", str(adapter_dir)),), max_lora_rank=8))
    result = runner.execute(_plan(0, "a"))
    assert result.req_ids == ["r"] and runner.requests.get("r").lora_name == "a"  # type: ignore[union-attr]
    runner.reset()
    with pytest.raises(ValueError, match="wants LoRA adapter 'x', not loaded"):
        runner.execute(_plan(1, "x"))
    off = make_runner(None)
    with pytest.raises(ValueError, match=r"not loaded \(LoRA is not enabled\)"):
        off.execute(_plan(0, "a"))
    assert off.model_info().max_loras == 0 and off.model_info().lora_names == []


def test_a_refused_start_module_is_logged_and_the_rest_serve(
    make_runner: Make, tmp_path: Path, adapter_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    modules = (("bad", str(bad)), ("a", str(adapter_dir)))
    runner = make_runner(lora_config(modules, max_lora_rank=8))
    assert runner.model_info().lora_names == ["a"]
    assert f"{bad}/adapter_config.json: missing" in caplog.text


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama's KV layout (2 layers, 2 KV heads of 16) with hidden 128: an overlap
    swap takes it, the tiny llama's adapters do not fit it."""
    folder = tmp_path_factory.mktemp("wide") / "m"
    return make_tiny_model_own_vocab(folder, hidden_size=128, num_heads=8, num_kv_heads=2)


def test_adapters_are_checked_against_the_model_served_now(
    tiny_dir: Path, wide_dir: Path, adapter_dir: Path
) -> None:
    options = lora_config((("a", str(adapter_dir)),), max_lora_rank=8)
    runner = ModelRunner(str(tiny_dir), RunnerOptions(block_size=4, num_blocks=16, lora=options))
    runner.set_default_version(runner.load_version(str(wide_dir)))
    with pytest.raises(
        LoraAdapterError, match=r"has shape \[64, 4\], the model and rank 4 need \[128, 4\]"
    ):
        runner.load_lora("b", str(adapter_dir))
    with pytest.raises(LoraAdapterError, match="does not fit this model version"):
        runner.execute(_plan(0, "a"))


def test_a_drain_swap_keeps_the_adapters_that_fit_the_new_model(
    tmp_path: Path, tiny_dir: Path, wide_dir: Path, adapter_dir: Path, rslora_dir: Path
) -> None:
    options = lora_config((("a", str(adapter_dir)),), max_lora_rank=8)

    def build(path: str) -> ModelRunner:  # the worker's builder with LoRA on (the config's
        return ModelRunner(
            path, RunnerOptions(block_size=4, num_blocks=16, lora=options)
        )  # part: lora-svc)

    worker, outbox = _worker(build(str(tiny_dir)), tmp_path / "run")
    worker._build = build  # type: ignore[method-assign]
    worker._on_load_lora(LoadLora("b", str(rslora_dir)))
    second = make_tiny_model(tmp_path / "second", "llama", seed=2)
    worker._on_load_model(LoadModel(path=str(second), version="v2", mode="drain"))
    reply = outbox.sent[-1]
    assert reply.error == "" and reply.model.lora_names == ["a", "b"]
    worker._on_load_model(LoadModel(path=str(wide_dir), version="v3", mode="drain"))
    assert outbox.sent[-1].error == "" and outbox.sent[-1].model.lora_names == []
