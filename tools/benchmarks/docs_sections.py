"""docs/benchmarks.md's sections on features, each beside a baseline: scheduling policies,
speculative decoding, the peers (vLLM, SGLang, ...), data and tensor parallelism, multi-LoRA.
tools/benchmarks/docs_render.py puts them in the page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.benchmarks.docs_format import load_line, ms, read_json, read_note


def scheduling(out: Path) -> str:
    r = read_json(out, "scheduling")
    if r is None:
        return ""
    first = (r.get("batching") or r.get("prefix") or [{}])[0]
    w = first.get("workload", {})
    text = (
        "## Scheduling: batch policies, the prefix cache, overlapped steps\n\n"
        "`python -m tools.benchmarks.scheduling --json docs/bench/scheduling.json`: "
        f"{w.get('num_prompts', '?')} requests, prompts {w.get('input_len', '?')}, "
        f"outputs {w.get('output_len', '?')}, fp32, `--max-num-seqs 32 "
        "--max-num-batched-tokens 512`; *burst* sends all at once, *poisson* 2 "
        "requests/s.\n\n"
    )
    titles = {
        "batching": "Batch policy (continuous: vLLM/SGLang; static: run a full batch "
        "to completion; dynamic: collect for a window, then run to "
        "completion)",
        "prefix": "Prefix cache: every prompt starts with the same 512 tokens",
        "overlap": "Overlapped scheduling (step N+1 planned while step N runs)",
    }
    for key, title in titles.items():
        rows = r.get(key) or []
        if not rows:
            continue
        step_cols = key == "overlap"
        text += (
            f"**{title}**\n\n| config | out tok/s | TTFT p50/p99 ms | TPOT p50 ms | "
            "E2E p50 s | prefix hits / queries (tokens)"
            + (" | step interval / worker ms" if step_cols else "")
            + " |\n|---|---|---|"
            "---|---|---" + ("|---" if step_cols else "") + "|\n"
        )
        for run in rows:
            sh, st = run["shuttle"], run.get("server_stats", {})
            text += (
                f"| {run['name']} | {sh['output_tok_s']:.1f} | "
                f"{ms(sh['ttft_s']['median'])} / {ms(sh['ttft_s']['p99'])} | "
                f"{ms(sh['tpot_s']['median'])} | {sh['e2e_s']['median']:.1f} | "
                f"{st.get('prefix_cache_hits', 0)} / {st.get('prefix_cache_queries', 0)}"
            )
            if step_cols:
                text += (
                    f" | {st.get('mean_step_interval_s', 0) * 1e3:.1f} / "
                    f"{st.get('mean_step_forward_s', 0) * 1e3:.1f}"
                )
            text += " |\n"
        text += "\n"
    return text + read_note(out, "scheduling")


def speculative(out: Path) -> str:
    r = read_json(out, "speculative")
    if r is None:
        return ""
    w = r["workload"]
    text = (
        "## Speculative decoding, one request\n\n"
        "`python -m tools.benchmarks.speculative --json docs/bench/speculative.json`: greedy, "
        f"{w['output_len']} tokens, k = {w['k']} drafts per step, {w['dtype']}, "
        f"{w['threads']} threads, the worker and the scheduler policy in one process. "
        "Decode tokens/s count the steps after the prompt's.\n\n"
        "| prompt | drafter | decode tok/s | speed-up | acceptance | tokens per step | "
        "same tokens as without |\n|---|---|---|---|---|---|---|\n"
    )
    for row in r["rows"]:
        text += (
            f"| {row['prompt']} ({row['prompt_tokens']} tokens) | {row['method']} | "
            f"{row['decode_tok_s']:.1f} | {row['speedup']:.2f}x | "
            f"{row['acceptance_rate']:.2f} | {row['tokens_per_step']:.2f} | "
            f"{'yes' if row['identical_to_off'] else 'NO'} |\n"
        )
    return text + "\n" + read_note(out, "speculative")


def _peers_table(out: Path, loads: dict[str, Any], name: str, heading: str, how: str) -> str:
    result = read_json(out, name)
    if result is None:
        return ""
    from tools.benchmarks.peers import table

    return heading + load_line(loads, name) + how + table(result) + "\n\n" + read_note(out, name)


PEERS_SITTINGS = (
    (
        "peers",
        "## Peers: shuttle beside vLLM and llama.cpp\n\n",
        "`python -m tools.benchmarks.docs --only peers`, i.e. `tools/bench --compare "
        "shuttle,vllm,llamacpp --threads 2` (tools/benchmarks/peers.py): each server started "
        "in turn with 2 threads on the same converted weights (the peers by "
        "tools/peers/start-*.sh), the same load generator, one sitting.\n\n",
    ),
    (
        "peers_bf16",
        "### The same in bfloat16\n\n",
        "`python -m tools.benchmarks.docs --only peers_bf16`, i.e. the same with "
        "`--dtype bfloat16` for all three (llama.cpp on a bf16 GGUF).\n\n",
    ),
    (
        "peers_avx2",
        "### The same on a CPU without AVX-512\n\n",
        "`python -m tools.benchmarks.docs --only peers_avx2` on a machine of the same kind "
        "whose CPU has AVX2 only (no AVX-512, no bf16 instructions: float32 is every "
        "server's best dtype there).\n\n",
    ),
)


def peers(out: Path, loads: dict[str, Any]) -> str:
    return "".join(
        _peers_table(out, loads, name, heading, how) for name, heading, how in PEERS_SITTINGS
    )


def data_parallel(out: Path) -> str:
    r = read_json(out, "data_parallel")
    if r is None:
        return ""
    from tools.benchmarks.data_parallel import markdown

    return (
        "## Data parallelism: prefix-aware routing against round-robin\n\n"
        "`python -m tools.benchmarks.data_parallel --load-bounds 1.25,2 --json "
        "docs/bench/data_parallel.json` (or `--only data_parallel` here): "
        "`--data-parallel-size 2`, the same shared-prefix workload once per routing.\n\n"
        + markdown(r)
        + "\n"
        + read_note(out, "data_parallel")
    )


def tensor_parallel(out: Path, loads: dict[str, Any]) -> str:
    r = read_json(out, "tensor_parallel")
    if r is None:
        return ""
    text = (
        "## Tensor parallelism\n\n"
        + load_line(loads, "tensor_parallel")
        + "`python -m tools.benchmarks.docs --only tensor_parallel`, i.e. "
        "`python -m tools.benchmarks.tensor_parallel --tp-sizes 1,3 --batch-sizes 1,4` on "
        "SmolLM2 (9 heads, 3 KV heads: TP=2 is refused for it) and `--tp-sizes 1,2 "
        "--smol-shaped 8` on SmolLM2 cut to its first 8 heads and 2 KV heads; "
        "fp32, the shipped ModelRunner on each rank's shard (gloo, cores / N threads per "
        "rank, C kernels on), requests "
        f"prefilled to {r.get('context', 128)} tokens, the median decode step; the "
        "collectives are timed on rank 0 inside the worker (the all-reduces after the "
        "embedding, o_proj and down_proj, and the logits all-gather) over the same steps.\n\n"
        "| model | TP | batch | decode ms/step | decode tok/s | collectives ms/step | "
        "share of step | calls/step | bytes/token sent by rank 0 |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for row in r["rows"]:
        text += (
            f"| {row['model']} | {row['tp']} | {row['batch']} | {row['decode_step_ms']:.1f} | "
            f"{row['decode_tok_s']:.1f} | {row['comm_ms_per_step']:.2f} | "
            f"{row['comm_share']:.0%} | {row['collectives_per_step']:.0f} | "
            f"{row['bytes_per_token']:,.0f} |\n"
        )
    return text + "\n" + read_note(out, "tensor_parallel")


def lora(out: Path, loads: dict[str, Any]) -> str:
    """Multi-LoRA serving (tools/benchmarks/lora.py) and the kernels' note."""
    r = read_json(out, "lora_serving")
    text = "## Multi-LoRA: 8 adapters against the base model\n\n"
    if r:
        m = r["machine"]
        text += (
            load_line(loads, "lora")
            + f"One server (`{' '.join(a for a in r['flags'] if '/' not in a)}`, "
            f"paths left out), SmolLM2-135M float32, {m['threads']} threads, "
            f"{m['cpu']} ({' '.join(m['flags'])}). Every adapter rank 16 on all 7 targets.\n\n"
            "| workload | base | 8 adapters round-robin (1 for single) | ratio |\n"
            "|---|---|---|---|\n"
        )
        mb, ml = r["mixed_base"], r["mixed_lora"]
        sb, sl = r["single_base"], r["single_lora"]
        text += (
            f"| mixed: output tok/s | {mb['output_tok_s']:.1f} | {ml['output_tok_s']:.1f} | "
            f"**{r['ratios']['mixed_output_tok_s']:.2f}x** (target >= 0.85) |\n"
            f"| mixed: TTFT p50 ms | {ms(mb['ttft_s']['median'])} | "
            f"{ms(ml['ttft_s']['median'])} | |\n"
            f"| single: ITL p50 ms | {sb['itl_s']['median'] * 1e3:.1f} | "
            f"{sl['itl_s']['median'] * 1e3:.1f} | **{r['ratios']['single_itl']:.2f}x** "
            "(target <= 1.15) |\n\n"
            f"Adapter load (`POST /v1/load_lora_adapter`, a 19.6 MB rank-16 adapter, read, "
            f"checked and cached by the worker, median of 3): {ms(r['load']['load_s'])} ms; "
            f"unload {ms(r['load']['unload_s'])} ms.\n\n"
        )
    return text + read_note(out, "lora")
