"""The adapters a runner has loaded (gpu_worker/lora/registry.py), on both runners alike: the
worker's LoadLora -> LoraLoaded and UnloadLora, the ModelInfo fields, --lora-modules at
start, and plans naming adapters (recorded per request, refused when not loaded)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.config import Config
from common.messages import LoadLora, LoraLoaded, SamplingParams, StepPlan, UnloadLora
from common.model_paths import prepare_synthetic_folder
from gpu_worker.lora.registry import LoraOptions
from gpu_worker.model_runner import ModelRunner
from gpu_worker.synthetic import SyntheticRunner
from gpu_worker.worker import WorkerActor

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
Make = Callable[[LoraOptions | None], ModelRunner | SyntheticRunner]


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHUTTLE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return prepare_synthetic_folder("synthetic:num_blocks=16", tiny_dir)


@pytest.fixture(params=["model", "synthetic"])
def make_runner(request: pytest.FixtureRequest, tiny_dir: Path, synthetic_dir: Path) -> Make:
    if request.param == "model":
        return lambda lora: ModelRunner(str(tiny_dir), block_size=4, num_blocks=16, lora=lora)
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
    options = LoraOptions(max_loras=2, max_lora_rank=8, modules=(("a", str(adapter_dir)),))
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
    runner = make_runner(LoraOptions(max_lora_rank=8, modules=(("a", str(adapter_dir)),)))
    result = runner.execute(_plan(0, "a"))
    assert result.req_ids == ["r"] and runner.requests.get("r").lora_name == "a"  # type: ignore[union-attr]
    runner.reset()
    with pytest.raises(ValueError, match="wants LoRA adapter 'x', not loaded"):
        runner.execute(_plan(1, "x"))
    off = make_runner(None)
    with pytest.raises(ValueError, match=r"not loaded \(LoRA is not enabled\)"):
        off.execute(_plan(0, "a"))
    assert off.model_info().max_loras == 0 and off.model_info().lora_names == []


def test_bad_options_fail_at_start() -> None:
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        LoraOptions(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="--max-loras"):
        LoraOptions(max_loras=0)
    with pytest.raises(ValueError, match="unique"):
        LoraOptions(modules=(("a", "/x"), ("a", "/y")))


def test_a_refused_start_module_is_logged_and_the_rest_serve(
    make_runner: Make, tmp_path: Path, adapter_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    modules = (("bad", str(bad)), ("a", str(adapter_dir)))
    runner = make_runner(LoraOptions(max_lora_rank=8, modules=modules))
    assert runner.model_info().lora_names == ["a"]
    assert f"{bad}/adapter_config.json: missing" in caplog.text


@dataclasses.dataclass(frozen=True)
class _Module:
    name: str
    path: str


@dataclasses.dataclass(frozen=True)
class _Flags:
    """The shape of the config's LoRA section (common/lora_config.py)."""

    enable_lora: bool = True
    max_loras: int = 2
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    modules: tuple[_Module, ...] = (_Module("a", "/adapters/a"),)


def test_options_come_from_the_config_section() -> None:
    assert LoraOptions.from_flags(_Flags()) == LoraOptions(2, 16, 0, (("a", "/adapters/a"),))
    assert LoraOptions.from_flags(_Flags(enable_lora=False)) is None
