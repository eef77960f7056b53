"""Every `shuttle serve` flag reaches the code that uses it.

Two checks. (1) Every leaf field of the config tree is read somewhere in the serving code
(an attribute access outside common/config.py and the section modules split from it, where
fields are only validated): a flag nobody reads fails here. (2) The settings the worker's
runner and the scheduler's engine take are checked end to end: a config with a non-default
value in each field, parsed from `shuttle serve` flags, builds the runner's arguments and
the engine's policy, and each value arrives.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from common.config import Config, add_flags, from_args
from common.messages import RequestError, SamplingParams, TokenizedRequest
from services.scheduler.engine_core import EngineCore
from services.scheduler.policy import PolicyConfig
from tests.unit.services.scheduler.test_engine_core import Outbox, _info

REPO = Path(__file__).resolve().parents[3]
SERVING = ("common", "services", "gpu_worker")
# where sections are defined and validated: a field read only there is read by nobody
DEFINING = {
    REPO / "common" / name for name in ("config.py", "speculative_config.py", "parallel_config.py")
}


def _leaf_fields() -> list[tuple[str, str]]:
    return [
        (section.name, leaf.name)
        for section in dataclasses.fields(Config)
        for leaf in dataclasses.fields(
            section.type
            if isinstance(section.type, type)
            else type(getattr(Config(), section.name))
        )
    ]


def _attributes_read() -> set[str]:
    names: set[str] = set()
    for folder in SERVING:
        for path in (REPO / folder).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path in DEFINING:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute):
                    names.add(node.attr)
    return names


def test_every_config_field_is_read_by_the_serving_code() -> None:
    read = _attributes_read()
    # config.py itself reads these to build addresses (Config.addr / tokenizer_addrs /
    # bind_addr): the address section is consumed there, by every process
    in_config = {
        "gateway_addr",
        "scheduler_addr",
        "worker_addr",
        "detokenizer_addr",
        "supervisor_addr",
        "tokenizer_addrs",
        "zmq_bind_host",
    }
    unread = [f"{s}.{n}" for s, n in _leaf_fields() if n not in read and n not in in_config]
    assert not unread, f"flags no serving code reads: {unread}"


# non-default values for the worker's and the scheduler's settings, as flags
FLAGS = {
    "--dtype": "bfloat16",
    "--max-model-len": "77",
    "--seed": "5",
    "--num-threads": "3",
    "--attention-backend": "torch",
    "--enforce-eager": None,
    "--max-graph-batch-size": "9",
    "--block-size": "8",
    "--kv-cache-memory": "0.7",
    "--gpu-memory-utilization": "0.55",
    "--swap-space": "0.3",
    "--preemption-mode": "swap",
    "--speculative": "ngram",
    "--num-speculative-tokens": "6",
    "--prompt-lookup-max": "5",
    "--prompt-lookup-min": "3",
    "--max-num-seqs": "11",
    "--max-num-batched-tokens": "333",
    "--max-waiting": "1",
    "--scheduling-policy": "priority",
    "--batch-policy": "dynamic",
    "--batch-window": "0.2",
    "--static-batch-timeout": "2.5",
    "--no-async-scheduling": None,
    "--no-enable-prefix-caching": None,
    "--no-cpu-kernels": None,
    "--no-cpu-packed-weights": None,
    "--no-cpu-huge-pages": None,
    "--quantization": "int8",
    "--kv-cache-dtype": "fp8",
    "--enable-lora": None,
    "--lora-modules": "a=/a",
    "--max-loras": "3",
    "--max-lora-rank": "32",
    "--max-cpu-loras": "5",
    "--lora-dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def config() -> Config:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    argv = [x for flag, value in FLAGS.items() for x in (flag, value) if x is not None]
    return from_args(parser.parse_args(argv), env={})


def test_runner_settings_reach_the_model_runner(config: Config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from common.lora_config import LoraConfig
    from gpu_worker.runner.model_runner import ModelRunner
    from gpu_worker.runner.options import RunnerOptions

    seen: dict[str, Any] = {}

    def record(self: ModelRunner, model_path: str, options: RunnerOptions, **kwargs: Any) -> None:
        seen.update(kwargs, model_path=model_path, options=options)

    monkeypatch.setattr(ModelRunner, "__init__", record)
    ModelRunner.from_config("/some/model", config)
    assert seen == {
        "model_path": "/some/model",
        "options": RunnerOptions(
            dtype="bfloat16",
            device="cpu",
            block_size=8,
            kv_cache_memory_gib=0.7,
            kv_cache_dtype="fp8",
            gpu_memory_utilization=0.55,
            max_model_len=77,
            seed=5,
            attention_backend="torch",
            enforce_eager=True,
            max_graph_batch_size=9,
            num_threads=3,
            swap_space_gib=0.3,
            speculative="ngram",
            cpu_kernels=False,
            cpu_packed_weights=False,
            cpu_huge_pages=False,
            quantization="int8",
            draft_model="",
            prompt_lookup_min=3,
            prompt_lookup_max=5,
            lora=LoraConfig(
                enable_lora=True,
                lora_modules="a=/a",
                max_loras=3,
                max_lora_rank=32,
                max_cpu_loras=5,
                lora_dtype="bfloat16",
            ),
        ),
        "tp": None,  # a single worker: no tensor-parallel group
        "progress": None,  # the worker passes its report_progress
    }


def test_scheduler_settings_reach_the_engine(config: Config) -> None:
    out = Outbox()
    core = EngineCore(config, out)
    assert core.policy_config == PolicyConfig(
        max_num_seqs=11,
        max_num_batched_tokens=333,
        scheduling_policy="priority",
        preemption_mode="swap",
        batch_policy="dynamic",
        batch_window=0.2,
        static_batch_timeout=2.5,
        num_speculative_tokens=6,
        max_loras=3,
    )
    assert core.window.max_in_flight == 1  # --no-async-scheduling (and speculation)
    core.on_worker_ready(_info("v", num_blocks=16, block_size=8, max_model_len=77, model_name="m"))
    assert core.policy is not None and not core.policy.blocks.enable_prefix_caching
    for rid in ("a", "b"):  # --max-waiting 1: the second queued request is refused
        core.add(
            TokenizedRequest(
                request_id=rid, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2)
            )
        )
    assert [e.status for e in out.of(RequestError)] == [429]
