"""Render docs/benchmarks.md from the JSON files tools/benchmarks/docs.py writes in docs/bench/.

Hand-written analysis lives in docs/bench/notes/*.md and is pasted in where its section is;
every number in a table comes from the JSON, so a rerun updates the page.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def _load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _note(out: Path, name: str) -> str:
    path = out / "notes" / f"{name}.md"
    return path.read_text().strip() + "\n\n" if path.is_file() else ""


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x >= 0.01 else f"{x * 1e3:.1f}"


def _load_line(loads: dict[str, Any], step: str) -> str:
    entry = loads.get(step)
    if not entry:
        return ""
    b, a = entry["load_before"], entry["load_after"]
    return (
        f"*Run {entry['date']}, {entry['minutes']} min; load average (1/5/15 min) "
        f"before {b[0]:.1f}/{b[1]:.1f}/{b[2]:.1f}, after {a[0]:.1f}/{a[1]:.1f}/{a[2]:.1f} "
        f"on 2 cores.*\n\n"
    )


def _latency_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    rows = [
        "| run | ok/failed | duration s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
        "| ITL p50/p99 ms | E2E p50/p99 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs:
        rows.append(
            f"| {name} | {s['completed']}/{s['failed']} | {s['duration_s']:.1f} | "
            f"{s['output_tok_s']:.1f} | {_ms(s['ttft_s']['median'])} / {_ms(s['ttft_s']['p99'])}"
            f" | {_ms(s['tpot_s']['median'])} / {_ms(s['tpot_s']['p99'])} | "
            f"{_ms(s['itl_s']['median'])} / {_ms(s['itl_s']['p99'])} | "
            f"{s['e2e_s']['median']:.2f} / {s['e2e_s']['p99']:.2f} |"
        )
    return "\n".join(rows) + "\n\n"


def _steps(out: Path, loads: dict[str, Any]) -> str:
    text = "## Worker alone: one decode step\n\n" + _note(out, "step")
    tables = [
        (label, t)
        for label, name in (
            ("before (first commit of the torch backend)", "step_float32_before"),
            ("fp32", "step_float32"),
            ("bf16", "step_bfloat16"),
        )
        if (t := _load(out, name))
    ]
    if not tables:
        return text
    batches = [r["batch"] for r in tables[0][1]["rows"]]
    text += "| B (context 300) | " + " | ".join(label for label, _ in tables) + " |\n"
    text += "|---" * (len(tables) + 1) + "|\n"
    for i, b in enumerate(batches):
        cells = [
            f"{t['rows'][i]['decode_step_ms']:.1f} ms, {t['rows'][i]['decode_tok_s']:.0f} tok/s"
            for _, t in tables
        ]
        text += f"| {b} | " + " | ".join(cells) + " |\n"
    cells = [f"{t['rows'][-1]['prefill_tok_s']:.0f} tok/s" for _, t in tables]
    text += "| prefill (512-token chunks) | " + " | ".join(cells) + " |\n\n"
    return text + _load_line(loads, "step")


def _mixed(out: Path, loads: dict[str, Any]) -> str:
    fp32, bf16 = _load(out, "mixed_fp32"), _load(out, "mixed_bf16")
    if fp32 is None:
        return ""
    w, s = fp32["workload"], fp32["shuttle"]
    text = (
        "## Mixed workload: shuttle beside transformers\n\n"
        f"{w['num_prompts']} requests at once, prompts uniform {w['input_len']} tokens "
        f"({w['prompt_tokens']} in all), outputs uniform {w['output_len']} "
        f"({w['output_tokens']} in all), `ignore_eos`, greedy, {w['dtype']}, "
        f"{w['threads']} threads; server flags `{w['server_flags']}`.\n\n"
    )
    text += "| system | duration s | useful output tok/s | shuttle fp32 is |\n|---|---|---|---|\n"
    text += f"| shuttle fp32 | {s['duration_s']:.1f} | {s['output_tok_s']:.1f} | 1.00x |\n"
    if bf16 is not None:
        b = bf16["shuttle"]
        text += (
            f"| shuttle bf16 | {b['duration_s']:.1f} | {b['output_tok_s']:.1f} | "
            f"{s['output_tok_s'] / b['output_tok_s']:.2f}x (bf16 is "
            f"{b['output_tok_s'] / s['output_tok_s']:.2f}x fp32) |\n"
        )
    for base in fp32["baselines"]:
        note = (
            f" (measured on {base['num_requests']} of the requests, spread evenly)"
            if base.get("subset")
            else ""
        )
        ratio = s["output_tok_s"] / base["output_tok_s"]
        text += (
            f"| transformers {base['name']}{note} | {base['duration_s']:.1f} | "
            f"{base['output_tok_s']:.1f} | {ratio:.2f}x |\n"
        )
    for base in bf16.get("baselines", []) if bf16 is not None else []:
        note = (
            f" (measured on {base['num_requests']} of the requests, spread evenly)"
            if base.get("subset")
            else ""
        )
        text += (
            f"| transformers {base['name']} bf16{note} | {base['duration_s']:.1f} | "
            f"{base['output_tok_s']:.1f} | shuttle bf16 is "
            f"{b['output_tok_s'] / base['output_tok_s']:.2f}x |\n"
        )
    text += "\n" + _latency_table(
        [("shuttle fp32", s)] + ([("shuttle bf16", bf16["shuttle"])] if bf16 else [])
    )
    text += _load_line(loads, "mixed") + _note(out, "mixed")
    for png in ("mixed_fp32_throughput.png", "mixed_fp32_latency_cdf.png"):
        if (out / png).is_file():
            text += f"![{png}](bench/{png})\n\n"
    return text


def _sweep(out: Path, loads: dict[str, Any]) -> str:
    r = _load(out, "sweep_fp32")
    if r is None or not r.get("sweep"):
        return ""
    w = r["workload"]
    slo = w["slo"]
    text = (
        "## Request-rate sweep (Poisson arrivals)\n\n"
        f"{w['num_prompts']} requests per rate, prompts {w['input_len']}, outputs "
        f"{w['output_len']}, fp32. Goodput: requests meeting TTFT <= {slo['ttft_ms']:g} ms "
        f"and TPOT <= {slo['tpot_ms']:g} ms.\n\n"
    )
    text += (
        "| rate req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | goodput "
        "(fraction, req/s) |\n|---|---|---|---|---|\n"
    )
    for s in r["sweep"]:
        g = s.get("goodput", {})
        text += (
            f"| {s['rate']} | {s['output_tok_s']:.1f} | {_ms(s['ttft_s']['median'])} / "
            f"{_ms(s['ttft_s']['p99'])} | {_ms(s['tpot_s']['median'])} / "
            f"{_ms(s['tpot_s']['p99'])} | {g.get('fraction', 0):.0%}, "
            f"{g.get('request_rate', 0):.2f} |\n"
        )
    text += "\n" + _load_line(loads, "sweep")
    for png in ("sweep_fp32_rate_sweep.png", "sweep_fp32_latency_cdf.png"):
        if (out / png).is_file():
            text += f"![{png}](bench/{png})\n\n"
    return text


def _synthetic(out: Path, loads: dict[str, Any]) -> str:
    cap, low = _load(out, "synthetic_256"), _load(out, "synthetic_c1")
    if cap is None or low is None:
        return ""
    text = (
        "## Synthetic model: the pipeline's own capacity\n\n"
        "`--model synthetic` computes nothing and answers every step at once "
        "(gpu_worker/runner/synthetic.py), so these figures are the five processes, their "
        "messages and HTTP/SSE alone, with the load generator on the same 2 cores.\n\n"
    )
    text += _latency_table(
        [
            (
                f"{cap['workload']['num_prompts']} requests, 256 concurrent SSE streams",
                cap["shuttle"],
            ),
            ("concurrency 1", low["shuttle"]),
        ]
    )
    text += _load_line(loads, "synthetic") + _note(out, "synthetic")
    for png in ("synthetic_256_latency_cdf.png", "synthetic_c1_latency_cdf.png"):
        if (out / png).is_file():
            text += f"![{png}](bench/{png})\n\n"
    return text


def _parity(out: Path) -> str:
    r = _load(out, "bf16_parity")
    if r is None:
        return ""
    text = (
        "## bfloat16: the parity bound\n\n"
        f"Greedy decoding of {len(r['prompt_lens'])} prompts ({r['prompt_lens']} tokens) "
        f"for {r['num_new_tokens']} tokens, scored against transformers in fp32: "
        "sequences identical throughout, and how many leading tokens agree before the "
        "first difference.\n\n| run | identical sequences | agreeing prefix per prompt |"
        "\n|---|---|---|\n"
    )
    for name in ("shuttle_fp32", "shuttle_bf16", "transformers_bf16"):
        a = r[name]
        text += (
            f"| {name.replace('_', ' ')} | {a['identical_sequences']}/{a['num_sequences']}"
            f" | {a['agreeing_prefix']} |\n"
        )
    return text + "\n" + _note(out, "parity")


def _small(out: Path) -> str:
    """The first figures: one request, and 16 at once, beside transformers."""
    runs = [r for name in ("issue2-single", "issue2-16") if (r := _load(out, name))]
    if not runs:
        return ""
    text = (
        "## One request, and sixteen at once\n\n"
        "Commands: `tools/bench --num-prompts 1 --input-len 128 --output-len 32 --baseline "
        "hf-sequential` and `tools/bench --num-prompts 16 --input-len 64:256 --output-len "
        "64 --baseline hf-static --hf-batch-size 16` (fp32, 2 threads, `ignore_eos`).\n\n"
        "| workload | shuttle out tok/s | TTFT p50 ms | TPOT p50 ms | transformers | "
        "its out tok/s | shuttle is |\n|---|---|---|---|---|---|---|\n"
    )
    for r in runs:
        w, sh = r["workload"], r["shuttle"]
        for base in r.get("baselines", []):
            text += (
                f"| {w['num_prompts']} x ({w['input_len']} in, {w['output_len']} out) | "
                f"{sh['output_tok_s']:.1f} | {_ms(sh['ttft_s']['median'])} | "
                f"{_ms(sh['tpot_s']['median'])} | {base['name']} | "
                f"{base['output_tok_s']:.1f} | "
                f"{sh['output_tok_s'] / base['output_tok_s']:.2f}x |\n"
            )
    return text + "\n" + _note(out, "small")


def _scheduling(out: Path) -> str:
    r = _load(out, "scheduling")
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
                f"{_ms(sh['ttft_s']['median'])} / {_ms(sh['ttft_s']['p99'])} | "
                f"{_ms(sh['tpot_s']['median'])} | {sh['e2e_s']['median']:.1f} | "
                f"{st.get('prefix_cache_hits', 0)} / {st.get('prefix_cache_queries', 0)}"
            )
            if step_cols:
                text += (
                    f" | {st.get('mean_step_interval_s', 0) * 1e3:.1f} / "
                    f"{st.get('mean_step_forward_s', 0) * 1e3:.1f}"
                )
            text += " |\n"
        text += "\n"
    return text + _note(out, "scheduling")


def _speculative(out: Path) -> str:
    r = _load(out, "speculative")
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
    return text + "\n" + _note(out, "speculative")


def _peers_table(out: Path, loads: dict[str, Any], name: str, heading: str, how: str) -> str:
    result = _load(out, name)
    if result is None:
        return ""
    from tools.benchmarks.peers import table

    return heading + _load_line(loads, name) + how + table(result) + "\n\n" + _note(out, name)


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


def _peers(out: Path, loads: dict[str, Any]) -> str:
    return "".join(
        _peers_table(out, loads, name, heading, how) for name, heading, how in PEERS_SITTINGS
    )


def _data_parallel(out: Path) -> str:
    r = _load(out, "data_parallel")
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
        + _note(out, "data_parallel")
    )


def _tensor_parallel(out: Path, loads: dict[str, Any]) -> str:
    r = _load(out, "tensor_parallel")
    if r is None:
        return ""
    text = (
        "## Tensor parallelism\n\n"
        + _load_line(loads, "tensor_parallel")
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
    return text + "\n" + _note(out, "tensor_parallel")


def _lora(out: Path, loads: dict[str, Any]) -> str:
    """Multi-LoRA serving (tools/benchmarks/lora.py) and the kernels' note."""
    r = _load(out, "lora_serving")
    text = "## Multi-LoRA: 8 adapters against the base model\n\n"
    if r:
        m = r["machine"]
        text += (
            _load_line(loads, "lora")
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
            f"| mixed: TTFT p50 ms | {_ms(mb['ttft_s']['median'])} | "
            f"{_ms(ml['ttft_s']['median'])} | |\n"
            f"| single: ITL p50 ms | {sb['itl_s']['median'] * 1e3:.1f} | "
            f"{sl['itl_s']['median'] * 1e3:.1f} | **{r['ratios']['single_itl']:.2f}x** "
            "(target <= 1.15) |\n\n"
            f"Adapter load (`POST /v1/load_lora_adapter`, a 19.6 MB rank-16 adapter, read, "
            f"checked and cached by the worker, median of 3): {_ms(r['load']['load_s'])} ms; "
            f"unload {_ms(r['load']['unload_s'])} ms.\n\n"
        )
    return text + _note(out, "lora")


