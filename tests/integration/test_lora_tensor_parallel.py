"""LoRA under tensor parallelism: two ranks (processes over gloo), each a ModelRunner with its
shard of the tiny model and of every adapter (B's rows split for q/k/v and gate/up, A's
columns for o and down: a partial delta the layer's all-reduce completes). Each rank drives
the same in-process engine (its plans are deterministic), so their collectives pair up;
rank 0's greedy tokens must equal transformers + peft's, in a batch mixing adapters and the
base model."""

from __future__ import annotations

import multiprocessing
import queue
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from common.messages import SamplingParams
from tests.lora_adapters import lora_config, make_adapter, peft_model
from tests.reference import greedy, hf_greedy
from tests.tiny_models import make_tiny_model

NUM_NEW = 10
LORAS = ["all", "", "attn", "all"]
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _rank_main(
    rank: int, addr: str, model: str, adapters: dict[str, str], prompts: list[list[int]], out: Any
) -> None:
    """One rank: join the group, build its runner, serve every prompt with its adapter."""
    from gpu_worker.distributed.tensor_parallel import join_group
    from gpu_worker.runner.model_runner import ModelRunner
    from gpu_worker.runner.options import RunnerOptions
    from services.scheduler.policy import PolicyConfig
    from tests.engine import LocalEngine

    try:
        tp = join_group(rank, 2, addr, "cpu")
        options = lora_config(adapters.items(), max_loras=2, max_lora_rank=8)
        runner = ModelRunner(
            model, RunnerOptions(block_size=4, num_blocks=128, num_threads=1, lora=options), tp=tp
        )
        engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=12))
        ids = [engine.add(p, GREEDY, lora_name=n) for p, n in zip(prompts, LORAS, strict=True)]
        done = engine.run()
        out.put((rank, [done[seqs[0]] for seqs in ids]))
    except BaseException as e:  # the test reports it instead of waiting for a timeout
        out.put((rank, f"{type(e).__name__}: {e}"))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tp2_adapters_equal_peft(tmp_path: Path) -> None:
    model = str(make_tiny_model(tmp_path / "llama", "llama"))
    all_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {
        "all": str(make_adapter(model, tmp_path / "all", r=8, target_modules=all_targets)),
        "attn": str(
            make_adapter(
                model,
                tmp_path / "attn",
                r=4,
                target_modules=["q_proj", "k_proj", "o_proj"],
                use_rslora=True,
                seed=4,
            )
        ),
    }
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (11, 7, 19, 5)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    addr = f"127.0.0.1:{_free_port()}"
    ranks = [
        context.Process(target=_rank_main, args=(r, addr, model, adapters, prompts, results))
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    try:
        got = dict(results.get(timeout=300) for _ in ranks)
    except queue.Empty:
        pytest.fail("the ranks did not answer")
    finally:
        for p in ranks:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert not isinstance(got[0], str), got[0]
    assert got[0] == got[1]
    for lora, prompt, tokens in zip(LORAS, prompts, got[0], strict=True):
        if lora:
            want = greedy(peft_model(model, adapters[lora]), prompt, NUM_NEW)
            assert want != hf_greedy(model, prompt, NUM_NEW), lora
        else:
            want = hf_greedy(model, prompt, NUM_NEW)
        assert tokens == want, lora
