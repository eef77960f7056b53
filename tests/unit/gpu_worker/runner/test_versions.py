"""ModelVersions (gpu_worker/runner/versions.py) on tiny random models: what a load checks and
names, which version is the default, when one may leave, the tokenizer fingerprints; and the
runner reading its default version from the table instead of keeping copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.messages import SamplingParams, StepPlan
from common.model_facts import tokenizer_fingerprint
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.model_loader.hf_folder import read_hf_config, weights_version
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.builder import load_weights
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from gpu_worker.runner.versions import Built, IncompatibleModel, ModelVersion, ModelVersions
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, make_tiny_model

OPTIONS = RunnerOptions(block_size=4, num_blocks=16)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two llama models of one KV layout (other weights) and a qwen2 one of another."""
    root = tmp_path_factory.mktemp("models")
    return {
        "a": str(make_tiny_model(root / "a", "llama", seed=0)),
        "b": str(make_tiny_model(root / "b", "llama", seed=1)),
        "qwen2": str(make_tiny_model(root / "qwen2", "qwen2")),  # 1 KV head, not 2
    }


def _build(path: str, hf_config: dict[str, Any]) -> Built:
    """What the runner builds on the CPU: backend and weights, no graphs (eager)."""
    progress: list[str] = []
    backend, model = load_weights(
        path, hf_config, OPTIONS, tp=TensorParallel(), max_model_len=64, progress=progress.append
    )
    assert progress and path in progress[-1]  # its stages were told
    return backend, model, None


def _versions(path: str) -> ModelVersions:
    hf_config = read_hf_config(path)
    config = LlamaConfig.from_hf(hf_config)
    first = ModelVersion.create(
        path, hf_config, config, _build(path, hf_config), torch.device("cpu")
    )
    return ModelVersions("v1", first, _build)


def test_a_load_is_named_by_its_weights_unless_named_and_never_twice(
    folders: dict[str, str],
) -> None:
    versions = _versions(folders["a"])
    version = versions.load(folders["b"])
    assert version == weights_version(folders["b"]) != weights_version(folders["a"])
    assert list(versions) == ["v1", version] and versions.default_version == "v1"
    loaded = versions[version]
    assert loaded.path == folders["b"] and loaded.eos_token_ids == [EOS_TOKEN_ID]
    assert loaded.counts.vocab_size == VOCAB_SIZE and loaded.graphs is None
    assert loaded.model is not versions.default.model
    for label in ("", "v1"):  # its own hash again, or a label in use
        with pytest.raises(ValueError, match="already loaded"):
            versions.load(folders["b"], label)
    assert versions.load(folders["b"], "b-again") == "b-again"  # a second copy, named
    assert list(versions) == ["v1", version, "b-again"]


def test_a_model_with_another_kv_layout_is_refused_before_its_weights_load(
    folders: dict[str, str],
) -> None:
    versions = _versions(folders["a"])
    assert versions.kv_layout == (2, 2, 16, ())  # layers, KV heads, head size, windows
    with pytest.raises(IncompatibleModel, match=r"\(2, 1, 16, \(\)\).*drain mode"):
        versions.load(folders["qwen2"])
    assert list(versions) == ["v1"]


def test_the_default_moves_only_to_a_loaded_version_and_only_others_unload(
    folders: dict[str, str],
) -> None:
    versions = _versions(folders["a"])
    first = versions.default
    with pytest.raises(KeyError):
        versions.set_default("v9")
    version = versions.load(folders["b"])
    versions.set_default(version)
    assert versions.default_version == version and versions.default is versions[version]
    with pytest.raises(ValueError, match="is the default"):
        versions.unload(version, num_users=0)
    with pytest.raises(ValueError, match="still serves 2 requests"):
        versions.unload("v1", num_users=2)
    assert versions["v1"] is first
    versions.unload("v1", num_users=0)
    assert list(versions) == [version]
    with pytest.raises(KeyError):
        versions.unload("v1", num_users=0)


def test_tokenizer_fingerprints_find_the_version_with_that_tokenizer(
    folders: dict[str, str],
) -> None:
    if not (Path(folders["a"]) / "tokenizer.json").is_file():
        pytest.skip("the tiny models have no tokenizer without the default model's files")
    versions = _versions(folders["a"])
    version = versions.load(folders["b"])
    fingerprint = versions.fingerprint("v1")
    assert fingerprint == tokenizer_fingerprint(Path(folders["a"]))
    assert versions.fingerprint(version) == fingerprint  # the same tokenizer files
    info = versions.tokenizer_info(fingerprint)
    assert info.vocab_size == VOCAB_SIZE and EOS_TOKEN_ID in info.stop_token_ids
    with pytest.raises(KeyError):
        versions.tokenizer_info("not-a-loaded-tokenizer")


def test_the_runner_reads_its_default_version_from_the_table(folders: dict[str, str]) -> None:
    runner = ModelRunner(folders["a"], OPTIONS)
    old = runner.default_version
    runner.execute(_prefill(0, "r1", [5, 6, 7], block=0))
    version = runner.load_version(folders["b"])
    assert runner.model_path == folders["a"]  # loaded beside, not served yet
    runner.set_default_version(version)
    assert (runner.default_version, runner.model_path) == (version, folders["b"])
    assert runner.model is runner.versions[version].model
    assert runner.model_info().weights_version == version
    copies = {"model", "graphs", "config", "model_path", "eos_token_ids", "weights_version"}
    assert not copies & set(vars(runner))  # only the table holds them
    runner.execute(_prefill(1, "r2", [5, 6, 7], block=1))  # new: on the new default
    assert runner.requests.get("r2").version == version  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="still serves 1 requests"):
        runner.unload_version(old)
    runner.execute(StepPlan(2, finished_req_ids=["r1"]))
    runner.unload_version(old)
    assert list(runner.versions) == [version]


def _prefill(step: int, req_id: str, prompt: list[int], block: int) -> StepPlan:
    return StepPlan(
        step,
        new_req_ids=[req_id],
        new_prompt_token_ids=[prompt],
        new_sampling=[GREEDY],
        req_ids=[req_id],
        num_computed_tokens=[0],
        num_new_tokens=[len(prompt)],
        new_block_ids=[[block]],
    )