def render(out: Path) -> str:
    loads = json.loads((out / "load.json").read_text()) if (out / "load.json").is_file() else {}
    head = (
        "# Benchmarks\n\nRegenerate everything on this page with `make bench-docs` "
        "(tools/benchmarks/docs.py, about 30 minutes); "
        "`python -m tools.benchmarks.docs --render` rebuilds the page from the JSON in "
        "docs/bench/.\n\n"
        f"Machine: {platform.machine()}, {platform.processor() or 'CPU'}, 2 cores shared "
        "with other work. All runs: torch CPU, 2 threads, `OMP_WAIT_POLICY=PASSIVE` "
        "(gpu_worker/__init__.py sets it for the worker; the transformers baselines run "
        "with the same setting in the same process as the load generator); runs before "
        "2026-11-30 slept at once, the worker now spins briefly first "
        "(`GOMP_SPINCOUNT=10000`; the Peers section shows both).\n\n"
    )
    body = (
        _note(out, "summary")
        + _note(out, "method")
        + _peers(out, loads)
        + _steps(out, loads)
        + _small(out)
        + _mixed(out, loads)
        + _sweep(out, loads)
        + _scheduling(out)
        + _synthetic(out, loads)
        + _speculative(out)
        + _note(out, "structured")
        + _data_parallel(out)
        + _tensor_parallel(out, loads)
        + _parity(out)
        + _note(out, "soak")
        + _note(out, "quantized")
        + _note(out, "int8_linear")
        + _lora(out, loads)
    )
    gpu = "## GPU figures\n\n" + (
        _note(out, "gpu")
        or "tools/gpu-check has not yet run on a GPU: no device was lent to this task. Its "
        "kernel and model timings (triton backend, CUDA graphs) will be recorded here.\n\n"
    )
    return head + body + gpu
