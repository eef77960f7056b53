"""tools/bench baselines: transformers `generate` on the same prompts and lengths, in-process.

    hf-sequential   one request at a time
    hf-static       padded static batches of --hf-batch-size (left padding, as generate wants)

EOS is ignored (every request runs its full length, like the load's `ignore_eos`), greedy,
same dtype and threads as the server. `subset` > 0 runs only that many requests, spread
evenly over the workload (hf-sequential on 64 long requests takes many minutes); its
tokens/s is then measured on those requests alone, and the result says so.
"""

from __future__ import annotations

import time
from typing import Any

from tools.benchmarks.workload import Workload, tokenized


def pick_subset(n: int, subset: int) -> list[int]:
    """`subset` indices spread evenly over range(n) (all of them when subset is 0 or >= n)."""
    if not subset or subset >= n:
        return list(range(n))
    return [round(i * (n - 1) / max(1, subset - 1)) for i in range(subset)]


def hf_baseline(
    kind: str,
    model_dir: str,
    wl: Workload,
    batch_size: int,
    dtype: str,
    threads: int,
    subset: int = 0,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    if kind not in ("hf-sequential", "hf-static"):
        raise ValueError(f"unknown baseline {kind!r}: hf-sequential or hf-static")
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every request runs its length
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    prompts = tokenized(wl.prompts, model_dir)
    order = pick_subset(len(prompts), subset)
    size = 1 if kind == "hf-sequential" else batch_size
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    start = time.perf_counter()
    computed = 0
    with torch.inference_mode():
        for g in groups:
            width = max(len(prompts[i]) for i in g)
            ids = torch.full((len(g), width), pad, dtype=torch.long)
            mask = torch.zeros((len(g), width), dtype=torch.long)
            for row, i in enumerate(g):  # left padding, as generate wants for decoder-only
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            new = max(wl.output_lens[i] for i in g)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
            computed += len(g) * new
    dur = time.perf_counter() - start
    useful = sum(wl.output_lens[i] for i in order)
    return {
        "name": kind,
        "duration_s": dur,
        "output_tok_s": useful / dur,
        "useful_output_tokens": useful,
        "computed_output_tokens": computed,
        "batch_size": size,
        "num_requests": len(order),
        "subset": len(order) < len(prompts),
        "dtype": dtype,
        "threads": threads,
    }
