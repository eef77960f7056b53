"""What KV layer groups save (common/kv_groups.py): the blocks one long sequence holds on a
tiny Gemma 3 model (5 sliding layers : 1 global, window 512 as in Gemma 3 1B; only the
widths are shrunk), against the same model with its windows off, and how many such
sequences one `--kv-cache-memory` admits at once.

    .venv/bin/python -m tools.benchmarks.kv_groups [--seq-len 8192] [--window 512]
        [--layers 12] [--memory-mib 64] [--json out.json]

1. One sequence, served by the real runner and engine in this process (tests/engine.py):
   a prompt of `seq_len` tokens in chunks of 2048, then 16 greedy tokens; after each step
   the blocks its table holds in each layer group (a block is `slots` layers' K and V of
   16 tokens). Reported: the most each group held while it decoded, and the bytes, next to
   the model with its windows off (one dense group of every layer); and the most while
   its prompt's chunks were computed (a sliding group holds its window and the chunk).
2. Admission at a fixed KV memory: the pool the worker sizes from `--memory-mib`
   (gpu_worker/runner/kv_pool.py), and the real policy and block manager driven without
   a model (admission does not look at the KV's values): 64 sequences of `seq_len` prompt
   tokens and 256 output tokens each, queued at once; the most running at once and the
   preemptions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common.kv_groups import PLACEHOLDER  # noqa: E402
from common.messages import SamplingParams  # noqa: E402
from gpu_worker.kv_cache import bytes_per_block  # noqa: E402
from gpu_worker.model_loader.hf_folder import read_hf_config  # noqa: E402
from gpu_worker.models.llama_config import LlamaConfig  # noqa: E402
from gpu_worker.runner.kv_pool import kv_layer_groups  # noqa: E402
from gpu_worker.runner.model_runner import ModelRunner  # noqa: E402
from gpu_worker.runner.options import RunnerOptions  # noqa: E402
from services.scheduler.block_manager import BlockManager  # noqa: E402
from services.scheduler.grouped_blocks import GroupedBlockManager  # noqa: E402
from services.scheduler.policy import PolicyConfig, SchedulingPolicy  # noqa: E402
from services.scheduler.request import Request  # noqa: E402
from tests.engine import LocalEngine  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

BLOCK = 16
CHUNK = 2048
MIB = 1 << 20


def make_models(folder: Path, layers: int, window: int, max_len: int) -> tuple[Path, Path]:
    """The tiny Gemma 3 (layers 5:1 sliding:global, `window`) and a copy with no window."""
    windowed = make_tiny_model(folder / "gemma3-windowed", "gemma3", num_layers=layers)
    cfg = json.loads((windowed / "config.json").read_text())
    cfg.update(sliding_window=window, max_position_embeddings=max_len)
    (windowed / "config.json").write_text(json.dumps(cfg))
    dense = folder / "gemma3-dense"
    if not dense.exists():
        dense.mkdir()
        for f in windowed.iterdir():
            (dense / f.name).symlink_to(f)
        (dense / "config.json").unlink()
    cfg["layer_types"] = ["full_attention"] * len(cfg["layer_types"])
    (dense / "config.json").write_text(json.dumps(cfg))
    return windowed, dense


def held_by_group(blocks: Any, req_id: str) -> list[int]:
    if isinstance(blocks, GroupedBlockManager):
        tables = blocks.tables.get(req_id, [])
        return [sum(1 for b in t if b != PLACEHOLDER) for t in tables]
    return [len(blocks.block_tables.get(req_id, ()))]


def one_sequence(path: Path, seq_len: int) -> dict[str, Any]:
    """Serve one sequence of `seq_len` prompt tokens + 16 with the real runner; the most
    blocks each group held after the prompt was computed."""
    runner = ModelRunner(
        str(path), RunnerOptions(block_size=BLOCK, kv_cache_memory_gib=0.125, num_threads=2)
    )
    engine = LocalEngine(runner, PolicyConfig(max_num_batched_tokens=CHUNK))
    prompt = torch.randint(3, 40000, (seq_len,), generator=torch.Generator().manual_seed(0))
    engine.add(prompt.tolist(), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    core, plans = engine.core, engine.collector.plans
    peaks: dict[str, list[int]] = {"prefill": [], "decode": []}
    core.step()
    while plans:
        core.on_step_result(runner.execute(plans.popleft()))
        policy = core.policy
        assert policy is not None
        req = next(iter(policy.requests.values()), None)  # (the one sequence)
        if req is not None:
            # planned so far: prompt chunks (a sliding group holds its window and the
            # chunk), then decodes (one token each: the window)
            phase = "decode" if req.num_computed_tokens > seq_len + 1 else "prefill"
            held, peak = held_by_group(policy.blocks, req.request_id), peaks[phase]
            peaks[phase] = [max(a, b) for a, b in zip(peak, held, strict=True)] if peak else held
        core.step()
    peak = peaks["decode"]
    groups = runner.kv_groups
    slots = groups.num_slots if groups else runner.config.num_layers
    cfg = runner.config
    per_block = bytes_per_block(slots, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return {
        "windows": list(groups.windows) if groups else [0],
        "layers_per_block": slots,
        "blocks_held_per_group": peak,
        "prefill_blocks_held_per_group": peaks["prefill"],
        "blocks_held": sum(peak),
        "kv_bytes_held": sum(peak) * per_block,
        "released_blocks": getattr(engine.policy.blocks, "num_released", 0),
    }


def admitted(path: Path, seq_len: int, memory_mib: int, num_seqs: int = 64) -> dict[str, Any]:
    """The pool `memory_mib` holds for this model (the worker's sizing) and how many
    sequences of `seq_len` + 256 tokens the policy runs at once in it."""
    config = LlamaConfig.from_hf(read_hf_config(str(path)))
    options = RunnerOptions(block_size=BLOCK, kv_cache_memory_gib=memory_mib / 1024)
    groups = kv_layer_groups(config, options)
    slots = groups.num_slots if groups else config.num_layers
    per_block = bytes_per_block(slots, BLOCK, config.num_kv_heads, config.head_dim, torch.float32)
    num_blocks = memory_mib * MIB // per_block
    blocks: BlockManager | GroupedBlockManager = (
        GroupedBlockManager(num_blocks, BLOCK, groups.windows)
        if groups
        else BlockManager(num_blocks, BLOCK)
    )
    policy = SchedulingPolicy(
        blocks, PolicyConfig(max_num_batched_tokens=CHUNK, max_num_seqs=256, watermark=0.0)
    )
    sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [3 + (i * 7919 + j) % 40000 for j in range(seq_len)]
        limit = seq_len + 256
        policy.add(Request(f"s{i}", prompt, sp, eos_token_ids=(2,), max_model_len=limit))
    most, in_flight = 0, deque[list[str]]()
    while policy.has_work() or in_flight:
        if len(in_flight) < 2 and policy.has_work():
            out = policy.schedule()
            in_flight.append([s.request.request_id for s in out.scheduled if s.samples])
            most = max(most, policy.num_running)
        else:
            done = in_flight.popleft()
            policy.update(done, [5] * len(done))
    return {
        "num_blocks": num_blocks,
        "block_bytes": per_block,
        "most_running": most,
        "preemptions": policy.num_preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--memory-mib", type=int, default=64)
    ap.add_argument("--folder", default="", help="where the tiny models go (default: a temp)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or tmp)
        max_len = args.seq_len + 512
        windowed, dense = make_models(folder, args.layers, args.window, max_len)
        report: dict[str, Any] = {"seq_len": args.seq_len, "window": args.window}
        for name, path in (("groups", windowed), ("dense", dense)):
            report[name] = {
                "one_sequence": one_sequence(path, args.seq_len),
                "admitted": admitted(path, args.seq_len, args.memory_mib),
            }
    bound = -(-args.window // BLOCK) + 1
    print(f"tiny Gemma 3, {args.layers} layers (5 sliding : 1 global), window {args.window}, "
          f"blocks of {BLOCK} tokens, one sequence of {args.seq_len} + 16 tokens")  # fmt: skip
    for name in ("groups", "dense"):
        one, adm = report[name]["one_sequence"], report[name]["admitted"]
        print(
            f"  {name:6}  windows per group {one['windows']}  layers per block "
            f"{one['layers_per_block']}  blocks held per group {one['blocks_held_per_group']}"
            f"  KV held {one['kv_bytes_held'] / MIB:.2f} MiB"
        )
        print(
            f"          in the prefill (chunks of {CHUNK}): {one['prefill_blocks_held_per_group']}"
        )
        print(
            f"          at {args.memory_mib} MiB: {adm['num_blocks']} blocks, "
            f"{adm['most_running']} sequences running at once, {adm['preemptions']} preemptions"
        )
    sliding = report["groups"]["one_sequence"]["blocks_held_per_group"][1:]
    print(f"  sliding groups hold at most {max(sliding, default=0)} blocks each "
          f"(ceil(window / block) + 1 = {bound})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
