"""Multi-LoRA against the base model, one server, one sitting (issue 23's figures).

    python -m tools.benchmarks.lora --adapters 8 --rank 16 --json out/lora.json

Builds `--adapters` PEFT adapters of rank `--rank` on the served model (every target module
q/k/v/o/gate/up/down, `init_lora_weights=False`: random, so they change the output), starts
one shuttle server with them (`--enable-lora --max-loras N --max-lora-rank R --lora-modules`),
and measures on the same prompts:

    mixed     peers.py's mixed workload (64 prompts, 32..512 in, 16..256 out, all at once):
              every request on the base model, then round-robin over the adapters
    single    one stream (8 prompts, 128 in, 64 out, one at a time): base, then one adapter
    load      POST /v1/load_lora_adapter of a fresh adapter folder (and its unload), timed

The ratios the issue asks for: adapters' output tok/s over the base's (target >= 0.85) and
the adapter's single-stream ITL over the base's (target <= 1.15).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.benchmarks.load import Extras, run_load  # noqa: E402
from tools.benchmarks.peers import WORKLOADS, machine  # noqa: E402
from tools.benchmarks.report import summarize  # noqa: E402
from tools.benchmarks.workload import make_workload  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(model_dir: str, count: int, rank: int, out: Path, seed: int) -> list[Path]:
    """`count` random PEFT adapters of `rank` on every target module, saved under `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(seed + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
        )
        model = get_peft_model(base, config)
        with torch.no_grad():  # small deltas: the outputs change but stay text-like
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(0.05)
        path = out / f"adapter{i}"
        model.save_pretrained(str(path))
        paths.append(path)
    return paths


class RoundRobin(Extras):
    """Request i names adapter i mod N (its `model` field)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names

    def of(self, i: int) -> dict[str, Any]:
        return {"model": self.names[i % len(self.names)]}


def measure(url: str, load: str, vocab: int, seed: int, names: list[str]) -> dict[str, Any]:
    n, input_len, output_len, concurrency, rate = WORKLOADS[load]
    wl = make_workload(n, input_len, output_len, vocab, seed)
    base = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    extras = RoundRobin(names) if names else None
    timings, duration, peak = asyncio.run(
        run_load(url, base, wl, concurrency, rate, seed, extras=extras)
    )
    failed = [t.error for t in timings if t.error]
    if failed:
        raise SystemExit(f"{load}: {len(failed)} requests failed, first: {failed[0]}")
    return summarize(timings, duration, peak, wl, None)


def time_load(url: str, token: str, path: Path, repeats: int = 3) -> dict[str, float]:
    """Seconds to load (and unload) a fresh adapter over the admin API, median of `repeats`."""
    headers = {"Authorization": f"Bearer {token}"}
    loads, unloads = [], []
    with httpx.Client(base_url=url, headers=headers, timeout=300) as c:
        for k in range(repeats):
            name = f"timed{k}"
            t0 = time.perf_counter()
            r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            loads.append(time.perf_counter() - t0)
            r.raise_for_status()
            t0 = time.perf_counter()
            c.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
            unloads.append(time.perf_counter() - t0)
    return {"load_s": statistics.median(loads), "unload_s": statistics.median(unloads)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.benchmarks.lora", description=__doc__)
    p.add_argument("--model-dir", default="")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-flags", default="")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    from common.model_paths import hf_config_of
    from common.prepare_model import prepare_default_model
    from tests.server import running_server

    model_dir = args.model_dir or str(prepare_default_model())
    threads = args.threads or os.cpu_count() or 1
    vocab = hf_config_of(model_dir)["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = build_adapters(model_dir, args.adapters + 1, args.rank, tmp, args.seed)
    names = [f"lora{i}" for i in range(args.adapters)]
    modules = [f"{n}={p}" for n, p in zip(names, paths, strict=False)]
    flags = [
        "--model", model_dir, "--kv-cache-memory", "3", "--num-threads", str(threads),
        "--admin-token", "bench", "--model-root", str(tmp),
        "--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
        "--max-cpu-loras", str(args.adapters + 4), "--lora-modules", *modules,
        *args.server_flags.split(),
    ]  # fmt: skip
    result: dict[str, Any] = {"machine": machine(model_dir, "float32", threads), "flags": flags}
    with running_server(*flags) as server:
        url = server.url
        measure(url, "single", vocab, args.seed + 1, names[:1])  # warm-up, every path once
        result["mixed_base"] = measure(url, "mixed", vocab, args.seed, [])
        result["mixed_lora"] = measure(url, "mixed", vocab, args.seed, names)
        result["single_base"] = measure(url, "single", vocab, args.seed, [])
        result["single_lora"] = measure(url, "single", vocab, args.seed, names[:1])
        result["load"] = time_load(url, "bench", paths[-1])
    mixed = result["mixed_lora"]["output_tok_s"] / result["mixed_base"]["output_tok_s"]
    itl_base = result["single_base"]["itl_s"]["median"]
    itl = result["single_lora"]["itl_s"]["median"] / itl_base
    result["ratios"] = {"mixed_output_tok_s": mixed, "single_itl": itl}
    print(
        f"mixed output tok/s: base {result['mixed_base']['output_tok_s']:.1f}, "
        f"{args.adapters} adapters r{args.rank} {result['mixed_lora']['output_tok_s']:.1f} "
        f"({mixed:.2f}x)\nsingle-stream ITL p50: base {itl_base * 1e3:.2f} ms, adapter "
        f"{result['single_lora']['itl_s']['median'] * 1e3:.2f} ms ({itl:.2f}x)\n"
        f"adapter load {result['load']['load_s'] * 1e3:.0f} ms, unload "
        f"{result['load']['unload_s'] * 1e3:.0f} ms\nCPU {result['machine']['cpu']} "
        f"{' '.join(result['machine']['flags'])}, {threads} threads"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
