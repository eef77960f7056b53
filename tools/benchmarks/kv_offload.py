"""TTFT of a repeated long prompt served from each tier of the prefix cache: the KV pool,
host memory (--kv-offload-memory), disk (--kv-offload-dir), disk after a restart, and
recomputed (its first sight), on the default model (SmolLM2, float32) unless --model.

    .venv/bin/python -m tools.benchmarks.kv_offload [--input-len 4096] [--rounds 3]
        [--json out.json]

Sizes, in blocks of the prompt's length P: the pool holds ~1.2 P, host memory ~2.4 P, the
disk 32 P. Each round takes fresh random prompts: the measured prompt (first sight:
recomputed), again at once (pool), again after one filler prompt has pushed it out of the
pool (host memory), again after four fillers have pushed it out of host memory too (disk);
then the server restarts on the same folder and each round's prompt comes again (disk after
a restart). The figure is the median TTFT over the rounds (streamed, max_tokens 1), with the
cached_tokens each answer reported. Prompts are random token ids, sent as such.
"""

from __future__ import annotations

import argparse
import json
import random
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

from common.prepare_model import prepare_default_model  # noqa: E402
from tests.server import Server, running_server  # noqa: E402

TOKEN = "bench"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
GIB = 1 << 30
BLOCK = 16


def block_bytes(model_dir: Path, itemsize: int = 4) -> int:
    """K and V of one block of 16 tokens, every layer (float32 unless `itemsize`)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * kv_heads * head_dim * itemsize


def ttft(server: Server, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached_tokens) of one streamed greedy request."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, cached = time.perf_counter(), 0.0, -1
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("choices") and not first:
                first = time.perf_counter()
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return first - start, cached


def _stats(server: Server) -> dict[str, Any]:
    return httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30).json()


def run(model_dir: Path, input_len: int, rounds: int, folder: Path) -> dict[str, Any]:
    per_block = block_bytes(model_dir)
    p_blocks = -(-input_len // BLOCK)
    flags = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--admin-token",
        TOKEN,
        "--max-model-len",
        str(input_len + 64),
        "--max-num-batched-tokens",
        "2048",
        "--kv-cache-memory",
        str(int(p_blocks * 1.2) * per_block / GIB),
        "--kv-offload-memory",
        str(int(p_blocks * 2.4) * per_block / GIB),
        "--kv-offload-dir",
        str(folder),
        "--kv-offload-disk",
        str(p_blocks * 32 * per_block / GIB),
    ]
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(input_len)]

    rows: dict[str, list[tuple[float, int]]] = {
        k: [] for k in ("recomputed", "device", "host", "disk", "disk_after_restart")
    }
    measured: list[list[int]] = []
    with running_server(*flags) as s:
        ttft(s, prompt())  # warm-up (kernels, allocator)
        for _ in range(rounds):
            p = prompt()
            measured.append(p)
            rows["recomputed"].append(ttft(s, p))
            rows["device"].append(ttft(s, p))
            ttft(s, prompt())  # one filler: p leaves the pool for host memory
            rows["host"].append(ttft(s, p))
            for _ in range(4):  # four more: p leaves host memory for disk
                ttft(s, prompt())
            rows["disk"].append(ttft(s, p))
            for _ in range(4):  # and again, so it is on disk only when the server stops
                ttft(s, prompt())
        before = _stats(s)
    with running_server(*flags) as s:
        ttft(s, prompt())  # warm-up
        for p in measured:
            rows["disk_after_restart"].append(ttft(s, p))
        after = _stats(s)
    return {
        "model": str(model_dir),
        "input_len": input_len,
        "rounds": rounds,
        "block_bytes": per_block,
        "prompt_bytes": p_blocks * per_block,
        "ttft_ms": {k: statistics.median(t for t, _ in v) * 1e3 for k, v in rows.items()},
        "cached_tokens": {k: [c for _, c in v] for k, v in rows.items()},
        "stats_before_restart": {k: v for k, v in before.items() if k.startswith("kv_offload")},
        "stats_after_restart": {k: v for k, v in after.items() if k.startswith("kv_offload")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="a model folder (default: SmolLM2)")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="", help="the disk tier's folder (default: a temporary one)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    model_dir = Path(args.model) if args.model else prepare_default_model()
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="shuttle-kv-"))
    result = run(model_dir, args.input_len, args.rounds, folder)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
