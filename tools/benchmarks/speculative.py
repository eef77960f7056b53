"""Speculative decoding, measured: one request at a time, with and without drafting.

    .venv/bin/python -m tools.benchmarks.speculative --json docs/bench/speculative.json

For each prompt (a repetitive one: code to rewrite; a list; and free chat) and each
drafter (none; n-gram prompt lookup; a draft model), the worker and the scheduler policy
run in this process (the plans the real processes exchange, no sockets) and greedy-decode
`--output-len` tokens. Reported: decode tokens/s (the steps after the prompt's), the
acceptance rate, tokens per verification step, the speed-up over no drafting, and whether
the tokens equal those without drafting (they must).

The draft model is SmolLM2 cut to its first `--draft-layers` layers (same tokenizer,
embeddings and LM head; `common.prepare_model.prepare_truncated_model`), as no smaller
model with SmolLM2's tokenizer is available offline; untrained for early exit, it agrees with
the target rarely. `self` drafts with the target itself: every draft is accepted, so it
shows the mechanism's ceiling and what a drafter as costly as the target costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CODE = """Rewrite this function with type hints, keeping everything else the same.

def merge_sorted(left, right):
    result = []
    i = 0
    j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
"""
LIST = "Continue the list up to 40: 1. apple, 2. banana, 3. cherry, 4. date, 5. elderberry,"
CHAT = "Tell me about the history of the bicycle and why it became popular."
PROMPTS = {"code (repetitive)": CODE, "list (repetitive)": LIST, "free chat": CHAT}


def _prompt_ids(model_dir: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    return cast("list[int]", ids)  # tokenize=True, one conversation, no dict: its token ids


def _decode(runner: Any, prompt: list[int], output_len: int, k: int) -> dict[str, Any]:
    """Greedy-decode one request with the engine the scheduler runs (in this process)."""
    from common.messages import SamplingParams
    from services.scheduler.in_process import InProcessEngine
    from services.scheduler.policy import PolicyConfig

    engine = InProcessEngine(runner, policy_config=PolicyConfig(num_speculative_tokens=k))
    (sid,) = engine.add(
        prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    )
    tokens = engine.run()[sid]
    # the first step computes the prompt; the last one only tells the worker it finished
    decode = [r for r in engine.results[1:] if r.req_ids]
    decode_s = sum(r.forward_s for r in decode)
    decode_tokens = sum(len(r.token_ids) for r in decode)
    policy = engine.policy
    steps = len(decode) + 1
    return {
        "tokens": tokens,
        "decode_tok_s": decode_tokens / decode_s,
        "steps": steps,
        "proposed": policy.num_draft_tokens,
        "accepted": policy.num_accepted_tokens,
        "acceptance_rate": policy.num_accepted_tokens / max(1, policy.num_draft_tokens),
        "tokens_per_step": decode_tokens / max(1, steps - 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--methods", default="off,ngram,draft,self")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    methods = args.methods.split(",")

    from common.prepare_model import prepare_default_model, prepare_truncated_model
    from gpu_worker.runner.model_runner import ModelRunner
    from gpu_worker.runner.options import RunnerOptions

    model_dir = str(prepare_default_model())
    draft_dir = str(prepare_truncated_model(args.draft_layers)) if "draft" in methods else ""
    common = RunnerOptions(dtype=args.dtype, num_threads=args.threads, kv_cache_memory_gib=0.25)
    lookup = dict(
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max
    )
    runners = {"off": ModelRunner(model_dir, common)}
    if "ngram" in methods:
        runners[f"ngram ({args.prompt_lookup_min}-{args.prompt_lookup_max})"] = ModelRunner(
            model_dir, dataclasses.replace(common, speculative="ngram", **lookup)
        )
    if "draft" in methods:
        runners[f"draft (first {args.draft_layers} layers)"] = ModelRunner(
            model_dir, dataclasses.replace(common, speculative="draft", draft_model=draft_dir)
        )
    if "self" in methods:  # the target drafting for itself: acceptance 1, the draft's cost
        runners["draft (the target itself)"] = ModelRunner(
            model_dir, dataclasses.replace(common, speculative="draft", draft_model=model_dir)
        )
    rows = []
    for name, text in PROMPTS.items():
        prompt = _prompt_ids(model_dir, text)
        base = None
        for method, runner in runners.items():
            _decode(runner, prompt, 8, args.k if method != "off" else 0)  # warm-up
            r = _decode(runner, prompt, args.output_len, args.k if method != "off" else 0)
            base = base or r
            row = {
                "prompt": name,
                "prompt_tokens": len(prompt),
                "method": method,
                "identical_to_off": r["tokens"] == base["tokens"],
                "speedup": r["decode_tok_s"] / base["decode_tok_s"],
                **{k: v for k, v in r.items() if k != "tokens"},
            }
            rows.append(row)
            print(
                f"{name:18} {method:18} {r['decode_tok_s']:6.1f} tok/s  x{row['speedup']:.2f}"
                f"  acceptance {r['acceptance_rate']:.2f}  tokens/step "
                f"{r['tokens_per_step']:.2f}  identical {row['identical_to_off']}",
                flush=True,
            )
    result = {
        "workload": {
            "output_len": args.output_len,
            "k": args.k,
            "dtype": args.dtype,
            "threads": args.threads,
            "batch": 1,
            "greedy": True,
            "draft_layers": args.draft_layers,
            **lookup,
        },
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
