"""How far bfloat16 greedy decoding strays from float32 transformers, for docs/benchmarks.md.

    .venv/bin/python -m tools.benchmarks.bf16_parity --json docs/bench/bf16_parity.json

The parity test's eight prompts (1 to 200 tokens of one text) decode 32 greedy tokens with
our runner in bf16, and with transformers in bf16 for comparison; both are scored against
transformers in fp32: how many leading tokens agree before the first difference (greedy
decoding diverges for good after it) and whether the whole sequence agrees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch


def _agreement(ours: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    prefixes = []
    for a, b in zip(ours, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(n)
    return {
        "identical_sequences": sum(p == len(r) for p, r in zip(prefixes, ref, strict=True)),
        "num_sequences": len(ref),
        "agreeing_prefix": prefixes,
        "median_agreeing_prefix": statistics.median(prefixes),
    }


def measure(num_new: int = 32, threads: int = 2) -> dict[str, Any]:
    from gpu_worker.runner.model_runner import ModelRunner
    from gpu_worker.runner.options import RunnerOptions
    from tests.integration.test_model_parity import (
        SMOL_PROMPT_LENS,
        SMOL_TEXT,
        hf_greedy,
        hf_references,
        run_greedy,
    )

    torch.set_num_threads(threads)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from common.prepare_model import prepare_default_model

    path = prepare_default_model()
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(SMOL_TEXT).ids
    prompts = [ids[len(ids) - n - 7 * i :][:n] for i, n in enumerate(SMOL_PROMPT_LENS)]
    ref = hf_references(path, prompts, num_new)
    ours = run_greedy(
        ModelRunner(str(path), RunnerOptions(dtype="bfloat16", num_blocks=256)), prompts, num_new
    )
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    theirs = [hf_greedy(hf_bf16, p, num_new) for p in prompts]
    ours32 = run_greedy(
        ModelRunner(str(path), RunnerOptions(dtype="float32", num_blocks=256)), prompts, num_new
    )
    return {
        "num_new_tokens": num_new,
        "prompt_lens": list(SMOL_PROMPT_LENS),
        "shuttle_fp32": _agreement(ours32, ref),
        "shuttle_bf16": _agreement(ours, ref),
        "transformers_bf16": _agreement(theirs, ref),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    result = measure()
    for name in ("shuttle_fp32", "shuttle_bf16", "transformers_bf16"):
        r = result[name]
        print(
            f"{name:18} vs transformers fp32: {r['identical_sequences']}/{r['num_sequences']} "
            f"sequences identical; agreeing prefix {r['agreeing_prefix']}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
